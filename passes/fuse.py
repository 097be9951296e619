"""Fuse small collectives into buckets (tensor fusion), sizes chosen by the timeline model.

Collectives of one kind on one process group are fused into one (first fit
in graph order; other collectives may lie between them) when every member's
input exists before any member's result is read (so no dependency is
reordered) and the bucket stays under a byte cap; the local steps that only
prepare a collective's input (dim moves, padding) are first moved up to just
after their input, so that positions say when inputs exist, and the scalar arithmetic
that reads a collective's result only for graph outputs (the loss's ``sum / count``) is
moved down to the output, so that the loss's all-reduce can ride in a gradient bucket
(:func:`_sink_scalar_tails`; the sharding search prices it so):

- all-reduce: flatten and concatenate, one all-reduce, split back;
- reduce-scatter (dim 0): each input viewed as ``(p, n_i / p)``, concatenated
  along dim 1 so that row ``r`` holds rank ``r``'s piece of every tensor, one
  reduce-scatter, split back into each tensor's shard;
- all-gather (dim 0): flattened shards concatenated, one all-gather, viewed as
  ``(p, sum k_i)`` and split by columns back into each gathered tensor.

Fusing saves one start-up latency per member and costs waiting for the
bucket's last input; :func:`fuse_best` tries no fusion and a ladder of caps, from
the largest down, and keeps the one whose program timeline (:mod:`cost_models.program`)
is shortest, so the choice comes from the model, never from measured timing
(:func:`search_by_timeline`, which :mod:`passes.partition` shares to choose its piece
size). The ladder stops at the first cap slower than the best of it so far (the
makespan is taken to be unimodal in the cap: see :func:`fuse_search`).

Trying is kept cheap without changing any choice: each option is tried on a
:class:`Trial` (a copy of the graph that never generates Python code), a cap that
provably fuses like one tried already is skipped (:class:`CapsAlike`: it would give
the same collectives, which are not timed twice), the trials take the fake values of
the nodes they build from one :class:`FakeValues`, which works them out on meta tensors
rather than through the fake mode's dispatch, and the chosen trial's graph, put back in
its order before scheduling, becomes the program instead of transforming it again. A
search returns a :class:`Timed` record of its choice: the makespan and the
scheduled order of the chosen trial, which is exactly what scheduling the
transformed graph again would give (the scheduler is deterministic), so the
pipeline adopts it (:func:`adopt`) instead of scheduling again, and
:func:`passes.partition.partition_search` takes it as the timing of the size that
splits nothing instead of trying that size again.
"""
from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
from torch import fx

from cost_models.collectives import repriced
from cost_models.program import NodeCosts, order_makespan
from ddlc import comm
from ddlc.errors import LoweringError
from ddlc.fake import all_fake, run_on_meta
from ddlc.ir import (BUCKETABLE, COLLECTIVE, FUSED, collective_kind, collective_sequence, is_wait,
                     name_alike, output_scalars)
from ddlc.mesh import Mesh

__all__ = ["fuse", "fuse_best", "fuse_search", "choose_by_timeline", "search_by_timeline", "Timed",
           "adopt", "Trial", "FakeValues", "issue_args",
           "pack", "unpack", "CAPS", "bucketable_kind"]

_c10d = torch.ops._c10d_functional


def bucketable_kind(node: fx.Node) -> str | None:
    """The kind of the collective ``node`` issues if fusion and partition handle it (dim-0
    all-reduce, reduce-scatter, all-gather), else None."""
    kind = collective_kind(node)
    return kind if kind in BUCKETABLE else None

#: Bucket byte caps tried by :func:`fuse_best` (0 = no fusion).
CAPS = (0, 2**16, 2**20, 2**24, math.inf)

#: kind -> the arguments of that collective of tensor ``x`` on ``p`` ranks of ``group``.
_ARGS = {"all_reduce": lambda x, p, group: (x, "sum", group),
         "reduce_scatter": lambda x, p, group: (x, "sum", p, group),
         "all_gather": lambda x, p, group: (x, p, group)}


def issue_args(kind: str, x, group_size: int, group: str) -> tuple:
    """The arguments of the ``_c10d_functional`` op of ``kind`` on ``x`` (:data:`_ARGS`)."""
    return _ARGS[kind](x, group_size, group)


