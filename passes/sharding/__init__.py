"""Sharding propagation: choose every node's n-D SBP signature (AutoDDL).

``shard(gm, mesh)`` builds the :class:`ShardingProblem` (candidates from the rules,
costs from the cost models: :mod:`passes.sharding.problem`), reduces it exactly,
solves it and returns a :class:`~ddlc.plan.Plan` (:func:`make_plan`); it also records
each node's chosen signature (``ir.SHARDING``). :func:`search_mesh_shapes` runs it on
every mesh shape of a world size (:func:`mesh_shapes`) and keeps the best.

Solvers: ``solver="cd"`` (default), AutoDDL's coordinate descent
(:mod:`passes.sharding.descent`, whose docstring states the algorithm);
``solver="exact"``, the MILP of :mod:`passes.sharding.exact` over the same problem.
Where every plan coordinate descent reaches needs a forbidden redistribution (an S->P,
or with ``move_activations=False`` any move of an activation), descent starts again from
a plan without one that constraint propagation finds (:func:`~passes.sharding.descent.feasible_start`),
and where that finds none the MILP, held to :data:`FEASIBILITY_NODE_LIMIT`
branch-and-bound nodes, looks for one before ``shard`` refuses the step.
"""
from __future__ import annotations

import math

import time
from typing import Mapping, Sequence

from torch import fx

from ddlc.errors import OptionError, ShardingError
from ddlc.ir import ORIGIN, SHARDING, where
from ddlc.mesh import Mesh
from ddlc.plan import NodePlan, Plan
from ddlc.printing import format_bytes, op_name
from ddlc.sbp import NdSBP
from passes.rules import has_rule

from .descent import SEEDS, Conflict, NoPlanWithoutForbiddenMoves, coordinate_descent, feasible_start, first_conflict
from .exact import smallest_footprint, solve_exact, solve_milp
from .problem import (FORBIDDEN, PriceCache, ShardingProblem, build_problem, compute_seconds,
                      lone_scalar_axes, reduce_problem)

__all__ = ["shard", "replicate", "make_plan", "coordinate_descent", "search_mesh_shapes", "mesh_shapes", "SEEDS",
           "build_problem", "compute_seconds", "ShardingProblem", "solve_exact"]


#: How many forbidden redistributions beyond the first a refusal names.
MORE_EDGES = 8

#: Branch-and-bound nodes of the exact solver where coordinate descent found no plan
#: without a forbidden redistribution (a deterministic limit, unlike a time limit: every
#: run plans alike).
FEASIBILITY_NODE_LIMIT = 2000


