"""Repair the ``as_strided`` replays of a trace made without views.

An in-place operator on a non-contiguous view (DeBERTa's ``pos_query_layer /= c`` on a
permuted tensor, RWKV's ``out[:, t] = ...``) makes autograd replay the view with
``as_strided(base, size, stride, offset)``. Traced under
``functionalize(remove="mutations_and_views")`` (what :mod:`ddlc.tracing` runs), every
view is a ``*_copy`` whose value is contiguous, so the replay records the copy's
contiguous strides instead of the view's: the gradient lands on the wrong elements
(checked on torch 2.13: the trace differs from eager autograd, while the same step
traced with ``remove="mutations"`` matches it).

:func:`repair` takes the step traced both ways (the second only where the first has such
replays: ``as_strided_copy`` or ``as_strided_scatter``). Their replays pair up in order
(the traces may decompose other operators differently, e.g. a ``reshape`` of a strided
view as ``clone`` + ``view``). Each replay gets the size, strides and offset of its
counterpart in the trace with views, and reads the storage its counterpart reads:
``as_strided`` ignores its input's strides and reads the storage from the given offset,
so a replay of a view reads the view's root (the first input that is no view), which
both traces reach through the same chain of views (copies here). Where the chains or the
roots' layouts differ, or a scatter writes into a view, the replay cannot be carried over
and the step is refused."""
from __future__ import annotations

import torch
from torch import fx
from torch._ops import OpOverload

from .errors import TraceError

__all__ = ["needs_repair", "repair", "view_form"]

#: what reads a tensor so, as an error names it
_READERS = "torch.stft, frames cut by as_strided, autograd's replay of an in-place update of a view"

aten = torch.ops.aten
#: the replays, as the trace without views has them -> the op in the trace with views
REPLAYS = {aten.as_strided_copy.default: aten.as_strided.default,
           aten.as_strided_scatter.default: aten.as_strided_scatter.default}


def needs_repair(gm: fx.GraphModule) -> bool:
    """Whether the trace without views has a replay of a view (:data:`REPLAYS`)."""
    return any(n.op == "call_function" and n.target in REPLAYS for n in gm.graph.nodes)


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, OpOverload) and node.target.is_view


def view_form(node: fx.Node):
    """The view op whose ``*_copy`` form ``node`` runs (``view_copy`` -> ``view``), else None."""
    target = node.target if node.op == "call_function" else None
    name = getattr(getattr(target, "overloadpacket", None), "__name__", "")
    if not name.endswith("_copy"):
        return None
    view = getattr(getattr(torch.ops.aten, name[:-len("_copy")], None), target._overloadname, None)
    return view if isinstance(view, OpOverload) and view.is_view else None


def _chain(node: fx.Node, step) -> list[fx.Node]:
    """``node`` and the inputs it is a view (``step``) of, down to the first that is not."""
    chain = [node]
    while step(chain[-1]):
        chain.append(chain[-1].args[0])
    return chain


def _layout(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    return (tuple(val.shape), val.stride(), val.storage_offset()) if isinstance(val, torch.Tensor) else ()


def _distinct_replays(gm: fx.GraphModule, targets) -> tuple[list[fx.Node], dict[fx.Node, list[fx.Node]]]:
    """The replays (``targets``) of ``gm`` that something reads, each once: a replay with the
    arguments of an earlier one is left out of the list, and mapped with it to that one
    (the two traces decompose some backwards with other numbers of dead or repeated
    replays: a linear layer's weight and bias gradients each read their own replay of
    ``as_strided``'s gradient with views, one shared replay without)."""
    first: dict[str, fx.Node] = {}
    alike: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets and node.users:
            key = str((node.target, node.args, node.kwargs))  # nodes print as their unique names
            alike.setdefault(first.setdefault(key, node), []).append(node)
    return list(alike), alike


def repair(without_views: fx.GraphModule, with_views: fx.GraphModule, where) -> None:
    """Give every replay of ``without_views`` the size, strides and offset of its
    counterpart in ``with_views`` (the same step traced keeping views; the distinct replays
    that something reads pair up in order, :func:`_distinct_replays`), and the storage it
    reads, in place; ``where(node)``: the source line an error cites. A replay of a view reads the view's root: ``without_views`` has the same chain of
    views there, as copies, down to a root of the same layout (else the step is refused)."""
    ours, alike_ours = _distinct_replays(without_views, REPLAYS)
    theirs, _ = _distinct_replays(with_views, REPLAYS.values())
    if [REPLAYS[n.target] for n in ours] != [n.target for n in theirs]:
        raise TraceError(f"the step reads tensors through strides it gives (as_strided: {_READERS}) "
                         "differently when traced with views and without, so ddlc cannot check "
                         "which elements they read; give the tensor read a row-major copy of its "
                         "own first (.clone(memory_format=torch.contiguous_format)), or write an "
                         "in-place update of a view out of place",
                         where=where(ours[0]) if ours else None)
    for node, counterpart in zip(ours, theirs):
        our_chain, their_chain = _chain(node.args[0], view_form), _chain(counterpart.args[0], _is_view)
        alike = len(our_chain) == len(their_chain) and _layout(our_chain[-1]) == _layout(their_chain[-1]) \
            and all(view_form(a) is b.target for a, b in zip(our_chain[:-1], their_chain[:-1]))
        if not alike or (node.target is aten.as_strided_scatter.default and len(our_chain) > 1):
            raise TraceError(f"the step reads a tensor through strides it gives (as_strided: {_READERS}) "
                             "where that tensor, or the tensor it is a view of, is laid out otherwise "
                             "once views are copies (a transposed or permuted activation); give it a "
                             "row-major copy of its own before it is read so "
                             "(.clone(memory_format=torch.contiguous_format): .contiguous() is not "
                             "enough, the trace without views has it row-major already), or, for an "
                             "in-place update of a view, write the update out of place (`y = y / c` "
                             "instead of `y /= c`)", where=where(node))
        args = list(counterpart.args)
        position = 3 if node.target is aten.as_strided_copy.default else 4  # the storage offset
        if len(args) <= position or args[position] is None:  # as_strided's default: the input's
            args[position:] = [counterpart.args[0].meta["val"].storage_offset()]
        # as_strided reads the storage from the offset, whatever its input's strides: the root's
        repaired = (our_chain[-1], *node.args[1:position - 2], *args[position - 2:])
        for alike_node in alike_ours[node]:
            alike_node.args = repaired
    without_views.graph.lint()
