"""Order collectives for overlap: issue early, wait late (DeAR/PipeDAP in graph form).

A list scheduler re-emits the nodes of a lowered graph in a new topological
order:

- an *issue* node (a ``_c10d_functional`` collective, together with the local
  copies that only feed it) is emitted as soon as its inputs exist, as long as
  the bytes of issued-but-unwaited collectives stay under ``max_inflight_bytes``
  and, with ``max_live_bytes`` (when the order without it goes above it), hoisting
  it does not push the live bytes above the cap anywhere between here and its
  original position (otherwise it keeps its original position). The live bytes
  are those of the original order (:func:`cost_models.program.live_bytes`: inputs,
  outputs until their last reader, a collective's input until its wait), changed
  by each admitted hoist: its output lives longer, the inputs it reads last are
  freed sooner;
- the pieces of a split collective (:mod:`passes.partition`) after the first are
  held back while the link is busy: one is issued when the link would otherwise
  go idle during the next operator (by the program timeline,
  :class:`cost_models.program.ProgramClock`), before a less urgent collective on
  the same link, or when something reads it; so a collective that becomes ready
  meanwhile goes between pieces instead of behind all of them;
- a ``wait_tensor`` is emitted only right before the first node that reads it;
- everything else keeps its original relative order.

So a gradient's reduce-scatter starts the moment backward produces the
gradient and is waited just before the optimizer update reads it, and a
parameter's all-gather for the forward pass starts ahead of the layers before
it. The order depends on the graph alone (ties go to the original position),
so every rank computes the same collective sequence. :func:`check_waits`
verifies statically that no collective output is read except through its wait.
"""
from __future__ import annotations

import heapq

import numpy as np
import torch
from torch import fx

from cost_models.program import ProgramClock, allocated_bytes, live_bytes, owner, reads_until, releases
from ddlc.errors import LoweringError
from ddlc.mesh import HardwareProfile

__all__ = ["schedule", "follow", "check_waits", "is_issue", "is_wait"]

_c10d = torch.ops._c10d_functional
ISSUE_OPS = {_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default,
             _c10d.all_reduce.default, _c10d.all_to_all_single.default}


