"""ddlc compiled for a 1-device mesh against the eager model, in one process.

Run: ``python bench/single_device.py`` (the models of ``bench/runtime.py``, a minute or
two) or ``--quick``.

One gloo process (:func:`ddlc.spawn` with world size 1, one intra-op thread) builds each
model of :mod:`bench.runtime` twice from seed 0 and times a training step (forward, loss,
backward, AdamW update) of

- ``eager``: the model itself;
- ``ddlc``: ``ddlc.compile`` on the mesh ``(1,)``: the per-rank program of a plan with no
  collectives, so what is measured is the program itself (views run as views; the
  optimizer update in place, ``passes/inplace.py``; the step's flattening around the graph);
- ``ddlc-functional``: the same with ``inplace=False``: the update allocates every result;
- ``ddlc-inductor``: the same program compiled by Inductor (needs a C++ compiler).

The variants step in turn on the same batches (the order rotating every round), so
machine noise hits them alike; the figure is the median step over the timed rounds, and
each is printed as a ratio to eager, and as the median of its per-round ratios to eager's
step of the same round with that median's 95% interval (``bench/runtime.py``'s
``paired_ratio``). The issue's target is ddlc at most 1.05x eager.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import ddlc  # noqa: E402
from ddlc.inductor import has_compiler  # noqa: E402
from runtime import FULL, QUICK, build, eager_step, make_batches, make_optimizer, paired_ratio  # noqa: E402


def _variants(name: str, kwargs: dict, batch0) -> dict:
    """variant -> step(batch) -> loss, each on its own copy of the model (seed 0)."""
    model, loss_fn = build(name, kwargs)
    opt = make_optimizer(model)
    steps = {"eager": lambda batch: eager_step(model, loss_fn, opt, batch)}
    for variant, backend, inplace in (("ddlc", "eager", True), ("ddlc-functional", "eager", False),
                                      ("ddlc-inductor", "inductor", True)):
        if backend == "inductor" and not has_compiler():
            continue
        model_c, loss_c = build(name, kwargs)
        compiled = ddlc.compile(model_c, (1,), batch0, loss_c, make_optimizer(model_c), backend=backend,
                                inplace=inplace)
        steps[variant] = (lambda c: (lambda batch: c.step(batch) if isinstance(batch, dict)
                                     else c.step(*batch)))(compiled)
    return steps


def _worker(rank: int, models: dict, warmup: int, timed: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for name, (kwargs, global_batch) in models.items():
        batches = make_batches(name, kwargs, global_batch, warmup + timed)
        steps = _variants(name, kwargs, batches[0])
        order = list(steps)
        times = {v: [] for v in order}
        losses = {v: [] for v in order}
        for i, batch in enumerate(batches):
            for variant in order[i % len(order):] + order[:i % len(order)]:
                start = time.perf_counter()
                loss = steps[variant](batch)
                elapsed = time.perf_counter() - start
                losses[variant].append(float(loss))
                if i >= warmup:
                    times[variant].append(elapsed)
        results[name] = {v: (statistics.median(times[v]),
                             max(abs(a - b) for a, b in zip(losses[v], losses["eager"])),
                             paired_ratio(times[v], times["eager"]))
                         for v in order}
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="timed rounds (default 15, quick 5)")
    args = ap.parse_args(argv)
    models = QUICK if args.quick else FULL
    timed = args.steps or (5 if args.quick else 15)
    print(f"ddlc on a 1-device mesh against eager: torch {torch.__version__}, one process, one "
          f"intra-op thread; {args.warmup} warm-up + {timed} timed steps per variant, "
          f"interleaved; load average at start {os.getloadavg()[0]:.2f}")
    (results,) = ddlc.spawn(_worker, 1, models, args.warmup, timed, timeout=600, deadline=1800)
    for name, rows in results.items():
        base = rows["eager"][0]
        print(f"\n== {name} {models[name][0]}, batch {models[name][1]}")
        print(f"  {'variant':<15}{'median ms':>10}{'/ eager':>9}{'paired / eager [95% CI]':>25}"
              f"{'max |loss - eager|':>20}")
        for variant, (seconds, gap, paired) in rows.items():
            print(f"  {variant:<15}{seconds * 1e3:>10.1f}{seconds / base:>9.2f}"
                  f"{'%.2f [%.2f, %.2f]' % paired:>25}{gap:>20.2e}")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