def shard(gm: fx.GraphModule, mesh: Mesh, *, solver: str = "cd",
          memory_budget: float | None = None, fixed: Mapping[str, NdSBP] | None = None,
          time_limit: float = 60.0, move_activations: bool = True, bucket_traffic: bool = True) -> Plan:
    """Choose a signature for every node of ``gm`` on ``mesh``; annotate and return the plan.

    ``memory_budget`` (bytes per device) defaults to the profile's device memory;
    ``fixed`` pins graph inputs by placeholder name; ``move_activations=False`` forbids
    every collective but those of parameter traffic, outputs and scalars; with
    ``bucket_traffic=False`` parameter traffic pays the start-ups of all its collectives
    (:func:`~passes.sharding.problem.build_problem`).
    """
    if solver not in ("cd", "exact"):
        raise OptionError(f"unknown solver {solver!r}; use 'cd' or 'exact'")
    start = time.perf_counter()
    budget = mesh.profile.memory_capacity if memory_budget is None else memory_budget
    prices = PriceCache(mesh)  # shared with the rebuild below: most of its prices are the same
    problem = build_problem(gm, mesh, fixed, move_activations=move_activations, prices=prices,
                            bucket_traffic=bucket_traffic)
    need, dominant = problem.min_memory()
    if need > budget:
        _refuse_budget(budget, need, dominant)
    build_seconds = time.perf_counter() - start

    def solve(problem, start=None, method=solver):
        """(choice, stats) by ``method``; coordinate descent from ``start`` (a choice of an
        earlier problem of the same variables) instead of the seeds, where given."""
        core, expand, fixed_memory = reduce_problem(problem, budget)
        if method == "cd":
            warm = None if start is None else [start[problem.var_of[m[0]]] for m in core.members]
            core_choice, stats = coordinate_descent(core, budget - fixed_memory, start=warm,
                                                    group_moves=start is None)
        elif method == "exact":
            core_choice, stats = solve_exact(core, budget - fixed_memory, time_limit)
        elif method == "propagation":  # coordinate descent from a start without a forbidden move
            feasible = feasible_start(core)
            if feasible is None:
                raise ShardingError("constraint propagation found no plan without a forbidden move")
            core_choice, stats = coordinate_descent(core, budget - fixed_memory, start=feasible)
        else:  # the exact solver, held to a deterministic number of branch-and-bound nodes
            core_choice, stats = solve_milp(core.unary, core.memory, core.edges, budget - fixed_memory,
                                            time_limit, node_limit=FEASIBILITY_NODE_LIMIT)
        stats["core_variables"] = core.num_vars
        return expand(core_choice), stats

    choice, stats = solve(problem)
    # the loss's all-reduce was priced as riding in a gradient bucket; where the plan has
    # none on that axis, price its start-ups and repair the plan (coordinate descent's
    # path and single-variable moves from it; the exact solver starts afresh), keeping
    # the better plan
    lone: frozenset[int] = frozenset()
    while True:
        _annotate(problem, choice)
        found = lone | lone_scalar_axes(gm, mesh)
        if found == lone:
            break
        lone = found
        problem = build_problem(gm, mesh, fixed, lone_scalars=lone, move_activations=move_activations,
                                prices=prices, bucket_traffic=bucket_traffic)
        other, other_stats = solve(problem, start=choice)
        stats["lone_scalar_axes"] = sorted(lone)
        if problem.objective(other) < problem.objective(choice):
            choice, stats = other, {**other_stats, "lone_scalar_axes": sorted(lone)}
    conflict: Conflict | None = None  # where propagation proves the placements conflict
    if solver == "cd" and problem.objective(choice) >= FORBIDDEN:
        # every plan coordinate descent reached needs a forbidden redistribution; one that
        # needs none may still exist, reached only by changing many variables at once (a
        # BERT's data parallelism on (2, 2) with activations kept in place: the seeds split
        # its embeddings along the sequence where the pinned batch wants dim 0). Descend
        # again from a start propagation finds, else ask the node-capped MILP; the refusal
        # below stands only where neither finds one
        for method in ("propagation", "feasibility"):
            try:
                other, other_stats = solve(problem, method=method)
            except NoPlanWithoutForbiddenMoves:
                conflict = first_conflict(problem)
                break  # proved: the refusal below stands
            except ShardingError:
                continue
            if problem.objective(other) < FORBIDDEN:
                choice, stats = other, {**other_stats, "repaired_by": method}
                break
    if problem.memory_of(choice) > budget:
        # the search stayed above the budget: the smallest footprint any plan without a
        # forbidden redistribution can have decides whether one fits
        choice, smallest = smallest_footprint(problem)
        if smallest > budget:
            _refuse_budget(budget, smallest, dominant)
        stats["smallest_footprint_fallback"] = True
    stats.update(build_seconds=build_seconds, search_seconds=time.perf_counter() - start - build_seconds)
    if problem.objective(choice) >= FORBIDDEN and stats.get("optimal") is False:
        raise ShardingError(f"the exact solver stopped ({stats['status']}) before finding a "
                            f"solution without forbidden redistributions; raise time_limit")
    if problem.objective(choice) >= FORBIDDEN and not move_activations:
        edge, *others = [e for e in problem.edges if e.cost[choice[e.src], choice[e.dst]] >= FORBIDDEN]
        reader = problem.members[edge.dst][0]
        # where a move is needed is the solver's pick among plans that all need one (a
        # ResNet's moves its input before the first convolution, for the batch norms
        # after it): name every move of the plan found, not a cause
        more = f"; and {len(others)} more: " + ", ".join(e.what for e in others[:MORE_EDGES]) + \
            (", ..." if len(others) > MORE_EDGES else "") if others else ""
        unruled = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"
                          and n.all_input_nodes and not has_rule(n)})
        unruled = f"; operators without a sharding rule in ddlc yet, which every rank computes on " \
            f"whole tensors (their inputs gathered): {', '.join(unruled)}" if unruled else ""
        found = f"the least costly plan found moves {edge.what} (read by {op_name(reader)}){more}"
        if conflict is not None:  # name the first operator that cannot go on, not the plan's pick
            reader = conflict.node
            origin = ORIGIN.get(reader)
            module = f" in module {origin.module}" if origin is not None and origin.module else ""
            found = (f"{reader.name} ({op_name(reader)}{module}) is the first operator no "
                     f"signature of which takes what reaches it without a move ({conflict.describe()}); "
                     f"{found}")
        raise ShardingError("no plan runs this step without redistributing activations "
                            f"(move_activations=False) on mesh {mesh} with these placements: "
                            f"{found}{unruled}", where=where(reader))
    if problem.objective(choice) >= FORBIDDEN:
        raise ShardingError("every sharding found needs a forbidden redistribution (S->P); "
                            "the rules are missing a signature for some operator",
                            where=where(conflict.node) if conflict is not None else None)
    return make_plan(problem, choice, solver, stats)


