"""Command line: ``python -m ddlc <command> ...``.

Each subcommand imports what it needs when it runs, so ``--help`` stays light.

``schedule --layer-profile FILE``: iteration time of every gradient-communication strategy
on a per-layer profile (see :mod:`cost_models.layer_schedules`); ``--json`` prints exactly
one JSON object on stdout, ``--trace OUT.json`` writes the Chrome trace of ddlc's schedule.
"""
from __future__ import annotations

import argparse
import json
import sys

from cost_models.layer_schedules import LayerProfile, lower_bound, schedules

TRACE_ITERATIONS = 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlc", description="ddlc: a distributed "
                                     "deep-learning compiler for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    schedule = commands.add_parser("schedule", help="compare communication schedules on a "
                                   "per-layer profile")
    schedule.add_argument("--layer-profile", required=True, metavar="FILE",
                          help='JSON: {"allreduce": {"a", "b"}, "layers": [{name, params, '
                               'forward, backward}, ...]} (seconds; b per element)')
    schedule.add_argument("--json", action="store_true", help="print one JSON object of "
                          "iteration times (s) and nothing else")
    schedule.add_argument("--trace", metavar="OUT.json", help="write the Chrome trace of "
                          f"ddlc's schedule ({TRACE_ITERATIONS} iterations)")
    schedule.set_defaults(run=_schedule)
    calibrate = commands.add_parser("calibrate", help="measure a hardware profile (compute and "
                                    "gloo links) on this machine and print it as JSON")
    calibrate.add_argument("--world-size", type=int, default=4, help="local gloo processes")
    calibrate.add_argument("--name", default="calibrated", help="the profile's name")
    calibrate.add_argument("--out", metavar="FILE.json", help="also write the profile here")
    calibrate.set_defaults(run=_calibrate)
    args = parser.parse_args(argv)
    return args.run(args)


def _calibrate(args) -> int:
    # imported when used: calibration starts worker processes, the other commands do not
    from ddlc.calibrate import main as calibrate_main
    return calibrate_main(args)


def _schedule(args) -> int:
    try:
        profile = LayerProfile.load(args.layer_profile)
    except (OSError, ValueError) as e:
        print(f"ddlc schedule: {args.layer_profile}: {e}", file=sys.stderr)
        return 2
    results = schedules(profile)
    bound = lower_bound(profile)
    if args.trace:
        results["ddlc"].simulate(TRACE_ITERATIONS).write_chrome_trace(args.trace)
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
