"""Wall time of ``ddlc plan`` on a GPT-2-small-shaped model (12 layers, hidden 768, vocab
50304, sequence 1024, batch 8, AdamW) on a 2x4 mesh: the whole command in a fresh process
(interpreter start, imports, building the model, tracing, planning, lowering rank 0's
program, the report), and the per-pass times it logs with ``-v`` (summed over the two
processes: ``ddlc plan`` plans the data-parallel candidate in a forked one). The target is
5 s on a 2-core machine; this script measures (wall and CPU seconds), it does not assert.

A shared VM's speed drifts by tens of percent within an hour, so ``--against REV`` also
times the command of git revision ``REV`` (checked out in a temporary worktree), the two
run alternately, and prints each one's best and median and their ratio. Each round also
times the imports alone (a fresh interpreter importing torch, ``torch._dynamo``, which
tracing needs, and ``ddlc.cli``): the floor under the command, and a yardstick of the
VM's speed at the hour of the run.

    python bench/cli_time.py [--repeat 1] [--factory examples/factories.py:gpt2_small] [--mesh 2x4]
                             [--against REV]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^ddlc\.(?:pipeline|cli): (\S+)\s+([0-9.]+) ms")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(factory: str, mesh: str, profile: str, tree: Path = ROOT) -> tuple[float, float, dict[str, float]]:
    """(wall seconds of the whole command, its CPU seconds (both processes), pass ->
    seconds from its log), run on the code of ``tree`` (a checkout of this repository)."""
    command = [sys.executable, "-m", "ddlc", "plan", factory, "--mesh", mesh, "--profile", profile, "-v"]
    env = dict(os.environ, PYTHONPATH=str(tree))
    cpu, start = _children_cpu(), time.perf_counter()
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if out.returncode != 0:
        raise SystemExit(f"ddlc plan failed ({out.returncode}):\n{out.stderr}")
    passes: dict[str, float] = {}
    for line in out.stderr.splitlines():
        match = LINE.match(line)
        if match:
            passes[match.group(1)] = passes.get(match.group(1), 0.0) + float(match.group(2)) / 1e3
    return wall, cpu, passes


def imports_alone(tree: Path = ROOT) -> float:
    """Wall seconds of a fresh interpreter importing what every ``ddlc plan`` imports
    before it can trace: torch, ``torch._dynamo`` and ``ddlc.cli``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torch._dynamo, ddlc.cli"], cwd=tree, env=env, check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factory", default="examples/factories.py:gpt2_small")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--profile", default="dgx-h100-ib")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--against", metavar="REV", help="also time git revision REV, alternately with this code")
    args = ap.parse_args()
    print(f"ddlc plan {args.factory} --mesh {args.mesh} --profile {args.profile}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if args.against:
        compare(args.factory, args.mesh, args.profile, args.against, args.repeat)
        return
    rounds, floors = [], []
    for _ in range(args.repeat):
        rounds.append(measure(args.factory, args.mesh, args.profile))
        floors.append(imports_alone())
    wall, cpu, passes = min(rounds, key=lambda r: r[0])
    accounted = sum(passes.values())
    print(f"whole command {wall:.2f} s (best of {args.repeat}; target 5 s), {cpu:.2f} CPU-seconds; "
          f"the imports alone {min(floors):.2f} s (best of {args.repeat})")
    for name, seconds in passes.items():
        print(f"  {name:<13} {seconds:8.2f} s")
    if accounted <= wall:
        print(f"  {'other':<13} {wall - accounted:8.2f} s  (interpreter, imports, report)")
    else:  # ddlc plan forks the data-parallel candidate: its passes run beside the search's
        print(f"  (the passes add up to {accounted:.2f} s: those of the data-parallel candidate "
              "ran in a forked process beside the search's)")


@contextlib.contextmanager
def checkout(rev: str):
    """A temporary git worktree of this repository at ``rev``, removed on leaving."""
    with tempfile.TemporaryDirectory() as parent:
        tree = Path(parent) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev], cwd=ROOT, check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)


def compare(factory: str, mesh: str, profile: str, rev: str, repeat: int) -> None:
    """Time this code and revision ``rev`` alternately, ``repeat`` runs each (this code
    first in odd rounds, ``rev`` first in even ones); print each one's runs, best and
    median wall time and median CPU-seconds, and the ratios of the best and the medians."""
    with checkout(rev) as tree:
        runs: dict[str, list[tuple[float, float]]] = {"this code": [], rev: []}
        floors = []
        for i in range(repeat):
            floors.append(imports_alone())
            order = [("this code", ROOT), (rev, tree)]
            for name, path in order if i % 2 == 0 else order[::-1]:
                wall, cpu, _ = measure(factory, mesh, profile, path)
                runs[name].append((wall, cpu))
    for name, times in runs.items():
        walls = [w for w, _ in times]
        print(f"{name:>12}: {' '.join(f'{w:.2f}' for w in walls)} s; best {min(walls):.2f} s, "
              f"median {statistics.median(walls):.2f} s, {statistics.median(c for _, c in times):.2f} CPU-seconds")
    print(f"the imports alone (this code): best {min(floors):.2f} s, median {statistics.median(floors):.2f} s")
    mine, theirs = ([w for w, _ in runs[k]] for k in ("this code", rev))
    print(f"this code / {rev}: best {min(mine) / min(theirs):.3f}, "
          f"median {statistics.median(mine) / statistics.median(theirs):.3f}")


if __name__ == "__main__":
    main()
