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

- ``fidelity.png``: modeled against measured step time per plan, one marker per model,
  with the y = x line and the +-15 % band, from the rows ``python bench/fidelity.py --json
  FILE`` wrote (``--fidelity-json FILE``, default ``bench/plots/fidelity.json``; drawn only
  when that file exists: the benchmark itself takes minutes on 4 ranks).

    python bench/plots.py [--layers 1 2 4] [--meshes 8 2x4 2x2x2] [--only planning|schedule|fidelity]
                          [--fidelity-json FILE]
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


def plot_fidelity(data: dict, path: str) -> None:
    """Modeled against measured milliseconds, every plan of every model of a fidelity run."""
    fig = Figure(figsize=(6.5, 5))
    ax = fig.add_subplot()
    markers = "osD^v<>"
    everything = []
    for i, (model, summary) in enumerate(data["summary"].items()):
        rows = summary["rows"]
        xs, ys = [r["measured"] * 1e3 for r in rows], [r["modeled"] * 1e3 for r in rows]
        everything += xs + ys
        ax.scatter(xs, ys, marker=markers[i % len(markers)], label=f"{model} (median error "
                   f"{summary['median_error']:.0%}, rho {summary['rho']:.2f})", zorder=3)
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(r["plan"] + ("*" if r["plan"] == summary.get("chosen") else ""), (x, y),
                        fontsize=6, xytext=(3, 2), textcoords="offset points")
    lo, hi = min(everything) / 1.5, max(everything) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="modeled = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="k", alpha=0.08,
                    label="+-15 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms, slowest rank, median)")
    ax.set_ylabel("modeled step time (ms, timeline model)")
    load = data.get("load")
    ax.set_title(f"Cost-model fidelity: {data['world']} gloo ranks, compute {data['compute']}, "
                 f"profile {os.path.basename(str(data['profile']))}" + (f"\nload average {load[0]:.1f} at the end" if load else ""),
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--meshes", nargs="*", default=["8", "2x4", "2x2x2"])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layer-profile", metavar="FILE", help="per-layer profile JSON for the schedule plot")
    ap.add_argument("--only", choices=("planning", "schedule", "fidelity"))
    ap.add_argument("--fidelity-json", default=os.path.join(OUT, "fidelity.json"),
                    help="rows of `python bench/fidelity.py --json FILE` for fidelity.png")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if args.only in (None, "fidelity"):
        if os.path.exists(args.fidelity_json):
            import json
            with open(args.fidelity_json) as f:
                plot_fidelity(json.load(f), os.path.join(OUT, "fidelity.png"))
        else:
            print(f"no {args.fidelity_json}: run `python bench/fidelity.py --json "
                  f"{args.fidelity_json}` first; fidelity.png not drawn", file=sys.stderr)
    if args.only == "fidelity":
        print(f"wrote {OUT}")
        return
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
