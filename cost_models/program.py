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
the compute stream stalls there if the collective has not finished. Where the ranks
share cores (a profile with a measured contention, ``shared_cores``),
collectives run on the compute stream instead: they need the cores the compute needs, so
nothing overlaps.

Memory: every operator and collective allocates its output when it starts; a
buffer is released when the last task reading it (directly or through an
alias: a wait, a getitem; a collective reads its input until its wait) ends; an optimizer
update (``ddlc::optimizer_update``, which runs several operators) also holds its
intermediate values while it runs (:func:`temporary_bytes`). The program's inputs (parameters, optimizer
state, batch: the caller holds them) are resident throughout, and what it
returns is never released. The result shows how much communication the order
hides: makespan, exposed communication, a lower bound, peak memory and a Chrome
trace. :class:`ProgramClock` works out the same start and end times node by node,
without the rest, so the scheduler can ask when a channel becomes free and searches
can compare makespans (:func:`order_makespan`); clocks over the same nodes can share
one :class:`NodeCosts`, so each node's time is worked out once.
"""
from __future__ import annotations

import math
import operator
from collections import defaultdict

import torch
from torch import fx
from torch._ops import OpOverload

from ddlc import fused_update
from ddlc.ir import COLLECTIVE, frozen, is_collective
from ddlc.mesh import HardwareProfile

from .compute import op_time, tensors
from .timeline import COMPUTE, Timeline, TimelineResult

__all__ = ["ALIASES", "NodeCosts", "ProgramClock", "allocated_bytes", "live_bytes", "order_makespan",
           "order_timeline", "owner", "program_makespan", "program_timeline", "reads_until", "releases",
           "stream_totals", "task_order", "temporary_bytes"]

_c10d = torch.ops._c10d_functional

#: Operators whose output is (part of) an argument's buffer -> index of that argument.
ALIASES = {_c10d.wait_tensor.default: 0, operator.getitem: 0}


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(t.numel() * t.element_size() for t in tensors(value))


def _is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ALIASES


def owner(node: fx.Node) -> fx.Node:
    """The node that allocated ``node``'s buffer (following waits and getitems)."""
    while _is_alias(node):
        node = node.args[ALIASES[node.target]]
    return node


_TEMPORARIES: dict[tuple, int] = {}


def temporary_bytes(node: fx.Node) -> int:
    """Bytes ``node`` holds only while it runs, beyond its output: an optimizer update's
    intermediate values (:func:`ddlc.fused_update.temporary_bytes`), else none."""
    if node.target is not fused_update.OP:
        return 0
    args = fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
    key = (args[0], args[1], tuple((tuple(t.shape), t.dtype) for t in fused_update.update_inputs(args)))
    if key not in _TEMPORARIES:
        _TEMPORARIES[key] = fused_update.temporary_bytes(args)
    return _TEMPORARIES[key]


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
        during.append(live + temporary_bytes(node))
        live -= sum(allocated_bytes(b) for b in released.get(node, ()))
    return during


