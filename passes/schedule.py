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
- with ``updates="early"`` (PipeDAP's all-gather "moved into backward"), an
  optimizer update runs inside backward: an optimizer-phase operator that
  depends on the batch (through its gradient) is emitted, ahead of the
  remaining backward, once its inputs exist and the collectives whose results
  it reads are modeled (by the program clock) to have finished by the compute
  stream's current time, so its wait does not stall; when nothing else is left,
  the update whose collectives finish first goes next. The update's operators
  that depend on parameters and optimizer state alone (step count, bias
  corrections, a parameter's shard) are emitted just before the first early
  operator that reads them, and the update's all-gather is then issued at once;
  nodes after that all-gather's wait stay late. Early operators and what they
  pull in count as one hoist for ``max_live_bytes`` (refused: the operator
  keeps its original place);
- everything else keeps its original relative order.

So a gradient's reduce-scatter starts the moment backward produces the
gradient and is waited just before the optimizer update reads it (at the end
of backward, or inside it with early updates), and a parameter's all-gather
for the forward pass starts ahead of the layers before it. ``updates="auto"``
builds both orders and keeps the one with the shorter modeled makespan
(:func:`cost_models.program.order_makespan`, or the scheduler's own clock where it
timed the order as it built it; ties: "end"), except where the ranks share cores
(``profile.shared_cores``): there every task runs on the compute stream, every order has
the same makespan, and the updates stay at the end. With ``search=True`` (the final
order of a program) it then chooses per group of updates (one parameter's, or a
bucket's) which run early, PipeDAP's per-layer choice: hill climbing from the
better whole order, toggling one group or two consecutive ones while the modeled
makespan shortens, within a budget of scheduler runs (on programs too large for a
sweep over every parameter's update within it, the whole order stays).

A gradient's reduce-scatter is never held back to its all-gather's slot (the
per-layer profile's "held" choice, :mod:`cost_models.layer_schedules`): in the
program the two are separate collectives with the update between them, so holding
cannot merge them into one message and save a start-up; all it could do is let a
more urgent collective issued later pass it on the link, and with the updates
chosen per group the programs measured had no wait stalled behind a less urgent
collective (split collectives' later pieces are held already, see above).

The order depends on the graph and the cost model alone, never on measured time
(ties go to the original position, the search's to the set it has), so every rank
computes the same collective sequence.
:func:`check_waits` verifies statically that no collective output is read
except through its wait.
"""
from __future__ import annotations

import functools
import heapq

import numpy as np
import torch
from torch import fx

from cost_models.program import (NodeCosts, ProgramClock, allocated_bytes, live_bytes, order_makespan, owner,
                                  reads_until, releases, task_order, temporary_bytes)
from ddlc.errors import LoweringError
from ddlc.ir import ORIGIN, PIECE, RECOMPUTED, ROLE, UPDATES as UPDATES_KEY, is_collective as is_issue, is_wait
from ddlc.mesh import HardwareProfile

__all__ = ["schedule", "follow", "check_waits", "UPDATES"]

#: Where optimizer updates go: "end" (after backward, their original place) or "early"
#: (inside backward, once their gradient's collective is modeled done).
UPDATES = ("end", "early")

#: The budget of the per-group search (``schedule(..., updates="auto", search=True)``): its
#: scheduler runs beyond the two whole orders visit at most this many nodes (runs x nodes)
SEARCH_NODES = 30_000


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _depends_on(node: fx.Node) -> set[fx.Node]:
    """Inputs for readiness: a wait counts as its collective (it is emitted on demand)."""
    return {a.args[0] if is_wait(a) else a for a in node.all_input_nodes}


def _feeders(nodes: list[fx.Node], seeds: set[fx.Node]) -> set[fx.Node]:
    """``seeds`` plus the operators that only feed them (transitively), reading no wait,
    but recomputed activations (``ir.RECOMPUTED``: hoisted, they would live from forward
    on, as if they had not been checkpointed) and the forward's computation (only its
    local copies): with one bucket of every gradient and the loss the whole step feeds
    one collective, and hoisted ahead of the nodes that read a wait (a forward's
    collective: the token count of the loss) the next micro-batch's forward would run
    before the backward of the one before, every micro-batch's activations live at once."""
    out = set(seeds)
    for node in reversed(nodes):
        if node.op == "call_function" and node.users and not is_wait(node) and not RECOMPUTED.has(node) \
                and all(u in out for u in node.users) and (not _in_forward(node) or _copies(node)) \
                and not any(is_wait(a) for a in node.all_input_nodes):
            out.add(node)
    return out


def _in_forward(node: fx.Node) -> bool:
    origin = ORIGIN.get(node)
    return origin is not None and origin.phase == "forward"


def _copies(node: fx.Node) -> bool:
    """Whether ``node`` moves data and computes nothing: a view or its ``*_copy`` form, a
    concatenation or copy."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        target.is_view or torch.Tag.view_copy in target.tags or target in _COPIES)


_COPIES = frozenset({torch.ops.aten.cat.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default,
                     torch.ops.aten.contiguous.default})


def _eager(nodes: list[fx.Node]) -> set[fx.Node]:
    """Collectives that read no other collective's result, plus the local copies that only
    feed them: these are issued as soon as they can be. (A collective chained after
    another stays in place, so the first one's wait is not forced early.)"""
    return _feeders(nodes, {n for n in nodes if is_issue(n) and not any(is_wait(a) for a in n.all_input_nodes)})


def _updates(nodes: list[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """(the update nodes that may run early, the static update nodes they pull in).
    Update nodes: operators of the optimizer phase other than collectives and waits, and
    unannotated or static ones that only they read (a fused or split collective's
    unpacking, the local piece of a parameter an update on a shard reads). Those after a
    collective that an update feeds (unpacking a gathered parameter) are not early: their
    wait stays late. Static ones are computed from the parameters, buffers and optimizer
    state alone, not from the batch (the step count, a parameter's shard): they run where
    they are, or when an early update reads them."""
    static = _static(nodes)
    update = set()
    for node in reversed(nodes):
        if node.op != "call_function" or is_issue(node) or is_wait(node):
            continue
        origin = ORIGIN.get(node)
        if (origin is not None and origin.phase == "optimizer") or \
                ((origin is None or node in static) and node.users and all(u in update for u in node.users)):
            update.add(node)
    return update - static - _after_updated_collectives(nodes, update), update & static


def _static(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes computed from the parameters, buffers and optimizer state alone."""
    static = set()
    for node in nodes:
        state = node.op == "get_attr" or (node.op == "placeholder" and ROLE.get(node) != "input")
        if state or (node.op == "call_function" and all(a in static for a in node.all_input_nodes)):
            static.add(node)
    return static


def _after_updated_collectives(nodes: list[fx.Node], update: set[fx.Node]) -> set[fx.Node]:
    """The nodes that read (transitively) the wait of a collective ``update`` feeds."""
    fed, after = set(), set()
    for node in nodes:
        inputs = node.all_input_nodes
        if any(a in update or a in fed for a in inputs):
            fed.add(node)
        if any(a in after or (is_wait(a) and a.args[0] in fed) for a in inputs):
            after.add(node)
    return after


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
        while_running = self.live[frontier] + allocated_bytes(node) + temporary_bytes(node)  # inputs still live
        if max(while_running, (window + delta[:len(window)]).max()) > self.cap:
            return False
        window += delta[:len(window)]
        return True

    def admit_all(self, nodes: list[fx.Node], frontier: int, position: dict[fx.Node, int],
                  emitted: set[fx.Node]) -> bool:
        """:meth:`admit` for each of ``nodes`` in turn (run one after the other at
        ``frontier``); all or none: if one is refused, the others are undone."""
        saved, done = self.live.copy(), set(emitted)
        for node in nodes:
            if not self.admit(node, frontier, position[node], done):
                self.live = saved
                return False
            done.add(node)
        return True


class _Pieces:
    """Held pieces of split collectives: per split, its pieces after the first (in order)
    once the first is issued, and the program clock that says when their link idles."""

    def __init__(self, nodes: list[fx.Node], clock: ProgramClock):
        position = {n: i for i, n in enumerate(nodes)}
        self.clock = clock
        issues = [n for n in nodes if PIECE.has(n)]
        self.later = {n for n in issues if PIECE(n).index > 0}
        self.held = _feeders(nodes, self.later)
        self.queues: dict[str, list[fx.Node]] = {}
        by_split: dict[str, list[fx.Node]] = {}
        for node in issues:
            by_split.setdefault(PIECE(node).split, []).append(node)
        self.rest = {split: sorted(ns[1:], key=lambda n: PIECE(n).index)
                     for split, ns in by_split.items()}
        self.urgency = {n: min((position[u] for w in n.users for u in w.users), default=len(nodes))
                        for n in nodes if is_issue(n)}

    def started(self, first: fx.Node) -> None:
        """The first piece of a split was issued: its other pieces wait to be released."""
        split = PIECE(first).split
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
        queue = self.queues.get(PIECE(piece).split, [])
        if piece not in queue:
            return []
        index = queue.index(piece)
        taken, queue[:] = queue[:index], queue[index + 1:]
        if not queue:  # the split is issued: ``due`` and ``most_urgent`` no longer look at it
            del self.queues[PIECE(piece).split]
        return taken

    def most_urgent(self) -> fx.Node | None:
        heads = [q[0] for q in self.queues.values() if q]
        return min(heads, key=lambda n: (self.urgency[n], PIECE(n))) if heads else None


class _Program:
    """What every scheduler run over the original order ``nodes`` reads and none changes:
    positions, readiness inputs, the collectives to issue eagerly and the updates that may
    run early with their static nodes (worked out once, as the first run needs them)."""

    def __init__(self, nodes: list[fx.Node]):
        self.nodes = nodes
        self.position = {n: i for i, n in enumerate(nodes)}
        self.inputs = {n: _depends_on(n) for n in nodes}
        self.eager = _eager(nodes)
        self.split = any(PIECE.has(n) for n in nodes)

    @functools.cached_property
    def updates(self) -> tuple[frozenset[fx.Node], frozenset[fx.Node]]:
        """:func:`_updates`: (the update nodes that may run early, the static ones they pull in)."""
        early, static = _updates(self.nodes)
        return frozenset(early), frozenset(static)

    def early(self, updates: str) -> frozenset[fx.Node]:
        """The update nodes that run early with ``updates`` ("end" or "early")."""
        return self.updates[0] if updates == "early" else frozenset()


class _Scheduler:
    """One run of the list scheduler over ``program``'s nodes (see the module docstring), the
    update nodes ``early`` (of those that may) inside backward. ``costs``: the
    :class:`cost_models.program.NodeCosts` of the nodes on ``profile`` for its clock."""

    def __init__(self, program: _Program, max_inflight_bytes: float, max_live_bytes: float | None,
                 profile: HardwareProfile | None, costs: NodeCosts | None = None,
                 early: frozenset[fx.Node] = frozenset()):
        self.nodes = nodes = program.nodes
        self.position = program.position
        self.early = early
        self.static = program.updates[1] if early else frozenset()
        self.eager = program.eager - self.early - self.static
        self.max_inflight = max_inflight_bytes
        self.memory = _LiveCap(nodes, max_live_bytes) if max_live_bytes is not None else None
        timed = profile is not None and (program.split or bool(early))
        self.clock = ProgramClock(profile, costs=costs) if timed else None
        self.pieces = _Pieces(nodes, self.clock) if timed and program.split else None
        deps = {n: program.inputs[n] - self.static if n in early else program.inputs[n] for n in nodes}
        self.waiting_on = {n: [] for n in nodes}
        for node, inputs in deps.items():
            for a in inputs:
                self.waiting_on[a].append(node)
        self.missing = {n: len(deps[n]) for n in nodes}
        self.ready_eager: list[tuple[int, fx.Node]] = []
        self.ready_other: list[tuple[int, fx.Node]] = []
        self.gated: list[tuple[float, int, fx.Node]] = []  # early updates by when their inputs arrive
        self.ready_updates: list[tuple[int, fx.Node]] = []  # early updates whose inputs have arrived
        self.order: list[fx.Node] = []
        self.emitted: set[fx.Node] = set()
        self.inflight: dict[fx.Node, int] = {}  # issued, not yet waited; in issue order
        self.frontier = 0  # original position reached by the nodes kept in place

    def _push(self, node: fx.Node) -> None:
        if is_wait(node) or (self.pieces and node in self.pieces.held):
            return  # emitted on demand
        if node in self.early:  # waits until its collectives' results arrive (modeled)
            arrives = max((self.clock.ends(a.args[0]) for a in node.all_input_nodes if is_wait(a)),
                          default=0.0)
            heapq.heappush(self.gated, (arrives, self.position[node], node))
            return
        heapq.heappush(self.ready_eager if node in self.eager else self.ready_other,
                       (self.position[node], node))

    def _fits(self, node: fx.Node) -> bool:
        return not self.inflight or sum(self.inflight.values()) + _nbytes(node) <= self.max_inflight

    def _hoist(self, *nodes: fx.Node) -> bool:
        """Whether ``nodes`` may go here rather than at their original positions (memory cap)."""
        return self.memory is None or self.memory.admit_all(list(nodes), self.frontier, self.position,
                                                            self.emitted)

    def _pulled(self, node: fx.Node) -> list[fx.Node]:
        """The static update nodes not yet emitted that ``node`` reads (transitively), inputs
        first, then ``node``: what emitting it emits."""
        out: list[fx.Node] = []

        def visit(n: fx.Node) -> None:
            for a in n.all_input_nodes:
                if a in self.static and a not in self.emitted and a not in out:
                    visit(a)
            out.append(n)
        visit(node)
        return out

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
        if self.clock:
            self.clock.add(node)
        if self.pieces:
            if PIECE.has(node) and PIECE(node).index == 0:
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
        """The next node to emit from the ready queues (None: all are empty): a collective
        that fits, else an early update whose inputs have arrived by the compute stream's
        modeled time, else the next node in original order, else (nothing else left) the
        early update whose inputs arrive first."""
        while self.ready_eager or self.ready_other or self.gated or self.ready_updates:
            self._arrived()
            if self.ready_eager and (self._fits(self.ready_eager[0][1])
                                     or not (self.ready_other or self.gated or self.ready_updates)):
                position, node = heapq.heappop(self.ready_eager)
                if self._hoist(node):
                    return node
                heapq.heappush(self.ready_other, (position, node))  # not hoisted: stays in place
            elif self.ready_updates:
                position, node = heapq.heappop(self.ready_updates)
                if self._hoist(*self._pulled(node)):
                    return node
                heapq.heappush(self.ready_other, (position, node))
            elif self.ready_other:
                position, node = heapq.heappop(self.ready_other)
                if node not in self.emitted:  # else a static node an early update pulled in
                    self.frontier = max(self.frontier, position + 1)
                    return node
            else:
                _, position, node = heapq.heappop(self.gated)
                heapq.heappush(self.ready_updates, (position, node))
        return None

    def _arrived(self) -> None:
        """Early updates whose waited collectives end by the compute stream's modeled time
        become ready."""
        while self.gated and self.gated[0][0] <= self.clock.now:
            _, position, node = heapq.heappop(self.gated)
            heapq.heappush(self.ready_updates, (position, node))

    def run(self) -> list[fx.Node]:
        nodes = self.nodes
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

    @property
    def makespan(self) -> float | None:
        """The modeled makespan of the order built (by the clock, which added every node
        of it in order), None if untimed."""
        return self.clock.makespan if self.clock else None


def schedule(gm: fx.GraphModule, max_inflight_bytes: float = float("inf"),
             max_live_bytes: float | None = None, profile: HardwareProfile | None = None,
             updates: str = "end", search: bool = False,
             costs: NodeCosts | None = None) -> fx.GraphModule:
    """Reorder ``gm`` in place (see the module docstring) and return it. ``max_live_bytes``
    applies only if the order without it exceeds it (a refused hoist can also keep an input
    alive that the hoist would free). ``profile`` times the program for holding back the
    pieces of split collectives (without it, they are issued as soon as they can be, like
    any collective) and for early updates. ``updates``: one of :data:`UPDATES`, or "auto":
    the one whose order has the shorter modeled makespan (ties: "end"). With ``search`` (for
    the final order of a program; the trials that only time it leave it off), "auto" then
    chooses per group of updates which run early (:func:`_search_updates`; at most
    :data:`SEARCH_NODES` / (nodes of ``gm``) more scheduler runs; none where
    :func:`searches_updates` says the budget is too small), "mixed" where neither whole
    order is best. The choice is recorded in ``ir.UPDATES``. ``costs``: a
    :class:`cost_models.program.NodeCosts` of ``gm``'s nodes on ``profile`` to price them in
    (a caller that times the scheduled program after reuses it; default: a new one)."""
    # where the ranks share cores every task runs on the compute stream: the updates' place
    # cannot change the makespan, so "auto" keeps them at the end
    shared = profile is not None and profile.shared_cores is not None
    options = (UPDATES[:1] if shared else UPDATES) if updates == "auto" else (updates,)
    if updates not in UPDATES + ("auto",):
        raise ValueError(f"updates must be one of {UPDATES + ('auto',)}, got {updates!r}")
    if profile is None and "early" in options:
        raise ValueError(f"updates={updates!r} needs a profile to time the program")
    program = _Program(list(gm.graph.nodes))
    if costs is None and profile is not None:  # the nodes stay as they are: one table serves
        costs = NodeCosts(profile)

    def order_of(early: frozenset[fx.Node]) -> tuple[list[fx.Node], float | None]:
        return _order(program, max_inflight_bytes, max_live_bytes, profile, costs, early)
    orders = {u: order_of(program.early(u)) for u in options}
    chosen = _shortest(orders, profile, costs)
    order = orders[chosen][0]
    if search and updates == "auto" and not shared and searches_updates(gm):
        chosen, order = _per_group(program, order_of, orders, chosen, profile, costs)
    UPDATES_KEY.set(gm, chosen)
    _reorder(gm, order)
    check_waits(gm)
    return gm


def searches_updates(gm: fx.GraphModule) -> bool:
    """Whether ``schedule(gm, ..., updates="auto", search=True)`` searches per group: only
    where its budget (:data:`SEARCH_NODES` / nodes) covers a sweep over one update per
    parameter; on a larger program a partial sweep would cost runs for little, so it keeps
    the better whole order, as without ``search``."""
    params = sum(1 for n in gm.graph.nodes if n.op == "placeholder" and ROLE.get(n) == "param")
    return SEARCH_NODES // max(1, len(gm.graph.nodes)) >= params


def _order(program: _Program, max_inflight_bytes: float, max_live_bytes: float | None,
           profile: HardwareProfile | None, costs: NodeCosts | None,
           early: frozenset[fx.Node]) -> tuple[list[fx.Node], float | None]:
    """The scheduled order with the update nodes ``early`` inside backward; again under the
    live-bytes cap if the first one exceeds it. With it, its modeled makespan if the
    scheduler timed it (else None)."""
    run = _Scheduler(program, max_inflight_bytes, None, profile, costs, early)
    order = run.run()
    if max_live_bytes is not None and max(live_bytes(order)) > max_live_bytes:
        run = _Scheduler(program, max_inflight_bytes, max_live_bytes, profile, costs, early)
        order = run.run()
    if run.makespan is not None and costs is not None and costs.profile is profile:
        costs.makespans[task_order(order)] = run.makespan  # its clock timed it as order_makespan would
    return order, run.makespan


def _makespan(built: tuple[list[fx.Node], float | None], profile: HardwareProfile,
              costs: NodeCosts | None) -> float:
    """The modeled makespan of an ``_order`` result: the scheduler's own if it timed it."""
    order, timed = built
    return timed if timed is not None else order_makespan(order, profile, costs)


def _shortest(orders: dict[str, tuple[list[fx.Node], float | None]], profile: HardwareProfile | None,
              costs: NodeCosts | None) -> str:
    """The key of the order with the shortest modeled makespan; ties go to the earlier key
    (a single order, or one equal to the best so far, is not timed; an order the scheduler
    timed as it built it is not timed again: :func:`order_makespan` gives the same)."""
    best = None
    for key, built in orders.items():
        if best is not None and built[0] == orders[best[1]][0]:
            continue
        makespan = 0.0 if len(orders) == 1 else _makespan(built, profile, costs)
        if best is None or makespan < best[0] - 1e-12:
            best = (makespan, key)
    return best[1]


def _per_group(program: _Program, order_of, whole: dict[str, tuple[list[fx.Node], float | None]],
               chosen: str, profile: HardwareProfile,
               costs: NodeCosts | None) -> tuple[str, list[fx.Node]]:
    """(the label, the order) of the best choice of which :func:`_update_groups` run early,
    searched from the whole order ``chosen`` of ``whole`` (both "end" and "early", built by
    ``order_of(early update nodes)``): "end", "early" or "mixed"."""
    groups = _update_groups(program)
    if not groups:
        return chosen, whole[chosen][0]
    every = frozenset(range(len(groups)))
    built = {frozenset(): whole["end"], every: whole["early"]}

    def evaluate(indices: frozenset[int]) -> float:
        if indices not in built:
            built[indices] = order_of(frozenset().union(*(groups[i] for i in indices)))
        return _makespan(built[indices], profile, costs)
    budget = max(1, SEARCH_NODES // len(program.nodes))
    indices = _search_updates(len(groups), evaluate, every if chosen == "early" else frozenset(), budget)
    label = {frozenset(): "end", every: "early"}.get(indices, "mixed")
    return label, built[indices][0]


def _update_groups(program: _Program) -> list[frozenset[fx.Node]]:
    """The update nodes that may run early, in groups that go early together: the connected
    components of those nodes (one parameter's update, or a bucket's members with their
    unpacking), in the order of their first node."""
    early = program.updates[0]
    parent = {n: n for n in program.nodes if n in early}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n
    for node in parent:
        for arg in node.all_input_nodes:
            if arg in parent:
                parent[root(arg)] = root(node)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in parent:
        groups.setdefault(root(node), []).append(node)
    return [frozenset(g) for g in groups.values()]


def _search_updates(count: int, evaluate, start: frozenset[int], budget: int) -> frozenset[int]:
    """The set of groups ``0..count-1`` to run early, by first-improvement hill climbing on
    ``evaluate(indices) -> makespan`` from ``start``: each sweep tries, in order, toggling
    one group, then two consecutive ones (a compound move: an update that pays only with
    its neighbour's), and takes each toggle that shortens the makespan; it sweeps again
    while one did, evaluating at most ``budget`` sets besides ``start``. Ties keep the
    current set, so the result is never worse than ``start``."""
    seen: dict[frozenset[int], float] = {}

    def cost(indices: frozenset[int]) -> float:
        if indices not in seen:
            seen[indices] = evaluate(indices)
        return seen[indices]
    moves = [frozenset({i}) for i in range(count)] + [frozenset({i, i + 1}) for i in range(count - 1)]
    chosen, best, improved = start, cost(start), True
    while improved:
        improved = False
        for move in moves:
            if chosen ^ move not in seen and len(seen) > budget:
                return chosen
            if cost(chosen ^ move) < best - 1e-12:
                chosen, best, improved = chosen ^ move, cost(chosen ^ move), True
    return chosen


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
    """Move the nodes into ``order`` (placeholders first; the output stays last), and
    check that every node still comes after its inputs (:func:`_check_order`)."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in order if n.op == "placeholder"]
    body = [n for n in order if n.op != "placeholder" and n is not output]
    anchor = next(iter(graph.nodes))
    for node in placeholders + body:  # prepend in order: placeholders first
        if node is not anchor:
            anchor.append(node)
        anchor = node
    _check_order(graph)
    gm.recompile()


def _check_order(graph: fx.Graph) -> None:
    """Raise LoweringError if a node of ``graph`` comes before one of its inputs: of what
    ``graph.lint()`` checks, all that moving a valid graph's nodes can break (the nodes,
    their names, arguments and targets stay as they were)."""
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            if arg not in seen:
                raise LoweringError(f"internal: the schedule puts {node.name} before its input {arg.name}")
        seen.add(node)


def check_waits(gm: fx.GraphModule) -> None:
    """Raise LoweringError if a collective's output is read other than through its wait,
    or a collective is never waited."""
    for node in gm.graph.nodes:
        if is_issue(node):
            users = list(node.users)
            if not users or not all(is_wait(u) for u in users):
                raise LoweringError(f"collective {node.name} is read before (or without) its "
                                    f"wait_tensor: users {[u.name for u in users]}")

