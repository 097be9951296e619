"""The compiler pipeline: every pass, in order, in one place.

::

    planning  (rank 0 traces and plans, see ddlc.runtime)
      trace          model + inputs + loss + optimizer -> one functional aten graph (ddlc.tracing)
      canonicalize   mean reductions -> sum / count, so batch splits give partial sums
      shard          every node's SBP signature (AutoDDL): ir.SHARDING on every node
      decouple       gradient all-reduce -> reduce-scatter + update on the shard + all-gather
      (choose_plan)  where nothing is pinned: data parallelism instead, if its lowered
                     program's modeled step is shorter than the searched plan's
    lowering  (every rank, for its own mesh coordinate; rank 0 first, whose searched choices
               for fuse, partition and schedule the others take, see ddlc.runtime)
      collectives    boxing collectives on every edge whose SBP changes (ir.COLLECTIVE)
      localize       global -> per-rank shapes and arguments (ir.GLOBAL_VAL keeps the global)
      random         random ops draw their global shape from the program's generator and
                     keep this rank's piece (ddlc.rng: ranks agree, single-device numbers)
      fuse           bucket small collectives (cap chosen by the program timeline)
      partition      split large collectives (piece size chosen by the program timeline)
      schedule       issue early, wait late, updates inside backward, chosen per group
                     where the program is small enough (else the order the searches above
                     scheduled for the chosen program, where they ran); then the static
                     check that every collective is read only through its wait
      views          view copies run as views (strided tensors made contiguous only for
                     the readers that need it)
      inplace        the optimizer update writes into its inputs and temporaries where
                     nothing reads them later (eager backend)

Each pass runs through :func:`run_pass`, which times it and logs one line under the
``ddlc.pipeline`` logger. This is the only module of ``ddlc`` that imports ``passes``.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from cost_models.program import program_makespan
from passes.canonicalize import canonicalize
from passes.collectives import insert_collectives
from passes.decouple import decouple
from passes.fuse import adopt, fuse, fuse_search
from passes.inplace import update_in_place
from passes.localize import localize
from passes.partition import partition, partition_search
from passes.random import draw_globally
from passes.schedule import check_waits, follow, schedule, searches_updates
from passes.sharding import mesh_shapes, shard
from passes.views import views_as_views

from .errors import MeshError, SBPError, ShardingError, UnsupportedInputError
from .ir import BUCKET_CAP, PIECE_BYTES, SHARDING, STEP
from .mesh import Mesh
from .options import CompileOptions
from .plan import Plan
from .sbp import NdSBP, S, divides, parse_sbp
from .tracing import trace

__all__ = ["PLANNING", "LOWERING", "run_pass", "trace_step", "resolve_placements", "plan", "choose_plan", "ChosenPlan",
           "data_parallel_placements", "lower",
           "LoweringChoices", "mesh_shapes"]

log = logging.getLogger("ddlc.pipeline")

#: The passes, in the order they run.
PLANNING = ("trace", "canonicalize", "shard", "decouple")
LOWERING = ("collectives", "localize", "random", "fuse", "partition", "schedule", "views", "inplace")


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


# -- planning ------------------------------------------------------------------------------

def trace_step(model: nn.Module, example_inputs, loss_fn, optimizer,
               options: CompileOptions) -> fx.GraphModule:
    """trace, canonicalize: the step graph at global shapes, mean losses as sum / count."""
    gm = run_pass("trace", trace, model, example_inputs, loss_fn, optimizer,
                  num_targets=options.num_targets, clip_grad_norm=options.clip_grad_norm)
    return run_pass("canonicalize", canonicalize, gm)


def resolve_placements(gm: fx.GraphModule, placements: Mapping[str, object],
                       ndim: int) -> dict[str, NdSBP]:
    """Map user placements keyed by parameter name or ``input<i>`` to placeholder names."""
    by_key = {i.key: i.name for i in STEP(gm).inputs}
    fixed = {}
    for key, sbp in placements.items():
        if key not in by_key and key not in by_key.values():
            raise UnsupportedInputError(f"placement given for {key!r}, which is neither a "
                                        f"parameter nor an input (inputs are input0, input1, ...)")
        sbp = parse_sbp(sbp) if isinstance(sbp, str) else NdSBP(tuple(sbp))
        if len(sbp) != ndim:
            raise MeshError(f"placement {sbp} of {key!r} has {len(sbp)} axes; the mesh has {ndim}")
        if any(x.is_partial for x in sbp):
            raise SBPError(f"placement {sbp} of {key!r} is a partial sum (P), which cannot hold "
                           "user data: every rank holds the full value and the program would "
                           "add them up; pin it B (replicated) or S(d) (split along dim d)")
        fixed[by_key.get(key, key)] = sbp
    return fixed


def plan(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions,
         fixed: Mapping[str, NdSBP]) -> Plan:
    """shard, decouple: annotate every node of ``gm`` with its signature; return the plan."""
    result = run_pass("shard", shard, gm, mesh, solver=options.solver,
                      memory_budget=options.memory_budget, fixed=fixed,
                      move_activations=options.move_activations)
    # invariant: every node but the output carries ir.SHARDING
    if options.decouple:
        decoupled = run_pass("decouple", decouple, gm, mesh, options.ag_placement, frozenset(fixed),
                             always=options.decouple == "always")
        result.stats["decoupled"] = len(decoupled)
    return result


class ChosenPlan(NamedTuple):
    """What :func:`choose_plan` returns: the ``plan`` and, where it lowered the candidates,
    the kept plan's program for mesh coordinate 0 (``program``, its process groups named
    ``axis0``, ``axis1``, ...) and the ``choices`` it was lowered with; else both None."""

    plan: Plan
    choices: LoweringChoices | None = None
    program: fx.GraphModule | None = None


def choose_plan(gm: fx.GraphModule, mesh: Mesh, options: CompileOptions,
                fixed: Mapping[str, NdSBP]) -> ChosenPlan:
    """:func:`plan`, checked against data parallelism, the plan most users write by hand.

    The search minimises an additive objective (per node and per edge); the program's
    timeline adds what that leaves out: buckets sharing start-ups, overlap, the order. So
    where nothing is pinned (``fixed`` empty, activations may move) and the search did not
    choose data parallelism itself, the data-parallel plan
    (:func:`data_parallel_placements`) is planned too, both are lowered for mesh coordinate
    0 on copies, and ``gm`` keeps the plan whose program has the shorter modeled step
    (:func:`cost_models.program.program_makespan`; the searched plan on ties, and where
    the data-parallel plan cannot be made, e.g. over the memory budget). Where the two were
    compared, the kept plan's lowered program and choices come with it (:func:`lower`
    takes the choices instead of searching again). Deterministic: rank 0 runs it and
    broadcasts the decisions (``ddlc.runtime``)."""
    reference = (data_parallel_placements(gm, mesh)
                 if not fixed and options.move_activations and mesh.size > 1 else None)
    searched = plan(gm, mesh, options, fixed)
    if reference is None or all(SHARDING(n).outputs[0] == reference[n.name]
                                for n in gm.graph.find_nodes(op="placeholder") if n.name in reference):
        return ChosenPlan(searched)
    # planning annotates every node afresh (shard reads no earlier annotation), so a copy
    # of the searched graph plans as the unplanned one would
    unplanned = copy.deepcopy(gm)
    try:
        data_parallel = plan(unplanned, mesh, replace(options, move_activations=False), reference)
    except ShardingError as e:
        log.info("data-parallel plan: none (%s)", str(e).splitlines()[0])
        return ChosenPlan(searched)
    (mine, *my_program), (theirs, *their_program) = (_lowered_step(g, mesh, options)
                                                      for g in (gm, unplanned))
    log.info("modeled step of the searched plan %.3f ms, of data parallelism %.3f ms",
             mine * 1e3, theirs * 1e3)
    compared = dict(searched_step=mine, data_parallel_step=theirs)
    if theirs >= mine:
        searched.stats.update(compared)
        return ChosenPlan(searched, *my_program)
    gm.graph = unplanned.graph
    gm.meta.update(unplanned.meta)
    data_parallel.stats.update(compared, chosen_over_search=True)
    return ChosenPlan(data_parallel, *their_program)


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


def _lowered_step(planned: fx.GraphModule, mesh: Mesh,
                  options: CompileOptions) -> tuple[float, "LoweringChoices", fx.GraphModule]:
    """The modeled seconds of mesh coordinate 0's program of ``planned``, the choices it
    was lowered with, and that program (lowered on a copy)."""
    program = copy.deepcopy(planned)
    choices = lower(program, mesh, (0,) * mesh.ndim, [f"axis{k}" for k in range(mesh.ndim)], options)
    return program_makespan(program, mesh.profile), choices, program


# -- lowering ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoweringChoices:
    """What lowering chose for one rank's program: the bucket cap, the piece size and the
    node order. Where local shapes differ by rank, every rank adopts mesh coordinate 0's
    (its pieces are the largest), so that all ranks issue the same collectives."""

    bucket_cap: float
    piece_bytes: float
    order: tuple[str, ...] | None


def _splits_evenly(gm: fx.GraphModule, mesh: Mesh) -> bool:
    """Whether every planned tensor splits into equal pieces (then every rank's local
    shapes, modeled timelines and lowering choices are the same)."""
    for node in gm.graph.nodes:
        sharding = SHARDING.get(node)
        leaves = tree_leaves(node.meta.get("val"))
        if sharding is not None and any(isinstance(v, torch.Tensor) and x is not None
                                        and not divides(tuple(v.shape), x, mesh.shape)
                                        for v, x in zip(leaves, sharding.outputs)):
            return False
    return True


def lower(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int], groups: Sequence[str],
          options: CompileOptions,
          choices: LoweringChoices | Callable[[], LoweringChoices] | None = None) -> LoweringChoices:
    """collectives, localize, random, fuse, partition, schedule, views, inplace: the program of the rank at
    mesh coordinate ``coord`` whose per-axis process groups are named ``groups``, in place;
    returns the choices it was lowered with. Needs no process group, so tests can lower
    every rank in one process.

    ``choices``: mesh coordinate 0's, where the caller has them, or a function that returns
    them, called once this rank's program is local (``ddlc.compile`` waits there for rank
    0's broadcast, so the passes before overlap rank 0's search); the searches for them are
    then skipped. Without them, a rank whose local shapes differ from coordinate 0's finds
    them by lowering a copy of the graph for coordinate 0 first (its pieces are the
    largest, so every rank issues the same collectives)."""
    uneven = not _splits_evenly(gm, mesh)
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
    run_pass("collectives", insert_collectives, gm, mesh, groups, coord)
    run_pass("localize", localize, gm, mesh, coord)
    run_pass("random", draw_globally, gm, mesh, coord)
    # from here on, shapes are local and every collective carries ir.COLLECTIVE
    if callable(choices):
        choices = choices()

    def order(graph: fx.GraphModule, search: bool = False) -> fx.GraphModule:
        return schedule(graph, options.max_inflight_bytes, options.max_live_bytes, mesh.profile,
                        options.updates_for_schedule, search)

    scheduler = order if options.schedule else None
    searched = None  # what the last search timed: the program as it stands, scheduled
    with _Deferred(gm) as codegen:  # fuse and partition end with code the schedule replaces
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
        search = scheduler is not None and options.updates_for_schedule == "auto" \
            and searches_updates(gm)
        if choices is not None and choices.order is not None:
            reorder = (follow, gm, list(choices.order))
        elif searched is not None and searched.order is not None and not search:
            # the search scheduled this very program already: the scheduler would order it alike
            reorder = (adopt, gm, searched, follow)
        else:
            reorder = (order, gm, search) if scheduler is not None else None
        codegen.needed = reorder is None
    if reorder is not None:
        run_pass("schedule", *reorder)
    check_waits(gm)  # invariant: every collective's output is read only through its wait
    chosen = LoweringChoices(cap, size, tuple(n.name for n in gm.graph.nodes) if options.schedule else None)
    with _Deferred(gm):  # after the choices, which name the nodes before them; code once
        run_pass("views", views_as_views, gm)
        if options.inplace and options.backend == "eager":
            run_pass("inplace", update_in_place, gm)
    return chosen


class _Deferred:
    """Within, ``gm.recompile()`` (code generation, with which every pass ends) only notes
    that it was asked for; on leaving without an error, ``gm`` generates its code once if it
    was, unless ``needed`` was set False (a pass after that regenerates it anyway: the
    schedule's reorder). The graph module's code is then that of its final graph, as if each
    pass had generated its own."""

    def __init__(self, gm: fx.GraphModule):
        self.gm, self.asked, self.needed = gm, False, True

    def _ask(self) -> None:
        self.asked = True

    def __enter__(self) -> "_Deferred":
        self.gm.recompile = self._ask  # an instance attribute: shadows the method
        return self

    def __exit__(self, kind, *_) -> None:
        del self.gm.recompile
        if kind is None and self.asked and self.needed:
            self.gm.recompile()


def _bucket_cap(option: bool | float, none: float = 0) -> float | str:
    """A fuse / partition option as a size: "auto" (the timeline model chooses), ``none``
    (off) or the bytes given."""
    if option is True:
        return "auto"
    return none if option is False else float(option)
