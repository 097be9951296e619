"""Give every activation read by several operators one placement they all read it from.

Lowering redistributes a tensor once per target placement and shares the result among
its readers (:mod:`passes.collectives`), but the search's objective is a sum over edges
(:mod:`passes.sharding.problem`): a tensor that two readers need in the same other
placement (a pre-activation that is ``P`` after a row-split matmul, read ``B`` by the
activation in forward and by its derivative in backward) would be charged its all-reduce
twice. :func:`insert_shared_reads` puts one ``aten.alias`` node (``ir.SHARED_READ``)
between such a tensor and its readers; the alias is a variable of the search like any
other, whose placement ``a`` costs the one redistribution from the producer's placement
``p`` to ``a`` (free where ``a == p``) plus, per reader, the one from ``a`` to what it
reads: every plan of the edges alone is still there (``a = p``), and so is the plan that
redistributes once and shares. Lowering redistributes exactly so, and
:func:`remove_shared_reads` then drops the aliases (after
:func:`passes.collectives.insert_collectives`: each alias's input is already the tensor
in placement ``a``).

Which tensors: those of the forward and backward passes (computed, or a batch input)
with two or more readers, all of them operators of those passes and none a replay of a
view through eager's strides (:data:`ddlc.ir.STRIDED_READERS`: lowering gives
such a reader eager's layout back after a redistribution on its own edge, which an
alias's edge would skip). Parameters and optimizer state (priced as bucketed parameter
traffic) and gradients entering the update are left alone.
"""
from __future__ import annotations

import torch
from torch import fx

from ddlc.ir import ORIGIN, ROLE, SHARED_READ, STRIDED_READERS, phase_of
from passes.rules import is_tensor_node

__all__ = ["insert_shared_reads", "remove_shared_reads"]

#: the phases whose values get a shared read
_PHASES = frozenset({"forward", "backward"})


def _shared(node: fx.Node) -> bool:
    """Whether ``node`` is a tensor of the module docstring's, which gets an alias."""
    if node.op == "placeholder":
        if ROLE.get(node) != "input":
            return False
    elif node.op != "call_function" or phase_of(node) not in _PHASES:
        return False
    if not is_tensor_node(node) or len(node.users) < 2:
        return False
    return all(u.op == "call_function" and phase_of(u) in _PHASES and u.target not in STRIDED_READERS
               for u in node.users)


def insert_shared_reads(gm: fx.GraphModule) -> fx.GraphModule:
    """An alias (``ir.SHARED_READ``, named ``<tensor>_shared``) between each tensor of the
    module docstring and its readers, in place: the alias comes right after the tensor
    (after the placeholders for a batch input, in their order), carries its value and
    origin, and every reader reads it instead."""
    graph = gm.graph
    first_operator = next(n for n in graph.nodes if n.op != "placeholder")
    for node in list(graph.nodes):
        if not _shared(node):
            continue
        batch_input = node.op == "placeholder"
        with graph.inserting_before(first_operator) if batch_input else graph.inserting_after(node):
            alias = graph.create_node("call_function", torch.ops.aten.alias.default, (node,),
                                      name=f"{node.name}_shared")
        alias.meta["val"] = node.meta["val"]
        if ORIGIN.has(node):
            ORIGIN.set(alias, ORIGIN(node))
        SHARED_READ.set(alias, True)
        node.replace_all_uses_with(alias, delete_user_cb=lambda user: user is not alias)
    graph.lint()
    gm.recompile()
    return gm


def remove_shared_reads(gm: fx.GraphModule) -> fx.GraphModule:
    """Every reader of an alias of :func:`insert_shared_reads` reads its input instead,
    and the alias goes, in place."""
    for alias in list(gm.graph.nodes):
        if alias.op == "call_function" and SHARED_READ.get(alias, False):
            alias.replace_all_uses_with(alias.args[0])
            gm.graph.erase_node(alias)
    gm.recompile()
    return gm
