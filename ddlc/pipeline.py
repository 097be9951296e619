"""The compiler pipeline: every pass, in order, in one place.

::

    planning  (rank 0 traces and plans, see ddlc.runtime)
      trace          model + inputs + loss + optimizer -> one functional aten graph (ddlc.tracing),
                     each parameter's optimizer update one ddlc::optimizer_update node
                     (ddlc.fused_update)
      canonicalize   mean reductions -> sum / count, so batch splits give partial sums
      recompute      backward reads recomputed copies of activation-checkpointed calls'
                     values (torch.utils.checkpoint), as eager autograd recomputes them
      shared_reads   an alias between an activation and its several readers, whose placement
                     the search chooses: one redistribution they share, priced once
      shard          every node's SBP signature (AutoDDL): ir.SHARDING on every node
      decouple       gradient all-reduce -> reduce-scatter + update on the shard + all-gather
      (choose_plan)  where nothing is pinned: data parallelism instead, if its lowered
                     program's modeled step is shorter than the searched plan's
    lowering  (every rank, for its own mesh coordinate; rank 0 first, whose searched choices
               for fuse, partition and schedule the others take, see ddlc.runtime)
      collectives    boxing collectives on every edge whose SBP changes (ir.COLLECTIVE);
                     then the aliases of shared_reads go
      localize       global -> per-rank shapes and arguments (ir.GLOBAL_VAL keeps the global)
      random         random ops draw their global shape from the program's generator and
                     keep this rank's piece (ddlc.rng: ranks agree, single-device numbers)
      fuse           bucket small collectives (cap chosen by the program timeline)
      partition      split large collectives (piece size chosen by the program timeline)
      schedule       issue early, wait late, updates inside backward, chosen per group
                     where the program is small enough (else the order the searches above
                     scheduled for the chosen program, where they ran); then the static
                     check that every collective is read only through its wait
      expand_updates every optimizer update node -> the aten operators it runs
      views          view copies run as views (strided tensors made contiguous only for
                     the readers that need it)
      inplace        the optimizer update writes into its inputs and temporaries where
                     nothing reads them later (eager backend)
    retarget  (where the plan splits every tensor evenly, instead of lowering on every rank)
      one rank's program made another coordinate's: the arguments that depend on the mesh
      coordinate (ir.RANK_ARG) recomputed (passes/retarget.py; see ddlc.runtime)

Each pass runs through :func:`run_pass`, which times it and logs one line under the
``ddlc.pipeline`` logger. This is the only module of ``ddlc`` that imports ``passes``.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import fx, nn

from cost_models.boxing import boxing_cost
from cost_models.collectives import axis_time
from cost_models.compute import op_time
from cost_models.program import NodeCosts, program_makespan, program_timeline
from cost_models.timeline import TimelineResult
from passes.canonicalize import canonicalize
from passes.collectives import insert_collectives, output_targets
from passes.decouple import decouple
from passes.expand_updates import expand_updates
from passes.fuse import adopt, fuse, fuse_search
from passes.inplace import update_in_place
from passes.localize import localize
from passes.partition import partition, partition_search
from passes.random import draw_globally
from passes.recompute import recompute_checkpointed
from passes.retarget import for_coordinate
from passes.schedule import check_waits, follow, schedule, searches_updates
from passes.shared_reads import insert_shared_reads, remove_shared_reads
from passes.sharding import mesh_shapes, replicate, shard
from passes.views import views_as_views
from passes.waits import wait_at_once

from .errors import MeshError, SBPError, ShardingError, UnsupportedInputError
from .ir import BUCKET_CAP, PIECE_BYTES, SHARDING, STEP, leaves, map_leaves, micro_batch_key, name_alike
from .mesh import Mesh
from .options import CompileOptions
from .plan import Plan
from .sbp import NdSBP, S, as_ndsbp, divides
from .tracing import trace

__all__ = ["PLANNING", "LOWERING", "run_pass", "collections_deferred", "trace_step",
           "resolve_placements", "plan", "choose_plan", "ChosenPlan", "Candidate", "NoCandidate",
           "data_parallel_reference", "plan_pinned", "named_alike_copy",
           "data_parallel_placements", "plan_replicated", "unsharded_compute", "lower", "LoweringChoices", "splits_evenly", "retarget", "mesh_shapes",
           "wait_at_once"]

log = logging.getLogger("ddlc.pipeline")

#: The passes, in the order they run.
PLANNING = ("trace", "canonicalize", "recompute", "shared_reads", "shard", "decouple")
LOWERING = ("collectives", "localize", "random", "fuse", "partition", "schedule", "views", "inplace")

#: How far the searched plan's lowered program may exceed its objective (beyond the one
#: all-reduce start-up the objective leaves out by design) before :func:`choose_plan` also
#: weighs the plan searched with parameter traffic's start-ups priced
#: (:func:`plan_startups_priced`): a program that pays start-ups the objective did not see.
UNPRICED_SLACK = 0.05


def run_pass(name: str, fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, timed, with one INFO line: the pass, its milliseconds and
    the size of the graph it returns (or its first argument)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    graph = result if isinstance(result, fx.GraphModule) else next(
        (a for a in args if isinstance(a, fx.GraphModule)), None)
    size = f"{len(graph.graph.nodes)} nodes" if graph is not None else ""
    log.info("%-13s %8.1f ms  %s", name, (time.perf_counter() - start) * 1e3, size)
    return result


@contextlib.contextmanager
def collections_deferred():
    """Within, Python's cyclic garbage collector does not run (as it was on entry after).
    Compiling builds millions of small objects that live on (nodes, their meta, fake
    values, a search's trial graphs), and each full collection walks all of them: on the
    GPT-2-small-shaped model on 2x4, 13 of them took 1.9 s of a 12.5 s compile. Deferred,
    the garbage of the compile (trial graphs, mostly: about a sixth more peak memory
    there) waits for the first collection after it. Reference counting frees everything
    else as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# -- planning ------------------------------------------------------------------------------

def trace_step(model: nn.Module, example_inputs, loss_fn, optimizer,
               options: CompileOptions) -> fx.GraphModule:
    """trace, canonicalize, recompute, shared_reads: the step graph at global shapes, mean
    losses as sum / count, checkpointed activations recomputed in backward, an alias where
    several operators read one activation (the search prices one redistribution for them)."""
    gm = run_pass("trace", trace, model, example_inputs, loss_fn, optimizer,
                  num_targets=options.num_targets, clip_grad_norm=options.clip_grad_norm,
                  clip_grad_value=options.clip_grad_value, micro_batches=options.micro_batches)
    gm = run_pass("canonicalize", canonicalize, gm)
    gm = run_pass("recompute", recompute_checkpointed, gm)
    return run_pass("shared_reads", insert_shared_reads, gm)


def resolve_placements(gm: fx.GraphModule, placements: Mapping[str, object],
                       ndim: int) -> dict[str, NdSBP]:
    """Map user placements keyed by parameter name or ``input<i>`` (a batch key: with
    micro-batches, every micro-batch's input) to placeholder names."""
    step = STEP(gm)
    by_key = {i.key: [i.name] for i in step.inputs}
    by_key.update({k: [step.input_name("input", micro_batch_key(k, i, step.micro_batches))
                       for i in range(step.micro_batches)] for k in step.batch_keys()})
    names = {name for named in by_key.values() for name in named}
    fixed = {}
    for key, sbp in placements.items():
        if key not in by_key and key not in names:
            raise UnsupportedInputError(
                f"placement given for {key!r}, which is neither a parameter nor a batch input (the "
                f"batch inputs are {', '.join(step.batch_keys())}; parameters go by the names "
                "model.named_parameters() gives, so a tied weight, such as an output embedding "
                "sharing the input embedding's, goes by the first module's name)")
        sbp = as_ndsbp(sbp)
        if len(sbp) != ndim:
            raise MeshError(f"placement {sbp} of {key!r} has {len(sbp)} axes; the mesh has {ndim}")
        if any(x.is_partial for x in sbp):
            raise SBPError(f"placement {sbp} of {key!r} is a partial sum (P), which cannot hold "
                           "user data: every rank holds the full value and the program would "
                           "add them up; pin it B (replicated) or S(d) (split along dim d)")
        for name in by_key.get(key, [key]):
            shape = tuple(gm.graph.find_nodes(op="placeholder", target=name)[0].meta["val"].shape)
            missing = [x.dim for x in sbp if x.is_split and x.dim >= len(shape)]
            if missing:
                raise SBPError(f"placement {sbp} of {key!r} splits dim {missing[0]} of a tensor of shape "
                               f"{shape}, which has {len(shape)} dim(s)")
            fixed[name] = sbp
    return fixed


def plan(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions,
         fixed: Mapping[str, NdSBP], bucket_traffic: bool = True) -> Plan:
    """shard, decouple: annotate every node of ``gm`` with its signature; return the plan.
    ``bucket_traffic=False``: the search prices parameter traffic with every collective's
    start-ups (:func:`passes.sharding.shard`)."""
    result = run_pass("shard", shard, gm, mesh, solver=options.solver,
                      memory_budget=options.memory_budget, fixed=fixed,
                      move_activations=options.move_activations, bucket_traffic=bucket_traffic)
    # invariant: every node but the output carries ir.SHARDING
    if options.decouple:
        decoupled = run_pass("decouple", decouple, gm, mesh, options.ag_placement, frozenset(fixed),
                             always=options.decouple == "always")
        result.stats["decoupled"] = len(decoupled)
    return result


class ChosenPlan(NamedTuple):
    """What :func:`choose_plan` returns: the ``plan``; where it lowered the candidates, the
    ``choices`` the kept plan's program for mesh coordinate 0 was lowered with (else None)
    and that ``program`` (None where it was lowered elsewhere: ``data_parallel``), with its
    modeled ``timeline`` where :func:`choose_plan` was asked for it."""

    plan: Plan
    choices: LoweringChoices | None = None
    program: fx.GraphModule | None = None
    timeline: TimelineResult | None = None


class Candidate(NamedTuple):
    """A plan with pinned inputs (data parallelism, replication) as :func:`choose_plan`
    weighs it: the ``plan``, its
    ``decisions`` (node name -> ``ir.SHARDING``), the modeled seconds of its program for
    mesh coordinate 0 (``step``), the ``choices`` that program was lowered with and the
    program of the coordinate it was made for (:func:`plan_pinned`; None where it is
    not there)."""

    plan: Plan
    decisions: dict
    step: float
    choices: LoweringChoices
    program: fx.GraphModule | None = None

    def to_send(self) -> "Candidate":
        """This candidate as another process takes it: no program, no solver state."""
        return self._replace(plan=self.plan.without_solver(), program=None)


class NoCandidate(NamedTuple):
    """Why a plan with pinned inputs could not be planned for comparison (e.g. over the
    memory budget): :func:`plan_pinned`'s answer instead of a :class:`Candidate`."""

    reason: str


def choose_plan(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions,
                fixed: Mapping[str, NdSBP], groups: Sequence[str] | None = None,
                data_parallel: Callable[[], Candidate | NoCandidate] | None = None,
                timeline: bool = False) -> ChosenPlan:
    """:func:`plan`, checked against data parallelism, the plan most users write by hand,
    and against replication, where the model is so small that running it whole on every
    rank may beat any plan that communicates.

    The search minimises an additive objective (per node and per edge); the program's
    timeline adds what that leaves out: buckets sharing start-ups, overlap, the order. So
    where nothing is pinned (:func:`_weighs_candidates`), the searched plan is lowered for
    mesh coordinate 0 on a copy and compared with the candidates (:func:`plan_pinned`,
    :func:`plan_replicated`): data parallelism where :func:`data_parallel_reference`
    gives pins and the search did not choose it itself (or ``data_parallel()``'s
    candidate where another process made it meanwhile: ``ddlc.runtime``'s rank 1), and
    replication (:func:`plan_replicated`) where its compute alone, unsharded
    (:func:`unsharded_compute`), is modeled below the searched plan's step: the lowered
    program's, or where the search chose data parallelism and nothing else is lowered
    yet, the plan's objective plus one all-reduce start-up (the objective prices gradient
    traffic as if bucketed, without one). Where the searched program's step exceeds its
    objective by more than that start-up and :data:`UNPRICED_SLACK` of it (it pays
    start-ups the objective did not see: bucketing shares a start-up only among
    collectives of one kind, axis and time), the plan searched with parameter traffic's
    start-ups all priced is weighed too (:func:`plan_startups_priced`), the other bound of
    what bucketing shares. ``gm`` keeps the plan whose program has the shortest modeled
    step (:func:`cost_models.program.program_makespan`; ties: the searched plan, then data
    parallelism, then replication; a candidate that cannot be made, e.g. over the memory
    budget, is left out): adopting a candidate sets its decisions on ``gm``. The kept
    plan's choices come with it (:func:`lower` takes them instead of searching again), and
    its program where this process lowered it (``groups`` names the program's process
    groups, default ``axis0``, ``axis1``, ...), with the searched program's
    :func:`cost_models.program.program_timeline` where ``timeline`` is set (``ddlc plan``
    reports it: worked out before waiting for ``data_parallel()``, not after). ``stats`` record the steps compared
    (``searched_step``, ``data_parallel_step``, ``replicated_step``,
    ``startups_priced_step``), which won (``chosen_over_search``: data parallelism;
    ``replicated_chosen``; ``startups_priced_chosen``) and why data
    parallelism was not compared (``data_parallel_none``).
    Deterministic: rank 0 runs it and broadcasts the decisions (``ddlc.runtime``)."""
    reference = data_parallel_reference(gm, mesh, options, fixed)
    searched = plan(gm, mesh, options, fixed)
    if not _weighs_candidates(mesh, options, fixed):
        return ChosenPlan(searched)
    searched_data_parallel = reference is not None and all(
        SHARDING(n).outputs[0] == reference[n.name]
        for n in gm.graph.find_nodes(op="placeholder") if n.name in reference)
    # replication itself: every tensor whole everywhere (whole inputs alone are not: the
    # search may split the batch inside the step and communicate)
    whole = NdSBP.broadcast(mesh.ndim)
    searched_replicated = all(sbp is None or sbp == whole for n in gm.graph.nodes if SHARDING.has(n)
                              for sbp in (*SHARDING(n).inputs, *SHARDING(n).outputs))
    compute = unsharded_compute(gm, mesh) if options.batch == "global" and not searched_replicated \
        else math.inf
    if searched_data_parallel and compute >= searched.objective + _one_startup(mesh):
        return ChosenPlan(searched)
    mine, *my_program = _lowered_step(named_alike_copy(gm), mesh, options, groups, timeline=timeline)
    stats: dict[str, Any] = {"searched_step": mine}
    best, kept = mine, None
    known = [decisions_of(gm)]  # the plans weighed
    if not searched_data_parallel and reference is not None:
        candidate = data_parallel() if data_parallel is not None else \
            plan_pinned(gm, mesh, options, reference, groups)
        if isinstance(candidate, NoCandidate):
            stats["data_parallel_none"] = candidate.reason
        else:
            known.append(candidate.decisions)
            stats["data_parallel_step"] = candidate.step
            if candidate.step < best:
                best, kept = candidate.step, (candidate, "chosen_over_search")
    elif reference is None:
        stats["data_parallel_none"] = f"no batch of the example inputs has {mesh.size} rows or more to split " \
                                      f"over the {mesh.size} devices"
    if compute < best:
        candidate = plan_replicated(gm, mesh, options, groups)
        if isinstance(candidate, Candidate):
            known.append(candidate.decisions)
            stats["replicated_step"] = candidate.step
            if candidate.step < best:
                best, kept = candidate.step, (candidate, "replicated_chosen")
    if mine > searched.objective * (1 + UNPRICED_SLACK) + _one_startup(mesh):
        candidate = plan_startups_priced(gm, mesh, options, groups, known)
        if isinstance(candidate, Candidate):
            stats["startups_priced_step"] = candidate.step
            if candidate.step < best:
                best, kept = candidate.step, (candidate, "startups_priced_chosen")
    log.info("modeled step of the searched plan %.3f ms%s", mine * 1e3, "".join(
        f", {name.removesuffix('_step').replace('_', ' ')} {stats[name] * 1e3:.3f} ms"
        for name in ("data_parallel_step", "replicated_step", "startups_priced_step") if name in stats))
    if kept is None:
        searched.stats.update(stats)
        return ChosenPlan(searched, *my_program)
    candidate, flag = kept
    for node in gm.graph.nodes:
        if node.name in candidate.decisions:
            SHARDING.set(node, candidate.decisions[node.name])
    candidate.plan.stats.update(stats, **{flag: True})
    return ChosenPlan(candidate.plan, candidate.choices, candidate.program)


def _weighs_candidates(mesh: Mesh, options: CompileOptions, fixed: Mapping[str, NdSBP]) -> bool:
    """Whether :func:`choose_plan` weighs the searched plan against data parallelism and
    replication: where nothing is pinned (``fixed`` empty), activations may move and the
    mesh has more than one device."""
    return not fixed and options.move_activations and mesh.size > 1


def data_parallel_reference(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions,
                            fixed: Mapping[str, NdSBP]) -> dict[str, NdSBP] | None:
    """The pins :func:`choose_plan` compares the searched plan with: the
    :func:`data_parallel_placements`, where it weighs candidates at all
    (:func:`_weighs_candidates`); else None (and None where no batch splits over every
    device: replication is still weighed). The same on every rank."""
    if not _weighs_candidates(mesh, options, fixed):
        return None
    return data_parallel_placements(gm, mesh)


def plan_pinned(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions,
                reference: Mapping[str, NdSBP], groups: Sequence[str] | None = None,
                coord: Sequence[int] | None = None, on_copy: bool = True) -> Candidate | NoCandidate:
    """The :class:`Candidate` of the plan with the pins ``reference`` (activations stay
    where the pins put them), planned and lowered on a copy of ``gm`` (on ``gm`` itself
    where not ``on_copy``: a forked process's own); a
    :class:`NoCandidate` with the reason where it cannot be planned (a ``ShardingError``,
    e.g. over the memory budget). Its program is
    lowered for mesh coordinate ``coord`` (default 0) where the plan splits every tensor
    evenly (then every rank's program models the same step and searches to the same
    choices), else for coordinate 0 and left out of the candidate unless that is
    ``coord``."""
    return _candidate(gm, mesh, options, groups, coord, lambda planned: plan(
        planned, mesh, replace(options, move_activations=False), reference), on_copy)


def plan_startups_priced(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions,
                         groups: Sequence[str] | None = None,
                         known: Sequence[dict] = ()) -> Candidate | NoCandidate:
    """The :class:`Candidate` of the plan searched with parameter traffic priced with the
    start-ups of all its collectives (``bucket_traffic=False``), as :func:`plan_pinned`
    makes its: the other bound of what bucketing shares, where the searched plan's program
    pays start-ups its objective left out (:func:`choose_plan`). Not lowered where it is
    one of the ``known`` plans."""
    return _candidate(gm, mesh, options, groups, None,
                      lambda planned: plan(planned, mesh, options, {}, bucket_traffic=False), known=known)


def plan_replicated(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions,
                    groups: Sequence[str] | None = None) -> Candidate | NoCandidate:
    """The :class:`Candidate` of replication (``passes.sharding.replicate``: every rank
    runs the whole step, nothing is communicated), as :func:`plan_pinned` makes its."""
    return _candidate(gm, mesh, options, groups, None, lambda planned: run_pass(
        "shard", replicate, planned, mesh, memory_budget=options.memory_budget))


def _candidate(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions, groups: Sequence[str] | None,
               coord: Sequence[int] | None, planner: Callable[[fx.GraphModule], Plan],
               on_copy: bool = True, known: Sequence[dict] = ()) -> Candidate | NoCandidate:
    """``planner`` run on a copy of ``gm`` (``gm`` itself where not ``on_copy``), and that
    lowered (see :func:`plan_pinned`); not lowered where its decisions are one of the
    ``known`` ones (plans weighed already: a :class:`NoCandidate` says so)."""
    # planning annotates every node afresh: as if unplanned
    planned = named_alike_copy(gm) if on_copy else gm
    try:
        result = planner(planned)
    except ShardingError as e:
        log.info("candidate plan: none (%s)", str(e).splitlines()[0])
        return NoCandidate(str(e).splitlines()[0])
    decisions = decisions_of(planned)
    if decisions in known:
        return NoCandidate("the same plan as one weighed already")
    wanted = tuple(coord) if coord is not None else (0,) * mesh.ndim
    lowered_for = wanted if splits_evenly(planned, mesh) else (0,) * mesh.ndim
    step, choices, program, _ = _lowered_step(planned, mesh, options, groups, lowered_for)
    return Candidate(result, decisions, step, choices, program if lowered_for == wanted else None)


def decisions_of(gm: fx.GraphModule) -> dict:
    """The plan annotated on ``gm``: node name -> ``ir.SHARDING``."""
    return {n.name: SHARDING(n) for n in gm.graph.nodes if SHARDING.has(n)}


def named_alike_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``copy.deepcopy(gm)`` that names new nodes as ``gm`` would (:func:`ddlc.ir.name_alike`).
    Lowering's choices name nodes (their order), and every rank lowers a graph that keeps
    the namespace of the traced one (``ddlc.portable`` ships it)."""
    new = copy.deepcopy(gm)
    name_alike(new.graph, gm.graph)
    return new


def unsharded_compute(gm: fx.GraphModule, mesh: Mesh) -> float:
    """Roofline seconds of ``gm``'s operators at their global shapes on ``mesh``'s profile
    (alone on its cores, whatever its contention): less than the replicated plan's modeled
    step, which runs them all on every rank and adds the per-operator costs."""
    profile = replace(mesh.profile, compute="roofline", contention=None)
    total = 0.0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            args, kwargs = map_leaves(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a,
                                      (node.args, node.kwargs))
            total += op_time(node.target, args, kwargs, node.meta.get("val"), profile)
    return total


def _one_startup(mesh: Mesh) -> float:
    """The longest start-up of an all-reduce over one of ``mesh``'s axes."""
    return max(axis_time("all_reduce", 0, mesh, axis) for axis in range(mesh.ndim))


def data_parallel_placements(gm: fx.GraphModule, mesh: Mesh) -> dict[str, NdSBP] | None:
    """Data parallelism as pins by placeholder name: every batch input (an ``input`` whose
    first dimension is the batch, the first dimension of the first batch tensor) split
    along dim 0 over every mesh axis, every parameter replicated. None when the step has
    no batch input or its batch is smaller than the mesh."""
    step = STEP(gm)
    values = {n.name: n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")}
    tensors = [(i.name, values[i.name]) for i in step.inputs if i.role == "input"
               and isinstance(values[i.name], torch.Tensor) and values[i.name].dim() > 0]
    if not tensors or tensors[0][1].shape[0] < mesh.size:
        return None
    batch = tensors[0][1].shape[0]
    pins = {name: NdSBP((S(0),) * mesh.ndim) for name, v in tensors if v.shape[0] == batch}
    pins.update({i.name: NdSBP.broadcast(mesh.ndim) for i in step.inputs if i.role == "param"})
    return pins


def _lowered_step(program: fx.GraphModule, mesh: Mesh, options: CompileOptions,
                  groups: Sequence[str] | None, coord: Sequence[int] | None = None,
                  timeline: bool = False) -> tuple[float, "LoweringChoices", fx.GraphModule, TimelineResult | None]:
    """Lower the planned ``program`` for mesh coordinate ``coord`` (default 0) in place
    (process groups ``groups``, default ``axis0``, ``axis1``, ...); return its modeled
    seconds, the choices it was lowered with, it, and its modeled timeline where
    ``timeline`` is set (the same makespan, by the same arithmetic), else None."""
    groups = groups if groups is not None else [f"axis{k}" for k in range(mesh.ndim)]
    choices = lower(program, mesh, coord if coord is not None else (0,) * mesh.ndim, groups, options)
    if timeline:
        result = program_timeline(program, mesh.profile)
        return result.makespan, choices, program, result
    return program_makespan(program, mesh.profile), choices, program, None


# -- lowering ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoweringChoices:
    """What lowering chose for one rank's program: the bucket cap, the piece size and the
    node order. Where local shapes differ by rank, every rank adopts mesh coordinate 0's
    (its pieces are the largest), so that all ranks issue the same collectives."""

    bucket_cap: float
    piece_bytes: float
    order: tuple[str, ...] | None


def splits_evenly(gm: fx.GraphModule, mesh: Mesh) -> bool:
    """Whether every planned tensor splits into equal pieces (then every rank's local
    shapes, modeled timelines and lowering choices are the same, and one rank's program
    serves every rank: :func:`retarget`): each node's outputs as it makes them, its tensor
    inputs as it reads them (a piece cut for a reader, ``local_chunk``, may be uneven where
    its producer's placement is not), the graph's outputs as the step returns them, and
    every placement a redistribution passes through on its way (the cheapest route of
    :func:`cost_models.boxing.boxing_cost`, which ``insert_collectives`` runs: a 5-element
    gradient summed from ``(P, P)`` to ``(B, B)`` on (2, 2) is reduce-scattered into 3 and
    2 elements on axis 0 first)."""
    def even(value, placement) -> bool:
        return not isinstance(value, torch.Tensor) or placement is None or \
            divides(tuple(value.shape), placement, mesh.shape)

    def read_evenly(producer: fx.Node, placement) -> bool:
        """``producer``'s tensor redistributed to ``placement``, every piece on the way equal."""
        value, made = producer.meta["val"], SHARDING.get(producer)
        if not even(value, placement):
            return False
        if made is None or len(made.outputs) != 1 or made.output == placement:
            return True
        route = boxing_cost(tuple(value.shape), value.element_size(), made.output, placement, mesh)
        return all(even(value, step.after) for step in route.steps)

    for node in gm.graph.nodes:
        sharding = SHARDING.get(node)
        if sharding is None:
            continue
        inputs = [a for a in leaves((node.args, node.kwargs))
                  if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        if not all(even(v, x) for v, x in zip(leaves(node.meta.get("val")), sharding.outputs)) or \
                not all(read_evenly(a, x) for a, x in zip(inputs, sharding.inputs)):
            return False
    returned = leaves(gm.graph.output_node().args[0])
    return all(read_evenly(a, x) for a, x in zip(returned, output_targets(gm, mesh.ndim))
               if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor))


def retarget(program: fx.GraphModule, mesh: Mesh, coord: Sequence[int]) -> fx.GraphModule:
    """A program lowered for some mesh coordinate of a plan that :func:`splits_evenly`,
    made mesh coordinate ``coord``'s in place (``passes.retarget.for_coordinate``): the
    program :func:`lower` makes for ``coord`` with the same choices, without lowering."""
    return run_pass("retarget", for_coordinate, program, mesh, coord)


def lower(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int], groups: Sequence[str],
          options: CompileOptions,
          choices: LoweringChoices | Callable[[], LoweringChoices] | None = None) -> LoweringChoices:
    """collectives, localize, random, fuse, partition, schedule, expand_updates, views, inplace:
    the program of the rank at mesh coordinate ``coord`` whose per-axis process groups are
    named ``groups``, in place; returns the choices it was lowered with. Needs no process
    group, so tests can lower every rank in one process.

    ``choices``: mesh coordinate 0's, where the caller has them, or a function that returns
    them, called once this rank's program is local (``ddlc.compile`` waits there for rank
    0's broadcast, so the passes before overlap rank 0's search); the searches for them are
    then skipped. Without them, a rank whose local shapes differ from coordinate 0's finds
    them by lowering a copy of the graph for coordinate 0 first (its pieces are the
    largest, so every rank issues the same collectives)."""
    uneven = not splits_evenly(gm, mesh)
    if choices is None and any(coord) and uneven:
        choices = _lower_passes(copy.deepcopy(gm), mesh, (0,) * mesh.ndim, groups, options, None)
    if uneven:
        # a copied graph names new nodes afresh (names of erased nodes are free again), so
        # every rank lowers a copy: all programs then name their nodes alike, as the
        # node order in ``choices`` needs
        gm.graph = copy.deepcopy(gm.graph)
    return _lower_passes(gm, mesh, coord, groups, options, choices)


def _lower_passes(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int], groups: Sequence[str],
                  options: CompileOptions,
                  choices: LoweringChoices | Callable[[], LoweringChoices] | None) -> LoweringChoices:
    """The lowering passes on ``gm`` (see :func:`lower`). Every pass ends with
    ``gm.recompile()``; a traced step is a lazy graph module, whose code is generated once,
    when the program first runs."""
    run_pass("collectives", insert_collectives, gm, mesh, groups, coord)
    remove_shared_reads(gm)
    run_pass("localize", localize, gm, mesh, coord)
    run_pass("random", draw_globally, gm, mesh, coord)
    # from here on, shapes are local and every collective carries ir.COLLECTIVE
    if callable(choices):
        choices = choices()

    def order(graph: fx.GraphModule, costs: NodeCosts | None = None, search: bool = False) -> fx.GraphModule:
        return schedule(graph, options.max_inflight_bytes, options.max_live_bytes, mesh.profile,
                        options.updates_for_schedule, search, costs)

    scheduler = order if options.schedule else None
    searched = None  # what the last search timed: the program as it stands, scheduled
    cap = _bucket_cap(options.fuse) if choices is None else choices.bucket_cap
    if cap == "auto":
        searched = run_pass("fuse", fuse_search, gm, mesh, scheduler)
        cap = BUCKET_CAP.set(gm, searched.option)
    elif cap:
        run_pass("fuse", fuse, gm, mesh, cap)
    size = _bucket_cap(options.partition, none=math.inf) if choices is None else choices.piece_bytes
    if size == "auto":
        searched = run_pass("partition", partition_search, gm, mesh, scheduler, searched)
        size = PIECE_BYTES.set(gm, searched.option)
    elif size != math.inf:
        run_pass("partition", partition, gm, mesh, size)
        searched = None
    # the final order alone chooses per group which updates run inside backward
    search = scheduler is not None and options.updates_for_schedule == "auto" and searches_updates(gm)
    if choices is not None and choices.order is not None:
        run_pass("schedule", follow, gm, list(choices.order))
    elif searched is not None and searched.order is not None and not search:
        # the search scheduled this very program already: the scheduler would order it alike
        run_pass("schedule", adopt, gm, searched, follow)
    elif scheduler is not None:
        run_pass("schedule", order, gm, search=search)
    check_waits(gm)  # invariant: every collective's output is read only through its wait
    chosen = LoweringChoices(cap, size, tuple(n.name for n in gm.graph.nodes) if options.schedule else None)
    run_pass("expand_updates", expand_updates, gm)
    run_pass("views", views_as_views, gm)  # after the choices, which name the nodes before them
    if options.inplace and options.backend == "eager":
        run_pass("inplace", update_in_place, gm)
    return chosen


def _bucket_cap(option: bool | float, none: float = 0) -> float | str:
    """A fuse / partition option as a size: "auto" (the timeline model chooses), ``none``
    (off) or the bytes given."""
    if option is True:
        return "auto"
    return none if option is False else float(option)
