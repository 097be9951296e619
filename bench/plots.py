"""PNG plots of the benchmarks (matplotlib), written to ``bench/plots/``:

- ``planning_time.png``: planning seconds (shard + decouple on rank 0, in this process)
  against model size (GPT layers at width ``--width``, sequence 64, vocabulary 1024,
  batch 8, AdamW), one line per mesh shape;
- ``schedule_bandwidth.png``: modeled iteration time against link bandwidth (the
  all-reduce's per-element cost divided by the scale) for every gradient-communication
  strategy of :mod:`cost_models.layer_schedules`, with the lower bound; the per-layer
  profile is ``--layer-profile FILE`` or, by default, a ddlc.zoo GPT (d512, 4 layers,
  sequence 256, batch 32) planned data parallel on 8 GPUs of the ``dgx-h100-ib``
  profile (:func:`passes.decouple.layer_profile`).

Modeled against measured step time per plan needs the fidelity benchmark, which does not
exist yet; that plot is not drawn.

    python bench/plots.py [--layers 1 2 4] [--meshes 8 2x4 2x2x2] [--only planning|schedule]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
from tqdm import tqdm  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plots")
SCALES = (1, 1 / 2, 1 / 5, 1 / 10, 1 / 20, 1 / 50)


def planning_seconds(layers: int, meshes: list[str], width: int) -> dict[str, float]:
    """Trace a GPT of ``layers`` layers once; plan it on every mesh (seconds per mesh)."""
    import torch

    import ddlc
    from ddlc import pipeline
    from ddlc.options import CompileOptions
    from ddlc.zoo import GPT, lm_loss
    torch.manual_seed(0)
    model = GPT(vocab=1024, d_model=width, n_heads=4, n_layers=layers, seq_len=64)
    tokens = torch.zeros(8, 64, dtype=torch.long)
    options = CompileOptions()
    gm = pipeline.trace_step(model, (tokens, tokens), lm_loss, torch.optim.AdamW(model.parameters()), options)
    seconds = {}
    for mesh in meshes:
        start = time.perf_counter()
        pipeline.plan(gm, ddlc.Mesh(mesh, profile="dgx-h100-ib"), options, {})
        seconds[mesh] = time.perf_counter() - start
    return seconds


def plot_planning(layer_counts: list[int], meshes: list[str], width: int, path: str) -> None:
    results = {}
    for layers in tqdm(layer_counts, desc="planning", file=sys.stderr, disable=not sys.stderr.isatty()):
        results[layers] = planning_seconds(layers, meshes, width)
        print(f"{layers} layers: " + ", ".join(f"{m} {s:.2f} s" for m, s in results[layers].items()))
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for mesh in meshes:
        ax.plot(layer_counts, [results[n][mesh] for n in layer_counts], marker="o", label=f"mesh {mesh}")
    ax.set_xticks(layer_counts)
    ax.set_xlabel("GPT layers (width %d)" % width)
    ax.set_ylabel("planning time (s): shard + decouple")
    ax.set_title("Planning time against model size")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def zoo_gpt_profile() -> dict:
    """The data-parallel per-layer profile of a ddlc.zoo GPT on 8 GPUs of dgx-h100-ib."""
    import torch

    import ddlc
    from ddlc.zoo import GPT, lm_loss
    from passes.canonicalize import canonicalize
    from passes.decouple import layer_profile
    from passes.sharding import shard
    torch.manual_seed(0)
    model = GPT(vocab=8192, d_model=512, n_heads=8, n_layers=4, seq_len=256)
    tokens = torch.zeros(32, 256, dtype=torch.long)
    gm = canonicalize(ddlc.trace(model, (tokens, tokens), lm_loss, torch.optim.SGD(model.parameters(), lr=0.1)))
    mesh = ddlc.Mesh((8,), profile="dgx-h100-ib")
    pins = {i.name: ddlc.sbp.parse_sbp("(S0)" if i.role == "input" else "(B)") for i in gm.meta["ddlc_step"].inputs}
    shard(gm, mesh, fixed=pins)
    return layer_profile(gm, mesh)


def plot_schedules(profile: dict, title: str, path: str) -> None:
    from cost_models.layer_schedules import LayerProfile, lower_bound, schedules
    times: dict[str, list[float]] = {}
    bounds = []
    for scale in tqdm(SCALES, desc="bandwidths", file=sys.stderr, disable=not sys.stderr.isatty()):
        scaled = LayerProfile.from_dict({**profile, "allreduce": {"a": profile["allreduce"]["a"],
                                                                  "b": profile["allreduce"]["b"] / scale}})
        for name, schedule in schedules(scaled).items():
            times.setdefault(name, []).append(schedule.iteration_time * 1e3)
        bounds.append(lower_bound(scaled) * 1e3)
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for name, values in times.items():
        ax.plot(SCALES, values, marker="o", label=name)
    ax.plot(SCALES, bounds, "k--", label="lower bound")
    ax.set_xscale("log")
    ax.set_xticks(SCALES, labels=["1" if s == 1 else f"1/{round(1 / s)}" for s in SCALES])
    ax.minorticks_off()
    ax.invert_xaxis()
    ax.set_xlabel("link bandwidth (fraction of the profile's)")
    ax.set_ylabel("modeled iteration time (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    for name, values in times.items():
        print(f"{name:<12}" + " ".join(f"{v:8.3f}" for v in values))
    print(f"{'bound':<12}" + " ".join(f"{v:8.3f}" for v in bounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--meshes", nargs="*", default=["8", "2x4", "2x2x2"])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layer-profile", metavar="FILE", help="per-layer profile JSON for the schedule plot")
    ap.add_argument("--only", choices=("planning", "schedule"))
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if args.only != "schedule":
        plot_planning(args.layers, args.meshes, args.width, os.path.join(OUT, "planning_time.png"))
    if args.only != "planning":
        if args.layer_profile:
            import json
            with open(args.layer_profile) as f:
                profile, title = json.load(f), os.path.basename(args.layer_profile)
        else:
            profile, title = zoo_gpt_profile(), "ddlc.zoo GPT d512 x4, data parallel on 8 GPUs"
        plot_schedules(profile, title, os.path.join(OUT, "schedule_bandwidth.png"))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
