"""The timeline of one rank's lowered program, as its node order dictates.

Walks the (scheduled) per-rank graph in order and issues one timeline task per
node: operators on the compute stream (roofline time at their local shapes),
collectives on the channel of their mesh axis (their modeled time, one start-up
per collective, so every piece of a split collective pays its own). A collective
starts once its inputs exist, its channel is free and the compute issued before
it in program order has ended (its issue point: NCCL's stream waits for the
compute stream when a collective is launched, and gloo runs on the issuing
thread), so where the scheduler issues a collective matters. Its
``wait_tensor`` is an empty compute task that ends when the collective does:
the compute stream stalls there if the collective has not finished.

Memory: every operator and collective allocates its output when it starts; a
buffer is released when the last task reading it (directly or through an
alias: a wait, a getitem; a collective reads its input until its wait) ends. The program's inputs (parameters, optimizer
state, batch: the caller holds them) are resident throughout, and what it
returns is never released. The result shows how much communication the order
hides: makespan, exposed communication, a lower bound, peak memory and a Chrome
trace. :class:`ProgramClock` builds the same timeline node by node, so the
scheduler can ask when a channel becomes free.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from ddlc.ir import COLLECTIVE, is_collective
from ddlc.mesh import HardwareProfile

from .compute import op_time
from .timeline import COMPUTE, Timeline, TimelineResult

__all__ = ["ALIASES", "ProgramClock", "allocated_bytes", "live_bytes", "order_timeline", "owner",
           "program_timeline", "reads_until", "releases"]

_c10d = torch.ops._c10d_functional

#: Operators whose output is (part of) an argument's buffer -> index of that argument.
ALIASES = {_c10d.wait_tensor.default: 0, operator.getitem: 0}


def _bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ALIASES


def owner(node: fx.Node) -> fx.Node:
    """The node that allocated ``node``'s buffer (following waits and getitems)."""
    while _is_alias(node):
        node = node.args[ALIASES[node.target]]
    return node


def allocated_bytes(node: fx.Node) -> int:
    """Bytes ``node`` allocates: its output's, none for an alias."""
    return 0 if _is_alias(node) else _bytes(node.meta.get("val"))


def reads_until(node: fx.Node) -> fx.Node:
    """Where ``node`` stops reading its inputs: a collective at its wait."""
    if is_collective(node) and len(node.users) == 1:
        return next(iter(node.users))
    return node


def releases(nodes: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """For each node of the program order ``nodes``, the buffers released when it ends: those
    it is the last reader of (a collective reads its input until its wait). Inputs and
    buffers the program returns are never released."""
    position = {n: i for i, n in enumerate(nodes)}
    last: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        reader = reads_until(node)
        for arg in node.all_input_nodes:
            buffer = owner(arg)
            if buffer not in last or position[reader] > position[last[buffer]]:
                last[buffer] = reader
    out = defaultdict(list)
    for buffer, reader in last.items():
        if buffer.op not in ("placeholder", "get_attr") and reader.op != "output":
            out[reader].append(buffer)
    return out


def live_bytes(nodes: list[fx.Node]) -> list[int]:
    """Bytes live while each node of the program order ``nodes`` runs (inputs included):
    its output is allocated, the buffers it releases are not yet freed."""
    released = releases(nodes)
    live, during = 0, []
    for node in nodes:
        live += allocated_bytes(node)
        during.append(live)
        live -= sum(allocated_bytes(b) for b in released.get(node, ()))
    return during


class ProgramClock:
    """The program timeline built node by node in program order (see the module docstring).
    ``released``: :func:`releases` of the final order, for memory; omit it for times only."""

    def __init__(self, profile: HardwareProfile, released: dict | None = None):
        self.profile, self.released = profile, released or {}
        self.timeline = Timeline()
        self.task_of: dict[fx.Node, int] = {}
        self.issue_point: int | None = None  # the last compute task so far
        self._seconds: dict[fx.Node, float] = {}

    def channel(self, node: fx.Node) -> str | None:
        """The stream a collective runs on; None for work on the compute stream."""
        info = COLLECTIVE.get(node)
        if info is not None and info.seconds > 0:
            return f"axis{info.axis}:{info.axis_name}"
        return None

    def duration(self, node: fx.Node) -> float:
        if node not in self._seconds:
            self._seconds[node] = self._duration(node)
        return self._seconds[node]

    def _duration(self, node: fx.Node) -> float:
        if self.channel(node) is not None:
            return COLLECTIVE(node).seconds
        if node.target is _c10d.wait_tensor.default:
            return 0.0
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        return op_time(node.target, args, kwargs, node.meta.get("val"), self.profile)

    @property
    def now(self) -> float:
        """When the compute stream finishes the work added so far."""
        return self.timeline.free_at(COMPUTE)

    def free_at(self, stream: str) -> float:
        return self.timeline.free_at(stream)

    def ends(self, node: fx.Node) -> float:
        """When the task of ``node`` (added already) ends."""
        return self.timeline.end[self.task_of[node]]

    def add(self, node: fx.Node) -> None:
        """Add ``node``'s task (none for placeholders and the output; a wait is an empty
        compute task that ends when its collective does)."""
        if node.op != "call_function":
            return
        deps = {self.task_of[a] for a in node.all_input_nodes if a in self.task_of}
        channel = self.channel(node)
        if channel is not None and self.issue_point is not None:
            deps.add(self.issue_point)
        free = sum(allocated_bytes(b) for b in self.released.get(node, ()))
        task = self.timeline.add(node.name, channel or COMPUTE, self.duration(node), sorted(deps),
                                 alloc=allocated_bytes(node), free=free,
                                 category=COLLECTIVE(node).kind if channel else "compute")
        self.task_of[node] = task
        if channel is None:
            self.issue_point = task


def program_timeline(gm: fx.GraphModule, profile: HardwareProfile) -> TimelineResult:
    """Simulate ``gm`` (lowered: local shapes, ``ir.COLLECTIVE`` on collectives)."""
    return order_timeline(list(gm.graph.nodes), profile)


def order_timeline(nodes: list[fx.Node], profile: HardwareProfile) -> TimelineResult:
    """Simulate the nodes of a lowered graph in the program order ``nodes``."""
    clock = ProgramClock(profile, releases(nodes))
    resident = sum(allocated_bytes(n) for n in nodes if n.op in ("placeholder", "get_attr"))
    clock.timeline.add("inputs (resident)", COMPUTE, 0.0, alloc=resident, category="inputs")
    for node in nodes:
        clock.add(node)
    return clock.timeline.run()
