"""Exact solvers of the sharding problem: a mixed-integer program (HiGHS) and min-sum
variable elimination, over ``unary`` costs, ``memory`` bytes and ``edges`` (the block
moves of :mod:`passes.sharding.descent` call them on folded blocks).

**MILP** (:func:`solve_milp`; :func:`solve_exact` runs it on a whole problem). Columns:
binary ``x[v,k]`` picks candidate ``k`` of variable ``v`` (column ``offsets[v] + k``, the
first ``n_x``); then, per edge, continuous ``y[e,a,b] >= 0`` over the *distinct* SBPs at
its two ends (``_distinct``: equal rows of the cost matrix stand for one source SBP
``a``, equal columns for one destination SBP ``b``; ``a(k)`` is candidate ``k``'s).

- one-hot rows, ``sum_k x[v,k] = 1`` per variable: ``solve_milp``'s first loop;
- transportation rows per edge, ``sum_b y[e,a,b] = sum_{k: a(k)=a} x[src,k]`` for each
  ``a`` and ``sum_a y[e,a,b] = sum_{k: b(k)=b} x[dst,k]`` for each ``b``: the
  ``for e in edges`` loop (its ``else`` branch). With binary ``x`` the only feasible
  ``y`` is the single pair chosen, so the model is exact, and it needs ``|A|·|B|``
  columns per edge instead of ``|K_src|·|K_dst|``;
- self-loop rows (``src == dst``: only diagonal pairs are consistent),
  ``y[e,a(k),b(k)] = x[v,k]`` per candidate: the same loop's ``e.src == e.dst`` branch;
- memory row, ``sum_{v,k} memory[v][k]·x[v,k] <= memory_budget``, only when the budget
  is finite: the ``np.isfinite(memory_budget)`` block after the loop;
- objective ``sum unary[v][k]·x[v,k] + sum_e sum_{a,b} cost_e[a,b]·y[e,a,b]``: the
  ``cost`` list (the concatenated unary costs, then each edge's ``cost[a_rep, b_rep]``),
  in microseconds (``cost * 1e6`` in the ``milp`` call), so HiGHS' absolute gap
  tolerance (1e-6) cannot hide differences between step times of a few hundred
  microseconds. Forbidden columns (cost >= FORBIDDEN) get an upper bound of 0 instead
  of their stand-in cost (``allowed`` in the ``Bounds``).

**Variable elimination** (no memory constraint): :func:`elimination_order` picks the
order and bounds the largest table by ``MAX_TABLE``; :func:`solve_elimination` runs it.
Their docstrings point at the lines that build each quantity.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import time
from typing import Sequence

import numpy as np

from ddlc.errors import ShardingError

from .problem import FORBIDDEN, Edge, ShardingProblem

__all__ = ["solve_exact", "solve_milp", "elimination_order", "solve_elimination", "MAX_TABLE"]


def _distinct(matrix_axis_keys):
    ids = {}
    return [ids.setdefault(k, len(ids)) for k in matrix_axis_keys], len(ids)


def solve_exact(problem: ShardingProblem, memory_budget: float = float("inf"),
                time_limit: float = 60.0) -> tuple[list[int], dict]:
    """Optimal candidate index per variable; raises ShardingError if infeasible or timed out
    without a solution. The info dict holds the MIP gap and the solver status."""
    return solve_milp(problem.unary, problem.memory, problem.edges, memory_budget, time_limit)


def solve_milp(unary: Sequence[np.ndarray], memory: Sequence[np.ndarray], edges: Sequence,
               memory_budget: float = float("inf"), time_limit: float = 60.0,
               node_limit: int | None = None):
    """The MILP over variables with ``unary`` costs and ``memory`` bytes per candidate and
    ``edges`` (objects with ``src``, ``dst``, ``cost``); returns (choice, info). The
    model, row by row, is in the module docstring. ``node_limit`` caps the
    branch-and-bound nodes (a deterministic limit)."""
    # imported when a MILP is built: scipy.optimize takes a noticeable part of a second to
    # import, and plans solved by elimination alone never need it
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix
    start = time.perf_counter()
    if not unary:  # nothing left to choose (the reduction decided every variable)
        return [], {"status": "no variables", "optimal": True, "mip_gap": 0.0, "columns": 0, "rows": 0,
                    "seconds": 0.0}
    offsets = np.cumsum([0] + [len(u) for u in unary])
    n_x = int(offsets[-1])
    cost = [np.concatenate(unary)]
    rows, cols, vals, lo, hi = [], [], [], [], []
    row = 0

    def add_row(entries, bound_lo, bound_hi):
        nonlocal row
        for c, v in entries:
            rows.append(row)
            cols.append(c)
            vals.append(v)
        lo.append(bound_lo)
        hi.append(bound_hi)
        row += 1

    for v in range(len(unary)):  # exactly one candidate each
        add_row([(offsets[v] + k, 1.0) for k in range(len(unary[v]))], 1.0, 1.0)

    col = n_x
    for e in edges:
        # distinct cost rows / columns of the matrix stand for distinct SBPs at each end
        a_of, n_a = _distinct(map(bytes, e.cost))
        b_of, n_b = _distinct(map(bytes, e.cost.T))
        a_rep = [a_of.index(a) for a in range(n_a)]
        b_rep = [b_of.index(b) for b in range(n_b)]
        cost.append(np.array([e.cost[a_rep[a], b_rep[b]] for a in range(n_a) for b in range(n_b)]))
        y = lambda a, b: col + a * n_b + b
        if e.src == e.dst:  # both ends on one variable: only diagonal pairs are consistent
            for k in range(len(a_of)):
                add_row([(y(a_of[k], b_of[k]), 1.0), (offsets[e.src] + k, -1.0)], 0.0, 0.0)
        else:
            for a in range(n_a):
                add_row([(y(a, b), 1.0) for b in range(n_b)]
                        + [(offsets[e.src] + k, -1.0) for k in range(len(a_of)) if a_of[k] == a],
                        0.0, 0.0)
            for b in range(n_b):
                add_row([(y(a, b), 1.0) for a in range(n_a)]
                        + [(offsets[e.dst] + k, -1.0) for k in range(len(b_of)) if b_of[k] == b],
                        0.0, 0.0)
        col += n_a * n_b

    n = col
    constraints = [LinearConstraint(coo_matrix((vals, (rows, cols)), shape=(row, n)).tocsr(), lo, hi)]
    if np.isfinite(memory_budget):
        mem = np.zeros(n)
        mem[:n_x] = np.concatenate(memory)
        constraints.append(LinearConstraint(mem.reshape(1, -1), -np.inf, memory_budget))
    integrality = np.zeros(n)
    integrality[:n_x] = 1
    cost = np.concatenate(cost)
    allowed = cost < FORBIDDEN
    res = milp(np.where(allowed, cost * 1e6, 0.0), constraints=constraints, integrality=integrality,
               bounds=Bounds(0, allowed.astype(float)), options={"time_limit": time_limit, "disp": False,
                                             **({"node_limit": node_limit} if node_limit else {})})
    if res.x is None:
        raise ShardingError(f"the exact solver found no solution ({res.message})")
    x = res.x[:n_x]
    choice = [int(np.argmax(x[offsets[v]:offsets[v + 1]])) for v in range(len(unary))]
    info = {"status": res.message, "optimal": res.status == 0,
            "mip_gap": getattr(res, "mip_gap", None), "columns": n, "rows": row,
            "seconds": time.perf_counter() - start}
    return choice, info


#: Largest table (product of candidate counts) :func:`solve_elimination` will build.
MAX_TABLE = 4_000_000


def elimination_order(sizes: Sequence[int], edges: Sequence, limit: float = MAX_TABLE):
    """A greedy elimination order of the interaction graph and the largest table it
    builds, or None when some table would exceed ``limit``. The graph joins the two ends
    of every edge that is not a self-loop (``nbrs``, the first loop). ``score(v)`` is
    ``(fill, table)``: the weighted fill-in ``sum sizes[a] * sizes[b]`` over the pairs of
    ``v``'s neighbours not yet joined, and the table ``sizes[v] * prod sizes[u]`` over its
    neighbours (the factor eliminating ``v`` builds in :func:`solve_elimination`). Next
    goes the least fill-in, then the smallest table, then the lowest index (the heap's
    order of ``(score(v), v)``); a table over ``limit`` returns None; scores are refreshed
    lazily (a popped entry whose score changed is pushed back), and eliminating ``v``
    joins its neighbours pairwise (the ``nbrs[u].update`` loop)."""
    nbrs = [set() for _ in sizes]
    for e in edges:
        if e.src != e.dst:
            nbrs[e.src].add(e.dst)
            nbrs[e.dst].add(e.src)

    def score(v):
        near = sorted(nbrs[v])
        fill = sum(sizes[a] * sizes[b] for i, a in enumerate(near) for b in near[i + 1:]
                   if b not in nbrs[a])
        return fill, sizes[v] * math.prod(sizes[u] for u in near)

    heap = [(score(v), v) for v in range(len(sizes))]
    heapq.heapify(heap)
    alive, order, largest = [True] * len(sizes), [], 0
    while heap:
        key, v = heapq.heappop(heap)
        if not alive[v]:
            continue
        if key != score(v):
            heapq.heappush(heap, (score(v), v))
            continue
        if key[1] > limit:
            return None
        alive[v] = False
        order.append(v)
        largest = max(largest, key[1])
        near = sorted(nbrs[v])
        for u in near:
            nbrs[u].discard(v)
            nbrs[u].update(w for w in near if w != u)
        for u in near:
            heapq.heappush(heap, (score(u), u))
    return order, largest


def solve_elimination(unary: Sequence[np.ndarray], edges: Sequence, order: Sequence[int]) -> list[int]:
    """Exact minimum of ``sum unary + sum edge costs`` by min-sum variable elimination
    (bucket elimination) along ``order``. No memory constraint.

    Factors (``add``): one per variable, its unary cost; one per edge, ``cost`` over the
    scope ``(min(src, dst), max(src, dst))`` (transposed when ``src > dst``), or
    ``diag(cost)`` over ``(v,)`` for a self-loop (the two loops before ``steps``).
    Eliminating ``v`` (the ``for v in order`` loop) minimizes, over ``v``, the sum of the
    factors that mention ``v``, a table over the union ``rest`` of their scopes: the new
    factor ``min_v`` and ``argmin_v`` over ``rest`` (:func:`_minimize_out`); the last loop
    back-substitutes those argmins in reverse order.

    Repeated layers give buckets that compute the same tables: each factor carries a
    content key (a digest of its table's bytes), a bucket's key is its factors' keys in
    order with where each one's axes land in ``(v, *rest)``, and a bucket whose key was
    met before takes that bucket's ``min_v`` and ``argmin_v`` instead of summing again (the
    same additions in the same order, so the same tables). Each new factor is shifted by
    its least entry (``_shifted``): a constant added to a factor moves every assignment's
    total alike, so no argmin changes, and the message a chain of identical layers passes
    on, which grows by a layer's cost at every layer, becomes the same table after a few
    layers, from where on each layer's buckets are met before (GPT-2-small on 2x4: 2.7x
    less summing)."""
    factors = {}
    by_var = [set() for _ in unary]
    ids = itertools.count()

    def content_key(table: np.ndarray) -> bytes:
        return hashlib.sha1(f"{table.shape}{table.dtype}".encode() + table.tobytes()).digest()

    def add(scope: tuple[int, ...], table: np.ndarray, key: bytes | None = None) -> None:
        i = next(ids)
        factors[i] = (scope, table, content_key(table) if key is None else key)
        for v in scope:
            by_var[v].add(i)

    for v, u in enumerate(unary):
        add((v,), np.asarray(u, dtype=float))
    for e in edges:
        if e.src == e.dst:
            add((e.src,), np.diag(e.cost))
        elif e.src < e.dst:
            add((e.src, e.dst), e.cost)
        else:
            add((e.dst, e.src), e.cost.T)
    sizes = [len(u) for u in unary]
    steps, solved = [], {}  # bucket key -> (min_v shifted, argmin_v, its key), of the first such bucket
    for v in order:
        bucket = sorted(by_var[v])
        rest = tuple(sorted({w for i in bucket for w in factors[i][0]} - {v}))
        axis = {w: k for k, w in enumerate((v,) + rest)}
        pieces, digest = [], hashlib.sha1(repr((sizes[v], [sizes[w] for w in rest])).encode())
        for i in bucket:  # each factor with v first and broadcastable to (sizes[v], *rest)
            sub, table, key = factors.pop(i)
            for w in sub:
                by_var[w].discard(i)
            digest.update(key + repr([axis[w] for w in sub]).encode())
            table = np.moveaxis(table, sub.index(v), 0) if v in sub else table[None]
            pieces.append(table.reshape([table.shape[0]] + [sizes[w] if w in sub else 1 for w in rest]))
        key = digest.digest()
        if key not in solved:
            least, arg = _minimize_out(pieces, sizes[v], tuple(sizes[w] for w in rest))
            least = _shifted(least)
            solved[key] = least, arg, content_key(least)
        least, arg, least_key = solved[key]
        steps.append((v, rest, arg))
        add(rest, least, least_key)
    choice = [0] * len(unary)
    for v, rest, arg in reversed(steps):
        choice[v] = int(arg[tuple(choice[w] for w in rest)])
    return choice


def _shifted(table: np.ndarray) -> np.ndarray:
    """``table`` less its least entry (unchanged when that is not finite or ``table`` is
    empty): see :func:`solve_elimination`."""
    low = table.min() if table.size else np.inf
    return table - low if np.isfinite(low) else table


def _minimize_out(pieces: Sequence[np.ndarray], n: int, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``(min, argmin)`` over the first axis (of length ``n``) of ``0 + pieces[0] +
    pieces[1] + ...`` (each broadcast to ``(n, *shape)``; a first axis of 1 is the same
    for every index), without building that table: one slab (index ``j`` of the first
    axis, a table of ``shape``) at a time, its sum kept at the shape its pieces span and
    broadcast only when a piece widens it (the same additions per entry, in the same
    order, so the same values), the full slab in one buffer; the running minimum takes a
    slab's entry only where it is strictly less, so ties keep the first index, as
    ``np.argmin`` does. The argmin is stored in the smallest integer type that holds
    ``n - 1`` (the back-substitution keeps one per eliminated variable)."""
    buffer, better = np.empty(shape), np.empty(shape, dtype=bool)
    least = arg = None
    for j in range(n):
        total, full = 0.0, False
        for piece in pieces:
            part = piece[j if piece.shape[0] > 1 else 0]
            if full:
                total += part
            elif np.broadcast_shapes(np.shape(total), part.shape) == shape:
                total = np.add(total, part, out=buffer)
                full = True
            else:
                total = np.add(total, part)
        total = np.broadcast_to(total, shape)
        if least is None:
            least, arg = np.array(total), np.zeros(shape, dtype=np.min_scalar_type(n - 1))
            continue
        np.less(total, least, out=better)
        np.copyto(arg, j, where=better)
        np.minimum(least, total, out=least)
    return least, arg


def smallest_footprint(problem: ShardingProblem, time_limit: float = 30.0) -> tuple[list[int], float]:
    """The assignment with the least resident memory among those that need no forbidden
    redistribution, and its bytes: the MILP with memory (in MiB) as the objective and
    every allowed edge free. Raises ShardingError if HiGHS finds none in ``time_limit``."""
    edges = [Edge(e.src, e.dst, np.where(e.cost >= FORBIDDEN, FORBIDDEN, 0.0), e.what)
             for e in problem.edges]
    unary = [np.where(u >= FORBIDDEN, FORBIDDEN, m / 2**20) for u, m in zip(problem.unary, problem.memory)]
    choice, _ = solve_milp(unary, problem.memory, edges, time_limit=time_limit)
    return choice, problem.memory_of(choice)
