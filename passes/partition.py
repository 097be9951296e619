"""Split very large collectives into pieces, the piece size chosen by the timeline model.

A collective of more than ``size`` bytes on its group (all-reduce, and
reduce-scatter and all-gather on dim 0) becomes ``k = min(ceil(bytes / size),
MAX_PIECES)`` collectives of about equal size on the same group, each with its
own issue and wait, whose results are put back together exactly:

- all-reduce: the flat input cut into ``k`` contiguous chunks, the results
  concatenated;
- reduce-scatter: the input viewed as ``(p, n / p)`` (row ``r`` is what rank
  ``r`` receives), cut into ``k`` column blocks, each copied contiguous; on every
  rank the results concatenated are its shard;
- all-gather: the flat shard cut into ``k`` chunks; result ``i`` viewed as
  ``(p, m_i)``, and the blocks concatenated along dim 1 are the ``(p, n / p)``
  gathered layout.

Each piece pays its own start-up (its ``CollectiveInfo.seconds`` is the α-β time
of its bytes) and is marked with its :class:`ddlc.ir.Piece` (``ir.PIECE``: the name of
the split collective, its index, k), so that the scheduler can put urgent collectives
between pieces; the reader waits for the last piece. :func:`partition_best`
tries :data:`SIZES`, from the largest down to the first one slower than the best so far,
and keeps the size whose scheduled program timeline is
shortest, so the choice comes from the model, never from measured timing (a size
that splits nothing, or splits every collective as a larger one does, is not tried;
:func:`partition_search` given the fuse search's record does not try the size that
splits nothing either: that program was timed already).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import fx

from cost_models.collectives import repriced
from cost_models.program import NodeCosts, stream_totals
from ddlc.ir import COLLECTIVE, PIECE, Piece
from ddlc.mesh import Mesh

from .fuse import FakeValues, Timed, bucketable_kind, issue_args, search_by_timeline

__all__ = ["partition", "partition_best", "partition_search", "SIZES", "MAX_PIECES"]

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

#: Piece sizes in bytes tried by :func:`partition_best` (inf = no split).
SIZES = (math.inf, 2**24, 2**20, 2**16)
#: Most pieces one collective is split into.
MAX_PIECES = 16


def _chunks(total: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ``[start, end)`` ranges of about equal length covering ``range(total)``."""
    bounds = [total * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class _Builder:
    """Adds nodes to ``graph``, each with its fake value (taken from ``values``)."""

    def __init__(self, graph: fx.Graph, values: FakeValues):
        self.graph, self.values = graph, values

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        node.meta["val"] = self.values.call(target, *vals[0], **vals[1])
        return node


def _split(call: _Builder, kind: str, x: fx.Node, p: int, k: int) -> list[fx.Node]:
    """The inputs of the ``k`` pieces (see the module docstring)."""
    # reshape, not view: the input is contiguous on mesh coordinate 0, whose program decided
    # the pieces, but may not be on another (a piece of a dim split unevenly)
    if kind == "reduce_scatter":
        grid = call(aten.reshape.default, x, [p, -1])
        return [call(aten.view.default,
                     call(aten.clone.default, call(aten.slice.Tensor, grid, 1, a, b),
                          memory_format=torch.contiguous_format), [-1])
                for a, b in _chunks(grid.meta["val"].shape[1], k)]
    flat = call(aten.reshape.default, x, [-1])
    return [call(aten.slice.Tensor, flat, 0, a, b) for a, b in _chunks(flat.meta["val"].numel(), k)]


def _merge(call: _Builder, kind: str, results: list[fx.Node], p: int, shape) -> fx.Node:
    """The split collective's result from its pieces' results."""
    if kind == "all_gather":
        grids = [call(aten.view.default, r, [p, -1]) for r in results]
        return call(aten.view.default, call(aten.cat.default, grids, 1), list(shape))
    return call(aten.view.default, call(aten.cat.default, results), list(shape))


def _pieces(node: fx.Node, size: float) -> int:
    """How many pieces ``node`` is split into under ``size`` (1: it stays whole)."""
    if bucketable_kind(node) is None or not node.args[0].meta["val"].is_contiguous():
        return 1
    info, x = COLLECTIVE(node), node.args[0]
    wanted = math.ceil(info.nbytes / size)
    return max(1, min(wanted, MAX_PIECES, x.meta["val"].numel() // info.group_size))


def _piece_bytes(node: fx.Node, k: int) -> list[int]:
    """The bytes of each of the ``k`` pieces of collective ``node`` (:func:`_split`'s
    chunks: of the flat input, or of the reduce-scatter input's ``(p, n / p)`` columns)."""
    info, numel = COLLECTIVE(node), node.args[0].meta["val"].numel()
    if bucketable_kind(node) == "reduce_scatter":
        p = info.group_size
        return [info.nbytes * p * (b - a) // numel for a, b in _chunks(numel // p, k)]
    return [info.nbytes * (b - a) // numel for a, b in _chunks(numel, k)]


def _busiest_stream(costs: NodeCosts, nodes, splits: list[tuple[fx.Node, int]], mesh: Mesh) -> float:
    """A lower bound of the modeled makespan of the program of ``nodes`` (priced in
    ``costs``) with ``splits`` made: each stream runs its tasks one at a time, and splitting
    a collective puts its pieces' seconds on its stream in its place (and adds slices and
    concatenations to the compute stream, counted as nothing here)."""
    totals = stream_totals(nodes, costs)
    for node, k in splits:
        pieces = sum(repriced(COLLECTIVE(node), b, mesh).seconds for b in _piece_bytes(node, k))
        totals[costs.stream(node)] += pieces - costs.seconds(node)
    return max(totals.values())


def _split_one(graph: fx.Graph, node: fx.Node, k: int, mesh: Mesh, values: FakeValues) -> None:
    """Replace collective ``node`` (and its wait) by ``k`` pieces and their merge (their
    fake values from ``values``)."""
    kind, info, x = bucketable_kind(node), COLLECTIVE(node), node.args[0]
    (wait,) = node.users
    p, group = info.group_size, node.args[-1]
    call = _Builder(graph, values)
    with graph.inserting_before(node):
        inputs = _split(call, kind, x, p, k)
        waits = []
        for index, (piece, nbytes) in enumerate(zip(inputs, _piece_bytes(node, k))):
            issued = call(node.target, *issue_args(kind, piece, p, group))
            COLLECTIVE.set(issued, repriced(info, nbytes, mesh))
            PIECE.set(issued, Piece(node.name, index, k))
            waits.append(call(_c10d.wait_tensor.default, issued))
    with graph.inserting_before(wait):
        merged = _merge(call, kind, waits, p, wait.meta["val"].shape)
    wait.replace_all_uses_with(merged)
    graph.erase_node(wait)
    graph.erase_node(node)


def _splits(gm: fx.GraphModule, size: float) -> list[tuple[fx.Node, int]]:
    """The collectives split under ``size`` and their numbers of pieces."""
    found = [(n, _pieces(n, size)) for n in gm.graph.nodes]
    return [(n, k) for n, k in found if k > 1]


def partition(gm: fx.GraphModule, mesh: Mesh, size: float,
              values: FakeValues | None = None) -> fx.GraphModule:
    """Split every collective of more than ``size`` bytes, in place (the new nodes' fake
    values from ``values``, if given)."""
    splits = _splits(gm, size)
    values = values if values is not None else FakeValues()
    for node, k in splits:
        _split_one(gm.graph, node, k, mesh, values)
    if splits:
        gm.graph.lint()
        gm.recompile()
    return gm


def partition_best(gm: fx.GraphModule, mesh: Mesh, schedule_fn=None) -> float:
    """Partition ``gm`` in place with the size of :data:`SIZES` whose scheduled program
    timeline is shortest (ties: the larger size, fewer pieces); returns that size. The
    sizes are tried from the largest down, and the search stops at the first size slower
    than the best so far (more pieces pay more start-ups: the makespan is taken to be
    unimodal, as for :func:`passes.fuse.fuse_search`'s caps, and on the same 98 searches
    this chose what trying every size chose, with one trial instead of three on the
    GPT-2-small-shaped model on 2x4). Sizes that split nothing are not tried, nor a size
    that splits every collective into as many pieces as a larger one (it gives the same
    program)."""
    return partition_search(gm, mesh, schedule_fn).option


def partition_search(gm: fx.GraphModule, mesh: Mesh, schedule_fn=None, given: Timed | None = None) -> Timed:
    """:func:`partition_best`, returning its :class:`passes.fuse.Timed` record (the size is
    its ``option``). ``given``: the timing of ``gm`` as it stands (what
    :func:`passes.fuse.fuse_search` chose, with the same ``schedule_fn``), so that the size
    that splits nothing is not tried again."""
    sizes, plans = [], []
    for size in SIZES:
        plan = _splits(gm, size)
        if (size == math.inf or plan) and plan not in plans:
            sizes.append(size)
            plans.append(plan)
    unsplit = replace(given, option=math.inf) if given is not None else None
    if sizes == [math.inf]:
        return unsplit or Timed(math.inf)
    values = FakeValues()  # shared by the trials and the final partition
    nodes = list(gm.graph.nodes)
    return search_by_timeline(gm, mesh, sizes, lambda g, size: partition(g, mesh, size, values),
                              schedule_fn, given=unsplit, ladder_from=0,
                              bound=lambda size, costs: _busiest_stream(costs, nodes, plans[sizes.index(size)], mesh))
