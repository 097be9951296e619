"""The cost of changing a tensor's n-D SBP ("boxing") on a mesh, one mesh axis at a time.

One step changes the SBP on one mesh axis (:data:`STEP_KINDS`): ``S->B``
all-gather, ``P->S`` reduce-scatter, ``P->B`` all-reduce, ``S(i)->S(j)``
all-to-all, ``B->S`` local slice and ``B->P`` zeroing all but one copy
(both free). A step's bytes ``n`` are those of the tensor after the splits on
the *other* axes at that moment (the largest piece, as
:func:`ddlc.sbp.local_shape`), priced by :mod:`cost_models.collectives`.

Executability (what lowering relies on; DTensor's nesting, axis 0 outermost):
a step on axis ``k`` whose old or new SBP splits tensor dim ``d`` is only
allowed while no axis ``j > k`` splits ``d``. Uneven pieces (``torch.chunk`` of a
dim the axis does not divide): an all-gather or reduce-scatter runs on pieces
zero-padded to the largest and is priced at the padded bytes, only where the other
axes cut the dim evenly (:func:`ddlc.sbp.padded_shape`); an all-to-all exchanges
equal pieces only.

The plan is a shortest path in the graph whose nodes are all n-D SBPs of the
tensor and whose edges are the allowed steps. This covers every order of the
direct per-axis changes, and also detours when they are cheaper or when no
direct order is executable: e.g. ``(S0, S1) -> (S1, S0)``, or ``(P, B) ->
(B, B)`` done hierarchically as slice on axis 1, all-reduce of 1/p1 of the
bytes on axis 0, all-gather on axis 1. Being a shortest-path metric, the cost
obeys the triangle inequality. Among equally cheap routes the one with fewer
steps wins (each step weighs an extra :data:`_TIE` seconds in the search).

``S->P`` on an axis is refused (infinite cost: it buys nothing and costs a
gather) unless ``allow_split_to_partial=True``; then it goes ``S->B->P``.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import networkx as nx
import numpy as np
import sympy
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

from ddlc.errors import SBPError
from ddlc.mesh import Mesh
from ddlc.sbp import B, P, S, SBP, NdSBP, divides, local_shape, padded_shape

from .collectives import COLLECTIVES, cheapest_algorithm, collective_expr, collective_time, priced_as

__all__ = ["STEP_KINDS", "BoxingStep", "BoxingPlan", "boxing_cost", "boxing_seconds", "boxing_table"]

#: (old, new) SBP letters on one axis -> step kind. S->P has no step of its own.
STEP_KINDS: dict[tuple[str, str], str] = {
    ("S", "B"): "all_gather",
    ("P", "S"): "reduce_scatter",
    ("P", "B"): "all_reduce",
    ("S", "S"): "all_to_all",
    ("B", "S"): "slice",
    ("B", "P"): "zero",
}

_TIE = 1e-12  # seconds added per step in the search only: prefer fewer steps on ties


def _letter(x: SBP) -> str:
    return "BPS"[x.kind]


@dataclass(frozen=True)
class BoxingStep:
    """One per-axis change ``before -> after`` (they differ on ``axis`` only)."""

    axis: int
    kind: str               # a value of STEP_KINDS
    src_sbp: SBP            # before[axis]
    dst_sbp: SBP            # after[axis]
    before: NdSBP
    after: NdSBP
    nbytes: int             # bytes on this axis' group: the tensor after the other axes' splits
    seconds: float
    algorithm: str | None   # "ring" / "tree" for collectives, None for local steps
    runs_as: str | None = None  # the collective the backend runs instead (priced as that)

    @property
    def collective(self) -> str | None:
        return self.kind if self.kind in COLLECTIVES else None

    @property
    def formula(self) -> sympy.Expr:
        """The symbolic time (see :mod:`cost_models.collectives`), 0 for local steps."""
        return collective_expr(self.runs_as or self.kind, self.algorithm) if self.collective \
            else sympy.Integer(0)

    def __str__(self) -> str:
        how = f"{self.kind}[{self.algorithm}]" if self.collective else self.kind
        how += f" as {self.runs_as}" if self.runs_as else ""
        return (f"axis {self.axis}: {self.src_sbp}->{self.dst_sbp} {how} {self.nbytes} B "
                f"{self.seconds * 1e6:.2f} us   {self.before} -> {self.after}")


@dataclass(frozen=True)
class BoxingPlan:
    """The steps from ``src`` to ``dst`` in order; ``seconds`` is inf when refused."""

    steps: tuple[BoxingStep, ...]
    seconds: float
    src: NdSBP
    dst: NdSBP

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.seconds)

    def __str__(self) -> str:
        head = f"{self.src} -> {self.dst}: {self.seconds * 1e6:.2f} us"
        return "\n  ".join([head, *map(str, self.steps)])


def _step(shape: tuple[int, ...], itemsize: int, mesh: Mesh, before: NdSBP, axis: int,
          new: SBP, algorithm: str) -> BoxingStep | None:
    """The step setting ``before[axis]`` to ``new``, or None if there is none or it is not executable."""
    old = before[axis]
    kind = STEP_KINDS.get((_letter(old), _letter(new)))
    if kind is None or old == new:
        return None
    dims = {x.dim for x in (old, new) if x.is_split}
    if any(x.is_split and x.dim in dims for x in before.per_axis[axis + 1:]):
        return None
    after = before.replace(axis, new)
    if kind == "all_to_all" and not (divides(shape, before, mesh.shape) and divides(shape, after, mesh.shape)):
        return None  # ddlc.comm.all_to_all_dims exchanges equal pieces only
    if kind in ("all_gather", "reduce_scatter"):
        split = before if kind == "all_gather" else after
        try:  # an uneven piece runs as a padded collective
            shape = padded_shape(shape, split, axis, mesh.shape)
        except SBPError:  # other axes cut the dim unevenly: no padding evens it
            return None
    nbytes = itemsize * math.prod(local_shape(shape, before.replace(axis, B), mesh.shape))
    algo, seconds, runs_as = None, 0.0, None
    if kind in COLLECTIVES:
        group = mesh.shape[axis]
        priced, link = priced_as(kind, mesh, axis)
        runs_as = priced if priced != kind else None
        if algorithm == "auto":
            algo, seconds = cheapest_algorithm(priced, nbytes, group, link)
        else:
            algo, seconds = algorithm, collective_time(priced, nbytes, group, link, algorithm)
    return BoxingStep(axis, kind, old, new, before, after, nbytes, seconds, algo,
                      runs_as)


@functools.lru_cache(maxsize=256)
def _graph(shape: tuple[int, ...], itemsize: int, mesh: Mesh, algorithm: str) -> nx.DiGraph:
    """All n-D SBPs of a ``shape`` tensor on ``mesh``, joined by their executable steps."""
    values = (B, P, *map(S, range(len(shape))))
    g = nx.DiGraph()
    states = [NdSBP(t) for t in itertools.product(values, repeat=mesh.ndim)]
    g.add_nodes_from(states)
    for u, axis, new in itertools.product(states, range(mesh.ndim), values):
        step = _step(shape, itemsize, mesh, u, axis, new, algorithm)
        if step is not None:
            g.add_edge(u, step.after, step=step, weight=step.seconds + _TIE)
    return g


@functools.lru_cache(maxsize=4096)
def _routes(shape: tuple[int, ...], itemsize: int, src: NdSBP, mesh: Mesh,
            algorithm: str) -> dict[NdSBP, list[NdSBP]]:
    """Cheapest route from ``src`` to every reachable n-D SBP (networkx Dijkstra)."""
    return nx.single_source_dijkstra_path(_graph(shape, itemsize, mesh, algorithm), src)


def _check(shape: tuple[int, ...], sbp: NdSBP, mesh: Mesh) -> None:
    if len(sbp) != mesh.ndim:
        raise SBPError(f"{sbp} has {len(sbp)} axes but the mesh {mesh} has {mesh.ndim}")
    sbp.check_rank(len(shape))


@functools.lru_cache(maxsize=65536)
def _plan(shape: tuple[int, ...], itemsize: int, src: NdSBP, dst: NdSBP, mesh: Mesh,
          allow_split_to_partial: bool, algorithm: str) -> BoxingPlan:
    _check(shape, src, mesh)
    _check(shape, dst, mesh)
    if not allow_split_to_partial and any(a.is_split and b.is_partial for a, b in zip(src, dst)):
        return BoxingPlan((), math.inf, src, dst)
    g = _graph(shape, itemsize, mesh, algorithm)
    route = _routes(shape, itemsize, src, mesh, algorithm).get(dst)
    if route is None:  # only through steps lowering cannot run (uneven pieces)
        return BoxingPlan((), math.inf, src, dst)
    steps = tuple(g.edges[u, v]["step"] for u, v in itertools.pairwise(route))
    return BoxingPlan(steps, math.fsum(s.seconds for s in steps), src, dst)


def boxing_cost(shape: Sequence[int], itemsize: int, src: NdSBP, dst: NdSBP, mesh: Mesh,
                allow_split_to_partial: bool = False, algorithm: str = "ring") -> BoxingPlan:
    """The cheapest executable plan changing a ``shape`` tensor from ``src`` to ``dst``.

    ``algorithm`` picks the collective forms: ``"ring"`` (the default, what NCCL and
    gloo run, and the boxing table of METHODS.md), ``"tree"`` or ``"auto"``.
    Both ends are read with ``B`` on every mesh axis of one device, where a split, a copy
    and a partial sum of one piece are all the whole value (an S->P there is no S->P;
    :func:`boxing_table`'s routes treat those axes so). Cached on all arguments.
    """
    return _plan(tuple(int(s) for s in shape), int(itemsize), _whole_on_single_axes(src, mesh),
                 _whole_on_single_axes(dst, mesh), mesh, bool(allow_split_to_partial), algorithm)


def _whole_on_single_axes(sbp: NdSBP, mesh: Mesh) -> NdSBP:
    return NdSBP(tuple(B if p == 1 else x for x, p in zip(sbp, mesh.shape)))


def boxing_seconds(shape: Sequence[int], itemsize: int, src: NdSBP, dst: NdSBP, mesh: Mesh,
                   allow_split_to_partial: bool = False, algorithm: str = "ring") -> float:
    """``boxing_cost(...).seconds``: inf when the change is refused."""
    return boxing_cost(shape, itemsize, src, dst, mesh, allow_split_to_partial, algorithm).seconds


@functools.lru_cache(maxsize=256)
def _all_pairs(shape: tuple[int, ...], itemsize: int, mesh: Mesh, algorithm: str):
    """(state -> index, matrix of cheapest seconds between all n-D SBPs): all-pairs
    Dijkstra (scipy) on :func:`_graph` weighted by seconds (free steps weigh 1e-30 so
    they stay edges; the sums round it away, and pure-local routes are set to 0)."""
    g = _graph(shape, itemsize, mesh, algorithm)
    index = {s: i for i, s in enumerate(g.nodes)}
    rows, cols, weights = [], [], []
    for u, v, step in g.edges(data="step"):
        rows.append(index[u])
        cols.append(index[v])
        weights.append(max(step.seconds, 1e-30))
    n = len(index)
    dist = dijkstra(csr_matrix((weights, (rows, cols)), shape=(n, n)), directed=True)
    dist[dist < 1e-20] = 0.0
    return index, dist


def boxing_table(shape: Sequence[int], itemsize: int, srcs: Sequence[NdSBP],
                 dsts: Sequence[NdSBP], mesh: Mesh, algorithm: str = "ring") -> np.ndarray:
    """``boxing_seconds`` for every (src, dst) pair at once (S->P refused: inf); equal to
    it up to float rounding. For pricing whole edge matrices in the sharding search."""
    index, dist = _all_pairs(tuple(int(s) for s in shape), int(itemsize), mesh, algorithm)
    table = dist[np.ix_([index[x] for x in srcs], [index[x] for x in dsts])]
    # S -> P on some mesh axis: a bit per axis, split in the source and partial in the target
    split = np.array([_axis_bits(x, "is_split") for x in srcs], dtype=np.int64)
    partial = np.array([_axis_bits(y, "is_partial") for y in dsts], dtype=np.int64)
    table[(split[:, None] & partial[None, :]) != 0] = math.inf
    return table


@functools.lru_cache(maxsize=4096)
def _axis_bits(sbp: NdSBP, kind: str) -> int:
    """Bit ``k`` set where ``sbp``'s entry on mesh axis ``k`` is of ``kind`` (an SBP
    property: ``is_split``, ``is_partial``)."""
    return sum(1 << k for k, x in enumerate(sbp) if getattr(x, kind))