class NodeCosts:
    """What the timeline needs of each node on ``profile``, worked out once per node: the
    stream it runs on (a collective's channel, None for compute), its seconds and the bytes
    it allocates. They depend on the node alone (target, arguments, values,
    ``ir.COLLECTIVE``), not on where the order puts it, so one table serves every timeline
    of the same nodes (the orders a scheduler builds and compares). Valid while those
    nodes are unchanged: make one per graph state (a :func:`passes.schedule.schedule`
    call makes its own), never keep one across a pass that edits nodes.

    ``earlier``: the table of a graph this one's was copied from (a search's previous
    trial): an operator whose node there has the same name, target, value and arguments
    (its input nodes' values the very same objects, as a copied graph shares them) costs
    what it cost there, without working it out again."""

    def __init__(self, profile: HardwareProfile, earlier: "NodeCosts | None" = None):
        self.profile = profile
        self._channel: dict[fx.Node, str | None] = {}
        self._seconds: dict[fx.Node, float] = {}
        self._alloc: dict[fx.Node, int] = {}
        self._priced: dict[str, fx.Node] = {}  # operators priced here, by name
        self._earlier = earlier if earlier is not None and earlier.profile is profile else None
        #: operator seconds by :func:`_price_key` (roofline profiles only: a measured
        #: profile's table prices by its own keys)
        self._by_call: dict = self._earlier._by_call if self._earlier is not None else {}
        #: the makespans of orders of these nodes timed with this table, by their
        #: :func:`task_order` (by :func:`order_makespan` or a scheduler's clock, which adds
        #: the same tasks in the same order): an order is timed once
        self.makespans: dict[tuple[fx.Node, ...], float] = {}

    def channel(self, node: fx.Node) -> str | None:
        """The stream a collective runs on; None for work on the compute stream."""
        if node not in self._channel:
            info = COLLECTIVE.get(node)
            communicates = info is not None and info.seconds > 0
            self._channel[node] = f"axis{info.axis}:{info.axis_name}" if communicates else None
        return self._channel[node]

    def stream(self, node: fx.Node) -> str:
        """The stream ``node``'s task runs on: its channel, or the compute stream for compute
        and, where the ranks share cores (``profile.shared_cores``), for collectives too:
        there they take the cores the compute needs, so they do not overlap it."""
        channel = self.channel(node)
        if channel is None or self.profile.shared_cores is not None:
            return COMPUTE
        return channel

    def seconds(self, node: fx.Node) -> float:
        """The modeled seconds of ``node``: a collective's ``CollectiveInfo.seconds``, 0 for a
        wait, else :func:`cost_models.compute.op_time` at its local shapes."""
        if node not in self._seconds:
            self._seconds[node] = self._time(node)
        return self._seconds[node]

    def _time(self, node: fx.Node) -> float:
        if self.channel(node) is not None:
            return COLLECTIVE(node).seconds
        if node.target is _c10d.wait_tensor.default:
            return 0.0
        self._priced[node.name] = node
        alike = self._earlier._priced.get(node.name) if self._earlier is not None else None
        if alike is not None and _same_call(alike, node):
            return self._earlier.seconds(alike)
        key = _price_key(node) if self.profile.compute != "measured" else None
        if key is not None and key in self._by_call:
            return self._by_call[key]
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        seconds = op_time(node.target, args, kwargs, node.meta.get("val"), self.profile)
        if key is not None:
            self._by_call[key] = seconds
        return seconds

    def alloc(self, node: fx.Node) -> int:
        """:func:`allocated_bytes` of ``node``."""
        if node not in self._alloc:
            self._alloc[node] = allocated_bytes(node)
        return self._alloc[node]


def _price_key(node: fx.Node):
    """A hashable key of what :func:`cost_models.compute.op_time` prices an operator
    (``OpOverload``) call by on a roofline profile: its target, and its arguments and
    output with each tensor (an input node's value) replaced by its shape, strides and
    dtype and anything else kept with its type (1, 1.0 and True differ: finer than the
    rules' ``call_key``, which strides do not change); None for other
    targets (priced apart: optimizer updates, boxing pieces, getitems) and where an
    argument is not hashable."""
    if not isinstance(node.target, OpOverload):
        return None
    key = (node.target, frozen((node.args, node.kwargs), _strided), frozen(node.meta.get("val"), _strided))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _strided(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype)


