"""What ``ddlc plan`` prints: the plan per module, the modeled step and the collectives.

Three pieces, each a pure function of the plan, the step's signature and rank 0's
lowered program:

- :func:`module_rows`: one row per module (its parameters' and its output activation's
  SBP, compute, communication, memory), with repeated layers collapsed
  (:class:`Repeats`);
- :func:`step_breakdown`: the program timeline of the lowered program (makespan, compute,
  exposed and hidden communication, peak memory against the budget);
- :func:`collective_rows`: the communicating collectives per step by phase, kind and
  mesh axis (count, bytes, modeled seconds).

:func:`format_report` lays them out as text; :func:`report_data` as JSON-ready data.
For ``ddlc schedule``, :func:`scheduled_collectives` places every collective on the
program timeline (start, end, the stall at its wait) and :func:`format_schedule` prints it.
Nothing here reads a clock or a hash-ordered container, so the text is the same under
every ``PYTHONHASHSEED``.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from torch import fx

from cost_models.program import program_timeline
from cost_models.timeline import COMPUTE, TimelineResult

from .ir import COLLECTIVE, ORIGIN, StepSignature
from .mesh import Mesh
from .plan import Plan
from .printing import align_columns, format_bytes

__all__ = ["Repeats", "repeats_of", "ModuleRow", "StepBreakdown", "CollectiveRow", "module_rows", "step_breakdown",
           "collective_rows", "format_report", "report_data", "ScheduledCollective",
           "scheduled_collectives", "format_schedule", "ROOT"]

ROOT = "(root)"
_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _instance(module: str) -> tuple[str, int, str] | None:
    """``blocks.3.attn.qkv`` -> ``("blocks", 3, "attn.qkv")``: the first numbered path
    component (a ModuleList / Sequential entry) splits a path; None without one."""
    match = _INDEX.search(module)
    if match is None:
        return None
    return module[:match.start(1)].rstrip("."), int(match.group(1)), module[match.end(1):].lstrip(".")


class Repeats:
    """Runs of identical repeated layers, and the label each module path gets.

    Instances of a numbered container (``blocks.0``, ``blocks.1``, ...) are identical when
    their fingerprints are equal (:func:`repeats_of`: what the plan decided in them).
    Consecutive identical instances form a run, labelled ``blocks.[1-11]`` (a run of one
    keeps its own number)."""

    def __init__(self, fingerprints: dict[tuple[str, int], object]):
        self._run: dict[tuple[str, int], tuple[int, int]] = {}
        for container in sorted({c for c, _ in fingerprints}):
            indices = sorted(i for c, i in fingerprints if c == container)
            start = indices[0]
            for prev, i in zip(indices, indices[1:] + [None]):
                if i is None or i != prev + 1 or fingerprints[(container, i)] != fingerprints[(container, prev)]:
                    for k in range(start, prev + 1):
                        self._run[(container, k)] = (start, prev)
                    start = i

    def label(self, module: str) -> tuple[str, int]:
        """(display path, number of layers it stands for) of a module path."""
        inst = _instance(module)
        if inst is None or inst[:2] not in self._run:
            return module or ROOT, 1
        container, index, rest = inst
        first, last = self._run[(container, index)]
        number = str(first) if first == last else f"[{first}-{last}]"
        return ".".join(p for p in (container, number, rest) if p), last - first + 1


@dataclass(frozen=True)
class ModuleRow:
    """One module of the plan; costs are per layer (the mean over the ``layers`` identical
    layers the row stands for)."""

    module: str
    layers: int
    parameters: str     # "weight (S0, B) bias (B, B)"
    activation: str     # the SBP of the module's last forward output
    placement: str      # what colours it in pictures: its first parameter's SBP, else its activation's
    compute: float      # seconds, all phases
    communication: float
    memory: float       # resident bytes per device


@dataclass
class _Module:
    """What the plan decided for one module path, and what it costs."""

    parameters: list = field(default_factory=list)   # [(own name, SBP)]
    activation: str = ""                             # SBPs of its last forward output(s)
    placement: str = ""                              # the first of them
    compute: float = 0.0
    communication: float = 0.0
    memory: float = 0.0
    first_forward: float = math.inf                  # plan position of its first forward node
    first_copy: float = math.inf                     # ... of its first forward clone or alias

    @property
    def order(self) -> float:
        """Where the module comes in the forward: its first forward node other than a
        clone or alias, else its first of those. The trace clones every buffer when the
        forward starts (the copy the forward may update in place; ``passes/shared_reads``
        aliases it), so a module holding a buffer (a router's bias, rotary embeddings'
        frequencies) would otherwise come first."""
        return self.first_forward if self.first_forward < math.inf else self.first_copy


def _modules(plan: Plan, signature: StepSignature) -> dict[str, _Module]:
    """Module path -> its decisions and costs, summed over its nodes in every phase (a
    parameter's placeholder counts for the module that owns the parameter)."""
    param_of = {s.name: s.key for s in signature.inputs if s.role == "param"}
    modules: dict[str, _Module] = {}
    for position, n in enumerate(plan.nodes):
        module = n.module
        if n.name in param_of:
            module, _, leaf = param_of[n.name].rpartition(".")
        m = modules.setdefault(module, _Module())
        if n.name in param_of:
            m.parameters.append((leaf, n.outputs[0]))
        m.compute += n.compute
        m.communication += n.communication
        m.memory += n.memory
        if n.phase == "forward" and n.outputs:
            m.activation, m.placement = ", ".join(n.outputs), n.outputs[0]
            if n.op in ("aten.clone", "aten.alias"):
                m.first_copy = min(m.first_copy, position)
            else:
                m.first_forward = min(m.first_forward, position)
    return modules


def repeats_of(plan: Plan, signature: StepSignature) -> Repeats:
    """The repeated layers of the plan: an instance's fingerprint is, per module inside it
    (by its path relative to the instance), its parameters' SBPs and its activation's SBP --
    the decisions the plan table shows."""
    prints: dict[tuple[str, int], list] = {}
    for module, m in _modules(plan, signature).items():
        inst = _instance(module)
        if inst is not None:
            prints.setdefault(inst[:2], []).append((inst[2], tuple(m.parameters), m.activation))
    return Repeats({k: tuple(v) for k, v in prints.items()})


def module_rows(plan: Plan, signature: StepSignature) -> list[ModuleRow]:
    """The plan per module, one row per run of identical layers (costs averaged over the
    run), in order of first forward use (modules with no forward node last)."""
    repeats = repeats_of(plan, signature)
    merged: dict[str, list] = {}
    modules = _modules(plan, signature)
    for module, m in modules.items():
        label, layers = repeats.label(module)
        merged.setdefault(label, [layers, m, 0.0, 0.0, 0.0])
        entry = merged[label]
        entry[2] += m.compute / layers
        entry[3] += m.communication / layers
        entry[4] += m.memory / layers
    rows = []
    for label, (layers, m, compute, comm, memory) in merged.items():
        sbps = " ".join(f"{leaf} {sbp}" for leaf, sbp in m.parameters)
        placement = m.parameters[0][1] if m.parameters else m.placement
        rows.append((m.order, ModuleRow(label, layers, sbps or "-", m.activation or "-",
                                                placement or "-", compute, comm, memory)))
    return [row for _, row in sorted(rows, key=lambda r: r[0])]


@dataclass(frozen=True)
class StepBreakdown:
    """The modeled step of rank 0's lowered program (seconds, bytes)."""

    step: float
    compute: float
    exposed: float
    hidden: float
    peak_memory: int
    budget: float
    planner_objective: float


def step_breakdown(plan: Plan, program: fx.GraphModule, mesh: Mesh, budget: float,
                   timeline: TimelineResult | None = None) -> StepBreakdown:
    """Simulate ``program`` (:func:`cost_models.program.program_timeline`, unless its
    ``timeline`` is given): compute is the compute stream's busy time, exposed
    communication the rest of the makespan, hidden communication the channels' busy time
    that the compute stream did not wait for."""
    result = timeline if timeline is not None else program_timeline(program, mesh.profile)
    exposed = result.exposed_communication
    return StepBreakdown(result.makespan, result.compute_time, exposed,
                         max(result.communication_time - exposed, 0.0),
                         result.peak_memory, budget, plan.objective)


@dataclass(frozen=True)
class CollectiveRow:
    """The collectives of one phase, kind and mesh axis in one step."""

    phase: str
    kind: str
    axis: str
    count: int
    nbytes: int
    seconds: float


def collective_rows(program: fx.GraphModule) -> list[CollectiveRow]:
    """Communicating collectives of ``program`` grouped by (phase, kind, axis), in order of
    first issue; a bucket (fused collectives, no module of its own) counts as phase
    ``bucket``."""
    groups: dict[tuple[str, str, str], list] = {}
    for node in program.graph.nodes:
        info = COLLECTIVE.get(node)
        if info is None or not info.communicates:
            continue
        origin = ORIGIN.get(node)
        key = (origin.phase if origin else "bucket", info.kind, info.axis_name)
        entry = groups.setdefault(key, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += info.nbytes
        entry[2] += info.seconds
    return [CollectiveRow(*key, *entry) for key, entry in groups.items()]


def over_budget_note(b: StepBreakdown) -> str:
    """Why the lowered program's modeled peak can exceed the budget the plan was searched
    under, or "" where it does not: the search's memory model counts the plan's tensors,
    not the buffers lowering adds (buckets, pieces) or the order's live ranges."""
    if not b.budget or b.peak_memory <= b.budget:
        return ""
    return ("the plan fits it by the search's estimate, which leaves out the buffers lowering "
            "adds (buckets, pieces) and the order's live ranges: give a smaller budget")


def _format_step(plan: Plan, b: StepBreakdown) -> list[str]:
    ms = lambda s: f"{s * 1e3:10.3f} ms"  # noqa: E731
    share = f"{b.peak_memory / b.budget:.1%}" if b.budget else "-"
    return [f"modeled step {b.step * 1e3:.3f} ms (rank 0's lowered program, timeline model)",
            f"  compute                 {ms(b.compute)}",
            f"  communication exposed   {ms(b.exposed)}",
            f"  communication hidden    {ms(b.hidden)}",
            f"  peak memory per device  {format_bytes(b.peak_memory):>13} of {format_bytes(b.budget)} "
            f"budget ({share})" + (over_budget_note(b) and f": OVER THE BUDGET, {over_budget_note(b)}"),
            f"  planner objective       {ms(b.planner_objective)} (compute + communication before "
            "bucketing and overlap)"]


#: the steps ``choose_plan`` compares (its plan's stats) and how the report names them
_COMPARED = (("searched_step", "searched"), ("data_parallel_step", "data parallel"),
             ("replicated_step", "replicated"), ("startups_priced_step", "start-ups priced"))
_CANDIDATE_NAMES = {"data parallel": "data parallelism", "replicated": "replication",
                    "start-ups priced": "the plan searched with every start-up priced"}
#: the flag ``choose_plan`` sets in its plan's stats when a candidate won, and that
#: candidate's name in :data:`_COMPARED`
_KEPT = (("replicated_chosen", "replicated"), ("chosen_over_search", "data parallel"),
         ("startups_priced_chosen", "start-ups priced"))
#: how the report's "kept ..." names each plan
_KEPT_TEXT = {"searched": "the searched plan",
              "replicated": "replication (every rank runs the whole step; nothing is communicated)",
              "data parallel": "data parallelism", "start-ups priced": "the plan searched with every start-up priced"}


def kept_plan(stats) -> str:
    """Which plan ``choose_plan`` kept, from its plan's ``stats``, by its name in
    :data:`_COMPARED`: searched, data parallel, replicated or start-ups priced."""
    return next((label for flag, label in _KEPT if stats.get(flag)), "searched")


def format_report(plan: Plan, rows: list[ModuleRow], step: StepBreakdown,
                  collectives: list[CollectiveRow]) -> str:
    """The plan table, the modeled step and the collectives per step, as text."""
    mesh = "x".join(map(str, plan.mesh_shape)) + f"({','.join(plan.axis_names)})"
    lines = [f"plan on mesh {mesh}, profile {plan.profile}, solver {plan.solver}"]
    stats = plan.stats
    steps = [(label, stats[key]) for key, label in _COMPARED if key in stats]
    kept = _KEPT_TEXT[kept_plan(stats)]
    if "data_parallel_none" in stats:
        lines.append(f"checked against data parallelism: none could be planned "
                     f"({stats['data_parallel_none']})" + ("" if len(steps) > 1 else f": kept {kept}"))
    if len(steps) > 1:
        against = " and ".join(_CANDIDATE_NAMES[label] for label, _ in steps[1:])
        lines.append(f"checked against {against} (modeled step of rank 0's program: "
                     + ", ".join(f"{label} {step * 1e3:.3f} ms" for label, step in steps) + f"): kept {kept}")
    lines.append("")
    table = [("module", "layers", "parameters", "activation", "compute us", "comm us", "memory")]
    table += [(r.module, str(r.layers), r.parameters, r.activation, f"{r.compute * 1e6:.1f}",
               f"{r.communication * 1e6:.1f}", format_bytes(r.memory)) for r in rows]
    lines += align_columns(table, right={1, 4, 5, 6})
    lines += ["(costs per layer; a row of several layers stands for each of them)", ""]
    lines += _format_step(plan, step) + ["", "collectives per step"]
    coll = [("phase", "kind", "axis", "count", "bytes", "modeled us")]
    coll += [(c.phase, c.kind, c.axis, str(c.count), format_bytes(c.nbytes), f"{c.seconds * 1e6:.1f}")
             for c in collectives]
    lines += align_columns(coll, right={3, 4, 5}) if collectives else ["  none"]
    return "\n".join(lines)


def report_data(rows: list[ModuleRow], step: StepBreakdown,
                collectives: list[CollectiveRow]) -> dict:
    """The report as JSON-ready data (added to the plan's own JSON by ``--json``)."""
    return {"modules": [asdict(r) for r in rows], "modeled_step": asdict(step),
            "collectives": [asdict(c) for c in collectives]}



@dataclass(frozen=True)
class ScheduledCollective:
    """One collective of the program timeline: when it runs and how long the compute
    stream stalls at its wait (seconds)."""

    order: int
    name: str
    kind: str
    axis: str
    nbytes: int
    start: float
    end: float
    stall: float
    phase: str
    module: str


def scheduled_collectives(program: fx.GraphModule, mesh: Mesh) -> tuple[list[ScheduledCollective], object]:
    """Every communicating collective of ``program`` in issue order with its modeled start
    and end, and the stall at its wait: how long the wait's (empty) compute task starts
    after the compute task before it ended. Returns the rows and the timeline result."""
    result = program_timeline(program, mesh.profile)
    task = {t.label: i for i, t in enumerate(result.tasks)}
    stall_at, compute_end = {}, 0.0
    for i, t in enumerate(result.tasks):
        if t.stream == COMPUTE:
            stall_at[t.label] = result.start[i] - compute_end
            compute_end = result.end[i]
    rows = []
    for node in program.graph.nodes:
        info = COLLECTIVE.get(node)
        if info is None or not info.communicates or node.name not in task:
            continue
        i = task[node.name]
        waits = [u.name for u in node.users if u.name in stall_at]
        origin = ORIGIN.get(node)
        rows.append(ScheduledCollective(len(rows), node.name, info.kind, info.axis_name, info.nbytes,
                                        result.start[i], result.end[i],
                                        max((stall_at[w] for w in waits), default=0.0),
                                        origin.phase if origin else "bucket",
                                        (origin.module or ROOT) if origin else "-"))
    return rows, result


def format_schedule(rows: list[ScheduledCollective], result) -> str:
    """The timeline summary and the collectives in issue order."""
    lines = [f"modeled step {result.makespan * 1e3:.3f} ms: compute {result.compute_time * 1e3:.3f} ms, "
             f"communication {result.communication_time * 1e3:.3f} ms of which exposed {result.exposed_communication * 1e3:.3f} ms; "
             f"lower bound {result.lower_bound * 1e3:.3f} ms; peak memory {format_bytes(result.peak_memory)}", ""]
    table = [("#", "start ms", "end ms", "stall ms", "kind", "axis", "bytes", "phase", "module")]
    table += [(str(r.order), f"{r.start * 1e3:.3f}", f"{r.end * 1e3:.3f}", f"{r.stall * 1e3:.3f}", r.kind,
               r.axis, format_bytes(r.nbytes), r.phase, r.module) for r in rows]
    return "\n".join(lines + (align_columns(table, right={0, 1, 2, 3, 6}) if rows else ["no collectives"]))
