"""AutoDDL's coordinate descent over a :class:`~passes.sharding.problem.ShardingProblem`
(the default solver of :func:`passes.sharding.shard`): :func:`coordinate_descent`.

1. *Start* from the best uniform scheme (:func:`_initial`): each seed policy of
   ``SEEDS`` (data parallel: batch split on dim 0 over every axis, or over the first
   axis only, parameters replicated; or everything replicated) places the graph
   inputs, then every other variable, in graph order, takes its cheapest candidate
   given the variables placed before it.
2. *Sweep* until a sweep improves nothing (:func:`_descend`): (a) exact dynamic
   programming over path-shaped blocks (:func:`_path_blocks`, :func:`_solve_path`),
   (b) every variable in graph order moves to its best candidate with all others fixed
   (``_Search.best_response``), (c) block moves (:func:`_solve_block`): a block's
   variables jump to their jointly optimal candidates with everything outside fixed
   (exact reduction, then min-sum variable elimination, or a node-capped MILP when the
   memory budget can bind: :func:`_block_optimum`). Where the block's elimination
   tables would be too large (n-D meshes: a 4-D tensor has 216 candidates on a 3-D
   mesh), the move is made exactly over the candidates that keep the current signature
   on all mesh axes but a freed subset, for every subset from large to small that is
   not inside one already solved (:func:`_axis_subsets`). The blocks (:func:`_regions`)
   are the modules that own parameters (with their neighbours, deepest first; repeated
   layers with the same folded costs are solved once), except when the budget cannot
   bind and the whole (already reduced) problem is small: it fits the elimination's
   table limit (then the one block is the whole problem and the result is the exact
   optimum) or has at most MAX_BLOCK variables (its node-capped MILP); see
   ``stats["whole_block"]``. On n-D meshes the module blocks are followed by the whole
   problem as one more block, which in practice moves one or two mesh axes of every
   variable at once (the axis-subset moves above): e.g. replicating the whole forward
   pass on one axis, which no module block can reach alone.

Every seed is first descended with moves (a) and (b) only; the best result (fitting the
budget, then the least objective) is descended again with the block moves added. Where
the one block is the whole problem and variable elimination solves it, the block move
reaches the optimum from any start: the seeds are then compared undescended, and the
axes are not permuted (step 3), as nothing ends lower than the optimum (between optimal
plans, the one found can differ from the one a descended seed would have kept).

3. *Permute the mesh axes* (:func:`_permuted`): on a mesh whose axes differ (in size or
   link), the result with every signature's per-axis SBPs exchanged between axes is
   descended again, with the cheap moves and, where those already end below the
   incumbent, with the block moves too, and kept if it ends lower. No move above reaches it: it moves every
   parameter's split from one axis to another at once (e.g. the tied GPT on (2, 4) keeps
   its parameters split 4 ways instead of 2 at 5% less modeled time).
Where the memory budget can bind (:func:`_unconstrained` is false), the steps above run
on Lagrangian relaxations instead, memory priced per byte and no budget, the price
searched until the plan fits (:func:`_lagrangian`); they run under the budget only where
no price gives a plan within it. Every move respects the memory budget. Ties keep the incumbent and otherwise go to the
lowest candidate index, so the result depends only on the graph. Moves (a), (b) and (c)
all solve the sub-problem :func:`~passes.sharding.problem.fold_block` builds.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
from torch import fx

from ddlc.errors import ShardingError
from ddlc.ir import ORIGIN, ROLE
from ddlc.mesh import Mesh
from ddlc.sbp import B, NdSBP, S, divides

from .exact import MAX_TABLE, elimination_order, solve_elimination, solve_milp
from .problem import FORBIDDEN, Edge, ShardingProblem, fold_block, reduce_costs, reduce_problem

__all__ = ["coordinate_descent", "feasible_start", "NoPlanWithoutForbiddenMoves", "SEEDS", "MAX_TABLE_WHOLE", "MAX_BLOCK", "BLOCK_NODE_LIMIT"]


def _split_batch(node: fx.Node, mesh: Mesh, split: NdSBP) -> NdSBP:
    """``split`` for a batch input whose shape it divides, else replicated."""
    if ROLE.get(node) == "input":
        shape = tuple(node.meta["val"].shape)
        if shape and divides(shape, split, mesh.shape):
            return split
    return NdSBP.broadcast(mesh.ndim)


def _seed_data_parallel(node: fx.Node, mesh: Mesh) -> NdSBP:
    return _split_batch(node, mesh, NdSBP((S(0),) * mesh.ndim))


def _seed_data_parallel_outer(node: fx.Node, mesh: Mesh) -> NdSBP:
    return _split_batch(node, mesh, NdSBP((S(0),) + (B,) * (mesh.ndim - 1)))


def _seed_replicated(node: fx.Node, mesh: Mesh) -> NdSBP:
    return NdSBP.broadcast(mesh.ndim)


#: Uniform starting schemes: placement of each graph input (parameters replicated).
SEEDS = {"data_parallel": _seed_data_parallel, "data_parallel_outer_axis": _seed_data_parallel_outer,
         "replicated": _seed_replicated}


@dataclass
class _Search:
    problem: ShardingProblem
    budget: float
    choice: list[int]

    def __post_init__(self):
        self.memory = self.problem.memory_of(self.choice) if self.choice else 0.0
        self._rest_keys: dict = {}

    def rest_keys(self, v: int, free: tuple[int, ...]) -> np.ndarray:
        """Per candidate of ``v``, an id of its signature on the mesh axes not in ``free``.
        Cached by the candidates themselves: the variables of repeated layers share theirs
        (one entry of the rules' cache), and the problem keeps them alive."""
        candidates = self.problem.candidates[v]
        key = (tuple(map(id, candidates)), free)
        keys = self._rest_keys.get(key)
        if keys is None:
            fixed = [a for a in range(self.problem.mesh.ndim) if a not in free]
            ids: dict = {}
            keys = self._rest_keys[key] = np.array([ids.setdefault(tuple(c.axis(a) for a in fixed), len(ids))
                                                    for c in candidates])
        return keys

    def best_response(self, v: int) -> bool:
        """Move ``v`` to its cheapest affordable candidate; True if it moved."""
        p = self.problem
        cost = p.local_cost(v, self.choice)
        current = self.choice[v]
        room = self.budget - (self.memory - p.memory[v][current])
        cost = np.where(p.memory[v] <= room, cost, np.inf)
        best = int(np.argmin(cost))
        now = cost[current]
        if cost[best] < (now - 1e-12 * max(1.0, abs(now)) if np.isfinite(now) else np.inf):
            self.memory += p.memory[v][best] - p.memory[v][current]
            self.choice[v] = best
            return True
        return False


def _initial(problem: ShardingProblem, seed, budget: float) -> list[int]:
    """Place inputs by ``seed``, then every variable greedily given those placed before it:
    its unary cost plus the edges from already placed producers (not :func:`fold_block`,
    which needs every other variable placed; edges to placed consumers, i.e. the loop
    edges into the placeholders, and self-loops are left out)."""
    choice = [-1] * problem.num_vars
    for v, group in enumerate(problem.members):
        rep = group[0]
        if rep.op == "placeholder":
            wanted = seed(rep, problem.mesh)
            outs = [c.outputs[0] for c in problem.candidates[v]]
            choice[v] = outs.index(wanted) if wanted in outs else 0
    for v in range(problem.num_vars):
        if choice[v] >= 0:
            continue
        cost = problem.unary[v].copy()
        for i in problem.incident[v]:
            e = problem.edges[i]
            if e.dst == v and e.src != v and choice[e.src] >= 0:
                cost += e.cost[choice[e.src], :]
        choice[v] = int(np.argmin(cost))
    return choice


class NoPlanWithoutForbiddenMoves(ShardingError):
    """Proved by :func:`feasible_start`: every choice of the problem needs a forbidden
    redistribution."""


def _allowed_pairs(problem: ShardingProblem) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per edge, which candidate pairs it allows (cost below FORBIDDEN); per variable, the
    candidates its unary cost and its self-loops allow."""
    allowed = [e.cost < FORBIDDEN for e in problem.edges]
    domains = [np.asarray(u < FORBIDDEN) for u in problem.unary]
    for e, ok in zip(problem.edges, allowed):
        if e.src == e.dst:
            domains[e.src] = domains[e.src] & np.diag(ok)
    return allowed, domains


def _support(e: Edge, ok: np.ndarray, domains: list[np.ndarray], w: int) -> np.ndarray:
    """The candidates of ``w``, an endpoint of ``e``, that some candidate left at its other
    endpoint is allowed with."""
    return ok[domains[e.src], :].any(axis=0) if w == e.dst else ok[:, domains[e.dst]].any(axis=1)


def feasible_start(problem: ShardingProblem) -> list[int] | None:
    """A choice without a forbidden redistribution (every edge's cost below FORBIDDEN),
    or None where this finds none: a start for coordinate descent where the seeds all
    end with one (their greedy placement is myopic: a tensor that can be split freely
    takes a split that a reader three operators on cannot take).

    Constraint propagation: a candidate is *supported* by a neighbour when some
    candidate the neighbour still has is joined to it by an allowed edge (cost below
    FORBIDDEN). Arc consistency removes every unsupported candidate until none is left (a
    variable left without candidates proves that no choice exists); then each variable in
    order takes its cheapest remaining candidate given those placed before it, and the
    candidates are made arc consistent again (maintained arc consistency). The graph has
    cycles, so a placement can still empty a set; there is no backtracking: None. Raises
    :class:`NoPlanWithoutForbiddenMoves` where arc consistency alone empties a set (every
    cost is non-negative, so every choice then costs FORBIDDEN or more)."""
    n = problem.num_vars
    allowed, domains = _allowed_pairs(problem)

    def consistent(changed) -> bool:
        """Arc consistency from the variables ``changed``; False where a set empties."""
        pending = collections.deque(changed)
        queued = set(pending)
        while pending:
            v = pending.popleft()
            queued.discard(v)
            for i in problem.incident[v]:
                e, ok = problem.edges[i], allowed[i]
                if e.src == e.dst:
                    continue
                w = e.dst if e.src == v else e.src
                kept = domains[w] & _support(e, ok, domains, w)
                if not kept.any():
                    return False
                if (kept != domains[w]).any():
                    domains[w] = kept
                    if w not in queued:
                        pending.append(w)
                        queued.add(w)
        return True

    if not all(d.any() for d in domains) or not consistent(range(n)):
        raise NoPlanWithoutForbiddenMoves("no plan without a forbidden redistribution exists "
                                          "(constraint propagation)")
    choice = [-1] * n
    for v in range(n):
        cost = problem.unary[v].copy()
        for i in problem.incident[v]:
            e = problem.edges[i]
            if e.src == e.dst:
                cost = cost + np.diag(e.cost)
            elif e.dst == v and choice[e.src] >= 0:
                cost = cost + e.cost[choice[e.src], :]
            elif e.src == v and choice[e.dst] >= 0:
                cost = cost + e.cost[:, choice[e.dst]]
        cost = np.where(domains[v], cost, np.inf)
        choice[v] = int(np.argmin(cost))
        domains[v] = np.arange(len(cost)) == choice[v]
        if not consistent([v]):
            return None
    return choice


class Conflict(NamedTuple):
    """Where :func:`first_conflict` finds the placements conflict: the operator ``node``,
    and per earlier neighbour (by name) the placements that can still reach it."""

    node: fx.Node
    reaching: tuple[tuple[str, tuple[str, ...]], ...]

    def describe(self) -> str:
        """What reaches the node, in words: ``mean as (P); convolution as (S0)``, with what
        a partial sum is where one does."""
        text = "; ".join(f"{name} as {' or '.join(placements)}" for name, placements in self.reaching)
        if any("P" in p for _, placements in self.reaching for p in placements):
            text += ", where P is a partial sum (a sum over a split dim, which only an all-reduce makes whole)"
        return text


def first_conflict(problem: ShardingProblem) -> Conflict | None:
    """The first node, in graph order, left without a candidate when each variable keeps
    only the candidates (cost below FORBIDDEN) its *earlier* neighbours support:
    propagation along the data flow, one pass over the variables of an unreduced problem
    (numbered in graph order). That is the first operator that cannot take what reaches
    it without a forbidden move, where a refusal's cause lies (an uneven batch split
    meeting a flatten, batch norm statistics over a split batch); full arc consistency
    also propagates back from the loss, and where two such fronts meet says little, and a
    reduced problem's folded costs carry later constraints into earlier variables. None
    where this weaker propagation empties nothing."""
    allowed, domains = _allowed_pairs(problem)
    for v in range(problem.num_vars):
        earlier = []
        for i in problem.incident[v]:
            e = problem.edges[i]
            u = e.src if e.dst == v else e.dst
            if u < v:
                domains[v] = domains[v] & _support(e, allowed[i], domains, v)
                earlier.append(u)
        if not domains[v].any():
            return Conflict(problem.members[v][0], tuple(_reaching(problem, u, domains[u])
                                                         for u in dict.fromkeys(earlier)))
    return None


def _reaching(problem: ShardingProblem, u: int, domain: np.ndarray) -> tuple[str, tuple[str, ...]]:
    """Variable ``u``'s name and the output placements its candidates left in ``domain``
    give (all of a multi-output node's)."""
    placements = dict.fromkeys(", ".join(map(str, sig.outputs)) for sig, left in zip(problem.candidates[u], domain)
                               if left)
    return problem.members[u][0].name, tuple(placements)


def _smallest_footprint(problem: ShardingProblem) -> list[int]:
    """Every variable at its least-memory candidate (the cheapest among those)."""
    return [int(np.lexsort((u, m))[0]) for u, m in zip(problem.unary, problem.memory)]


def _module_regions(problem: ShardingProblem) -> list[tuple[str, list[int]]]:
    """(module path, its variables and their direct neighbours) for every non-root module
    that owns a parameter, deepest modules first. The halo lets a module's move re-place
    the tensors at its boundary."""
    by_module: dict[str, list[int]] = {}
    for v, group in enumerate(problem.members):
        origin = ORIGIN.get(group[0])
        if origin is None:
            continue
        parts = origin.module.split(".") if origin.module else []
        for depth in range(1, len(parts) + 1):
            by_module.setdefault(".".join(parts[:depth]), []).append(v)
    neighbours = [set() for _ in range(problem.num_vars)]
    for e in problem.edges:
        neighbours[e.src].add(e.dst)
        neighbours[e.dst].add(e.src)
    regions = []
    for module, region in by_module.items():
        if any(ROLE.get(problem.members[v][0]) == "param" for v in region):
            halo = set(region).union(*(neighbours[v] for v in region))
            regions.append((module, sorted(halo)))
    regions.sort(key=lambda r: (-r[0].count("."), r[0]))
    return regions


#: Largest elimination table for the whole-problem block (0 switches it off).
MAX_TABLE_WHOLE = MAX_TABLE


def _unconstrained(problem: ShardingProblem, memory_budget: float) -> bool:
    """Whether the memory budget cannot bind: every variable's largest footprint fits."""
    return sum(float(m.max()) for m in problem.memory) <= memory_budget


#: Most multipliers :func:`_lagrangian` tries once it has a plan within the budget.
LAGRANGE_STEPS = 12


def _relaxed(problem: ShardingProblem, price: float) -> ShardingProblem:
    """``problem`` with every candidate's cost raised by ``price`` seconds per byte it
    keeps resident (its Lagrangian relaxation at multiplier ``price``)."""
    return replace(problem, compute=[u + price * m for u, m in zip(problem.unary, problem.memory)],
                   sink=[np.zeros(len(u)) for u in problem.unary])


class _Relaxed(NamedTuple):
    """A relaxed search's plan: its ``cost`` (the objective of the problem with the budget),
    the bytes it keeps resident, the ``choice`` and the ``price`` it was searched at."""

    cost: float
    memory: float
    choice: list[int]
    price: float


def _lagrangian(problem: ShardingProblem, memory_budget: float, max_sweeps: int) -> tuple[list[int], dict] | None:
    """Plan ``problem`` under a ``memory_budget`` that can bind, by Lagrangian relaxation:
    memory priced at ``price`` seconds per byte and the budget dropped, each relaxed
    problem is an unconstrained search (exact reduction with every variable removable,
    then :func:`coordinate_descent`), whose result either fits the budget or not.

    - ``price`` 0 (the plan without a budget): kept if it fits;
    - else the price grows from the ratio of the problem's cost spread to its memory
      spread, 16-fold at a time, until a plan fits (none within 40 tries: None);
    - then the walk along the lower hull of (memory, cost): the next price is the one at
      which the last plan over the budget and the cheapest within it cost alike; a plan
      found there lies between them (it replaces the one on its side of the budget) or
      the hull has no point between (the walk ends), at most LAGRANGE_STEPS prices;
    - the cheapest plan within the budget is descended with the cheap moves (paths,
      single variables) under the budget, to spend the memory the relaxation left.

    The first relaxed search is the one without a budget; each later one starts from the
    plan of the one before (:func:`coordinate_descent`'s ``start``: no seeds, no axis
    permutations). A relaxed search is as quick as one without a budget, where block
    moves under a budget that binds are MILPs with a knapsack row, slow and far from the
    optimum (:func:`_block_optimum`): a 2-layer GPT on (2, 2) planned in 34-127 s with those
    and in 5-10 s this way, its objective 3-5% above the exact optimum where theirs ended
    up to 5.5x above it; a 4-layer GPT on (4,) ends at the exact optimum at two budgets of
    ``tests/test_sharding.py`` and 60% above it at a third (the block moves': 26%, 3.3x
    and 104% above); a 1-layer GPT on (2, 2, 2) for ``dgx-h100-ib`` in 138 s instead of
    187 s, 13% lower. Returns None where no price gives a plan within the budget without
    a forbidden redistribution."""
    solves, last, stats = 0, None, {}  # last: the previous relaxed search's core and result

    def at(price: float) -> _Relaxed:
        nonlocal solves, last
        solves += 1
        core, expand, _ = reduce_problem(_relaxed(problem, price))
        start = last[1] if last is not None and last[0] == core.nodes else None
        found, found_stats = coordinate_descent(core, max_sweeps=max_sweeps, start=start)
        stats.setdefault("first", found_stats)  # the search without a budget's
        last = core.nodes, found
        choice = expand(found)
        return _Relaxed(problem.objective(choice), problem.memory_of(choice), choice, price)

    def result(choice: list[int], price: float) -> tuple[list[int], dict]:
        return choice, {**stats["first"], "seed": "lagrange", "unbudgeted_seed": stats["first"]["seed"],
                        "lagrange_price": price, "lagrange_solves": solves}

    over = at(0.0)
    if over.memory <= memory_budget:
        return result(over.choice, over.price)
    memory_spread = sum(float(np.ptp(m)) for m in problem.memory)
    if memory_spread == 0:
        return None
    price, within = sum(float(np.ptp(u)) for u in problem.unary) / memory_spread, None
    for _ in range(40):
        plan = at(price)
        if plan.cost >= FORBIDDEN:
            return None
        if plan.memory <= memory_budget:
            within = plan
            break
        over, price = plan, price * 16
    if within is None:
        return None
    best = within
    for _ in range(LAGRANGE_STEPS):
        if over.memory <= within.memory:
            break
        price = (within.cost - over.cost) / (over.memory - within.memory)
        if not price > 0:
            break
        plan = at(price)
        if plan.cost + price * plan.memory >= (over.cost + price * over.memory) * (1 - 1e-12):
            break  # no hull point between the two
        if plan.memory <= memory_budget:
            within = plan
            best = min(best, plan, key=lambda p: p.cost)
        else:
            over = plan
    choice, _ = _descend(problem, best.choice, memory_budget, _path_blocks(problem), [], max_sweeps)
    return result(choice, best.price)


def _eliminable(problem: ShardingProblem, memory_budget: float) -> bool:
    """Whether variable elimination solves the whole problem exactly within
    MAX_TABLE_WHOLE: the memory budget cannot bind and an elimination order keeps the
    tables within it. Block coordinate descent with that single block is then exact."""
    return MAX_TABLE_WHOLE > 0 and _unconstrained(problem, memory_budget) and \
        elimination_order([len(u) for u in problem.unary], problem.edges, MAX_TABLE_WHOLE) is not None


def _regions(problem: ShardingProblem, memory_budget: float, eliminable: bool) -> list[tuple[str, list[int]]]:
    """The blocks of the block moves: the whole problem when the memory budget cannot bind
    and either variable elimination solves it (``eliminable``: :func:`_eliminable`) or it
    has at most MAX_BLOCK variables (its node-capped MILP); else the module regions."""
    small = problem.num_vars <= MAX_BLOCK and MAX_TABLE_WHOLE > 0
    everything = list(range(problem.num_vars))
    if eliminable or (small and _unconstrained(problem, memory_budget)):
        return [("<all>", everything)]
    return _module_regions(problem) + ([("<all axes>", everything)] if problem.mesh.ndim > 1 else [])


def _path_blocks(problem: ShardingProblem) -> list[list[int]]:
    """Cover the variables with paths (in graph order) whose members share edges only with
    their path neighbours, so each path can be optimised exactly by dynamic programming.
    A path grows from its end along the edge with the widest cost range."""
    neighbours = [set() for _ in range(problem.num_vars)]
    for e in problem.edges:
        if e.src != e.dst:
            neighbours[e.src].add(e.dst)
            neighbours[e.dst].add(e.src)
    spread = {}
    for e in problem.edges:
        key = (min(e.src, e.dst), max(e.src, e.dst))
        spread[key] = spread.get(key, 0.0) + float(e.cost.max() - e.cost.min())
    used = [False] * problem.num_vars
    paths = []
    for start in range(problem.num_vars):
        if used[start]:
            continue
        path, members = [start], {start}
        used[start] = True
        while True:
            end = path[-1]
            options = [w for w in sorted(neighbours[end]) if w > end and not used[w]
                       and not (neighbours[w] & members) - {end}]
            if not options:
                break
            nxt = max(options, key=lambda w: (spread[(end, w)], -w))
            path.append(nxt)
            members.add(nxt)
            used[nxt] = True
        paths.append(path)
    return paths


def _solve_path(search: _Search, path: list[int]) -> None:
    """Exact min-sum DP over ``path`` with every other variable fixed; applied if it
    lowers the objective and fits the memory budget."""
    p = search.problem
    unary, edges = fold_block(p, path, search.choice)
    pair = [np.zeros((len(p.candidates[a]), len(p.candidates[b]))) for a, b in zip(path, path[1:])]
    for e in edges:  # a path's internal edges join neighbouring positions only
        pair[min(e.src, e.dst)] += e.cost if e.src < e.dst else e.cost.T
    # forward pass: best[i][k] = cheapest prefix ending with candidate k at position i
    best, back = unary[0], []
    for i in range(1, len(path)):
        total = best[:, None] + pair[i - 1]
        back.append(np.argmin(total, axis=0))
        best = total[back[-1], np.arange(total.shape[1])] + unary[i]
    picks = [int(np.argmin(best))]
    for arg in reversed(back):
        picks.append(int(arg[picks[-1]]))
    picks.reverse()
    current = sum(float(unary[i][search.choice[v]]) for i, v in enumerate(path)) + sum(
        float(pair[i][search.choice[a], search.choice[b]]) for i, (a, b) in enumerate(zip(path, path[1:])))
    if float(best.min()) < current - 1e-12 * max(1.0, abs(current)):
        memory = search.memory + sum(p.memory[v][k] - p.memory[v][search.choice[v]]
                                     for v, k in zip(path, picks))
        if memory <= search.budget:
            for v, k in zip(path, picks):
                search.choice[v] = k
            search.memory = memory


def _descend(problem: ShardingProblem, choice: list[int], budget: float,
             paths: list[list[int]], regions, max_sweeps: int) -> tuple[list[int], int]:
    search = _Search(problem, budget, list(choice))
    cache: dict = {}
    sweeps = 0
    for sweeps in range(1, max_sweeps + 1):
        before = problem.objective(search.choice)
        for path in paths:
            _solve_path(search, path)
        for v in range(problem.num_vars):
            search.best_response(v)
        for name, region in regions:
            _solve_block(search, region, cache, milp=name == "<all>")
        if problem.objective(search.choice) >= before - 1e-12 * max(1.0, before):
            break
    return search.choice, sweeps


def coordinate_descent(problem: ShardingProblem, memory_budget: float = float("inf"),
                       max_sweeps: int = 20, group_moves: bool = True,
                       start: list[int] | None = None) -> tuple[list[int], dict]:
    """AutoDDL's coordinate descent (see the module docstring); returns (choice, stats).

    Every seed is descended with the cheap moves (paths, single variables); the best
    result is then descended again with block moves added (:func:`_regions`). ``start``
    (a choice: the plan of a search under prices that differ in a few edges) replaces the
    seeds and the axis permutations: a local repair, with block moves where
    ``group_moves``. Where the memory budget can bind, the search is
    :func:`_lagrangian`'s, unless that finds no plan within the budget."""
    if start is None and group_moves and not _unconstrained(problem, memory_budget):
        found = _lagrangian(problem, memory_budget, max_sweeps)
        if found is not None:
            return found
    paths = _path_blocks(problem)
    eliminable = group_moves and _eliminable(problem, memory_budget)
    regions = _regions(problem, memory_budget, eliminable) if group_moves else []
    # one block that variable elimination solves exactly: the block move reaches the
    # optimum from any start, so the seeds are compared as they start, not descended first
    exact = start is None and eliminable
    results = []
    seeds = {"start": lambda: list(start)} if start is not None else \
        {name: (lambda seed=seed: _initial(problem, seed, memory_budget)) for name, seed in SEEDS.items()}
    for name, initial in seeds.items():
        choice = initial() if exact else _descend(problem, initial(), memory_budget, paths, [], max_sweeps)[0]
        results.append((problem.memory_of(choice) > memory_budget, problem.objective(choice), name, choice))
    if all(over for over, *_ in results):
        # no uniform scheme fits: start from the smallest footprint (memory is separable,
        # and every move keeps the footprint within the budget from there on)
        choice, _ = _descend(problem, _smallest_footprint(problem), memory_budget, paths, [], max_sweeps)
        results.append((problem.memory_of(choice) > memory_budget, problem.objective(choice),
                        "smallest_footprint", choice))
    _, _, name, choice = min(results, key=lambda r: r[:2])
    choice, sweeps = _descend(problem, choice, memory_budget, paths, regions, max_sweeps)
    permuted = 0
    for order in _axis_permutations(problem.mesh) if start is None and not exact else ():
        permuted_choice = _permuted(problem, choice, order)
        if permuted_choice is None or problem.memory_of(permuted_choice) > memory_budget:
            continue
        other, _ = _descend(problem, permuted_choice, memory_budget, paths, [], max_sweeps)
        if not _lower(problem, other, choice, memory_budget):
            continue  # the cheap moves do not get below the incumbent: not worth the blocks
        other, _ = _descend(problem, other, memory_budget, paths, regions, max_sweeps)
        if _lower(problem, other, choice, memory_budget):
            choice, permuted = other, permuted + 1
    return choice, {"seed": name, "sweeps": sweeps, "paths": len(paths), "blocks": len(regions),
                    "whole_block": [r[0] for r in regions] == ["<all>"], "exact_block": exact,
                    "axis_permutations": permuted}


def _lower(problem: ShardingProblem, choice: list[int], incumbent: list[int], budget: float) -> bool:
    """Whether ``choice`` fits the budget and has a lower objective than ``incumbent``."""
    best = problem.objective(incumbent)
    return problem.memory_of(choice) <= budget and problem.objective(choice) < best - 1e-12 * best


def _axis_permutations(mesh: Mesh) -> list[tuple[int, ...]]:
    """The orders of mesh axes other than the identity that can change the objective: all
    permutations, except where every axis has the same size and link (then a permuted
    plan costs the same by symmetry; the inputs' seeds do not break it)."""
    if len(set(zip(mesh.shape, mesh.links))) <= 1:
        return []
    identity = tuple(range(mesh.ndim))
    return [p for p in itertools.permutations(identity) if p != identity]


def _permuted(problem: ShardingProblem, choice: list[int], order: tuple[int, ...]) -> list[int] | None:
    """``choice`` with every signature's per-axis SBPs taken in ``order`` (axis ``k`` gets
    what axis ``order[k]`` had); a variable whose permuted signature is no candidate (a
    split that does not divide on the new axis) keeps its own. None if nothing moves."""
    def permute(sbp):
        return None if sbp is None else NdSBP(tuple(sbp[j] for j in order))

    start, moved = list(choice), False
    for v, cands in enumerate(problem.candidates):
        sig = cands[choice[v]]
        want = (tuple(map(permute, sig.inputs)), tuple(map(permute, sig.outputs)))
        for k, c in enumerate(cands):
            if (c.inputs, c.outputs) == want:
                moved |= k != choice[v]
                start[v] = k
                break
    return start if moved else None


#: Largest block, in variables left after the exact reduction, that a block move hands
#: to the MILP (when variable elimination does not apply).
MAX_BLOCK = 150

#: Branch-and-bound nodes a block's MILP may explore (deterministic, unlike a time limit).
BLOCK_NODE_LIMIT = 2000


def _block_optimum(unary, memory, edges, room: float, milp: bool) -> list[int] | None:
    """Jointly optimal candidates of a folded block: exact reduction, then variable
    elimination when ``room`` cannot bind and the tables stay within MAX_TABLE, else (up
    to MAX_BLOCK variables, when ``room`` can bind or ``milp`` is set) a MILP capped at
    BLOCK_NODE_LIMIT nodes (its best find) and at no time: a time limit would make the
    plan depend on the machine's speed at the hour (on a 3-D mesh these MILPs take 25-40 s
    each on a quiet 2-core machine, and went past the 60 s default under load, changing
    the plan from run to run); None when neither applies."""
    keep, core_unary, core_edges, expand, fixed = reduce_costs(unary, memory, edges, room)
    if not keep:
        return expand([])
    if not np.isfinite(room):
        order = elimination_order([len(u) for u in core_unary], core_edges)
        if order is not None:
            return expand(solve_elimination(core_unary, core_edges, order[0]))
    if len(keep) > MAX_BLOCK or not (milp or np.isfinite(room)):
        return None
    try:
        core, _ = solve_milp(core_unary, [memory[v] for v in keep], core_edges, room - fixed,
                             time_limit=np.inf, node_limit=BLOCK_NODE_LIMIT)
    except ShardingError:
        return None
    return expand(core)


def _axis_subsets(ndim: int) -> list[tuple[int, ...]]:
    """The mesh-axis sets a block move may free: all axes, then ever smaller subsets
    (within a size, lexicographic)."""
    return [s for k in range(ndim, 0, -1) for s in itertools.combinations(range(ndim), k)]


def _solve_block(search: _Search, block: list[int], cache: dict, milp: bool = False) -> None:
    """Set the variables of ``block`` to their jointly optimal candidates with every other
    variable fixed. When that block problem is too large to solve exactly (elimination
    tables over MAX_TABLE, and no MILP: the memory room cannot bind and ``milp`` is not
    set), solve it restricted to the candidates that agree with the
    current choice on every mesh axis but a freed subset, for each subset in
    :func:`_axis_subsets` order that is not inside one already solved. Each solution is
    applied if it lowers the objective. Identical restricted problems (repeated layers
    under the same neighbours) are solved once, via ``cache``; the memory room is part of
    the key only when it can bind."""
    p = search.problem
    unary, edges = fold_block(p, block, search.choice)
    outside = search.memory - sum(p.memory[v][search.choice[v]] for v in block)
    memory = [p.memory[v] for v in block]
    room = search.budget - outside
    if sum(float(m.max()) for m in memory) <= room:
        room = float("inf")

    def cost(c):
        return sum(float(u[k]) for u, k in zip(unary, c)) + sum(
            float(e.cost[c[e.src], c[e.dst]]) for e in edges)

    solved: list[set[int]] = []
    for free in _axis_subsets(p.mesh.ndim):
        if any(set(free) <= s for s in solved):
            continue
        current = [search.choice[v] for v in block]
        if len(free) == p.mesh.ndim:  # every axis free: the whole block problem
            allowed = [np.arange(len(u)) for u in unary]
            sub_unary, sub_memory, sub_edges = unary, memory, edges
        else:
            allowed = [np.flatnonzero(keys == keys[k])
                       for keys, k in zip((search.rest_keys(v, free) for v in block), current)]
            sub_unary = [u[a] for u, a in zip(unary, allowed)]
            sub_memory = [m[a] for m, a in zip(memory, allowed)]
            sub_edges = [Edge(e.src, e.dst, e.cost[np.ix_(allowed[e.src], allowed[e.dst])], e.what)
                         for e in edges]
        key = hashlib.sha1(b"".join([u.tobytes() for u in sub_unary] + [m.tobytes() for m in sub_memory]
                                    + [f"{e.src},{e.dst}".encode() + e.cost.tobytes() for e in sub_edges]
                                    + [repr(room).encode()])).digest()
        if key not in cache:
            cache[key] = _block_optimum(sub_unary, sub_memory, sub_edges, room, milp)
        if cache[key] is None:
            continue
        solved.append(set(free))
        picks = [int(a[k]) for a, k in zip(allowed, cache[key])]
        if cost(picks) < cost(current) - 1e-12 * max(1.0, cost(current)):
            for v, k in zip(block, picks):
                search.choice[v] = k
            search.memory = outside + sum(p.memory[v][k] for v, k in zip(block, picks))
