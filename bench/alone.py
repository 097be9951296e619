"""Measured mode's operator times against the program they make up, one process alone.

Run: ``python bench/alone.py [--models gpt,mlp,cnn,gpt2] [--top 8]``.

``compute="measured"`` (:mod:`cost_models.measured`) prices each operator by timing it in
a loop of the same call. This checks that against the program those operators make up,
with no other rank on the cores (no contention): for each model of ``bench/fidelity.py``,
the per-rank program of data parallelism on 4 ranks (the single-device step on the
micro-batch, global batch / 4) is compiled for a 1-device mesh in measured mode without
contention (its operators measured now, into a temporary cache: a cache from another hour
holds another speed of this machine), and

- ``modeled``: the program's modeled makespan (the sum of its operators' measured times);
- ``measured``: the median of ``CompiledStep.step`` over the timed steps, one thread;
- per operator kind, the seconds the program's nodes of that kind take under a
  node-timing ``torch.fx.Interpreter`` (which adds a few microseconds per node) against
  their modeled seconds, the kinds with the most excess first.

Where ``measured / modeled`` is far from 1 the fidelity benchmark's contention factors,
fitted on ``ddlc calibrate``'s MLP steps, cannot be right for every model.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ddlc  # noqa: E402
import fidelity  # noqa: E402
from cost_models.program import NodeCosts, program_timeline  # noqa: E402
from ddlc.mesh import load_profile  # noqa: E402


def one_model(name: str, steps: int, top: int) -> None:
    kwargs, global_batch = fidelity.FULL[name]
    batch = fidelity.make_batches(name, kwargs, global_batch // 4, 1)[0]
    model, loss_fn = fidelity.build(name, kwargs)
    profile = dataclasses.replace(load_profile("cpu-gloo"), compute="measured", contention=None)
    step = ddlc.compile(model, (1,), batch, loss_fn, fidelity.make_optimizer(model), profile=profile,
                        compute="measured")
    modeled = program_timeline(step.gm, profile).makespan
    times = []
    for _ in range(3 + steps):
        start = time.perf_counter()
        fidelity.call(step, batch)
        times.append(time.perf_counter() - start)
    measured = statistics.median(times[3:])
    print(f"{name}: modeled {modeled * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms "
          f"(measured / modeled {measured / modeled:.2f})")
    flat = fidelity.flat_inputs(step, batch)
    timer = fidelity.NodeTimer(step.gm)
    with torch.no_grad():
        for _ in range(5):
            timer.run(*flat)
    costs = NodeCosts(profile)
    kinds = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for node in step.gm.graph.nodes:
        if node.op == "call_function":
            kind = kinds[str(node.target)]
            kind[0] += 1
            kind[1] += costs.seconds(node)
            kind[2] += statistics.median(timer.seconds[node])
    print(f"  {'operator':52s} {'nodes':>5s} {'modeled ms':>10s} {'timed ms':>9s} {'ratio':>6s}")
    for kind, (count, model_s, timed_s) in sorted(kinds.items(), key=lambda kv: kv[1][1] - kv[1][2])[:top]:
        ratio = f"{timed_s / model_s:6.2f}" if model_s > 0 else "  free"
        print(f"  {kind[:52]:52s} {count:5d} {model_s * 1e3:10.3f} {timed_s * 1e3:9.3f} {ratio}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,mlp,cnn,gpt2")
    ap.add_argument("--steps", type=int, default=12, help="timed steps (after 3 untimed)")
    ap.add_argument("--top", type=int, default=8, help="operator kinds shown per model")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["DDLC_SHARING"] = "1"   # operator times as measured alone
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cache = tempfile.TemporaryDirectory()
    os.environ["DDLC_CACHE_DIR"] = cache.name
    try:
        print(f"measured mode against the program, one process alone: torch {torch.__version__}, "
              f"1 thread; load average {os.getloadavg()[0]:.2f}")
        for name in args.models.split(","):
            one_model(name, args.steps, args.top)
    finally:
        dist.destroy_process_group()
        cache.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