def _same_call(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` and ``b`` call the same target on the same values: the same output
    value object, and the same arguments with each input node's value the same object."""
    def key(node: fx.Node):
        return fx.node.map_arg((node.args, node.kwargs), lambda n: id(n.meta.get("val")))
    return a.target is b.target and a.meta.get("val") is b.meta.get("val") and key(a) == key(b)


class ProgramClock:
    """The start and end times of a program order's tasks, node by node (the times
    :func:`order_timeline` gives them, by the same arithmetic: a task starts at the latest
    of its stream's previous end and its inputs' ends, and a collective not before its
    issue point, the end of the compute issued before it), without the tasks, memory or
    trace: what the scheduler asks as it builds an order (when a channel becomes free,
    when a collective ends) and the makespan that searches compare. ``costs``: a
    :class:`NodeCosts` on ``profile`` to share with other clocks over the same nodes
    (default: a new one)."""

    def __init__(self, profile: HardwareProfile, costs: NodeCosts | None = None):
        self.costs = costs if costs is not None else NodeCosts(profile)
        self._ends: dict[fx.Node, float] = {}
        self._free: dict[str, float] = {COMPUTE: 0.0}  # the resident inputs' empty task
        self._issue_point = 0.0
        self.makespan = 0.0  # when the last task added so far ends

    def channel(self, node: fx.Node) -> str | None:
        """The stream a collective runs on; None for work on the compute stream."""
        return self.costs.channel(node)

    def duration(self, node: fx.Node) -> float:
        return self.costs.seconds(node)

    @property
    def now(self) -> float:
        """When the compute stream finishes the work added so far."""
        return self._free[COMPUTE]

    def free_at(self, stream: str) -> float:
        return self._free.get(stream, 0.0)

    def ends(self, node: fx.Node) -> float:
        """When the task of ``node`` (added already) ends."""
        return self._ends[node]

    def add(self, node: fx.Node) -> None:
        """Add ``node``'s task (none for placeholders and the output; a wait is an empty
        compute task that ends when its collective does)."""
        if node.op != "call_function":
            return
        costs = self.costs
        channel, stream, duration = costs.channel(node), costs.stream(node), costs.seconds(node)
        if not (math.isfinite(duration) and duration >= 0):
            raise ValueError(f"task {node.name!r}: duration must be a finite number >= 0, got {duration}")
        start = self._free.get(stream, 0.0)
        if channel is not None and self._issue_point > start:
            start = self._issue_point
        for arg in node.all_input_nodes:
            end = self._ends.get(arg)
            if end is not None and end > start:
                start = end
        end = self._free[stream] = self._ends[node] = start + duration
        if channel is None:
            self._issue_point = end
        if end > self.makespan:
            self.makespan = end


def program_timeline(gm: fx.GraphModule, profile: HardwareProfile) -> TimelineResult:
    """Simulate ``gm`` (lowered: local shapes, ``ir.COLLECTIVE`` on collectives)."""
    return order_timeline(list(gm.graph.nodes), profile)


def order_timeline(nodes: list[fx.Node], profile: HardwareProfile,
                   costs: NodeCosts | None = None) -> TimelineResult:
    """Simulate the nodes of a lowered graph in the program order ``nodes`` (``costs``: a
    :class:`NodeCosts` of these nodes on ``profile`` to reuse): one task per operator,
    collective and wait, with what it allocates and frees (:func:`releases`)."""
    costs = costs if costs is not None else NodeCosts(profile)
    released = releases(nodes)
    timeline = Timeline()
    resident = sum(costs.alloc(n) for n in nodes if n.op in ("placeholder", "get_attr"))
    timeline.add("inputs (resident)", COMPUTE, 0.0, alloc=resident, category="inputs")
    task_of: dict[fx.Node, int] = {}
    issue_point = None  # the last compute task so far
    for node in nodes:
        if node.op != "call_function":
            continue
        deps = {task_of[a] for a in node.all_input_nodes if a in task_of}
        channel = costs.channel(node)
        if channel is not None and issue_point is not None:
            deps.add(issue_point)
        temporary = temporary_bytes(node)  # held while it runs: allocated with it, freed when it ends
        task_of[node] = timeline.add(node.name, costs.stream(node), costs.seconds(node), sorted(deps),
                                     alloc=costs.alloc(node) + temporary,
                                     free=sum(costs.alloc(b) for b in released.get(node, ())) + temporary,
                                     category=COLLECTIVE(node).kind if channel else "compute",
                                     communication=channel is not None)
        if channel is None:
            issue_point = task_of[node]
    return timeline.run()


def program_makespan(gm: fx.GraphModule, profile: HardwareProfile) -> float:
    """``program_timeline(gm, profile).makespan`` (see :func:`order_makespan`)."""
    return order_makespan(list(gm.graph.nodes), profile)


def stream_totals(nodes, costs: NodeCosts) -> dict[str, float]:
    """Per stream, the summed seconds of the tasks of ``nodes``: a stream runs its tasks
    one at a time, so every order's makespan is at least the largest total."""
    totals: dict[str, float] = {}
    for node in nodes:
        if node.op == "call_function":
            stream = costs.stream(node)
            totals[stream] = totals.get(stream, 0.0) + costs.seconds(node)
    return totals


def order_makespan(nodes: list[fx.Node], profile: HardwareProfile, costs: NodeCosts | None = None) -> float:
    """``order_timeline(nodes, profile, costs).makespan``, by :class:`ProgramClock`: the same
    start and end times by the same arithmetic, without the tasks, the memory and the trace.
    For the searches that compare many programs by makespan only. An order timed with
    ``costs`` before (``costs.makespans``) is not timed again."""
    known = costs.makespans if costs is not None and costs.profile is profile else {}
    tasks = task_order(nodes)
    if tasks not in known:
        clock = ProgramClock(profile, costs)
        for node in tasks:
            clock.add(node)
        known[tasks] = clock.makespan
    return known[tasks]


def task_order(nodes) -> tuple[fx.Node, ...]:
    """The nodes of ``nodes`` that are tasks of the timeline (its operators, collectives and
    waits; not the placeholders and the output), in order: what an order's makespan
    depends on (the key of ``NodeCosts.makespans``)."""
    return tuple(n for n in nodes if n.op == "call_function")