def pack(kind: str, tensors: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """One flat buffer holding ``tensors`` laid out for one ``kind`` collective."""
    if kind == "reduce_scatter":
        return torch.cat([t.reshape(group_size, -1) for t in tensors], dim=1).flatten()
    return torch.cat([t.flatten() for t in tensors])


def unpack(kind: str, buffer: torch.Tensor, shapes: Sequence[Sequence[int]], group_size: int) -> tuple:
    """Split a fused collective's result into each member's result (``shapes``)."""
    sizes = [math.prod(s) for s in shapes]
    if kind == "all_gather":
        columns = buffer.reshape(group_size, -1).split([n // group_size for n in sizes], dim=1)
        return tuple(c.reshape(s) for c, s in zip(columns, shapes))
    return tuple(p.reshape(s) for p, s in zip(buffer.split(sizes), shapes))


def _members(gm: fx.GraphModule, cap: float, alike: "CapsAlike | None" = None) -> list[list[fx.Node]]:
    """Buckets (lists of issue nodes, in graph order) to fuse under ``cap`` bytes, first
    fit in graph order: a collective joins the earliest bucket of its (collective, process
    group, dtype) whose results are all read after its input exists and that stays under
    ``cap`` with it, else starts a new one. Collectives in between (of any kind) do not
    matter: the fused one is issued before the first read of any member's result.
    ``alike`` (if given) records the sizes that bound the caps giving these buckets
    (:class:`CapsAlike`)."""
    nodes = list(gm.graph.nodes)
    return _buckets(_candidates(nodes), {n: i for i, n in enumerate(nodes)}, cap, alike)


@dataclass
class CapsAlike:
    """The caps that bucket a graph exactly as a cap did: first fit compares the cap only
    with the sizes of buckets-with-a-collective, so every cap from the largest bucket it
    ``formed`` (of two collectives or more) up to, not including, the smallest one it
    ``refused`` makes every one of those comparisons alike, and so the same buckets (as
    long as the cap is above 0: a cap of 0 does not hoist feeders, see :func:`_fuse`)."""

    formed: float = 0
    refused: float = math.inf

    def covers(self, cap: float) -> bool:
        """Whether ``cap`` buckets the graph as the cap this records did."""
        return cap > 0 and self.formed <= cap < self.refused


def _candidates(nodes) -> list[fx.Node]:
    """The collectives of ``nodes`` that :func:`_members` buckets (not fused already), in order."""
    return [n for n in nodes if bucketable_kind(n) is not None and not FUSED.has(n)]


def _buckets(candidates: list[fx.Node], pos: dict[fx.Node, int], cap: float,
             alike: CapsAlike | None, kinds: dict[fx.Node, tuple] | None = None) -> list[list[fx.Node]]:
    """:func:`_members` of the collectives ``candidates`` (:func:`_candidates` of the
    graph, in graph order) at the graph positions ``pos``; ``kinds`` remembers each
    candidate's :func:`_kind_and_bytes` (which fusing other buckets leaves as they are)."""
    kinds = {} if kinds is None else kinds
    buckets: dict[tuple, list[list]] = {}  # key -> [members, first read, bytes] per bucket
    for node in candidates:
        (wait,) = node.users
        reads = min((pos[u] for u in wait.users), default=math.inf)
        inputs_at = max(pos[a] for a in node.all_input_nodes)
        if node not in kinds:
            kinds[node] = _kind_and_bytes(node)
        key, size = kinds[node]
        for bucket in buckets.setdefault(key, []):
            if inputs_at < bucket[1] and bucket[2] + size <= cap:
                bucket[0].append(node)
                bucket[1], bucket[2] = min(bucket[1], reads), bucket[2] + size
                break
            if inputs_at < bucket[1] and alike is not None:
                alike.refused = min(alike.refused, bucket[2] + size)
        else:
            buckets[key].append([[node], reads, size])
    fused = [(members, size) for per_key in buckets.values() for members, _, size in per_key if len(members) > 1]
    if alike is not None:
        alike.formed = max([alike.formed] + [size for _, size in fused])
    return sorted((members for members, _ in fused), key=lambda b: pos[b[0]])


def _kind_and_bytes(node: fx.Node) -> tuple[tuple, int]:
    """What :func:`_buckets` groups collective ``node`` by (its operator, process group and
    dtype) and its bytes: those the collective moves on its group as the plan prices it
    (:attr:`ddlc.ir.CollectiveInfo.nbytes`: the tensor with the other axes' splits at their
    largest piece), the same on every rank, so that every rank fills the same buckets
    under one cap. A piece of an unevenly split tensor has other bytes on other ranks
    (17 and 16 rows of 33): first fit on this rank's own bytes put a collective in a bucket
    on some ranks and not on others, whose programs then differed."""
    val = node.args[0].meta["val"]
    nbytes = COLLECTIVE(node).nbytes if COLLECTIVE.has(node) else val.numel() * val.element_size()
    return (node.target, node.args[-1], val.dtype), nbytes


#: The local steps the collectives pass puts right before a collective (dim moves, padding,
#: the slice of a placement that moves from B to S on another axis).
_PREPARATIONS = (comm.moved, comm.padded, comm.local_chunk)


def _hoist_feeders(graph: fx.Graph) -> None:
    """Move every local step that only prepares a collective's input (:data:`_PREPARATIONS`,
    inserted right before the collective) up to just after its input, so a collective's
    position in the graph says when its input really exists."""
    prepares: set[fx.Node] = set()
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _PREPARATIONS and \
                all(u in prepares or bucketable_kind(u) for u in node.users):
            prepares.add(node)
    for node in list(graph.nodes):
        if node in prepares:
            (source,) = node.all_input_nodes
            if source.next is not node:
                source.append(node)


def _sink_scalar_tails(graph: fx.Graph) -> None:
    """Move the scalar arithmetic that reads collectives' results only to compute graph
    outputs (:func:`ddlc.ir.output_scalars` downstream of a wait: the loss's ``sum /
    count`` right after the all-reduce of both) to just before the output. Those
    all-reduces are then read last, so they can share a bucket with the gradients' (one
    start-up less per step) instead of being read, and so fused, alone. The graph is
    functional, so moving a node later changes no value."""
    nodes = list(graph.nodes)
    output = next(n for n in reversed(nodes) if n.op == "output")
    after_comm: set[fx.Node] = set()
    for node in nodes:
        if is_wait(node) or (node.op == "call_function" and any(a in after_comm for a in node.all_input_nodes)):
            after_comm.add(node)
    tail = output_scalars(graph, lambda n: n in after_comm and not is_wait(n) and not collective_kind(n))
    for node in nodes:  # in graph order, so each stays after its inputs
        if node in tail:
            output.prepend(node)


def fuse(gm: fx.GraphModule, mesh: Mesh, cap: float) -> fx.GraphModule:
    """Fuse the buckets :func:`_members` finds under ``cap`` bytes, in place (after
    :func:`_hoist_feeders`), one at a time in graph order: fusing a bucket moves its
    results to its first reader, so the buckets after it are found again. A cap of 0
    leaves ``gm`` as it is."""
    _fuse(gm, mesh, cap)
    return gm


def _fuse(gm: fx.GraphModule, mesh: Mesh, cap: float, values: FakeValues | None = None) -> CapsAlike:
    """:func:`fuse` (taking the buckets' fake values from ``values``); returns the
    :class:`CapsAlike` of every bucketing it made: the caps that fuse ``gm`` to the same
    graph."""
    values = values if values is not None else FakeValues()
    alike = CapsAlike()
    if not cap:  # no fusion: the graph as it is
        return alike
    _hoist_feeders(gm.graph)
    _sink_scalar_tails(gm.graph)
    candidates = _candidates(gm.graph.nodes)  # fusing a bucket adds only a fused collective
    kinds: dict[fx.Node, tuple] = {}
    pos = _Positions(gm.graph)
    while True:
        buckets = _buckets(candidates, pos, cap, alike, kinds)
        if not buckets:
            break
        pos.inserted_before(_fuse_bucket(gm.graph, mesh, buckets[0], values, pos))
        fused = set(buckets[0])
        candidates = [n for n in candidates if n not in fused]
    gm.graph.lint()
    gm.recompile()
    return alike


class _Positions(dict):
    """Node -> a number that orders the nodes of ``graph`` as the graph does (what
    :func:`_buckets` and :func:`_fuse_bucket` compare), kept up to date as nodes are
    inserted, instead of numbering the whole graph again after each bucket fused: the
    nodes are numbered :data:`SPACING` apart, and nodes inserted before a node get numbers
    spread evenly in the gap before it (the whole graph is numbered again when the gap
    is too small). Erased nodes keep their stale numbers; only live nodes are looked up."""

    SPACING = 1 << 32

    def __init__(self, graph: fx.Graph):
        super().__init__()
        self.graph = graph
        self._number()

    def _number(self) -> None:
        self.clear()
        self.update((n, i * self.SPACING) for i, n in enumerate(self.graph.nodes))

    def inserted_before(self, node: fx.Node) -> None:
        """Number the nodes just inserted right before ``node`` (the unnumbered ones
        between it and the numbered node before them)."""
        new = []
        before = node.prev
        while before not in self and before.op != "root":
            new.append(before)
            before = before.prev
        low = self[before] if before in self else -self.SPACING
        high = self[node]
        if high - low <= len(new):
            self._number()
            return
        step = (high - low) // (len(new) + 1)
        for i, n in enumerate(reversed(new), start=1):
            self[n] = low + i * step


def _fuse_bucket(graph: fx.Graph, mesh: Mesh, bucket: list[fx.Node], values: FakeValues,
                 pos: dict[fx.Node, int]) -> fx.Node:
    """Replace the collectives of ``bucket`` by one on their packed inputs, issued and
    waited right before the first reader of any member's result, and unpacked there
    (their fake values from ``values``; ``pos``: the graph's node positions). Returns
    that first reader (the new nodes are right before it)."""
    kind, info = bucketable_kind(bucket[0]), COLLECTIVE(bucket[0])
    group, p = bucket[0].args[-1], info.group_size
    inputs = [n.args[0] for n in bucket]
    waits = [next(iter(n.users)) for n in bucket]
    shapes = [tuple(w.meta["val"].shape) for w in waits]
    nbytes = sum(COLLECTIVE(n).nbytes for n in bucket)
    first_reader = min((u for w in waits for u in w.users), key=pos.__getitem__)
    with graph.inserting_before(first_reader):
        packed = graph.call_function(pack, (kind, inputs, p))
        packed.meta["val"] = values.call(pack, kind, [a.meta["val"] for a in inputs], p)
        args = issue_args(kind, packed, p, group)
        issued = graph.call_function(bucket[0].target, args)
        issued.meta["val"] = values.call(bucket[0].target,
                                         *[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        COLLECTIVE.set(issued, repriced(info, nbytes, mesh))
        FUSED.set(issued, len(bucket))
        done = graph.call_function(_c10d.wait_tensor.default, (issued,))
        done.meta["val"] = issued.meta["val"]
        parts = graph.call_function(unpack, (kind, done, shapes, p))
        parts.meta["val"] = values.call(unpack, kind, done.meta["val"], shapes, p)
        for i, wait in enumerate(waits):
            piece = graph.call_function(operator.getitem, (parts, i))
            piece.meta["val"] = parts.meta["val"][i]
            wait.replace_all_uses_with(piece)
    for wait, node in zip(waits, bucket):
        graph.erase_node(wait)
        graph.erase_node(node)
    return first_reader


class FakeValues:
    """Results of functions of fake values (``pack``, a collective, ``unpack``, the ops a
    split is made of), remembered by the function, the identity of the fake tensors among
    the arguments and the other arguments, for one :func:`fuse_best` or
    :func:`passes.partition.partition_best` call: its trials and its final transform
    build many of the same values (a trial copies the graph, and the copy shares the
    nodes' values; a remembered result is the same object again, so what is built from it
    is found too), and each is worked out once. Fake values are never changed in place (a
    pass gives a node a new one), and an entry keeps the tensors it is keyed on alive (so
    their ids stay theirs): a remembered result is never stale.

    A result is worked out on meta tensors of the fake arguments' shapes, strides and
    dtypes and given back as fake tensors of their mode and device (:func:`_on_meta`):
    the same shapes, strides and dtypes as under the fake mode, without its dispatch,
    which costs several times more for the cats, views and splits these are made of."""

    def __init__(self):
        self._known: dict[tuple, tuple] = {}

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, worked out the first time only."""
        held: list[torch.Tensor] = []
        key = (fn, _identities(args, held), _identities(kwargs, held))
        try:
            hash(key)
        except TypeError:  # an argument that cannot be a key (a symbolic size)
            return fn(*args, **kwargs)
        if key not in self._known:
            self._known[key] = (held, _on_meta(fn, args, kwargs, held))
        return self._known[key][1]


def _on_meta(fn, args, kwargs, tensors: list[torch.Tensor]):
    """``fn(*args, **kwargs)`` worked out on meta tensors where its tensors (``tensors``)
    are fake (:func:`ddlc.fake.run_on_meta`); tensors that are not fake (tests build graphs
    of real ones): ``fn`` as it is."""
    if not all_fake(tensors):
        return fn(*args, **kwargs)
    return run_on_meta(fn, args, kwargs, tensors)


def _identities(x, held: list):
    """``x`` as a hashable key: tensors by identity (appended to ``held``), lists, tuples
    and dicts by their items, anything else as itself."""
    if isinstance(x, torch.Tensor):
        held.append(x)
        return (torch.Tensor, id(x))
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_identities(i, held) for i in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _identities(v, held)) for k, v in x.items()))
    return (type(x), x)


def fuse_best(gm: fx.GraphModule, mesh: Mesh, schedule_fn=None) -> float:
    """Fuse ``gm`` in place with the cap of :data:`CAPS` whose scheduled program timeline
    is shortest; returns that cap. No fusion (cap 0) is tried first, then the other caps
    from the largest down, up to the first one whose program is slower than the best of
    them so far (ties: no fusion, then the larger cap); a cap that :func:`_fuse` shows to
    fuse like one tried already (:class:`CapsAlike`) is not tried: it gives the same
    collectives."""
    return fuse_search(gm, mesh, schedule_fn).option


def fuse_search(gm: fx.GraphModule, mesh: Mesh, schedule_fn=None) -> "Timed":
    """:func:`fuse_best`, returning its :class:`Timed` record (the cap is its ``option``).

    Stopping at the first slower cap assumes the makespan is unimodal in the cap above 0
    (a larger bucket saves start-ups and waits longer for its last member); no fusion is a
    regime of its own (nothing hoisted, every collective issued as soon as its input
    exists), so it is always tried. On the models of the benchmarks and tests (98
    searches of fusion and partition: 11 models, meshes (4,), (2,2), (2,4), profiles
    ``cpu-gloo`` and ``dgx-h100-ib``) this chose the program that trying every cap and size
    chose, in 160 trials instead of 172; on the GPT-2-small-shaped model on 2x4, in
    three trials instead of five (its best cap is the largest, as on most large models).
    Without cap 0 apart, a test's MLP with sub-microsecond start-ups chose a program 5%
    slower than the best (tests/test_fuse.py)."""
    alike: dict[float, CapsAlike] = {}  # cap tried -> the caps that fuse alike
    values = FakeValues()  # shared by the trials and the final fuse

    def transform(g: fx.GraphModule, cap: float) -> fx.GraphModule:
        alike[cap] = _fuse(g, mesh, cap, values)
        return g

    def tried_alike(cap: float) -> bool:
        return any(tried > 0 and caps.covers(cap) for tried, caps in alike.items())

    return search_by_timeline(gm, mesh, _descending(CAPS), transform, schedule_fn, tried_alike,
                              ladder_from=1, unchanged=0)


def _descending(caps) -> list[float]:
    """``caps`` in the order :func:`fuse_search` tries them: 0 (no fusion), then the
    others from the largest down (the ladder)."""
    return sorted(caps, key=lambda cap: (cap > 0, -cap))


@dataclass(frozen=True)
class Timed:
    """What :func:`search_by_timeline` found for the option it chose: the ``option``, the
    modeled ``makespan`` of the program it gives (None: not timed, there was nothing to
    choose) and, where that program was scheduled, the scheduled program: ``order``, the
    names of the graph's nodes in scheduled order, and what the scheduler annotated
    (``graph_meta``: ``gm.meta`` entries; ``node_meta``: node name -> ``node.meta``
    entries). The scheduler is deterministic and reads no node names (a trial's copied
    graph may name new nodes differently), so scheduling the transformed graph again gives
    exactly this: :func:`adopt` puts it in place instead."""

    option: Any
    makespan: float | None = None
    order: tuple[str, ...] | None = None
    graph_meta: Mapping[str, Any] = field(default_factory=dict)
    node_meta: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def adopt(gm: fx.GraphModule, timed: Timed, follow) -> fx.GraphModule:
    """Give ``gm`` (the program ``timed`` records) the scheduled order and annotations of
    ``timed``: ``follow(gm, names)`` reorders it (:func:`passes.schedule.follow`)."""
    gm.meta.update(timed.graph_meta)
    if timed.node_meta:
        for node in gm.graph.nodes:
            node.meta.update(timed.node_meta.get(node.name, {}))
    return follow(gm, list(timed.order))


def choose_by_timeline(gm: fx.GraphModule, mesh: Mesh, options, transform, schedule_fn=None,
                       tried_alike=None):
    """Transform ``gm`` in place as ``transform(gm, option)`` would, for the option of
    ``options`` whose program (after ``schedule_fn``) has the shortest modeled makespan;
    ties go to the earlier option, and an option giving the same collectives as an earlier
    one is not re-timed, nor tried at all if ``tried_alike(option)`` says it transforms like
    an earlier one. Each option is tried on a :class:`Trial` copy of ``gm``;
    ``schedule_fn(trial, costs)`` orders it, pricing its nodes in ``costs`` (a
    :class:`cost_models.program.NodeCosts`), which the trial's timing then reuses; the
    chosen trial's graph, in its order before scheduling, then becomes ``gm``'s. Returns
    the option.
    Deterministic: the same graph gives the same choice on every rank."""
    return search_by_timeline(gm, mesh, options, transform, schedule_fn, tried_alike).option


def search_by_timeline(gm: fx.GraphModule, mesh: Mesh, options, transform, schedule_fn=None,
                       tried_alike=None, given: Timed | None = None, bound=None,
                       ladder_from: int | None = None, unchanged=None) -> Timed:
    """:func:`choose_by_timeline`, returning a :class:`Timed` record of the chosen option.
    ``given``: the timing of ``gm`` as it stands, which option ``given.option`` leaves
    unchanged (a search before timed this very program): that option is not tried again
    and, if chosen, ``gm`` is not transformed. ``unchanged``: an option that leaves ``gm``
    as it is (:func:`fuse_search`'s cap 0), tried on ``gm`` itself instead of a copy
    (scheduled in place, timed, then put back). ``bound(option, costs)``: a lower bound of
    the makespan of ``option``'s program from ``costs`` (a :class:`NodeCosts` of ``gm`` as
    it stands), without transforming; an option whose bound exceeds the best makespan so
    far cannot be chosen and is not tried. ``ladder_from``: the options from this index on
    are a ladder along which the makespan is taken to be unimodal: the search stops at the
    first of them whose program is slower than the best of them so far. Where
    the ranks share cores
    (``profile.shared_cores``) every task runs on the compute stream, so every order of a
    program has the same makespan: trials are timed without ``schedule_fn``, which
    otherwise only reorders a program's nodes and annotates its meta."""
    if mesh.profile.shared_cores is not None:
        schedule_fn = None
    # best: (makespan, option, the trial and its nodes and meta before scheduling, or the
    # Timed record of gm as it stands)
    best, seen = None, set()
    costs = None  # the last trial's node costs (most of its operators are the next one's)
    base = NodeCosts(mesh.profile) if bound is not None else None  # of gm as it stands
    on_ladder = math.inf  # the least makespan of the ladder's options so far

    def slower_on_ladder(index: int, makespan: float) -> bool:
        nonlocal on_ladder
        if ladder_from is None or index < ladder_from:
            return False
        slower, on_ladder = makespan > on_ladder + 1e-12, min(on_ladder, makespan)
        return slower

    for index, option in enumerate(options):
        if base is not None and best is not None and bound(option, base) > best[0] * (1 + 1e-9):
            continue
        if given is not None and option == given.option:
            key = tuple(collective_sequence(gm))
            if key not in seen:
                seen.add(key)
                if best is None or given.makespan < best[0] - 1e-12:
                    best = (given.makespan, option, replace(given, option=option))
                if slower_on_ladder(index, given.makespan):
                    break
            continue
        if tried_alike is not None and tried_alike(option):
            continue
        as_is = unchanged is not None and option == unchanged
        trial = gm if as_is else transform(Trial(gm), option)
        key = tuple(collective_sequence(trial))
        if key in seen:
            continue
        seen.add(key)
        before, costs = None, NodeCosts(mesh.profile, earlier=costs or base)  # the trial's, shared
        if schedule_fn is not None:
            before = (list(trial.graph.nodes), dict(trial.meta), [dict(n.meta) for n in trial.graph.nodes])
            schedule_fn(trial, costs)
        makespan = order_makespan(list(trial.graph.nodes), mesh.profile, costs)
        found = _put_back(gm, option, makespan, before) if as_is else (trial, before)
        if best is None or makespan < best[0] - 1e-12:
            best = (makespan, option, found)
        if slower_on_ladder(index, makespan):
            break
    makespan, option, found = best
    if isinstance(found, Timed):  # the program as it stands
        return found
    return _take_trial(gm, option, makespan, *found)


def _put_back(gm: fx.GraphModule, option, makespan: float, before) -> Timed:
    """The :class:`Timed` record of ``gm`` scheduled (``before``: its nodes in their order
    before, with the meta they held then; None: not scheduled), and ``gm`` put back as it
    was before."""
    if before is None:
        return Timed(option, makespan)
    nodes, graph_meta, node_metas = before
    if len(gm.graph.nodes) != len(nodes):
        raise LoweringError(f"internal: scheduling the program for option {option!r} of a search "
                            "made or removed nodes; a scheduler only reorders them")
    record = _scheduled(gm, option, makespan, before)
    for node, then in zip(nodes, node_metas):
        node.meta = then
    _put_in_order(gm.graph, nodes)
    gm.meta.clear()
    gm.meta.update(graph_meta)
    gm.recompile()  # the scheduler's reorder generated code for its order (a lazy module: none yet)
    return record


def _scheduled(gm: fx.GraphModule, option, makespan: float, before) -> Timed:
    """The :class:`Timed` record of ``option``'s program ``gm`` as scheduled, from ``before``
    (its nodes in their order before scheduling, with the meta they held then)."""
    nodes, graph_meta, node_metas = before

    def changed(now: dict, then: dict) -> dict:
        return {k: v for k, v in now.items() if k not in then or then[k] is not v}
    return Timed(option, makespan, tuple(n.name for n in gm.graph.nodes), changed(gm.meta, graph_meta),
                 {n.name: c for n, then in zip(nodes, node_metas) if (c := changed(n.meta, then))})


def _take_trial(gm: fx.GraphModule, option, makespan: float, trial: "Trial", before) -> Timed:
    """Make ``trial`` (``option``'s, transformed and then scheduled; ``before``: its nodes in
    the transformed order with the meta they held then, None if it was not scheduled) the
    program of ``gm``, as ``transform(gm, option)`` would leave it, and return the
    :class:`Timed` record of its scheduling. The trial names new nodes as ``gm`` does
    (:class:`Trial`), so its graph, put back in the transformed order and meta, is the
    graph that transforming ``gm`` again would give, without the work."""
    record = _put_back(trial, option, makespan, before)
    gm.graph = trial.graph
    gm.meta.clear()
    gm.meta.update(trial.meta)
    return record


def _put_in_order(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Move the nodes of ``graph`` into the order ``nodes`` (all of them)."""
    first = next(iter(graph.nodes))
    if first is not nodes[0]:
        first.prepend(nodes[0])
    for before, node in zip(nodes, nodes[1:]):
        if before.next is not node:
            before.append(node)


class Trial(fx.GraphModule):
    """A scratch copy of ``gm`` to try a transform on: a copy of its graph (``copy.deepcopy``
    of the graph, as ``copy.deepcopy(gm)`` makes: the same node names, and node ``meta``
    dicts copied shallowly, so values are shared) that names new nodes as ``gm`` would
    (:func:`ddlc.ir.name_alike`: the chosen trial's graph becomes ``gm``'s, see
    :func:`search_by_timeline`), a shallow copy of ``gm.meta``, and no
    Python code: a trial is transformed, scheduled and timed but never run, so
    :meth:`recompile` (code generation, which every pass ends with) does nothing."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, name_alike(copy.deepcopy(gm.graph), gm.graph))
        self.meta = dict(gm.meta)

    def recompile(self) -> None:
        """Nothing: a trial has no code (see the class docstring)."""