def replicate(gm: fx.GraphModule, mesh: Mesh, *, memory_budget: float | None = None) -> Plan:
    """The plan that communicates nothing: every node of ``gm`` takes its signature whose
    every input and output is whole on every rank (``B`` on every mesh axis), so every
    rank runs the whole step. Annotates every node and returns the plan (solver
    "replicated"); a ``ShardingError`` where an operator has no such signature or the
    step does not fit ``memory_budget`` (default: the profile's device memory) whole."""
    whole = NdSBP.broadcast(mesh.ndim)
    problem = build_problem(gm, mesh, {n.name: whole for n in gm.graph.find_nodes(op="placeholder")})

    def replicated(signature) -> bool:
        return all(x is None or x == whole for x in (*signature.inputs, *signature.outputs))
    choice = []
    for v, candidates in enumerate(problem.candidates):
        k = next((k for k, c in enumerate(candidates) if replicated(c)), None)
        if k is None:
            node = problem.members[v][0]
            raise ShardingError(f"{op_name(node)} has no signature that keeps every tensor whole",
                                where=where(node))
        choice.append(k)
    budget = mesh.profile.memory_capacity if memory_budget is None else memory_budget
    if problem.memory_of(choice) > budget:
        raise ShardingError(f"the whole step does not fit the memory budget of {format_bytes(budget)} "
                            f"per device ({format_bytes(problem.memory_of(choice))})")
    return make_plan(problem, choice, "replicated", {})


def _refuse_budget(budget: float, smallest: float, dominant: Sequence[tuple[str, float]]):
    top = ", ".join(f"{name} ({format_bytes(b)})" for name, b in dominant[:5])
    asked, least = format_bytes(budget), format_bytes(smallest)
    if asked == least:  # both round alike ("269 KiB" and "269 KiB"): the bytes tell them apart
        asked, least = f"{asked} ({budget:.0f} bytes)", f"{least} ({smallest:.0f} bytes)"
    raise ShardingError(f"no sharding fits the memory budget of {asked} per device: "
                        f"the smallest possible footprint is {least} "
                        "(parameters x2 for gradients, optimizer state, inputs, saved activations); "
                        f"give a budget (memory_budget=, --memory) of at least {smallest:.0f} bytes. "
                        "The largest tensors even at "
                        f"their best split: {top}")


