"""Command line: ``ddlc <command> ...`` (or ``python -m ddlc``).

- ``plan FACTORY --mesh 2x4``: trace, plan and lower rank 0's program in this one process
  (no process group, no workers) and print the plan per module, the modeled step and the
  collectives per step; ``--graph`` the per-rank graph by module, ``--json``/``--svg``/
  ``--html`` write the plan and its picture. ``--mesh 8`` (a device count) plans every mesh
  shape of 8 devices and reports the best.
- ``schedule FACTORY --mesh 4``: the compiled program's collectives in issue order on its
  modeled timeline (``--trace OUT.json``: Chrome / Perfetto); ``schedule --layer-profile
  FILE`` compares gradient-communication strategies on a per-layer profile
  (:mod:`cost_models.layer_schedules`).
- ``calibrate``: measure a hardware profile on this machine.

FACTORY is ``path/to/file.py:function`` or ``package.module:function``, returning ``(model,
example_inputs, loss_fn)`` (:mod:`ddlc.factory`). Standard output carries only the report;
logs (``-v``: one line per compiler pass with its time) and errors go to standard error. A
ddlc error prints one line naming its cause and exits with status 2 (``-v`` adds the
traceback). Each subcommand imports the compiler only when it runs, so ``--help`` stays light.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NoReturn

from .errors import DDLCError, OptionError, RuntimeMismatchError, UnsupportedInputError, as_shared

TRACE_ITERATIONS = 2
SEARCH_SHOWN = 5
#: The largest device count ``--mesh N`` searches the mesh shapes of.
MAX_DEVICES = 1 << 20
#: Mesh shapes of least planner objective that a device-count search lowers and times.
SEARCH_LOWERED = 3
log = logging.getLogger("ddlc.cli")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        _check_outputs(args)
        return args.run(args)
    except DDLCError as error:
        if args.verbose:
            traceback.print_exc()
        print(f"ddlc {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 2


def run_and_exit(argv=None) -> NoReturn:
    """:func:`main` as a command (``python -m ddlc``, the ``ddlc`` script), with Python's
    cyclic garbage collector off throughout; flush the output, then end the process at
    once. A compile leaves millions of small objects (graphs, their meta, fake values, the
    searches' trial graphs, much of it in reference cycles): each full collection walks
    them all (the first after compiling, 0.2-0.4 s of a 6.5 s ``ddlc plan`` on the
    GPT-2-small-shaped model, in the report's pricing), and so does the interpreter's own
    teardown (about 1 s). A command compiles once and ends, so its garbage is never
    collected; reference counting frees the rest as usual. Files the command writes are
    closed by then; the log is flushed here, and the operator times ``--compute measured``
    measured are saved to their cache (``os._exit`` skips the exit handler that saves
    them)."""
    gc.disable()
    try:
        code = main(argv)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader of the report left (``| head``): nothing more to say
        code = 0
    measured = sys.modules.get("cost_models.measured")
    if measured is not None:
        measured.flush_all()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def _check_outputs(args) -> None:
    """Refuse an output file the command could not write, before any work: its folder
    missing, a folder in its place, a picture not named ``.svg``."""
    for option in ("json", "svg", "html", "trace", "out"):
        path = getattr(args, option, None)
        if not isinstance(path, str):  # not given, or a flag (``schedule --json`` prints JSON)
            continue
        folder = Path(path).parent
        if not folder.is_dir():
            raise OptionError(f"cannot write --{option} {path}: there is no folder {folder}")
        if Path(path).is_dir():
            raise OptionError(f"cannot write --{option} {path}: it is a folder")
    if getattr(args, "svg", None) and Path(args.svg).suffix.lower() != ".svg":
        raise OptionError(f"--svg writes an SVG picture: give a file name ending in .svg, not {args.svg}")


def _one_line(error: Exception) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _configure_logging(verbose: bool) -> None:
    """The ``ddlc`` logger writes to stderr: INFO with ``-v`` (a line per pass), else WARNING."""
    logger = logging.getLogger("ddlc")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False


# -- arguments -----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddlc", description="ddlc: a distributed deep-learning "
                                     "compiler for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    plan = commands.add_parser("plan", help="plan a model's training step for a mesh and print "
                               "what ddlc decided (no workers needed)")
    _compile_arguments(plan, required=True)
    plan.add_argument("--graph", action="store_true", help="also print rank 0's annotated "
                      "program, grouped by module")
    plan.add_argument("--json", metavar="OUT.json", help="write the plan (loadable with "
                      "ddlc.Plan.load) and the report as JSON")
    plan.add_argument("--svg", metavar="OUT.svg", help="write the picture of the step")
    plan.add_argument("--html", metavar="OUT.html", help="write a page with the picture and the report")
    plan.set_defaults(run=_plan)
    schedule = commands.add_parser("schedule", help="the communication schedule of a compiled "
                                   "step, or strategies compared on a per-layer profile")
    _compile_arguments(schedule, required=False)
    schedule.add_argument("--layer-profile", metavar="FILE",
                          help='instead of a factory: JSON {"allreduce": {"a", "b"}, "layers": '
                               '[{name, params, forward, backward}, ...]} (seconds; b per element)')
    schedule.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    schedule.add_argument("--trace", metavar="OUT.json", help="write the Chrome trace of the "
                          f"modeled timeline (a layer profile: ddlc's schedule, {TRACE_ITERATIONS} "
                          "iterations)")
    schedule.set_defaults(run=_schedule)
    calibrate = commands.add_parser("calibrate", help="measure a hardware profile (compute and "
                                    "gloo links) on this machine and print it as JSON")
    calibrate.add_argument("--world-size", type=int, help="local gloo processes (default 4, or the --mesh's)")
    calibrate.add_argument("--mesh", metavar="SHAPE", help="time the collectives on each axis of "
                           "this mesh (e.g. 2x2; its size is the world size) instead of on the "
                           "whole world and the axes of its 2-D mesh")
    calibrate.add_argument("--name", default="calibrated", help="the profile's name")
    calibrate.add_argument("--out", metavar="FILE.json", help="also write the profile here")
    calibrate.add_argument("-v", "--verbose", action="store_true", help="log to stderr; tracebacks")
    calibrate.set_defaults(run=_calibrate)
    return parser


def _compile_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("factory", nargs=None if required else "?", metavar="FACTORY",
                        help="path/to/file.py:function or package.module:function returning "
                             "(model, example_inputs, loss_fn)")
    parser.add_argument("--mesh", help="mesh shape such as 2x4, or a device count (8) to search "
                        "the mesh shapes")
    parser.add_argument("--profile", help="hardware profile: a name (cpu-gloo, dgx-h100-ib) or a "
                        "JSON file (default cpu-gloo)")
    parser.add_argument("--memory", metavar="BYTES", help="memory budget per device, e.g. 16GB, "
                        "512MiB (default: the profile's device memory)")
    parser.add_argument("--solver", choices=("cd", "exact"), default="cd")
    parser.add_argument("--compute", choices=("roofline", "measured"), default="roofline",
                        help="operator times: the profile's roofline, or measured on this machine "
                             "(cached; see cost_models/measured.py)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw",
                        help="the optimizer of the step (none: gradients, or inference without loss)")
    parser.add_argument("--micro-batches", type=int, default=1, metavar="N",
                        help="gradient accumulation: the example batch cut into N micro-batches, "
                             "a forward and backward each, one update (default 1)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every pass with its time "
                        "to stderr; tracebacks on errors")


_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> float:
    """``16GB`` -> 16e9, ``512MiB`` -> 512 * 2**20, ``1e9`` -> 1e9 (decimal and binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise OptionError(f"--memory {text!r}: write a size such as 16GB, 512MiB or 1e9")
    value = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if not 0 < value < math.inf:
        raise OptionError(f"--memory {text!r}: the budget must be a positive, finite size")
    return value


# -- compiling rank 0 in this process ------------------------------------------------------

@dataclass
class Compiled:
    """Rank 0's planned and lowered step, with what the report needs."""

    plan: object
    program: object        # the lowered fx.GraphModule of rank 0
    mesh: object
    signature: object
    budget: float
    searched: list         # [(shape, objective or None, modeled step or None, note)] when searched
    timeline: object = None  # the program's modeled timeline where planning worked it out


def _mesh_request(text: str | None):
    """``(Mesh-able shape, None)`` or ``(None, device count)`` for ``--mesh``."""
    from .errors import MeshError
    from .mesh import Mesh
    if text is None:
        raise MeshError("give --mesh: a shape such as 2x4, or a device count such as 8")
    if text.strip().isdigit():
        if not 1 <= int(text) <= MAX_DEVICES:
            raise MeshError(f"--mesh {text}: a device count must be from 1 to {MAX_DEVICES}")
        return None, int(text)
    shape = Mesh(text).shape
    if math.prod(shape) > MAX_DEVICES:
        raise MeshError(f"--mesh {text}: {math.prod(shape)} devices; a mesh may have at most {MAX_DEVICES}")
    return shape, None


def _optimizer(name: str, model):
    import torch
    if name != "none" and not any(True for _ in model.parameters()):
        raise UnsupportedInputError(f"the model has no parameters for --optimizer {name} to train: pass "
                                    "--optimizer none (a plan of the loss and its gradients alone, or "
                                    "of inference)")
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return None


def _compile_rank0(args) -> Compiled:
    """Load the factory, trace the step, plan it (on every mesh shape when ``--mesh`` is a
    device count) and lower mesh coordinate 0's program, all in this process; what the
    user's code prints meanwhile (the factory's module as it loads, the factory, the
    forward as it is traced) goes to standard error, which standard output's report (or
    JSON) must not carry."""
    with _stdout_to_stderr():
        return _compiled_rank0(args)


@contextlib.contextmanager
def _stdout_to_stderr():
    """Within, ``sys.stdout`` and file descriptor 1 itself (``os.write(1, ...)``, a C
    extension's ``printf``) write to standard error; what was printed before is flushed
    to standard output first."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (a closed standard output)
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _compiled_rank0(args) -> Compiled:
    shape, devices = _mesh_request(args.mesh)
    budget = parse_bytes(args.memory) if args.memory else None
    from . import pipeline
    from .factory import call_factory
    from .ir import STEP
    from .mesh import Mesh, load_profile
    from .options import CompileOptions
    profile = replace(load_profile(args.profile or "cpu-gloo"), compute=args.compute)
    profile = profile.for_local_ranks(devices or math.prod(shape))   # as many ranks on this host
    options = CompileOptions.from_kwargs(solver=args.solver, memory_budget=budget, profile=profile,
                                         compute=args.compute, micro_batches=args.micro_batches)
    with pipeline.collections_deferred():
        start = time.perf_counter()
        model, inputs, loss_fn = call_factory(args.factory)
        log.info("factory      %8.1f ms  %s", (time.perf_counter() - start) * 1e3, args.factory)
        optimizer = _optimizer(args.optimizer, model)
        try:
            gm = pipeline.trace_step(model, inputs, loss_fn, optimizer, options)
        except UnsupportedInputError as error:
            if loss_fn is None and optimizer is not None and "so its output must hold the loss" in str(error):
                raise UnsupportedInputError(f"{error}; for an inference plan of a model that returns "
                                            "no loss, pass --optimizer none") from error
            raise
        if devices is not None:
            (mesh, plan, program), searched = _search_meshes(gm, devices, profile, options)
            return Compiled(plan, program, mesh, STEP(program), budget or profile.memory_capacity, searched)
        mesh = Mesh(shape, profile=profile)
        plan, program, timeline = _plan_and_lower(gm, mesh, options)
        return Compiled(plan, program, mesh, STEP(program), budget or profile.memory_capacity, [], timeline)


def _plan_and_lower(gm, mesh, options):
    """Plan ``gm`` (in place) on ``mesh`` and lower mesh coordinate 0's program; returns the
    plan, the program and its modeled timeline (None where the program was lowered after
    choosing). Where ``choose_plan`` weighs data parallelism against the search, a forked
    process makes that candidate on the machine's other cores meanwhile
    (:func:`_candidate_elsewhere`)."""
    from . import pipeline
    from .simulate import axis_group_names
    groups = axis_group_names(mesh)
    reference = pipeline.data_parallel_reference(gm, mesh, options, {})
    with _candidate_elsewhere(gm, mesh, options, reference, groups) as candidate:
        chosen = pipeline.choose_plan(gm, mesh, options, {}, groups, candidate, timeline=True)
    if chosen.program is not None:  # choose_plan lowered it already
        return chosen.plan, chosen.program, chosen.timeline
    pipeline.lower(gm, mesh, (0,) * mesh.ndim, groups, options, chosen.choices)
    return chosen.plan, gm, None


@contextlib.contextmanager
def _candidate_elsewhere(gm, mesh, options, reference, groups):
    """Within, a forked process plans and lowers the data-parallel candidate
    (``pipeline.plan_pinned`` with the pins ``reference``) on ``gm`` as it is on
    entry, one intra-op thread, and the function yielded receives it (without its program;
    the child's error is raised instead). Yields None, and forks nothing, where there is
    nothing to compare (``reference`` None), where operators are timed by running them
    (``compute="measured"``: the child would time them against this process) or where the
    platform cannot fork; ``choose_plan`` then makes the candidate itself. The child is
    stopped on leaving if its candidate was not needed."""
    import multiprocessing
    if reference is None or options.compute == "measured" \
            or "fork" not in multiprocessing.get_all_start_methods():
        yield None
        return
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_send_candidate, args=(writer, gm, mesh, options, reference, groups),
                            daemon=True)
    child.start()
    writer.close()

    def receive():
        try:
            message = reader.recv()
        except EOFError:
            child.join()
            raise RuntimeMismatchError(f"the process planning data parallelism for comparison died "
                                f"(exit code {child.exitcode})") from None
        if isinstance(message, BaseException):
            raise message
        return message

    try:
        yield receive
    finally:
        reader.close()
        if child.is_alive():
            child.kill()
        child.join()


def _send_candidate(writer, gm, mesh, options, reference, groups) -> None:
    """In the forked child: the data-parallel candidate (its plan without the solver's
    state, no program) or the error that stopped it, sent through ``writer``. The child's
    own ``gm`` is planned (no copy), and its program is not made to run in place
    (``passes.inplace``, which changes no task's modeled time: the program is not sent)."""
    import torch

    from . import pipeline
    torch.set_num_threads(1)   # the parent's OpenMP threads do not exist here
    try:
        candidate = pipeline.plan_pinned(gm, mesh, replace(options, inplace=False), reference, groups,
                                         on_copy=False)
        message = candidate.to_send() if isinstance(candidate, pipeline.Candidate) else candidate
    except Exception as error:
        message = as_shared(error, "planning data parallelism for comparison failed")
    writer.send(message)
    writer.close()


def _search_meshes(gm, devices: int, profile, options):
    """Plan ``gm`` on every mesh shape of ``devices`` devices (without decoupling, which
    does not change the planner's objective); then plan and lower rank 0's program on the
    :data:`SEARCH_LOWERED` shapes of least objective and choose the one whose program has
    the least modeled step (its timeline counts what the objective leaves out: the
    start-ups of buckets, overlap, decoupling). Returns (mesh, plan, program) of the choice
    and, per shape, (shape, the searched plan's objective or None, the kept plan's modeled
    step or None, note, which plan ``choose_plan`` kept or None: :func:`report.kept_plan`).
    A progress bar on a terminal."""
    import copy

    from tqdm import tqdm

    from cost_models.program import program_makespan
    from . import pipeline
    from .errors import ShardingError
    from .mesh import Mesh
    from .report import kept_plan
    shapes = pipeline.mesh_shapes(devices)
    objectives = {}
    notes = {}
    for shape in tqdm(shapes, desc="mesh shapes", file=sys.stderr, disable=not sys.stderr.isatty()):
        try:
            plan = pipeline.plan(copy.deepcopy(gm), Mesh(shape, profile=profile),
                                 replace(options, decouple=False), {})
            objectives[shape] = plan.objective
        except ShardingError as e:
            notes[shape] = _one_line(e)
    if not objectives:
        raise ShardingError(f"no mesh shape of {devices} devices admits a plan: "
                            + "; ".join(f"{'x'.join(map(str, s))}: {note}" for s, note in notes.items()))
    ranked = sorted(objectives, key=lambda s: (objectives[s], shapes.index(s)))
    lowered = {}
    for shape in ranked[:SEARCH_LOWERED]:
        mesh = Mesh(shape, profile=profile)
        plan, program, timeline = _plan_and_lower(copy.deepcopy(gm), mesh, options)
        step = timeline.makespan if timeline is not None else program_makespan(program, mesh.profile)
        lowered[shape] = (step, (mesh, plan, program))
    best = min(lowered, key=lambda s: (lowered[s][0], ranked.index(s)))
    rows = [(s, objectives.get(s), lowered[s][0] if s in lowered else None, notes.get(s, ""),
             kept_plan(lowered[s][1][1].stats) if s in lowered else None) for s in shapes]
    return lowered[best][1], rows


# -- plan -----------------------------------------------------------------------------------

def _plan(args) -> int:
    from .printing import format_bytes, format_graph_by_module
    from .report import (collective_rows, format_report, module_rows, over_budget_note, report_data,
                         step_breakdown)
    compiled = _compile_rank0(args)
    rows = module_rows(compiled.plan, compiled.signature)
    step = step_breakdown(compiled.plan, compiled.program, compiled.mesh, compiled.budget, compiled.timeline)
    note = over_budget_note(step)
    if note:
        log.warning("the lowered program's modeled peak memory, %s a device, is over the budget of %s: %s",
                    format_bytes(step.peak_memory), format_bytes(step.budget), note)
    collectives = collective_rows(compiled.program)
    text = format_report(compiled.plan, rows, step, collectives)
    if compiled.searched:
        text = _format_search(compiled.searched) + "\n\n" + text
    print(text)
    if args.graph:
        print("\nrank 0's program by module\n" + format_graph_by_module(compiled.program))
    if args.json:
        data = json.loads(compiled.plan.to_json()) | report_data(rows, step, collectives)
        # wall-clock timings are logged, not written: the file is the same on every run
        data["stats"] = {k: v for k, v in data["stats"].items() if not k.endswith("seconds")}
        if compiled.searched:  # the mesh shapes' table, in its order
            data["mesh_search"] = [{"mesh": "x".join(map(str, shape)), "modeled_step": step_seconds,
                                    "kept": kept, "planner_objective": objective, "note": note}
                                   for shape, objective, step_seconds, note, kept in _ranked(compiled.searched)]
        _write(args.json, json.dumps(data, indent=1) + "\n")
    if args.svg or args.html:
        _pictures(args, compiled, rows, text)
    return 0


def _ranked(results) -> list:
    """The searched shapes as the report ranks them (:func:`_format_search`): the lowered
    ones by modeled step, then the rest by planner objective, then those with no plan."""
    planned = sorted((r for r in results if r[1] is not None),
                     key=lambda r: (r[2] is None, r[2] if r[2] is not None else r[1], r[1]))
    return planned + [r for r in results if r[1] is None]


def _format_search(results) -> str:
    """The searched shapes: the lowered ones by modeled step (of the plan ``choose_plan``
    kept there: searched, data parallel or replicated), then the rest by the searched
    plan's objective, then those with no plan; ties in the order :func:`_search_meshes`
    breaks them (objective, then the order of ``results``), so the first row is the shape
    chosen."""
    ranked = [r for r in _ranked(results) if r[1] is not None]
    lines = [f"mesh shapes of {math.prod(results[0][0])} devices, best {min(SEARCH_SHOWN, len(ranked))} "
             f"of {len(results)}, by the modeled step of the {min(SEARCH_LOWERED, len(ranked))} of "
             "least planner objective (lowered)",
             f"  {'mesh':>8}  {'modeled step':>12}  {'of the plan kept':>16}  {'searched plan objective':>23}"]
    for s, objective, step, _, kept in ranked[:SEARCH_SHOWN]:
        modeled = f"{step * 1e3:9.3f} ms" if step is not None else f"{'-':>12}"
        lines.append(f"  {'x'.join(map(str, s)):>8}  {modeled}  {kept or '-':>16}  {objective * 1e3:20.3f} ms")
    lines += [f"  {'x'.join(map(str, s)):>8}  no plan: {note}" for s, objective, _, note, _ in results
              if objective is None]
    return "\n".join(lines)


def _pictures(args, compiled: Compiled, rows, report: str) -> None:
    from .picture import html_page, step_graph, write_picture
    from .report import repeats_of
    graph = step_graph(compiled.plan, compiled.program, rows, repeats_of(compiled.plan, compiled.signature))
    title = f"{args.factory} on mesh {compiled.mesh}, profile {compiled.plan.profile}"
    if args.svg:
        try:
            write_picture(graph, title, args.svg)
        except OSError as e:
            raise OptionError(f"cannot write {args.svg}: {e.strerror}") from e
    if args.html:
        _write(args.html, html_page(graph, title, report))


def _write_trace(timeline, path: str) -> None:
    try:
        timeline.write_chrome_trace(path)
    except OSError as e:
        raise OptionError(f"cannot write {path}: {e.strerror}") from e


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise OptionError(f"cannot write {path}: {e.strerror}") from e


# -- schedule --------------------------------------------------------------------------------

def _schedule(args) -> int:
    if (args.layer_profile is None) == (args.factory is None):
        raise OptionError("give either a FACTORY (with --mesh) or --layer-profile FILE")
    if args.layer_profile is not None:
        return _layer_schedule(args)
    from .report import format_schedule, scheduled_collectives
    compiled = _compile_rank0(args)
    rows, result = scheduled_collectives(compiled.program, compiled.mesh)
    if args.trace:
        _write_trace(result, args.trace)
    if args.json:
        print(json.dumps({"makespan": result.makespan, "exposed_communication": result.exposed_communication,
                          "lower_bound": result.lower_bound, "peak_memory": result.peak_memory,
                          "collectives": [asdict(r) for r in rows]}))
        return 0
    print(f"schedule of rank 0's program on mesh {compiled.mesh}, profile {compiled.plan.profile}\n")
    print(format_schedule(rows, result))
    return 0


def _layer_schedule(args) -> int:
    from cost_models.layer_schedules import LayerProfile, lower_bound, schedules
    try:
        profile = LayerProfile.load(args.layer_profile)
    except OSError as e:
        raise OptionError(f"cannot read --layer-profile {args.layer_profile}: {e.strerror}") from None
    except ValueError as e:
        raise OptionError(f"--layer-profile {e}" if str(e).startswith(args.layer_profile)
                          else f"--layer-profile {args.layer_profile}: {e}") from None
    results = schedules(profile)
    bound = lower_bound(profile)
    if args.trace:
        _write_trace(results["ddlc"].simulate(TRACE_ITERATIONS), args.trace)
    if args.json:
        times = {name: s.iteration_time for name, s in results.items()}
        print(json.dumps(times | {"lower_bound": bound}))
        return 0
    print(_table(profile, results, bound))
    return 0


def _table(profile, results, bound) -> str:
    """Strategies with iteration time, ratio to the bound, exposed communication and the number
    of collectives; then ddlc's collectives in issue order."""
    lines = [f"{len(profile.layers)} layers, {profile.params:,} parameters, compute "
             f"{profile.compute_time * 1e3:.3f} ms; all-reduce a = {profile.a * 1e6:.1f} us, "
             f"b = {profile.b:.3g} s/element", "",
             f"{'strategy':<12}{'iteration ms':>14}{'/ bound':>9}{'exposed ms':>12}{'collectives':>13}"]
    for name, s in results.items():
        exposed = s.simulate().exposed_communication
        lines.append(f"{name:<12}{s.iteration_time * 1e3:>14.3f}{s.iteration_time / bound:>9.3f}"
                     f"{exposed * 1e3:>12.3f}{len(s.collectives):>13}")
    lines += [f"{'lower_bound':<12}{bound * 1e3:>14.3f}", "", "ddlc schedule:",
              f"{'#':>4}  {'ms':>8}  {'elements':>12}  collective"]
    for row in results["ddlc"].rows():
        placement = f"  [{row['placement']}]" if row["placement"] else ""
        lines.append(f"{row['order']:>4}  {row['seconds'] * 1e3:>8.3f}  {row['elements']:>12,}"
                     f"  {row['collective']}{placement}")
    return "\n".join(lines)


# -- calibrate -------------------------------------------------------------------------------

def _calibrate(args) -> int:
    # imported when used: calibration starts worker processes, the other commands do not
    from .calibrate import main as calibrate_main
    return calibrate_main(args)
