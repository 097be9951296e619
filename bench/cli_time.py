"""Wall time of ``ddlc plan`` on a GPT-2-small-shaped model (12 layers, hidden 768, vocab
50304, sequence 1024, batch 8, AdamW) on a 2x4 mesh: the whole command in a fresh process
(interpreter start, imports, building the model, tracing, planning, lowering rank 0's
program, the report), and the per-pass times it logs with ``-v`` (summed over the two
processes: ``ddlc plan`` plans the data-parallel candidate in a forked one). The target is
5 s on a 2-core machine; this script measures (wall and CPU seconds), it does not assert.

    python bench/cli_time.py [--repeat 1] [--factory examples/factories.py:gpt2_small] [--mesh 2x4]
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^ddlc\.(?:pipeline|cli): (\S+)\s+([0-9.]+) ms")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(factory: str, mesh: str, profile: str) -> tuple[float, float, dict[str, float]]:
    """(wall seconds of the whole command, its CPU seconds (both processes), pass ->
    seconds from its log)."""
    command = [sys.executable, "-m", "ddlc", "plan", factory, "--mesh", mesh, "--profile", profile, "-v"]
    cpu, start = _children_cpu(), time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if out.returncode != 0:
        raise SystemExit(f"ddlc plan failed ({out.returncode}):\n{out.stderr}")
    passes: dict[str, float] = {}
    for line in out.stderr.splitlines():
        match = LINE.match(line)
        if match:
            passes[match.group(1)] = passes.get(match.group(1), 0.0) + float(match.group(2)) / 1e3
    return wall, cpu, passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factory", default="examples/factories.py:gpt2_small")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--profile", default="dgx-h100-ib")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    print(f"ddlc plan {args.factory} --mesh {args.mesh} --profile {args.profile}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    rounds = [measure(args.factory, args.mesh, args.profile) for _ in range(args.repeat)]
    wall, cpu, passes = min(rounds, key=lambda r: r[0])
    accounted = sum(passes.values())
    print(f"whole command {wall:.2f} s (best of {args.repeat}; target 5 s), {cpu:.2f} CPU-seconds")
    for name, seconds in passes.items():
        print(f"  {name:<13} {seconds:8.2f} s")
    if accounted <= wall:
        print(f"  {'other':<13} {wall - accounted:8.2f} s  (interpreter, imports, report)")
    else:  # ddlc plan forks the data-parallel candidate: its passes run beside the search's
        print(f"  (the passes add up to {accounted:.2f} s: those of the data-parallel candidate "
              "ran in a forked process beside the search's)")


if __name__ == "__main__":
    main()
