"""Recompute the activations of checkpointed calls in backward, as ``torch.utils.checkpoint``.

Tracing marks every forward node that ran inside a ``checkpoint(fn, ...)`` call with its
region (``ir.RECOMPUTE``). Eager autograd then keeps only the call's inputs and runs
``fn`` again in backward; here, a backward node that reads a value computed inside a
region reads a copy instead, recomputed right before the region's first backward reader
from what the region keeps:

- its inputs (values from outside it: parameters, the previous layer's output);
- its outputs (values read after it in forward, or returned: the operators there keep
  them, as eager's outside the call do);
- its random draws (eager recomputes dropout from the saved generator state; ddlc.rng
  draws each random tensor once, so the draw is kept and the rest recomputed from it).

The originals are then read in forward only (dead code elimination removes those that
only backward read), so the plan prices fewer saved activations
(``passes.sharding.problem``) and the program's live bytes peak lower, and the copies'
compute is priced like any other operator. Values are the originals' exactly: the same
operators on the same inputs. A region nested in another belongs to the outer one.

A call that updates a buffer (BatchNorm's running statistics in training mode) is refused:
eager runs the update again when it recomputes the call (the statistics move twice a
step, ``num_batches_tracked`` counts two), which this pass does not reproduce.
"""
from __future__ import annotations

from torch import fx

from ddlc import rng
from ddlc.errors import UnsupportedInputError
from ddlc.ir import ORIGIN, RECOMPUTE, RECOMPUTED, STEP, Origin, where

__all__ = ["recompute_checkpointed"]


def recompute_checkpointed(gm: fx.GraphModule) -> fx.GraphModule:
    """Give every backward reader of a checkpointed region's value a recomputed copy (see
    the module docstring), in place; the copies are backward nodes of the region's module,
    marked ``ir.RECOMPUTED`` (the scheduler leaves them where they are)."""
    regions: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and RECOMPUTE.has(node):
            regions.setdefault(RECOMPUTE(node), []).append(node)
    if not regions:
        return gm
    _refuse_buffer_updates(gm)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for members in regions.values():
        _recompute_region(gm.graph, members, position)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _refuse_buffer_updates(gm: fx.GraphModule) -> None:
    """Refuse a buffer whose new value a checkpointed call computes (see the module docstring)."""
    (output,) = gm.graph.find_nodes(op="output")
    for spec, value in zip(STEP(gm).outputs, output.args[0]):
        if spec.role == "buffer" and isinstance(value, fx.Node) and RECOMPUTE.has(value):
            raise UnsupportedInputError(
                f"buffer {spec.key!r} is updated inside a checkpointed call (torch.utils.checkpoint; "
                "BatchNorm's running statistics in training mode): eager updates it a second time "
                "when it recomputes the call in backward, which ddlc does not reproduce; keep that "
                "layer outside the checkpointed call, or put it in eval mode", where=where(value))


def _in_backward(node: fx.Node) -> bool:
    origin = ORIGIN.get(node)
    return origin is not None and origin.phase == "backward"


def _recompute_region(graph: fx.Graph, members: list[fx.Node], position: dict[fx.Node, int]) -> None:
    """Recompute the values of one region (``members``, in graph order) that backward reads."""
    inside = set(members)
    kept = {n for n in members if rng.draws_random_numbers(n)
            or any(u not in inside and not _in_backward(u) for u in n.users)}
    readers = {n: [u for u in n.users if _in_backward(u)] for n in members if n not in kept}
    read = {n for n, users in readers.items() if users}
    if not read:
        return
    needed: set[fx.Node] = set()
    stack = list(read)
    while stack:  # what the read values are computed from, back to what the region keeps
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        stack.extend(a for a in node.all_input_nodes if a in inside and a not in kept)
    first = min((u for n in read for u in readers[n]), key=position.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(first):
        for node in members:
            if node in needed:
                copy = graph.node_copy(node, lambda a: copies.get(a, a))
                del copy.meta[RECOMPUTE.name]
                RECOMPUTED.set(copy, RECOMPUTE(node))
                origin = ORIGIN(node)
                ORIGIN.set(copy, Origin("backward", origin.module, origin.source))
                copies[node] = copy
    for node in read:
        for user in readers[node]:
            user.replace_input_with(node, copies[node])
