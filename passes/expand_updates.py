"""Put each parameter's optimizer update back as the aten operators it runs.

From tracing to the end of lowering a parameter's update is one ``ddlc::optimizer_update``
node (:mod:`ddlc.fused_update`), so the search, decoupling and lowering's searches handle
one node where AdamW has about fifteen. Once the node order is chosen, this pass replaces
every such node, in place, by its template's operators evaluated on the node's local fake
inputs (the values a per-parameter trace of the update gives, at the rank's shapes), and
each getitem of it by the operator that computes that output: the views and in-place
passes and the program then see the operators a per-parameter trace gives. The operators
keep the node's origin (optimizer phase). The template runs once per distinct input
metadata (repeated layers' updates are alike: :func:`ddlc.fused_update.fake_values`).
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from ddlc.fused_update import OP, fake_values, results, template, update_inputs
from ddlc.ir import ORIGIN

__all__ = ["expand_updates"]


def expand_updates(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every ``ddlc::optimizer_update`` node of ``gm`` by its operators (in place).
    The graph's output, which reads most getitems of the updates, is rewritten once."""
    graph = gm.graph
    runs: dict[tuple, dict[fx.Node, torch.Tensor]] = {}
    updates = [n for n in graph.nodes if n.target is OP]
    computed: dict[fx.Node, fx.Node] = {}  # getitem of an update -> the operator computing it
    for node in updates:
        _expand(graph, node, runs, computed)
    output = graph.output_node()
    output.args = fx.map_arg(output.args, lambda a: computed.get(a, a))
    for getitem, new in computed.items():
        getitem.replace_all_uses_with(new)
        graph.erase_node(getitem)
    for node in updates:
        graph.erase_node(node)
    gm.recompile()
    return gm


def _expand(graph: fx.Graph, node: fx.Node, runs: dict, computed: dict[fx.Node, fx.Node]) -> None:
    """Insert the operators of update ``node`` before it and record in ``computed`` which
    one computes each of its getitems."""
    spec, scalars = node.args[0], node.args[1]
    inputs = [computed.get(a, a) for a in update_inputs(node.args)]
    vals = [a.meta["val"] for a in inputs]
    values = fake_values(spec, scalars, vals, runs)
    env = dict(zip((t for t in template(spec, scalars, vals).nodes if t.op == "placeholder"), inputs))
    origin, custom = ORIGIN.get(node), node.meta.get("custom")
    with graph.inserting_before(node):
        for t, val in values.items():
            if t.op == "placeholder":
                continue
            name = graph._target_to_str(t.target.overloadpacket.__name__) \
                if isinstance(t.target, torch._ops.OpOverload) else None
            new = graph.create_node("call_function", t.target, fx.map_arg(t.args, env.__getitem__),
                                    fx.map_arg(t.kwargs, env.__getitem__), name=name)
            new.meta["val"] = val
            if custom is not None:
                new.meta["custom"] = dict(custom)
            if origin is not None:
                ORIGIN.set(new, origin)
            env[t] = new
    outputs = results(spec, scalars, vals)
    for user in node.users:
        if user.target is not operator.getitem:
            raise AssertionError(f"{user.format_node()} reads {node.name} other than through getitem")
        computed[user] = env[outputs[user.args[1]]]
