"""One rank's compiled step (:class:`CompiledStep`, what ``ddlc.compile`` returns): its
program and its shards of the parameters, buffers and optimizer state; each ``step()``
takes the rank's part of the global batch and the optimizer's hyper-parameters, checks
that nothing the program fixed has changed (the model's attributes, the optimizer's
structure, the batch's layout) and runs the program. ``write_back``, ``state_dict``,
``optimizer_state`` and the checkpoints gather the shards back into full tensors.
"""
from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cost_models.program import program_timeline

from . import holding
from .errors import RandomStreamWarning, RuntimeMismatchError, UnsupportedInputError
from .ir import GLOBAL_VAL, HYPERPARAMETER_DTYPE, SHARDING, STEP, uneven_micro_batches
from .mesh import Mesh
from .model_state import (ModelWatch, OptimizerStateWatch, autocast_state, autocast_words, change_words,
                          recompute_pruned, settings)
from .optim import hyperparameter_values, refuse_step_hooks, structure as optimizer_structure
from .plan import Plan
from .printing import format_graph
from .random_stream import ProgramDraws
from .ranks import (broadcast_from_rank0, every_rank_calls, from_rank0, take_rank0_hyperparameters,
                    take_rank0_optimizer_state, tensor_fingerprint)
from .sbp import NdSBP, local_shape, local_slices

__all__ = ["CompiledStep", "layout", "memory_order"]


class _GraphText:
    """The lowered per-rank graph; prints each node with its SBP and each collective
    with its mesh axis and bytes. ``.module`` is the runnable GraphModule."""

    def __init__(self, gm: fx.GraphModule):
        self.module = gm

    def __str__(self) -> str:
        return format_graph(self.module)

    __repr__ = __str__


#: counts the compiled steps of this process (:attr:`CompiledStep.compiled_as`)
_COMPILED = itertools.count()


def _coordinates(device_mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Each global rank's coordinate in ``device_mesh`` (its place in the layout)."""
    grid = device_mesh.mesh
    places = {int(grid[index]): index for index in itertools.product(*map(range, grid.shape))}
    return [places[rank] for rank in range(grid.numel())]


def memory_order(t: torch.Tensor, dims: Sequence[int] | None = None) -> tuple[int, ...]:
    """The dims of ``t`` (of ``dims``, default all) from outermost to innermost in its
    memory, by stride (ties by position). A dim of length 1 counts: torch's suggested
    memory format reads its stride (a one-channel image batch in channels-last is
    contiguous, and a convolution of it still gives a channels-last output)."""
    dims = range(t.dim()) if dims is None else dims
    return tuple(sorted(dims, key=lambda d: (-t.stride(d), d)))


def layout(t: torch.Tensor) -> str:
    strides = tuple(t.stride())
    if strides == torch.empty(t.shape, device="meta").stride():
        return f"row-major (contiguous, strides {strides})"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return f"channels-last (strides {strides})"
    return f"with dims {memory_order(t)} from outermost to innermost (strides {strides})"


def _kind(t: torch.Tensor) -> tuple:
    """What a traced program fixes of a tensor it takes: its dtype, shape and device."""
    return t.dtype, tuple(t.shape), t.device


def _describe_kind(kind: tuple) -> str:
    dtype, shape, device = kind
    return f"{str(dtype).removeprefix('torch.')} of shape {list(shape)} on {device}"


def _group_members(optimizer: torch.optim.Optimizer) -> tuple:
    """Per param group of ``optimizer``, the ids of its parameters."""
    return tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)


def _difference(old: tuple, new: tuple) -> str:
    """What differs between two (spec structure, parameter count) entries of
    :func:`ddlc.optim.structure`."""
    (old_fields, old_count), (new_fields, new_count) = old, new
    before, after = dict(old_fields), dict(new_fields)
    parts = [f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in before.keys() | after.keys()
             if before.get(k) != after.get(k)]
    if old_count != new_count:
        parts.append(f"{old_count} -> {new_count} parameters")
    return ", ".join(sorted(parts))


def _like(old, number: float):
    """``number`` (a checkpoint's float64) as the kind of value ``old`` was: a flag, a whole
    number, else a float."""
    if isinstance(old, bool):
        return bool(number)
    return int(number) if isinstance(old, int) and number == int(number) else number


def _trained(state: Mapping[str, object]) -> bool:
    """Whether a parameter's optimizer ``state`` holds what training left: any state
    without a step count (SGD's momentum buffer), or a step count above 0 (Adagrad makes
    its sum, at step 0, when it is built)."""
    step = state.get("step")
    return bool(state) and (step is None or float(step) > 0)


def _check_checkpoint(path: str, state: Mapping[str, object]) -> Mapping[str, object]:
    """Refuse a checkpoint whose entries are not those of ``state`` (a step's
    ``_sharded_state``), by key and global shape: one saved by a step of another model or
    optimizer. Entries of ``state`` that the checkpoint lacks would be left as they are, and
    optimizer state it holds beyond them dropped; torch raised on the first, its own
    ``CheckpointException``, which an ``except Exception`` does not catch. Returns the
    checkpoint's entries (key -> metadata)."""
    try:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as error:
        raise RuntimeMismatchError(f"{path} is not a checkpoint of CompiledStep.save_checkpoint "
                                   f"({type(error).__name__}: {error})") from error
    roles = ("param/", "buffer/", "opt_state/")
    missing = [k for k in state if k not in saved]
    extra = [k for k in saved if k.startswith(roles) and k not in state]
    shapes = [f"{k} {tuple(saved[k].size)} (this step's {tuple(v.shape)})" for k, v in state.items()
              if isinstance(v, DTensor) and k in saved and tuple(saved[k].size) != tuple(v.shape)]
    problems = [f"{what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}" for what, keys in (
        ("this step's entries it does not hold", missing), ("entries this step does not have", extra),
        ("entries of other shapes", shapes)) if keys]
    if problems:
        raise RuntimeMismatchError(
            f"the checkpoint at {path} was saved by a step of another model or optimizer; "
            + "; ".join(problems) + ". To start from its weights alone, load it into a step "
            "compiled as it was, write_back(), and compile again with this optimizer")
    return saved


