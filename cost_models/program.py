"""The timeline of one rank's lowered program, as its node order dictates.

Walks the (scheduled) per-rank graph in order and issues one timeline task per
node: operators on the compute stream (roofline time at their local shapes),
collectives on the channel of their mesh axis (their modeled time), each
starting once its inputs exist; an operator that reads a collective's result
(through its ``wait_tensor``) waits for the collective to end. The result shows
how much communication the order hides: makespan, exposed communication, a
lower bound, peak memory (an output lives until its last reader ends) and a
Chrome trace.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from ddlc.mesh import HardwareProfile

from .compute import op_time
from .timeline import COMPUTE, Timeline, TimelineResult

__all__ = ["program_timeline"]

_c10d = torch.ops._c10d_functional


def _bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def program_timeline(gm: fx.GraphModule, profile: HardwareProfile) -> TimelineResult:
    """Simulate ``gm`` (lowered: local shapes, CollectiveInfo on collectives)."""
    from passes.collectives import CollectiveInfo
    nodes = list(gm.graph.nodes)
    last_reader = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_reader[arg] = i
    freed_at: dict[int, int] = {}
    for node, i in last_reader.items():
        freed_at[i] = freed_at.get(i, 0) + _bytes(node.meta.get("val"))
    timeline = Timeline()
    task_of: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        deps = sorted({task_of[a] for a in node.all_input_nodes if a in task_of})
        if node.target is _c10d.wait_tensor.default:
            task_of[node] = task_of[node.args[0]]
            continue
        info = node.meta.get("ddlc")
        if isinstance(info, CollectiveInfo) and info.seconds > 0:
            task_of[node] = timeline.add(node.name, f"axis{info.axis}:{info.axis_name}", info.seconds,
                                         deps, category=info.kind)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        seconds = op_time(node.target, args, kwargs, node.meta.get("val"), profile)
        task_of[node] = timeline.add(node.name, COMPUTE, seconds, deps,
                                     alloc=_bytes(node.meta.get("val")), free=freed_at.get(i, 0),
                                     category="compute")
    return timeline.run()