def mesh_shapes(world_size: int, max_ndim: int = 3) -> list[tuple[int, ...]]:
    """Every ordered factorization of ``world_size`` into 1 to ``max_ndim`` factors > 1
    (``(1,)`` for one device), shortest first, then lexicographic."""
    def split(n: int, parts: int):
        if parts == 1:
            yield (n,)
            return
        small = [f for f in range(2, math.isqrt(n) + 1) if n % f == 0]
        for f in sorted({*small, *(n // f for f in small)} - {n}):  # the divisors but 1 and n
            for rest in split(n // f, parts - 1):
                yield (f,) + rest
    if world_size == 1:
        return [(1,)]
    return [s for k in range(1, max_ndim + 1) for s in sorted(split(world_size, k))]


def search_mesh_shapes(gm: fx.GraphModule, world_size: int, *, profile="cpu-gloo",
                       shapes: Sequence[Sequence[int]] | None = None, max_ndim: int = 3,
                       **kwargs) -> tuple[Plan, list[tuple[tuple[int, ...], float | None, str]]]:
    """AutoDDL's outer loop: plan ``gm`` on every mesh shape of ``world_size`` devices
    (:func:`mesh_shapes`, or only ``shapes`` when the user fixes them) and keep the plan
    with the least modeled step time (ties: the earlier shape). Returns the best plan and,
    per shape, ``(shape, objective or None, note)``; ``kwargs`` go to :func:`shard`.
    ``fixed`` placements must have the right length for each shape tried."""
    candidates = [tuple(s) for s in shapes] if shapes is not None else mesh_shapes(world_size, max_ndim)
    best, report = None, []
    for shape in candidates:
        mesh = Mesh(shape, profile=profile)
        if mesh.size != world_size:
            raise ShardingError(f"mesh shape {shape} has {mesh.size} devices, not {world_size}")
        try:
            plan = shard(gm, mesh, **kwargs)
        except ShardingError as e:
            report.append((shape, None, str(e).splitlines()[0]))
            continue
        report.append((shape, plan.objective, plan.solver))
        if best is None or plan.objective < best.objective:
            best = plan
    if best is None:
        raise ShardingError(f"no mesh shape of {world_size} devices admits a plan: "
                            + "; ".join(f"{s}: {note}" for s, _, note in report))
    make_plan(best.problem, best.choice, best.solver, best.stats)  # re-annotate gm with the winner
    return best, report


def _annotate(problem: ShardingProblem, choice: Sequence[int]) -> None:
    """Record every node's chosen signature (``ir.SHARDING``)."""
    for node in problem.nodes:
        SHARDING.set(node, problem.candidates[problem.var_of[node]][choice[problem.var_of[node]]])


def make_plan(problem: ShardingProblem, choice: list[int], solver: str, stats: dict) -> Plan:
    """Turn a solved problem into a Plan and annotate every node's ``ir.SHARDING``."""
    incoming = [0.0] * problem.num_vars
    for e in problem.edges:
        incoming[e.dst] += float(e.cost[choice[e.src], choice[e.dst]])
    nodes = []
    for node in problem.nodes:
        v = problem.var_of[node]
        k = choice[v]
        cand = problem.candidates[v][k]
        SHARDING.set(node, cand)
        first = problem.members[v][0] is node
        origin = ORIGIN.get(node)
        nodes.append(NodePlan(
            node.name, op_name(node) if node.op == "call_function" else node.op,
            origin.module if origin else "", origin.phase if origin else "",
            tuple("-" if x is None else str(x) for x in cand.inputs),
            tuple("-" if x is None else str(x) for x in cand.outputs),
            float(problem.compute[v][k]) if first else 0.0,
            float(incoming[v] + problem.sink[v][k]) if first else 0.0,
            float(problem.memory[v][k]) if first else 0.0))
    mesh = problem.mesh
    return Plan(mesh.shape, mesh.axis_names, mesh.profile.name, solver,
                float(problem.objective(choice)), nodes, dict(stats), problem, list(choice))