def is_issue(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ISSUE_OPS


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _c10d.wait_tensor.default


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _depends_on(node: fx.Node) -> set[fx.Node]:
    """Inputs for readiness: a wait counts as its collective (it is emitted on demand)."""
    return {a.args[0] if is_wait(a) else a for a in node.all_input_nodes}


def _feeders(nodes: list[fx.Node], seeds: set[fx.Node]) -> set[fx.Node]:
    """``seeds`` plus the operators that only feed them (transitively), reading no wait."""
    out = set(seeds)
    for node in reversed(nodes):
        if node.op == "call_function" and node.users and not is_wait(node) \
                and all(u in out for u in node.users) \
                and not any(is_wait(a) for a in node.all_input_nodes):
            out.add(node)
    return out


def _eager(nodes: list[fx.Node]) -> set[fx.Node]:
    """Collectives that read no other collective's result, plus the local copies that only
    feed them: these are issued as soon as they can be. (A collective chained after
    another stays in place, so the first one's wait is not forced early.)"""
    return _feeders(nodes, {n for n in nodes if is_issue(n) and not any(is_wait(a) for a in n.all_input_nodes)})


class _LiveCap:
    """The live bytes of the original order while each node runs, changed by every hoist
    admitted so far; refuses a hoist that would take them above ``cap``."""

    def __init__(self, nodes: list[fx.Node], cap: float):
        position = {n: i for i, n in enumerate(nodes)}
        self.live, self.cap = np.array(live_bytes(nodes), dtype=np.float64), cap
        self.freed_at = {b: position[r] for r, bs in releases(nodes).items() for b in bs}
        self.readers: dict[fx.Node, set[fx.Node]] = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                self.readers.setdefault(owner(arg), set()).add(reads_until(node))

    def admit(self, node: fx.Node, frontier: int, position: int, emitted: set[fx.Node]) -> bool:
        """Whether running ``node`` at original position ``frontier`` instead of ``position``
        keeps the live bytes under the cap: its output lives from there on, and the inputs
        whose other readers have all run are freed from there on."""
        if position <= frontier:
            return True
        inputs = {owner(a) for a in node.all_input_nodes} if reads_until(node) is node else set()
        freed = [b for b in inputs if b in self.freed_at and self.readers[b] - emitted <= {node}]
        delta = np.zeros(max([position] + [self.freed_at[b] for b in freed]) - frontier)
        delta[:position - frontier] += allocated_bytes(node)
        for buffer in freed:
            delta[:self.freed_at[buffer] - frontier] -= allocated_bytes(buffer)
        window = self.live[frontier:frontier + len(delta)]
        while_running = self.live[frontier] + allocated_bytes(node)  # its inputs still live
        if max(while_running, (window + delta[:len(window)]).max()) > self.cap:
            return False
        window += delta[:len(window)]
        return True


class _Pieces:
    """Held pieces of split collectives: per split, its pieces after the first (in order)
    once the first is issued, and the program clock that says when their link idles."""

    def __init__(self, nodes: list[fx.Node], profile: HardwareProfile):
        position = {n: i for i, n in enumerate(nodes)}
        self.clock = ProgramClock(profile)
        issues = [n for n in nodes if "ddlc_piece" in n.meta]
        self.later = {n for n in issues if n.meta["ddlc_piece"][1] > 0}
        self.held = _feeders(nodes, self.later)
        self.queues: dict[str, list[fx.Node]] = {}
        by_split: dict[str, list[fx.Node]] = {}
        for node in issues:
            by_split.setdefault(node.meta["ddlc_piece"][0], []).append(node)
        self.rest = {split: sorted(ns[1:], key=lambda n: n.meta["ddlc_piece"][1])
                     for split, ns in by_split.items()}
        self.urgency = {n: min((position[u] for w in n.users for u in w.users), default=len(nodes))
                        for n in nodes if is_issue(n)}

    def started(self, first: fx.Node) -> None:
        """The first piece of a split was issued: its other pieces wait to be released."""
        split = first.meta["ddlc_piece"][0]
        self.queues[split] = list(self.rest[split])

    def due(self, node: fx.Node) -> list[fx.Node]:
        """Held pieces to issue before ``node``, most urgent split first."""
        out = []
        for queue in sorted((q for q in self.queues.values() if q), key=lambda q: self.urgency[q[0]]):
            link = self.clock.channel(queue[0])
            if is_issue(node) and self.clock.channel(node) == link:
                if self.urgency[queue[0]] < self.urgency[node]:
                    out += queue
            elif node.op == "call_function" and not (is_issue(node) or is_wait(node)
                                                     or node in self.held):
                ends = self.clock.free_at(link)
                horizon = self.clock.now + self.clock.duration(node)
                for piece in queue:  # keep the link busy through ``node``
                    if ends >= horizon:
                        break
                    out.append(piece)
                    ends = max(ends, self.clock.now) + self.clock.duration(piece)
        return out

    def earlier(self, piece: fx.Node) -> list[fx.Node]:
        """The held pieces before ``piece`` in its split; they and it leave the queue."""
        queue = self.queues.get(piece.meta["ddlc_piece"][0], [])
        if piece not in queue:
            return []
        index = queue.index(piece)
        taken, queue[:] = queue[:index], queue[index + 1:]
        return taken

    def most_urgent(self) -> fx.Node | None:
        heads = [q[0] for q in self.queues.values() if q]
        return min(heads, key=lambda n: (self.urgency[n], n.meta["ddlc_piece"])) if heads else None


class _Scheduler:
    """One run of the list scheduler over ``nodes`` (see the module docstring)."""

    def __init__(self, nodes: list[fx.Node], max_inflight_bytes: float, max_live_bytes: float | None,
                 profile: HardwareProfile | None):
        self.position = {n: i for i, n in enumerate(nodes)}
        self.eager = _eager(nodes)
        self.max_inflight = max_inflight_bytes
        self.memory = _LiveCap(nodes, max_live_bytes) if max_live_bytes is not None else None
        split = profile is not None and any("ddlc_piece" in n.meta for n in nodes)
        self.pieces = _Pieces(nodes, profile) if split else None
        deps = {n: _depends_on(n) for n in nodes}
        self.waiting_on = {n: [] for n in nodes}
        for node, inputs in deps.items():
            for a in inputs:
                self.waiting_on[a].append(node)
        self.missing = {n: len(deps[n]) for n in nodes}
        self.ready_eager: list[tuple[int, fx.Node]] = []
        self.ready_other: list[tuple[int, fx.Node]] = []
        self.order: list[fx.Node] = []
        self.emitted: set[fx.Node] = set()
        self.inflight: dict[fx.Node, int] = {}  # issued, not yet waited; in issue order
        self.frontier = 0  # original position reached by the nodes kept in place

    def _push(self, node: fx.Node) -> None:
        if is_wait(node) or (self.pieces and node in self.pieces.held):
            return  # emitted on demand
        heapq.heappush(self.ready_eager if node in self.eager else self.ready_other,
                       (self.position[node], node))

    def _fits(self, node: fx.Node) -> bool:
        return not self.inflight or sum(self.inflight.values()) + _nbytes(node) <= self.max_inflight

    def _hoist(self, node: fx.Node) -> bool:
        """Whether ``node`` may go here rather than at its original position (memory cap)."""
        return self.memory is None or self.memory.admit(node, self.frontier, self.position[node],
                                                        self.emitted)

    def emit(self, node: fx.Node) -> None:
        if node in self.emitted:
            return
        if self.pieces:
            self._release(node)
        if is_issue(node):  # respect the cap: retire the oldest collectives first
            while self.inflight and not self._fits(node):
                self.emit(next(iter(next(iter(self.inflight)).users)))
        for arg in node.all_input_nodes:  # a wait goes right before its first reader
            if arg not in self.emitted:
                self.emit(arg)
        self._append(node)

    def _release(self, node: fx.Node) -> None:
        """Emit the held pieces that go before ``node``: those :meth:`_Pieces.due` names that
        the memory cap admits (in order, stopping at the first it refuses), then, if
        ``node`` is a held piece, the pieces before it in its split."""
        for piece in self.pieces.due(node):
            if piece in self.emitted:
                continue
            if not self._hoist(piece):
                break
            self.emit(piece)
        if node in self.pieces.later:
            for piece in self.pieces.earlier(node):
                self.emit(piece)

    def _append(self, node: fx.Node) -> None:
        self.order.append(node)
        self.emitted.add(node)
        if self.pieces:
            self.pieces.clock.add(node)
            if node.meta.get("ddlc_piece", (None, None))[1] == 0:
                self.pieces.started(node)
        if is_issue(node):
            self.inflight[node] = _nbytes(node)
        elif is_wait(node):
            self.inflight.pop(node.args[0], None)
        for user in self.waiting_on[node]:
            self.missing[user] -= 1
            if self.missing[user] == 0:
                self._push(user)

    def _next(self) -> fx.Node | None:
        """The next node to emit from the ready queues (None: both are empty)."""
        while self.ready_eager or self.ready_other:
            if self.ready_eager and (self._fits(self.ready_eager[0][1]) or not self.ready_other):
                position, node = heapq.heappop(self.ready_eager)
                if self._hoist(node):
                    return node
                heapq.heappush(self.ready_other, (position, node))  # not hoisted: stays in place
                continue
            position, node = heapq.heappop(self.ready_other)
            self.frontier = max(self.frontier, position + 1)
            return node
        return None

    def run(self, nodes: list[fx.Node]) -> list[fx.Node]:
        for node in nodes:
            if self.missing[node] == 0:
                self._push(node)
        while True:
            node = self._next()
            if node is None and self.pieces:
                node = self.pieces.most_urgent()
            if node is None:
                break
            self.emit(node)
        for node in nodes:  # only waits nobody reads remain (none in a valid graph)
            self.emit(node)
        return self.order


def schedule(gm: fx.GraphModule, max_inflight_bytes: float = float("inf"),
             max_live_bytes: float | None = None, profile: HardwareProfile | None = None) -> fx.GraphModule:
    """Reorder ``gm`` in place (see the module docstring) and return it. ``max_live_bytes``
    applies only if the order without it exceeds it (a refused hoist can also keep an input
    alive that the hoist would free). ``profile`` times the program for holding back the
    pieces of split collectives (without it, they are issued as soon as they can be, like
    any collective)."""
    nodes = list(gm.graph.nodes)
    order = _Scheduler(nodes, max_inflight_bytes, None, profile).run(nodes)
    if max_live_bytes is not None and max(live_bytes(order)) > max_live_bytes:
        order = _Scheduler(nodes, max_inflight_bytes, max_live_bytes, profile).run(nodes)
    _reorder(gm, order)
    check_waits(gm)
    return gm


def follow(gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """Reorder ``gm`` in place to the node order ``names`` of another rank's program with
    the same nodes (where ranks' local shapes differ, every rank follows one rank's
    schedule, so their collective sequences agree)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    if sorted(by_name) != sorted(names):
        raise LoweringError("this rank's program has other nodes than the rank whose schedule "
                            f"it follows: {sorted(set(by_name) ^ set(names))[:5]}")
    _reorder(gm, [by_name[name] for name in names])
    check_waits(gm)
    return gm


def _reorder(gm: fx.GraphModule, order: list[fx.Node]) -> None:
    """Move the nodes into ``order`` (placeholders first; the output stays last)."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in order if n.op == "placeholder"]
    body = [n for n in order if n.op != "placeholder" and n is not output]
    anchor = next(iter(graph.nodes))
    for node in placeholders + body:  # prepend in order: placeholders first
        if node is not anchor:
            anchor.append(node)
        anchor = node
    graph.lint()
    gm.recompile()


def check_waits(gm: fx.GraphModule) -> None:
    """Raise LoweringError if a collective's output is read other than through its wait,
    or a collective is never waited."""
    for node in gm.graph.nodes:
        if is_issue(node):
            users = list(node.users)
            if not users or not all(is_wait(u) for u in users):
                raise LoweringError(f"collective {node.name} is read before (or without) its "
                                    f"wait_tensor: users {[u.name for u in users]}")
