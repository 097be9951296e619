"""The opt-in Inductor backend: each rank's lowered program compiled by ``torch._inductor``.

``ddlc.compile(..., backend="inductor")`` hands the rank's final graph (local shapes,
``_c10d_functional`` collectives in the planned order) to Inductor's ``compile_fx``
with example inputs of the placeholders' local shapes; nothing runs while it compiles.
Inductor may fuse and reorder compute, so before the program is used the collectives of
the generated wrapper code are read in the order it calls them and compared with the
planned ones (kind and process group, in program order): any difference is a
:class:`ddlc.errors.LoweringError` on every rank, never a deadlock or a mismatched
reduction. Inductor's own compute/communication reordering stays off
(``reorder_for_compute_comm_overlap=False``), and on gloo, where every collective is
waited for before the next is issued, so does its reordering for locality.

Needs a C++ compiler (Inductor's CPU kernels); programs that draw random numbers
(dropout) are refused: their draws read the program's generator, which Inductor's
tracing does not take.
"""
from __future__ import annotations

import re
import shutil
from typing import Callable, Sequence

import torch
from torch import fx

from . import comm
from .errors import LoweringError, UnsupportedInputError
from .ir import is_collective

__all__ = ["compile_program", "planned_collectives", "compiled_collectives", "most_in_flight", "check_order"]

#: a line of an Inductor wrapper that calls a ``_c10d_functional`` operator: name, arguments
_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\((.*)\)\s*$", re.MULTILINE)
#: Inductor's in-place form of a collective -> the functional one the graph holds
_IN_PLACE = {"all_reduce_": "all_reduce"}


def compile_program(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                    one_in_flight: bool = False) -> tuple[Callable, list, int]:
    """``(the compiled program, the collectives its wrapper calls, in order, the most of
    them in flight at once)``. ``one_in_flight``: ``gm`` waits for each collective before
    the next (gloo: :mod:`passes.waits`), so Inductor's reordering for locality, which moves
    a wait down to its result's first reader (past the next collectives), stays off."""
    if any(n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Generator)
           for n in gm.graph.nodes):
        raise UnsupportedInputError("backend='inductor' does not run programs that draw random "
                                    "numbers (dropout, random init) yet: use backend='eager'")
    if not has_compiler():
        raise UnsupportedInputError("backend='inductor' needs a C++ compiler (Inductor's CPU "
                                    "kernels are C++); none was found on PATH")
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.compile_fx import compile_fx
    loaded = len(PyCodeCache.modules)
    try:
        patches = {"reorder_for_compute_comm_overlap": False}
        if one_in_flight:
            patches["reorder_for_locality"] = False
        program = compile_fx(gm, list(example_inputs), config_patches=patches)
    except Exception as e:  # noqa: BLE001 - Inductor's own failure, named for the user
        raise LoweringError(f"Inductor could not compile this rank's program ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); use backend='eager'") from e
    sources = [open(module.__file__).read() for module in PyCodeCache.modules[loaded:]]
    return program, [call for source in sources for call in compiled_collectives(source)], \
        max((most_in_flight(source) for source in sources), default=0)


def has_compiler() -> bool:
    """Whether a C++ compiler for Inductor's CPU kernels is on PATH."""
    return shutil.which("c++") is not None or shutil.which("g++") is not None


def compiled_collectives(source: str) -> list[tuple[str, str]]:
    """The ``(operator name, group name)`` of each collective ``source`` calls, in order
    (its group is the last quoted argument)."""
    return [(_IN_PLACE.get(name, name), re.findall(r"'([^']*)'", args)[-1])
            for name, args in _CALL.findall(source) if name != "wait_tensor"]


def most_in_flight(source: str) -> int:
    """The most collectives ``source`` has issued and not yet waited for at any point of
    its calls (a gloo program must keep to one: :mod:`passes.waits`)."""
    pending = most = 0
    for name, _ in _CALL.findall(source):
        pending += -1 if name == "wait_tensor" else 1
        most = max(most, pending)
    return most


def planned_collectives(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The ``(operator name, group name)`` of each collective ``gm`` issues, in order
    (including the all-to-all inside :func:`ddlc.comm.all_to_all_dims`)."""
    calls = []
    for node in gm.graph.nodes:
        if is_collective(node):
            calls.append((node.target._opname, node.args[-1]))
        elif node.op == "call_function" and node.target is comm.all_to_all_dims:
            calls.append(("all_to_all_single", node.args[-1]))
    return calls


def check_order(planned: list, compiled: list) -> str | None:
    """None when ``compiled`` calls exactly the ``planned`` collectives in order, else
    what differs first."""
    for i, (want, got) in enumerate(zip(planned, compiled)):
        if want != got:
            return f"collective {i} is {got[0]} on group {got[1]!r}, planned {want[0]} on {want[1]!r}"
    if len(planned) != len(compiled):
        return f"{len(compiled)} collectives compiled, {len(planned)} planned"
    return None