class CompiledStep:
    """One rank's compiled program and its shards of the model and optimizer state."""

    def __init__(self, model: nn.Module, gm: fx.GraphModule, plan: Plan, mesh: Mesh,
                 coord: Sequence[int], batch: str, fingerprint: str, device: torch.device,
                 optimizer: torch.optim.Optimizer | None = None, device_mesh: DeviceMesh | None = None,
                 host_scalars: bool = True, loss_fn=None):
        self.gm, self.plan, self.mesh, self.coord = gm, plan, mesh, tuple(coord)
        #: what runs the program: the graph module itself, or Inductor's compiled form of it
        self.program = gm
        self.batch_mode, self.fingerprint, self.device = batch, fingerprint, device
        self.signature = STEP(gm)
        self._placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        self._spec = {i.key: i for i in self.signature.inputs}
        params = dict(model.named_parameters())
        self.device_mesh = device_mesh
        #: each global rank's mesh coordinate (the DeviceMesh's layout; row-major without one)
        self._coordinates = _coordinates(device_mesh) if device_mesh is not None else \
            [mesh.coordinate(r) for r in range(mesh.size)]
        self.steps_done = 0
        holding.register(self, model)
        #: when this step last took or changed the model's state (compile, a step): a
        #: training step of the model written back after it makes this one's copies old
        self._last_ran = holding.now()
        #: whether every rank's global batch was compared with rank 0's (the first call)
        self._batch_compared = False
        #: the parameters the step trains, as compile took them (by ``id``); the frozen ones
        #: it leaves as they are (``write_back`` does not write them)
        self.trained_ids = frozenset(id(p) for p in model.parameters() if p.requires_grad)
        self._frozen = frozenset(k for k, p in model.named_parameters() if not p.requires_grad)
        #: whether the step holds frozen parameters other than the model's (a checkpoint's)
        self._frozen_loaded = False
        #: compiled as the how-manyth step of this process (the same on every rank)
        self.compiled_as = next(_COMPILED)
        #: on a GPU, the scalars the update reads that stay in host memory, as torch.optim keeps
        #: them (:meth:`_device_for`); each hyper-parameter is one too
        self._host_scalars = host_scalars and device.type == "cuda"
        #: each trained parameter's update spec, by name
        self._optimizer_specs = dict(self.signature.optimizer)
        #: the optimizer states that are one scalar per parameter (step counts, NAdam's
        #: product of momenta), not one value per element, keyed ``"<param>:<state>"``
        self._scalar_states = frozenset(
            k for k in self.signature.keys("opt_state")
            if k.rsplit(":", 1)[1] not in self._optimizer_specs[k.rsplit(":", 1)[0]].per_element)
        self._on_host = self._scalar_states if self._host_scalars else frozenset()
        self._take_model_state(model)
        self.opt_state = {k: self._initial_opt_state(k, params, optimizer)
                          for k in self.signature.keys("opt_state")}
        self.gradients_local: dict[str, torch.Tensor] = {}
        self.last_grad_norm: torch.Tensor | None = None
        self._optimizer = optimizer
        self._structure = optimizer_structure(optimizer) if optimizer is not None else None
        self._members = _group_members(optimizer) if optimizer is not None else None
        self._groups = dict(self.signature.param_groups)
        #: the hyper-parameter values of the last step and their tensors on the device
        self._hyperparameter_values: dict[str, float] | None = None
        self._hyperparameter_inputs: dict[str, torch.Tensor] = {}
        self._model = model
        self._watch = ModelWatch(model)
        #: a loss module's attributes and weights (a class-weight tensor, label smoothing) are
        #: fixed by the trace as the model's are
        self._loss_watch = ModelWatch(loss_fn) if isinstance(loss_fn, nn.Module) else None
        #: and a loss function's plain values (an attribute of a loss object, a partial's
        #: keywords, a bound method's object's attributes)
        self._loss_fn = loss_fn
        self._loss_settings = settings(loss_fn)
        #: the program's generator and where the default generator stood when they last agreed
        self._draws = ProgramDraws(gm.rng) if hasattr(gm, "rng") else None
        if self._draws is not None:  # seeded with the stream's latest state: it holds it now
            self._draws.hold()
        #: whether this program warned that its random numbers went apart from eager's
        self._warned_apart = False
        #: the optimizer's state as this step took it (it holds its own from then on)
        self._optimizer_watch = OptimizerStateWatch(optimizer) if optimizer is not None else None
        self._autocast = autocast_state()
        #: fingerprints of the model's weights and buffers where they are the step's (at
        #: compile, after a write-back), which the next step compares (:meth:`_written_unseen`)
        self._prints = self._model_prints()
        #: the dtype, shape and device of each of the model's weights and buffers at compile
        self._kinds = {name: _kind(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}

    def _take_model_state(self, model: nn.Module) -> None:
        """This rank's pieces of ``model``'s parameters and buffers, as the program holds them."""
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        self.params = {k: self._shard(k, params[k]) for k in self.signature.keys("param")}
        self.buffers = {k: self._shard(k, buffers[k]) for k in self.signature.keys("buffer")}

    # -- placement helpers ---------------------------------------------------------------
    def _sbp(self, key: str) -> NdSBP:
        return SHARDING(self._placeholders[self._spec[key].name]).outputs[0]

    def _global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(GLOBAL_VAL(self._placeholders[self._spec[key].name]).shape)

    def _initial_opt_state(self, key: str, params: Mapping[str, torch.Tensor],
                           optimizer: torch.optim.Optimizer | None) -> torch.Tensor:
        """This rank's piece of the optimizer state ``key`` (``"<param>:<state>"``): the
        piece of the optimizer's own where it has stepped already (continue from it; torch
        names its state as ddlc.optim does), else filled with the value the spec starts it
        at (zeros, Adagrad's initial sum), made at the piece's shape alone (the whole state of
        every parameter at once, zeroed and then cut, took 24 s a rank for GPT-2 small's
        AdamW on 8 ranks of 2 cores)."""
        name, state_name = key.rsplit(":", 1)
        dtype = GLOBAL_VAL(self._placeholders[self._spec[key].name]).dtype
        given = optimizer.state.get(params[name], {}).get(state_name) if optimizer is not None else None
        if given is not None:
            return self._shard(key, given.detach().to(dtype))
        shape = local_shape(self._global_shape(key), self._sbp(key), self.mesh.shape, self.coord)
        value = self._optimizer_specs[name].initial_value(state_name)
        return torch.full(shape, value, dtype=dtype, device=self._device_for(key))

    def _device_for(self, key: str) -> torch.device:
        """Where this rank keeps ``key``: on the program's device, except, on a GPU, an
        optimizer's ``step`` count, which stays in host memory as torch.optim keeps it. The
        update's scalar arithmetic on it (bias corrections) then runs on the host, and the
        GPU kernels read its results as scalar arguments, instead of launching a kernel per
        parameter for each scalar operation and casting a float64 operand per element."""
        return torch.device("cpu") if key in self._on_host else self.device

    def _shard(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        index = local_slices(tuple(tensor.shape), self._sbp(key), self.mesh.shape, self.coord)
        return tensor.detach()[index].clone().to(self._device_for(key))

    def _gather(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's piece (a collective: every rank must call it).
        Pieces of an uneven split differ in size: each is zero-padded to the largest
        (coordinate 0's) for the all-gather, and placed without its padding."""
        shape, sbp = self._global_shape(key), self._sbp(key)
        home, local = local.device, local.to(self.device)  # a host scalar is gathered on the GPU
        largest = local_shape(shape, sbp, self.mesh.shape)
        padded = torch.zeros(largest, dtype=local.dtype, device=local.device)
        padded[tuple(slice(0, n) for n in local.shape)] = local
        pieces = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, padded)
        full = torch.empty(shape, dtype=local.dtype, device=local.device)
        for rank, piece in enumerate(pieces):
            where = local_slices(shape, sbp, self.mesh.shape, self._coordinates[rank])
            full[where] = piece[tuple(slice(0, s.stop - s.start) for s in where)]
        return full.to(home)

    @property
    def local_input_shapes(self) -> list[tuple[int, ...]]:
        """Per batch input, the shape each rank passes with ``batch="local"`` (with
        ``micro_batches``, all of them: a micro-batch's rows times their number)."""
        n = self.signature.micro_batches
        return [(shape[0] * n, *shape[1:]) if n > 1 else shape
                for shape in self._program_input_shapes()[:len(self.signature.batch_keys())]]

    def _program_input_shapes(self) -> list[tuple[int, ...]]:
        """Per batch input of the program (each micro-batch's), this rank's shape."""
        return [tuple(self._placeholders[self._spec[k].name].meta["val"].shape)
                for k in self.signature.keys("input")]

    def _batch_by_key(self, args: Sequence, kwargs: Mapping) -> dict[str, object]:
        """The batch entries by input key, from ``step(*tensors)`` for a positional batch
        or ``step(batch_dict)`` / ``step(**batch_dict)`` for a keyword one."""
        keys = self.signature.batch_keys()
        if self.signature.keyword_batch:
            if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
                given = dict(args[0])
            elif not args:
                given = dict(kwargs)
            else:
                raise UnsupportedInputError(f"the step was compiled for a dict batch with keys "
                                            f"{keys}: call it as step(batch) or step(**batch)")
            missing, extra = [k for k in keys if k not in given], [k for k in given if k not in keys]
            if missing or extra:
                raise UnsupportedInputError(f"the batch has keys {list(given)} but the step was "
                                            f"compiled for {keys} (missing {missing}, extra {extra})")
            return {k: given[k] for k in keys}
        if kwargs:
            raise UnsupportedInputError(f"the step was compiled for positional batch tensors; got "
                                        f"keyword arguments {list(kwargs)}")
        if len(args) == 1 and isinstance(args[0], (list, tuple)) and len(keys) != 1:
            raise UnsupportedInputError(f"got one {type(args[0]).__name__} of {len(args[0])} "
                                        f"items; pass the {len(keys)} batch tensors as separate "
                                        "arguments: step(*batch)")
        if len(args) != len(keys):
            raise UnsupportedInputError(f"the compiled step takes {len(keys)} batch tensor(s), "
                                        f"got {len(args)}")
        return dict(zip(keys, args))

    def _local_batch(self, args: Sequence, kwargs: Mapping) -> dict[str, torch.Tensor]:
        """This rank's part of the batch ``step()`` or a call was given, as the program takes
        it; the first call of a program with ``batch="global"`` compares the ranks' batches
        (:meth:`_check_one_global_batch`)."""
        if self.batch_mode == "global" and not self._batch_compared:
            try:
                batch = self._batch_by_key(args, kwargs)
                out = self._parts(self._micro_batches(batch))
            except UnsupportedInputError as error:
                self._check_one_global_batch(None, error)  # every rank hears of it: no hang
                raise
            self._check_one_global_batch(batch, None)
            self._batch_compared = True  # a refused call compared nothing: the next one does
            return out
        out = self._parts(self._micro_batches(self._batch_by_key(args, kwargs)))
        if self.batch_mode == "local":
            self._check_copies_agree(out)
        return out

    def _micro_batches(self, batch: Mapping[str, object]) -> dict[str, object]:
        """``batch`` as the program's batch inputs: with ``micro_batches``, each tensor's
        micro-batches (of this rank's batch, with ``batch="local"``)."""
        if self.signature.micro_batches == 1:
            return dict(batch)
        for key, t in batch.items():
            if not isinstance(t, torch.Tensor):
                raise UnsupportedInputError(f"{key} is of type {type(t).__name__}; the compiled step "
                                            "takes tensors")
        uneven = uneven_micro_batches(batch, self.signature.micro_batches)
        if uneven is not None:
            raise UnsupportedInputError(uneven)
        return self.signature.split_batch(batch)

    def _parts(self, batch: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """This rank's part of each input of ``batch`` (checked against the program's)."""
        out = {}
        shapes = dict(zip(self.signature.keys("input"), self._program_input_shapes()))
        for key, t in batch.items():
            if not isinstance(t, torch.Tensor):
                raise UnsupportedInputError(f"{key} is of type {type(t).__name__}; the compiled step "
                                            "takes tensors")
            if t.device.type == "meta":
                raise UnsupportedInputError(f"{key} is on the meta device: it holds no values to "
                                            "compute with")
            dtype = GLOBAL_VAL(self._placeholders[self._spec[key].name]).dtype
            if t.dtype != dtype:
                raise UnsupportedInputError(f"{key} has dtype {t.dtype} but the program was "
                                            f"compiled for {dtype}: convert it (e.g. .to({dtype}))")
            if self.generator is not None:
                self._check_memory_order(key, t)
            want = self._global_shape(key) if self.batch_mode == "global" else shapes[key]
            if tuple(t.shape) != want:
                hint = ""
                if self.batch_mode == "local" and any(not x.is_split for x in self._sbp(key)):
                    entry = key.rsplit("[", 1)[0] if self.signature.micro_batches > 1 else key
                    hint = (f": the plan does not split {key} over every mesh axis, so ranks take "
                            "copies or larger parts of it; for each rank's own part (a "
                            f"DistributedSampler's), pin it split, placements={{{entry!r}: "
                            f"\"({', '.join(['S0'] * len(self.mesh.shape))})\"}} for every batch input")
                if self.signature.micro_batches > 1:
                    hint += (f" ({key} is a micro-batch: the step cuts each batch tensor along its first "
                             f"dim into micro_batches={self.signature.micro_batches})")
                raise UnsupportedInputError(
                    f"{key} has shape {tuple(t.shape)} but the program was compiled for "
                    f"{self.batch_mode} shape {want} (placement {self._sbp(key)} on mesh {self.mesh}){hint}")
            if key in self.signature.strided_inputs:
                t = self._as_traced(key, t)
            out[key] = self._shard(key, t) if self.batch_mode == "global" else t.to(self.device)
        return out

    def _as_traced(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` in a tensor of its own laid out as the example of ``key`` was (its piece of
        it, with ``batch="local"``), where it is not already: a program that reads storage
        through strides and an offset it was given reads the batch, and what it computes from
        it, as traced (:func:`ddlc.graph_checks.strided_inputs`)."""
        placeholder = self._placeholders[self._spec[key].name]
        example = GLOBAL_VAL(placeholder) if self.batch_mode == "global" else placeholder.meta["val"]
        if t.stride() == example.stride() and t.storage_offset() == 0:
            return t
        return torch.empty_strided(t.shape, example.stride(), dtype=t.dtype, device=t.device).copy_(t)

    def _check_memory_order(self, key: str, t: torch.Tensor) -> None:
        """A program that draws random numbers takes its batch laid out in memory as the
        example was: eager fills a dropout mask in its activation's memory order
        (``empty_like``), which follows the batch's (a transposed or channels-last batch), and
        the program draws in the order the example's layout gave at compile."""
        example = GLOBAL_VAL(self._placeholders[self._spec[key].name])
        # a dim broadcast in either (stride 0: an expanded mask) has no place in memory
        dims = [d for d in range(t.dim()) if t.stride(d) and example.stride(d)]
        if memory_order(t, dims) != memory_order(example, dims):
            raise UnsupportedInputError(
                f"{key} is laid out in memory {layout(t)}, but the program was compiled for an "
                f"example laid out {layout(example)}: eager draws dropout masks in the memory order "
                "of their activations, which follows the batch's, and the compiled step draws them "
                "in the example's order. Pass the batch laid out as the example (.contiguous(), "
                ".to(memory_format=torch.channels_last)), or compile with an example laid out as it is")

    def _check_one_global_batch(self, batch: Mapping[str, torch.Tensor] | None,
                                error: UnsupportedInputError | None) -> None:
        """With ``batch="global"`` every rank passes the whole global batch, the same, and
        takes its own part. A rank given only its own data instead (a ``DistributedSampler``'s,
        as for DDP) would train on a mixture of parts, silently, and under a replicated plan
        the ranks' copies of the model would drift apart. So the first call of a program
        gathers from every rank either every input's fingerprint (:func:`tensor_fingerprint`) or
        the error its own checks raised (``error``: that rank then raises it), and every
        rank refuses at once, naming the first rank that failed or differs from rank 0
        (once only: the check waits for the device and costs a collective)."""
        mine = ("error", str(error)) if error is not None else \
            ("prints", [tensor_fingerprint(t).cpu() for t in batch.values()])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if error is not None:
            return
        for rank, (kind, found) in enumerate(everyone):
            if kind == "error":
                raise UnsupportedInputError(f"rank {rank} refused its batch: {found}")
        for rank, (_, prints) in enumerate(everyone):
            for key, theirs, first in zip(batch, prints, everyone[0][1]):
                if not torch.equal(theirs, first):
                    raise UnsupportedInputError(
                        f"rank {rank} passed another {key} than rank 0: with batch='global' (the "
                        "default) every rank passes the whole global batch, the same, and takes "
                        "its own part; to give each rank only its own data (a DistributedSampler's, "
                        "as for DDP), compile with batch='local'")

    def _check_copies_agree(self, parts: Mapping[str, torch.Tensor]) -> None:
        """With ``batch="local"``, the ranks that hold the same piece of an input (those
        apart only along mesh axes its placement does not split) must pass equal tensors:
        a data loader of each rank's own would give each its own data, and each would train
        on it, silently. Each such input's fingerprint (:func:`tensor_fingerprint`) is gathered
        from every rank and compared, so every rank refuses at once; an input every mesh
        axis splits needs nothing (on a GPU, the comparison waits for the device)."""
        keys = [k for k in parts if not all(x.is_split for x in self._sbp(k))]
        if not keys:
            return
        mine = torch.stack([tensor_fingerprint(parts[k]) for k in keys])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        everyone = [t.cpu() for t in everyone]
        for j, key in enumerate(keys):
            split_axes = [i for i, x in enumerate(self._sbp(key)) if x.is_split]
            first: dict[tuple, int] = {}  # the first rank of each group that holds one piece
            for rank, prints in enumerate(everyone):
                coord = self._coordinates[rank]
                peer = first.setdefault(tuple(coord[i] for i in split_axes), rank)
                if not torch.equal(prints[j], everyone[peer][j]):
                    raise UnsupportedInputError(
                        f"with batch='local', ranks {peer} and {rank} must pass the same {key} (its "
                        f"placement {self._sbp(key)} on mesh {self.mesh} does not split it along "
                        f"mesh axes {[i for i in range(self.mesh.ndim) if i not in split_axes]}), "
                        "but passed different values (a data loader of each rank's own?): pass "
                        f"them the same {key}, pin it split along every mesh axis "
                        f"(placements={{{key!r}: ...}}), or use batch='global'")

    # -- running -----------------------------------------------------------------------
    def _run(self, args, kwargs, hyperparameters: dict | None = None):
        self._take_stream()
        flat = self.signature.flatten(self.params, self.buffers, self.opt_state,
                                      self._local_batch(args, kwargs), hyperparameters)
        with contextlib.ExitStack() as stack:  # the casts autocast made are in the graph
            for device, _ in self._autocast:
                stack.enter_context(torch.autocast(device, enabled=False))
            out = self.signature.unflatten(self.program(*flat))
        self._refuse_resized_buffers(out.get("buffer", {}))
        return out

    def _refuse_resized_buffers(self, new: Mapping[str, torch.Tensor]) -> None:
        """A buffer the program gave back resized (a ``resize_`` in the forward that tracing
        saw at the old size: torch.ao's fake-quantize modules size their scales on their first
        call) would not gather, nor stay as eager keeps it: refused, before the step keeps
        anything of its run. (tracing refuses a resize it sees.)"""
        for key, value in new.items():
            if value.shape != self.buffers[key].shape:
                raise UnsupportedInputError(
                    f"the forward resized buffer {key} from {tuple(self.buffers[key].shape)} to "
                    f"{tuple(value.shape)} (torch.ao's fake-quantize and observer modules size their "
                    "statistics on their first call), which the step would do at every step, where eager "
                    "does it once: call the model once on the example batch before ddlc.compile")

    def step(self, *batch, **keyword_batch) -> torch.Tensor:
        """One training step on ``batch`` (the tensors, or for a step compiled on a dict
        batch, ``step(batch)`` / ``step(**batch)``); returns the loss (same on every rank).
        Buffers the step updates (BatchNorm running statistics) are kept; with
        ``clip_grad_norm``, ``last_grad_norm`` is the gradients' norm before clipping."""
        if not self.signature.has_loss:
            raise UnsupportedInputError("this program has no loss: it was compiled without "
                                        "loss_fn or optimizer; call it for inference instead")
        self._take_inference_statistics()
        newer = next((step for step in holding.trainers(self._model) if step is not self), None)
        if newer is not None and newer._model is self._model:
            raise UnsupportedInputError(
                "another compiled step of this model has trained it since this one last ran (its "
                "weights and optimizer state are that step's now): keep training with that step, "
                "or write it back (step.write_back()) and compile again")
        if newer is not None:
            shared = next(name for name, p in self._model.named_parameters() if id(p) in newer.trained_ids)
            raise UnsupportedInputError(
                f"parameter {shared} of this model is also a parameter of another model (a "
                f"submodule both hold), whose compiled step ({type(newer._model).__name__}'s) has "
                "trained it since this step last ran: each compiled step trains its own copy of "
                "its parameters, so two steps cannot train shared parameters in turn. Compile one "
                "model that runs both (a module calling each, with the losses added), or write "
                "the other step back (step.write_back()) and compile this one again")
        if holding.written_by_another(self, self._model, self._last_ran):
            raise UnsupportedInputError(
                "another compiled step of this model wrote its training back into the model since "
                "this step last ran: the model's weights and optimizer state are newer than this "
                "step's copies of them. Compile again to go on from them (ddlc.compile takes the model "
                "as it is; one compiled step per batch shape needs a write_back and a compile at each "
                "switch), or keep training with that step")
        self._take_the_models_newer_state()
        self._check_model()  # after the checks above: another step's training changed the model's state
        out = self._run(batch, keyword_batch, self._hyperparameters())
        self.params.update(out.get("param", {}))
        self.opt_state.update(out.get("opt_state", {}))
        self.buffers.update(out.get("buffer", {}))
        self.gradients_local = out.get("grad", {})
        if self._optimizer is not None:
            # this was the optimizer's step: what torch's lr schedulers check it has had
            self._optimizer._opt_called = True
        if "grad_norm" in out:
            self.last_grad_norm = out["grad_norm"]["grad_norm"].detach()
        self.steps_done += 1
        self._last_ran = holding.now()
        if self._keeps_state:  # it holds weights or statistics newer than the model's now
            holding.hold(self, self._model, self._optimizer)
        return out["loss"]["loss"].detach().reshape(self.signature.loss_shape)

    def _model_prints(self) -> dict[str, torch.Tensor] | None:
        """:func:`tensor_fingerprint` of each of the model's weights and buffers that the step
        holds copies of, newer than the model's once it runs: the weights where it has an
        optimizer, the buffers where it updates buffers."""
        if not self._keeps_state:
            return None
        tensors = [*(self._model.named_parameters() if self._optimizer is not None else ()),
                   *self._model.named_buffers()]
        return {name: tensor_fingerprint(t) for name, t in tensors}

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by name, as they are now."""
        return {**dict(self._model.named_parameters()), **dict(self._model.named_buffers())}

    @property
    def _keeps_state(self) -> bool:
        """Whether a step leaves weights or statistics of its own, newer than the model's
        until written back: it updates weights (has an optimizer) or buffers."""
        return self._optimizer is not None or any(o.role == "buffer" for o in self.signature.outputs)

    def _take_writes_into_the_current_model(self) -> None:
        """Where the model is as new as this step (it has not run since compile or since its
        last write-back): take what the user wrote into the model and the optimizer since, as
        eager's next step trains on it (rank 0's values; a small collective agrees which,
        :meth:`_take_users_changes`): weights and buffers written in place (``nn.init``,
        ``load_state_dict``, ``reset_running_stats``), and written without moving a version
        counter, which the fingerprints taken at compile or at the write-back see (through
        ``.data``: ``p.data.clamp_()``, WGAN's clipping; BatchNorm's running statistics by
        an eager call in train mode, whose kernel writes them so), and a parameter's
        optimizer state changed (``optimizer.load_state_dict``). Writes while the step holds
        newer training than the model are refused (:meth:`_check_model`)."""
        written = self._watch.written() | self._written_unseen()
        entries = self._optimizer_watch.changed_entries() if self._optimizer_watch is not None else set()
        changed_ids = {id_ for id_, _ in entries}
        changed = {name for name, p in self._model.named_parameters() if id(p) in changed_ids}
        taken = self._take_users_changes(written, changed, self._other_kind(written))
        self._accept_writes()
        if self._optimizer_watch is not None:
            self._optimizer_watch.accept()
        if self._prints is not None:  # the model's values are the step's again
            now = self._model_tensors()
            self._prints.update({name: tensor_fingerprint(now[name]) for name in taken
                                 if name in self._prints})

    def _written_unseen(self) -> set[str]:
        """The weights and buffers whose fingerprints differ from those taken at compile, at
        the last write-back or when the step last took the model's writes (writes into
        tensors the step has trained past are not compared)."""
        if self._prints is None:
            return set()
        now = self._model_tensors()
        return {name for name, print_ in self._prints.items()
                if name in now and not torch.equal(tensor_fingerprint(now[name]), print_)}

    def _other_kind(self, written: set[str]) -> UnsupportedInputError | None:
        """The refusal of a weight or buffer given another dtype, shape or device since
        compile (``model.double()``, ``p.data = t.double()``, a bias of another size through
        ``.data``), or None: the traced program has the tensors' dtypes and shapes."""
        now = self._model_tensors()
        for name in sorted(written):
            then, tensor = self._kinds.get(name), now.get(name)
            if then is not None and tensor is not None and then != _kind(tensor):
                return UnsupportedInputError(
                    f"{name} is now {_describe_kind(_kind(tensor))} where the step was "
                    f"compiled for {_describe_kind(then)} (model.double(), .to(), or a tensor of "
                    "another dtype or shape assigned to its .data): the compiled program has the "
                    "dtypes and shapes it was traced with; compile again", where=name)
        return None

    @property
    def _reads_model_weights(self) -> bool:
        """A training step without an optimizer changes no weight: its weights are the
        model's, read at each call (:meth:`_read_the_models_tensors`)."""
        return self.signature.has_loss and self._optimizer is None

    def _take_the_models_newer_state(self) -> None:
        """Take what the model holds newer than this step's copies, before the step runs or
        its state is read: the weights a step without an optimizer reads at each call
        (:meth:`_read_the_models_tensors`), and where the model is as new as this step (it
        has not run since compile or since its last write-back), what was written into it
        since (:meth:`_take_writes_into_the_current_model`, a collective)."""
        if self._reads_model_weights:
            self._read_the_models_tensors()
        if self._keeps_state and holding.holder(self._model) is not self:
            self._take_writes_into_the_current_model()

    def _read_the_models_tensors(self) -> None:
        """A step without an optimizer changes no parameter, so it reads the model's, as they
        are at each call, as eager's backward does: a loop that updates the weights itself
        from ``gradients()`` (``p.data.add_(g, alpha=-lr)``, word_language_model's) trains.
        So it reads the buffers too where it updates none (a constant table, a mask)."""
        params = dict(self._model.named_parameters())
        self.params = {k: self._shard(k, params[k]) for k in self.signature.keys("param")}
        read = set(self.params)
        if not self._keeps_state:
            buffers = dict(self._model.named_buffers())
            self.buffers = {k: self._shard(k, buffers[k]) for k in self.buffers}
            read |= set(self.buffers)
        self._watch.accept_writes(read)

    def _take_inference_statistics(self) -> None:
        """Where an inference program of this model, or of a model sharing a submodule with
        it, updated buffers since this step last ran (BatchNorm's statistics, called in train
        mode) and holds them, write it back and take its buffers (rank 0's; a collective),
        which eager's next step, and this step's ``state_dict``, read."""
        if not self._write_back_inference_programs():
            return
        written = self._watch.written() & set(self.buffers)
        self._take_users_changes(written, set())
        self._watch.accept_writes(written)

    def _write_back_inference_programs(self) -> bool:
        """Write back the other inference programs holding statistics of this model
        (:func:`holding.statistics_holders`; a collective); whether there were any."""
        others = [h for h in holding.statistics_holders(self._model) if h is not self]
        for other in others:
            other.write_back()
        return bool(others)

    def write_back(self) -> None:
        """Put this step's training state into the model and optimizer it was compiled from
        (collective): the full parameters and buffers (non-persistent ones too) into the
        model's own tensors, except those written in the model since compile (eager would train on
        those values: they stay, and this step goes on from them), the optimizer state into
        ``optimizer.state`` as torch.optim keeps it (except a parameter's state the user
        changed since: ``optimizer.load_state_dict`` of a checkpoint, a reset, which stays, and
        this step goes on from it; :meth:`_take_users_changes`), and the program generator's
        state into the default generator
        (CPU or CUDA, as the program's), so that an eager step, ``torch.save`` of the model or
        a ``ddlc.compile`` of it again continues from them (dropout goes on to new masks
        instead of replaying the compiled steps'). This step keeps running as it was. Again
        with no step in between, it does nothing: the model and optimizer are the user's,
        and may have been trained eagerly since; a step that holds no training of the model
        (not trained since compile, or another step of it trained since) writes back the one
        that holds it. Under ``torch.inference_mode()`` (an
        inference program called there writes a training step back) the optimizer's state
        is still made of normal tensors, which eager steps can update."""
        every_rank_calls("step.write_back()", self.steps_done)
        with torch.inference_mode(False):
            self._write_back()

    def _write_back(self) -> None:
        """:meth:`write_back`, outside inference mode. Only the step that holds the model's
        training writes back: another one's values are older than the model's (it has not
        trained, or was written back, or another step of the model trained since), and
        copying them in would also look like the user's writes to the step that holds it;
        it writes back the one that holds it, if any (an inference program called since
        in train mode, whose statistics are the newest)."""
        self._hand_back_stream()
        holder = holding.holder(self._model)
        if holder is not self:
            if holder is not None:
                holder.write_back()
            self._take_inference_statistics()  # a submodule's program's, in train mode
            return
        written = self._watch.written()
        params = dict(self._model.named_parameters())
        # the optimizer state the user changed since compile or the last write-back, per entry
        # (a reset of one parameter's moments leaves its step count the step's)
        user_entries = self._optimizer_watch.changed_entries() if self._optimizer is not None else set()
        changed_ids = {q for q, _ in user_entries}
        changed = {name for name, p in params.items() if id(p) in changed_ids}
        # a collective per tensor, alike on every rank; a frozen parameter stays as it is
        # unless a checkpoint was loaded, and an inference program's parameters (the model's,
        # as it took them)
        held = {**self.params, **self.buffers} if self._optimizer is not None else self.buffers
        skipped = frozenset() if self._frozen_loaded else self._frozen
        full = {k: self._gather(k, v) for k, v in held.items() if k not in skipped}
        self._frozen_loaded = False
        own = {**params, **dict(self._model.named_buffers())}
        with torch.no_grad():
            for name, value in full.items():
                if name not in written:
                    own[name].copy_(value)
        if self._optimizer is not None:
            for key, value in self.optimizer_state().items():  # a collective: on every rank
                name, state_name = key.rsplit(":", 1)
                shape = () if key in self._scalar_states else params[name].shape
                if (id(params[name]), state_name) not in user_entries:  # else the user's: it stays
                    self._optimizer.state[params[name]][state_name] = value.detach().reshape(shape).clone()
        self._take_users_changes(written, changed)
        recompute_pruned(self._model)
        if self._optimizer is not None:
            self._optimizer_watch.accept()
        self._accept_writes()
        self._prints = self._model_prints()
        holding.release(self._model)
        if self.signature.has_loss:
            holding.wrote(self, self._model)

    def _take_users_changes(self, written: set[str], changed: set[str],
                            refusal: UnsupportedInputError | None = None) -> list[str]:
        """After :meth:`write_back`: the step goes on from the parameters and buffers the
        user wrote into the model (``written``: ``nn.init``, ``load_state_dict``, an average
        copied in) and from the optimizer state of the parameters whose state the user
        changed (``changed``: ``optimizer.load_state_dict``, a reset of one parameter's
        moments), as eager training would, instead of from its own shards. Every rank
        takes rank 0's values (as compile does), the optimizer's hyper-parameters too, for
        what any rank changed: which that is, is agreed first (one small collective), and
        so is a ``refusal`` of any rank's, which every rank raises then.
        Returns the names of the weights and buffers taken (those any rank wrote)."""
        own = self._model_tensors()
        names = sorted(own)
        mask = torch.tensor([name in written for name in names] + [name in changed for name in names]
                            + [refusal is not None], dtype=torch.int32, device=self.device)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX)
        if mask[-1]:
            raise refusal or UnsupportedInputError(
                "another rank refused what was written into its model since compile or the last "
                "write-back (a weight or buffer of another dtype, shape or device; its error names "
                "it): every rank must change its model alike")
        mask = mask[:-1]
        written = [name for name, bit in zip(names, mask[:len(names)].tolist()) if bit]
        changed = {name for name, bit in zip(names, mask[len(names):].tolist()) if bit}
        with torch.no_grad():
            for name in written:
                broadcast_from_rank0(own[name])
                held = self.params if name in self.params else self.buffers if name in self.buffers else None
                if held is not None:  # else a buffer the step does not read
                    held[name] = self._shard(name, own[name])
        if changed:
            take_rank0_optimizer_state(self._optimizer)
            take_rank0_hyperparameters(self._optimizer)
            params = dict(self._model.named_parameters())
            self.opt_state.update({k: self._initial_opt_state(k, params, self._optimizer)
                                   for k in self.signature.keys("opt_state") if k.rsplit(":", 1)[0] in changed})
        return written

    def _hand_back_stream(self) -> None:
        """The random stream's latest state (another program's draws too) into the default
        generator (:meth:`ProgramDraws.hand_back`)."""
        if self._draws is not None:
            self._draws.take_stream()
            self._draws.hand_back()

    def _take_stream(self) -> None:
        """:meth:`ProgramDraws.take_stream`, where the program draws; the first time the
        user's draws from the default generator stay unseen, a :class:`RandomStreamWarning`
        (on each rank whose generator moved)."""
        if self._draws is None:
            return
        self._draws.take_stream()
        if not self._warned_apart and self._draws.apart_from_default():
            self._warned_apart = True
            warnings.warn(
                "ddlc: the default random generator moved since this program last took its random "
                "stream (a draw or a seed in the loop between compiled calls: torch.randint, an "
                "eager forward with dropout, a DataLoader shuffling without generator=). The "
                "program's random numbers (dropout, randn_like) go on from its own stream without "
                "those draws, so they are not the numbers eager would draw after them. To match "
                "eager, keep the loop's draws off the default generator (a torch.Generator of "
                "their own, a DataLoader's generator=) or pass such numbers in as inputs; "
                "write_back() hands the stream back to the default generator where nothing "
                "moved it since", RandomStreamWarning, stacklevel=4)

    def sees_no_change(self) -> bool:
        """Whether nothing was written into the model's parameters and buffers or the
        optimizer's state since this program last took or wrote them."""
        return not self._watch.written() and (self._optimizer_watch is None
                                              or not self._optimizer_watch.changed())

    def accept_compiles_writes(self) -> None:
        """Another ``compile`` of the model wrote rank 0's values into it (the values this
        program sees: :meth:`sees_no_change` held before): they are no change."""
        self._accept_writes()
        if self._optimizer_watch is not None:
            self._optimizer_watch.accept()

    def _accept_writes(self) -> None:
        """Take the model's parameters and buffers as they are now (this step wrote its own
        into them, or took theirs), in the loss module's watch too: it may hold some of them
        (a learnable temperature in a submodule of the model, class weights the model keeps)."""
        self._watch.accept_writes()
        if self._loss_watch is not None:
            self._loss_watch.accept_writes()

    def _only_gates_closed(self, now: tuple) -> bool:
        """Whether the optimizer structure ``now`` differs from the compiled one only in a
        weight decay that was non-zero and is 0 now: a value the graph takes (it multiplies
        by it). A momentum set to 0 is not: torch then leaves its buffer as it was, while the
        graph would keep refreshing it."""
        if len(now) != len(self._structure):
            return False
        gates = ("weight_decay",)
        for (old_fields, old_count), (new_fields, new_count) in zip(self._structure, now):
            before, after = dict(old_fields), dict(new_fields)
            if old_count != new_count or before.keys() != after.keys() or any(
                    before[k] != after[k] and not (k in gates and before[k] and not after[k]) for k in before):
                return False
        return True

    def _loss_change(self) -> str | None:
        """Which plain value of a loss function that is not a module changed since compile
        (:func:`ddlc.model_state.settings`), in words; None if none did."""
        if self._loss_watch is not None:
            return None
        now = settings(self._loss_fn)
        if now == self._loss_settings:
            return None
        then, now = dict(self._loss_settings), dict(now)
        name = next(k for k in [*then, *now] if then.get(k) != now.get(k))
        return change_words(name, then.get(name, "<unset>"), now.get(name, "<unset>"))

    def _check_model(self) -> None:
        """Refuse to run when the model changed since compile in a way the program cannot
        see (:class:`ddlc.model_state.ModelWatch`: it holds its own shards of the weights
        and buffers and runs the modules as they were traced), or the optimizer's state did
        (:class:`ddlc.model_state.OptimizerStateWatch`: it holds its own), or a loss module
        did, or a loss function's plain values (:meth:`_loss_change`), or when ``torch.autocast``
        is not as it was at compile (the traced step has its dtypes). A global the model or
        the loss reads goes unseen."""
        if self._optimizer_watch is not None and self._optimizer_watch.changed():
            raise UnsupportedInputError(
                "the optimizer's state changed after compile (optimizer.load_state_dict, an eager "
                "optimizer step, an edit of optimizer.state): the compiled step holds its own and "
                "would ignore it; compile again (that takes the optimizer's state as it is then), "
                "or load a checkpoint of this step with step.load_checkpoint")
        change = self._loss_watch.change() if self._loss_watch is not None else self._loss_change()
        if change is not None:
            raise UnsupportedInputError(
                f"the loss function changed after compile: {change}. The compiled step computes "
                "the loss as it was traced: undo the change, or compile again")
        change = self._watch.change()
        if change is not None:
            raise UnsupportedInputError(
                f"the model changed after compile: {change}. The compiled step runs the model as "
                "it was traced and holds its own copy of the weights and buffers, newer than the "
                "model's once it has run, so it would ignore the change: undo it. To change weights, "
                "buffers or optimizer state, call step.write_back() first and make the change then "
                "(the next step takes it); to change anything else, compile again (that takes the "
                "model as it is then, with the weights and optimizer state this step trained, "
                "written back); weights written into the model are superseded by step.load_checkpoint")
        if autocast_state() != self._autocast:
            raise UnsupportedInputError(
                f"torch.autocast is {autocast_words(autocast_state())} here but was "
                f"{autocast_words(self._autocast)} when the step was compiled; the traced step "
                "has the dtypes it was traced with: call step() under the autocast that "
                "ddlc.compile ran under (or compile again under this one)")

    def _hyperparameters(self) -> dict[str, torch.Tensor]:
        """This step's hyper-parameter inputs, read from the optimizer's param groups now
        (lr schedulers and edits of ``param_groups`` take effect). A change the graph
        cannot take as an input value (a weight decay turned on, another optimizer flag,
        parameters moved between groups) is refused: the graph would ignore it."""
        if self._optimizer is None:
            return {}
        refuse_step_hooks(self._optimizer)
        now = optimizer_structure(self._optimizer)
        if now == self._structure and _group_members(self._optimizer) != self._members:
            raise UnsupportedInputError("parameters moved between the optimizer's param groups after "
                                        "compile; compile again")
        if now != self._structure and not self._only_gates_closed(now):
            changed = [f"param group {g}: {_difference(old, new)}"
                       for g, (old, new) in enumerate(zip(self._structure, now)) if old != new]
            if len(now) != len(self._structure):
                changed.append(f"{len(self._structure)} param groups became {len(now)}")
            raise UnsupportedInputError(
                "the optimizer changed after compile in a way the compiled step cannot take as a "
                "new hyper-parameter value (a zero weight decay or momentum made non-zero, a "
                "momentum turned off, another flag, or parameters moved between groups): "
                f"{'; '.join(changed)}; compile again")
        values = hyperparameter_values(self._optimizer, self._groups)
        if values != self._hyperparameter_values:  # the first step, or a schedule's new values
            self._hyperparameter_inputs = self._hyperparameter_tensors(values)
            self._hyperparameter_values = values
        return self._hyperparameter_inputs

    def _hyperparameter_tensors(self, values: dict[str, float]) -> dict[str, torch.Tensor]:
        """``values`` as scalar tensors: in host memory on the CPU or where the program
        keeps scalars there (:meth:`_device_for`), else on the GPU, each copied from pinned
        memory without waiting for it (``torch.tensor(v, device="cuda")`` synchronizes the
        host with the device, which stalls the step once per hyper-parameter)."""
        if self.device.type == "cpu" or self._host_scalars:
            return {k: torch.tensor(v, dtype=HYPERPARAMETER_DTYPE) for k, v in values.items()}
        return {k: torch.tensor(v, dtype=HYPERPARAMETER_DTYPE, pin_memory=True)
                .to(self.device, non_blocking=True) for k, v in values.items()}

    def __call__(self, *inputs, **keyword_inputs):
        """Inference (compiled without loss_fn and optimizer): the model's output, in the
        model's own structure (a tensor, tuple, dict or ``ModelOutput``), full on every rank.
        It runs on the model's weights and buffers as they are now (:meth:`_take_current_state`:
        those another compiled step has trained since, or written into the model since);
        buffers it updates (BatchNorm statistics in training mode) are its own until written
        back, as a training step's are (compiling the model again writes them back first)."""
        if self.signature.has_loss:
            raise UnsupportedInputError("this program is a training step; call .step(*batch)")
        self._take_current_state()
        self._check_model()
        out = self._run(inputs, keyword_inputs)
        if out.get("buffer"):
            self.buffers.update(out["buffer"])
            self.steps_done += 1  # calls that changed the model's state, for write_back
            holding.hold(self, self._model, self._optimizer)
        return self.signature.output_tree.rebuild(list(out["output"].values()))

    def _take_current_state(self) -> None:
        """Before an inference call: where another compiled program has trained the model
        since, or moved statistics of it (a step, or another inference program in train
        mode), write that program back (collective; every rank runs the same calls); then
        reshard the parameters and buffers written into the model since this program took
        them, keeping the statistics it moved itself that nothing wrote since (eager
        inference would read the model's, which these are)."""
        # the steps that trained the model, or programs that moved statistics of it (a frozen
        # backbone's BatchNorm in train mode, the whole model's after its backbone's), in
        # compile order
        steps = holding.buffer_holders(self._model)
        for step in sorted(set(holding.trainers(self._model) + steps), key=lambda s: s.compiled_as):
            if step is not self:
                step.write_back()
        written = self._watch.written()
        if not written:
            return
        if holding.holder(self._model) is self:  # it holds statistics it moved: keep those not written
            kept = {k: v for k, v in self.buffers.items() if k not in written}
            self._take_model_state(self._model)
            self.buffers.update(kept)
            if not kept:  # the model's values are newer than all of this program's
                holding.release(self._model)
        else:
            self._take_model_state(self._model)
        self._accept_writes()

    # -- random numbers ----------------------------------------------------------------
    @property
    def generator(self) -> torch.Generator | None:
        """The generator every random op of the program draws from (the same state on every
        rank; see :mod:`ddlc.rng`), or None when the program draws no random numbers."""
        return getattr(self.gm, "rng", None)

    def manual_seed(self, seed: int) -> None:
        """Reseed the program's generator with rank 0's ``seed`` (collective)."""
        if self.generator is not None:
            self.generator.manual_seed(from_rank0(int(seed)))
            self._draws.hold()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and persistent buffers under exactly the keys of the model's own
        ``state_dict()`` (a tied parameter under each of its names), so that
        ``model.load_state_dict(step.state_dict(), strict=True)`` works (collective)."""
        every_rank_calls("step.state_dict()", self.steps_done)
        self._take_inference_statistics()
        self._take_the_models_newer_state()
        full = {k: self._gather(k, v) for k, v in {**self.params, **self.buffers}.items()}
        # the model's own state_dict() with the step's state in the model's place: its keys
        # and order, and what its state-dict hooks and modules' get_extra_state make of it
        with holding.current(self._model, full):
            return self._model.state_dict()

    # -- checkpoints -------------------------------------------------------------------
    def _sharded_state(self) -> dict:
        """The training state as DTensors of this rank's pieces (their global shapes and
        placements), plus the step count: what ``torch.distributed.checkpoint`` saves,
        and the destinations it loads into (resharding to this program's placements)."""
        if self.device_mesh is None:
            raise RuntimeMismatchError("checkpoints need the DeviceMesh of the compiled step")

        def dtensor(key: str, local: torch.Tensor) -> DTensor:
            shape = self._global_shape(key)
            return DTensor.from_local(local.to(self.device), self.device_mesh, self._sbp(key).to_placements(),
                                      run_check=False, shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
        tables = {"param": self.params, "buffer": self.buffers, "opt_state": self.opt_state}
        state = {f"{role}/{k}": dtensor(k, v) for role, table in tables.items() for k, v in table.items()}
        state["steps_done"] = torch.tensor(self.steps_done)
        if self.generator is not None and self.generator.device.type == "cpu":
            state["rng_state"] = self.generator.get_state()
        return state

    def _param_group_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's param groups' numbers (``lr``, ``betas`` as a tuple or a list,
        ``momentum``, ``eps``, ``weight_decay``, a scheduler's ``initial_lr``, ...) and flags
        (``maximize``, ``nesterov``, ``decoupled_weight_decay``, ...), keyed
        ``param_group/<index>/<name>``, as float64 tensors: what ``optimizer.state_dict()``
        carries besides the state, which a checkpoint restores as torch's
        ``optimizer.load_state_dict`` does."""
        if self._optimizer is None:
            return {}
        index = {id(p): i for i, (_, p) in enumerate(self._model.named_parameters())}
        state = {}
        for g, group in enumerate(self._optimizer.param_groups):
            # which parameters the group holds (their places in model.named_parameters()):
            # numbers loaded into a group of other parameters would train them wrongly
            state[f"param_group/{g}/params"] = torch.tensor([index.get(id(p), -1) for p in group["params"]],
                                                            dtype=torch.float64)
            for name, value in sorted(group.items()):
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    value = value.item()
                numbers = value if isinstance(value, (tuple, list)) else (value,)
                if name != "params" and numbers and all(isinstance(x, (int, float)) for x in numbers):
                    state[f"param_group/{g}/{name}"] = torch.tensor(numbers, dtype=torch.float64)
        return state

    def _set_param_groups(self, state: Mapping[str, torch.Tensor], mine: Mapping[str, torch.Tensor],
                          saved: Mapping[str, object], path: str) -> None:
        """Put the numbers of :meth:`_param_group_state` entries ``state`` (loaded from the
        checkpoint; ``mine``: this optimizer's own, before) back into the param groups
        (a tensor filled; a flag where the group held one, a whole number where it held an
        int, else a float; a pair as the group held it, tuple or list). Refused, changing
        nothing, where the checkpoint's groups hold other parameters than this optimizer's
        (as ``optimizer.load_state_dict`` refuses groups of other sizes), or where its
        numbers or flags change what the step was compiled for (a weight decay or momentum
        turned on from 0, ``maximize`` set)."""
        members = sorted(k for k in mine if k.endswith("/params"))
        if any(k.endswith("/params") for k in saved) and (
                members != sorted(k for k in saved if k.startswith("param_group/") and k.endswith("/params"))
                or any(k not in state or not torch.equal(state[k], mine[k]) for k in members)):
            raise RuntimeMismatchError(
                f"the checkpoint at {path} was saved by an optimizer whose param groups hold other "
                "parameters than this one's: build the optimizer's groups as they were, or load the "
                "weights alone (into a step compiled as it was, then write_back())")
        before = [dict(group) for group in self._optimizer.param_groups]
        tensors = [(v, v.clone()) for group in before for v in group.values() if isinstance(v, torch.Tensor)]
        for key, tensor in state.items():
            _, g, name = key.split("/", 2)
            if name == "params":
                continue
            group = self._optimizer.param_groups[int(g)]
            numbers, old = tensor.tolist(), group[name]
            if isinstance(old, torch.Tensor):
                old.fill_(numbers[0])
            elif isinstance(old, (tuple, list)):
                group[name] = type(old)(_like(o, x) for o, x in zip(old, numbers))
            else:
                group[name] = _like(old, numbers[0])
        now = optimizer_structure(self._optimizer)
        if now != self._structure and not self._only_gates_closed(now):
            changed = "; ".join(f"param group {g}: {_difference(old, new)}"
                                for g, (old, new) in enumerate(zip(self._structure, now)) if old != new)
            for group, old in zip(self._optimizer.param_groups, before):
                group.update({k: v for k, v in old.items() if not isinstance(v, torch.Tensor)})
            for tensor, value in tensors:  # a tensor lr was filled in place
                tensor.copy_(value)
            raise RuntimeMismatchError(
                f"the checkpoint at {path} holds hyper-parameters this step was not compiled for "
                f"({changed}): set them in the optimizer as the checkpoint has them and compile again "
                "before loading it")

    def save_checkpoint(self, path: str) -> None:
        """Save parameters, buffers, optimizer state, the param groups' hyper-parameters,
        the step count and the program's random generator state to the directory
        ``path`` with ``torch.distributed.checkpoint``, each rank writing its own pieces
        (collective). Load it with :meth:`load_checkpoint`, on any mesh shape or world size."""
        params = dict(self._model.named_parameters())
        frozen = [name for name in sorted(self._frozen) if self._optimizer is not None
                  and _trained(self._optimizer.state.get(params[name], {}))]
        if frozen:
            raise UnsupportedInputError(
                f"the optimizer holds state of the frozen parameter(s) {', '.join(frozen)} (from "
                "training before they were frozen), which a checkpoint does not carry: resuming from "
                "it would lose that state when they train again. Save with step.write_back() and "
                "torch.save of model.state_dict() and optimizer.state_dict() instead")
        every_rank_calls("step.save_checkpoint()", self.steps_done)
        self._take_stream()  # the stream's latest state, another program's draws too
        self._take_inference_statistics()
        self._take_the_models_newer_state()
        dcp.save({**self._sharded_state(), **self._param_group_state()}, checkpoint_id=path)

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint of :meth:`save_checkpoint` into this program's placements
        (resharded if it was saved on another mesh; collective). The optimizer's param
        groups take the checkpoint's hyper-parameters, as ``optimizer.load_state_dict``
        gives them (the lr a scheduler set, OneCycle's momentum); an lr scheduler's own
        state (its position) is the user's to restore (``scheduler.load_state_dict``)."""
        every_rank_calls("step.load_checkpoint()", self.steps_done)
        state = self._sharded_state()
        saved = _check_checkpoint(path, state)
        mine = self._param_group_state()
        groups = {k: v.clone() for k, v in mine.items() if k in saved and tuple(saved[k].size) == tuple(v.shape)}
        if any(k.startswith("param_group/") for k in saved):  # first: a refusal changes nothing
            if groups:
                dcp.load(groups, checkpoint_id=path)
            self._set_param_groups(groups, mine, saved, path)
        # what an inference program of a model sharing a submodule moved goes into the model
        # first (its own BatchNorm's statistics stay its own); the checkpoint supersedes the rest
        self._write_back_inference_programs()
        dcp.load(state, checkpoint_id=path)
        for key, value in state.items():
            if key == "steps_done":
                self.steps_done = int(value)
                continue
            if key == "rng_state":
                self.generator.set_state(value)
                self._draws.hold()
                self._draws.agree()
                continue
            role, name = key.split("/", 1)
            {"param": self.params, "buffer": self.buffers, "opt_state": self.opt_state}[role][name] = \
                value.to_local().contiguous().to(self._device_for(name))
        self._frozen_loaded = bool(self._frozen)  # written back with the rest
        self._prints = None  # the model's weights are superseded
        if self._reads_model_weights:
            own = dict(self._model.named_parameters())
            with torch.no_grad():
                for name, local in self.params.items():  # a collective per tensor, alike on every rank
                    own[name].copy_(self._gather(name, local))
        self._accept_writes()  # the model's weights written since compile are superseded
        if self._optimizer_watch is not None:  # and so is the optimizer's state
            self._optimizer_watch.accept()
        # newer than the model's: compiling it again, or an inference program of it,
        # writes it back first
        holding.hold(self, self._model, self._optimizer)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Full optimizer state keyed ``"<param>:<state>"`` (collective), as torch.optim
        keeps it. A parameter the loss does not read (never given a gradient) is not
        updated: its state is the optimizer's own, as every rank took it from rank 0 at
        compile (none for most optimizers; Adagrad makes its sum when it is made); so is a
        frozen parameter's (the state an earlier training left it, which eager keeps)."""
        every_rank_calls("step.optimizer_state()", self.steps_done)
        self._take_the_models_newer_state()
        untrained = set(self.signature.untrained)
        on_cpu = self._steps_kept_on_cpu()
        state = {k: self._gather(k, v).cpu() if k in on_cpu else self._gather(k, v)
                 for k, v in self.opt_state.items() if k.rsplit(":", 1)[0] not in untrained}
        state.update(self._optimizers_own_state(untrained | self._frozen))
        return state

    def _optimizers_own_state(self, names) -> dict[str, torch.Tensor]:
        """The optimizer's own tensor state of the parameters ``names`` (sorted), keyed
        ``"<param>:<state>"``."""
        if self._optimizer is None:
            return {}
        params = dict(self._model.named_parameters())
        return {f"{name}:{state_name}": value.detach().clone() for name in sorted(names)
                for state_name, value in self._optimizer.state.get(params[name], {}).items()
                if isinstance(value, torch.Tensor)}

    def _steps_kept_on_cpu(self) -> set[str]:
        """The scalar states (``_scalar_states``: step counts) torch.optim keeps on the
        CPU: those of param groups neither ``capturable`` nor ``fused`` (the program's own
        copy is in host memory too, except in an Inductor program on a GPU: :meth:`_device_for`)."""
        if self._optimizer is None:
            return set()
        names = {id(p): n for n, p in self._model.named_parameters()}
        cpu_params = {names[id(p)] for g in self._optimizer.param_groups
                      if not (g.get("capturable") or g.get("fused")) for p in g["params"] if id(p) in names}
        return {k for k in self._scalar_states if k.rsplit(":", 1)[0] in cpu_params}

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full gradients of the last step (compiled with loss_fn, no optimizer; collective),
        but of the parameters the loss does not reach, whose ``.grad`` eager leaves None. A
        step with an optimizer keeps none (its update consumes them inside the program), nor
        does an inference program: refused, rather than an empty dict a logger would read as
        zero gradients."""
        if self._optimizer is not None or not self.signature.has_loss:
            raise UnsupportedInputError(
                "step.gradients() is for a step compiled with a loss_fn and without an optimizer; "
                + ("this one has an optimizer, whose update takes the gradients inside the "
                   "compiled program, which keeps none: for their norm, compile with "
                   "clip_grad_norm= and read step.last_grad_norm; to see them, compile without the "
                   "optimizer and update the weights yourself" if self._optimizer is not None
                   else "this is an inference program, which computes no gradient"))
        every_rank_calls("step.gradients()", self.steps_done)
        unreached = set(self.signature.untrained)
        return {k: self._gather(k, v) for k, v in self.gradients_local.items() if k not in unreached}

    def timeline(self):
        """The modeled timeline of this rank's program (:mod:`cost_models.program`):
        ``.makespan``, ``.exposed_communication``, ``.write_chrome_trace(path)``."""
        return program_timeline(self.gm, self.mesh.profile)

    @property
    def graph(self) -> _GraphText:
        return _GraphText(self.gm)
