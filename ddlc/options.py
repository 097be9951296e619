"""Compile options: one frozen, validated object, checked before any work starts.

``ddlc.compile(model, mesh, inputs, loss_fn, optimizer, **options)`` builds
:class:`CompileOptions` from its keyword arguments; an unknown option, a value of
the wrong type or outside its choices, or two options that contradict each other
is an :class:`ddlc.errors.OptionError` that names the option.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Union

from .errors import OptionError, SBPError
from .mesh import HardwareProfile
from .sbp import as_ndsbp

__all__ = ["CompileOptions", "Solver", "BatchMode", "Decouple", "AllGatherPlacement", "Updates",
           "Compute", "Backend"]

Solver = Literal["cd", "exact"]
BatchMode = Literal["global", "local"]
Decouple = Union[bool, Literal["always"]]
AllGatherPlacement = Literal["auto", "forward", "backward"]
Updates = Literal["auto", "early", "end"]
Backend = Literal["eager", "inductor"]
Compute = Literal["roofline", "measured"]


@dataclass(frozen=True)
class CompileOptions:
    """Everything ``ddlc.compile`` accepts besides the model, mesh, inputs, loss and
    optimizer. See the README for what each does; :mod:`ddlc.pipeline` for where."""

    #: how many trailing example inputs are targets of ``loss_fn``
    num_targets: int = 1
    #: clip gradients to this global 2-norm before the update (torch.nn.utils.clip_grad_norm_)
    clip_grad_norm: Union[float, None] = None
    #: clamp every gradient to [-v, v] before the update (torch.nn.utils.clip_grad_value_)
    clip_grad_value: Union[float, None] = None
    #: gradient accumulation: cut the step's batch along its first dim into this many equal
    #: micro-batches, a forward and backward each, their gradients summed before one update
    #: (eager's loop of ``(loss / n).backward()`` per micro-batch, then ``optimizer.step()``)
    micro_batches: int = 1
    #: sharding solver: coordinate descent, or the exact MILP (a reference; slow)
    solver: Solver = "cd"
    #: bytes per device the plan may keep resident (None: the profile's device memory)
    memory_budget: Union[float, None] = None
    #: pinned SBPs by parameter name or ``input<i>`` (e.g. ``"(S0, B)"``)
    placements: Mapping[str, Any] = field(default_factory=dict)
    #: False: the plan redistributes no activation; only parameters and optimizer state
    #: (read from their placement), gradients (into the update), outputs and scalars (the
    #: loss, its count) move. With the batch pinned ``(S0)`` and parameters ``(B)`` that is
    #: data parallelism; with parameters ``(S0)``, a fully sharded (ZeRO-3) plan
    move_activations: bool = True
    #: ``step`` receives the global batch (each rank takes its part) or each rank's own
    batch: BatchMode = "global"
    #: hardware profile: name, JSON path or object (None: the mesh's, default ``cpu-gloo``)
    profile: Union[str, HardwareProfile, None] = None
    #: turn gradient all-reduces into reduce-scatter + sharded update + all-gather
    decouple: Decouple = True
    #: where a decoupled parameter's all-gather goes
    ag_placement: AllGatherPlacement = "auto"
    #: reorder collectives for overlap (issue early, wait late)
    schedule: bool = True
    #: bucket small collectives: True lets the timeline model choose the cap, a number
    #: fixes it (bytes each bucket's collectives move on their group, an all-gather's
    #: whole output: the same on every rank), False fuses nothing
    fuse: Union[bool, float] = True
    #: split large collectives: True lets the timeline model choose the piece size, a
    #: number fixes it (bytes), False splits nothing
    partition: Union[bool, float] = True
    #: bytes of issued-but-unwaited collectives the scheduler allows
    max_inflight_bytes: float = math.inf
    #: peak live bytes the scheduler may not raise by issuing early (waiting late, a
    #: collective's input lives until its result is read: not capped)
    max_live_bytes: Union[float, None] = None
    #: optimizer updates at the end of the step, inside backward, or as modeled faster
    #: ("auto": the faster whole order, then per parameter or bucket in the final schedule)
    updates: Updates = "auto"
    #: operator times: the roofline over the profile, or measured on this machine and
    #: cached (cost_models/measured.py); sets the mesh profile's ``compute``
    compute: Compute = "roofline"
    #: how each rank runs its program: the torch.fx graph as it is, or compiled by
    #: Inductor (ddlc/inductor.py; checked to keep the planned collective order)
    backend: Backend = "eager"
    #: the optimizer update writes into its parameters, state and temporaries where
    #: nothing reads them later (passes/inplace.py; the eager backend: Inductor reinplaces
    #: on its own)
    inplace: bool = True

    def __post_init__(self):
        hints = typing.get_type_hints(CompileOptions)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _matches(value, hints[f.name]):
                raise OptionError(f"option {f.name}={value!r} is not {_describe(hints[f.name])}")
        object.__setattr__(self, "placements", dict(self.placements))
        for key, value in self.placements.items():
            try:
                as_ndsbp(value)
            except SBPError as e:
                raise OptionError(f"option placements: the placement of {key!r}: {e}") from None
        for name in ("memory_budget", "max_live_bytes", "max_inflight_bytes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise OptionError(f"option {name}={value!r} must be a positive number of bytes")
        for name in ("fuse", "partition"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not value > 0:
                raise OptionError(f"option {name}={value!r}: give True, False or a positive "
                                  "number of bytes")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise OptionError(f"option clip_grad_norm={self.clip_grad_norm!r} must be a positive "
                              "norm (or None: no clipping)")
        if self.clip_grad_value is not None and not 0 < self.clip_grad_value < math.inf:
            raise OptionError(f"option clip_grad_value={self.clip_grad_value!r} must be a positive "
                              "finite bound (or None: no clipping)")
        if self.clip_grad_norm is not None and self.clip_grad_value is not None:
            raise OptionError("options clip_grad_norm and clip_grad_value clip the same gradients, and "
                              "which comes first changes the result: give one of them")
        if self.micro_batches < 1:
            raise OptionError(f"option micro_batches={self.micro_batches} must be >= 1")
        if self.num_targets < 0:
            raise OptionError(f"option num_targets={self.num_targets} must be >= 0")
        if self.updates == "early" and not self.schedule:
            raise OptionError("option updates='early' needs the scheduler, but schedule=False; "
                              "use updates='end' or schedule=True")
        if not self.schedule and (self.max_live_bytes is not None
                                  or self.max_inflight_bytes != math.inf):
            raise OptionError("options max_live_bytes / max_inflight_bytes cap the scheduler, "
                              "but schedule=False")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "CompileOptions":
        """The options from ``compile``'s keyword arguments; an unknown name is an
        OptionError that suggests the closest known one."""
        known = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; options are {known}"
                raise OptionError(f"unknown compile option {name!r}{hint}")
        if kwargs.get("placements") is None:
            kwargs.pop("placements", None)
        return cls(**kwargs)

    @property
    def updates_for_schedule(self) -> str:
        """``updates`` as the scheduler takes it (no scheduler: updates stay at the end)."""
        return self.updates if self.schedule else "end"


def _matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin is Union:
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return any(value == choice and type(value) is type(choice) for choice in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None:  # Mapping[...]
        return isinstance(value, origin)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin is Union:
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if hint is type(None):
        return "None"
    return "a " + getattr(origin or hint, "__name__", str(hint))
