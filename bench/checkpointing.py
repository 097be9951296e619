"""What activation checkpointing buys and costs in ddlc's model of a step: a ddlc.zoo GPT
with and without its blocks under ``torch.utils.checkpoint``, traced, planned (the plan
``ddlc.compile`` would choose) and lowered for rank 0 in this process; printed: the modeled
step, its compute and the modeled peak memory of rank 0's program, and the ratios.

    python bench/checkpointing.py [--layers 8] [--width 256] [--seq 256] [--batch 16] [--mesh 4]
"""
from __future__ import annotations

import argparse

import torch

from cost_models.program import program_timeline
from ddlc import pipeline
from ddlc.mesh import Mesh, load_profile
from ddlc.options import CompileOptions
from ddlc.simulate import axis_group_names
from ddlc.zoo import GPT, lm_loss


def modeled(checkpoint: bool, args) -> tuple[float, float, int]:
    """(modeled step s, its compute s, peak bytes) of rank 0's program."""
    torch.manual_seed(0)
    model = GPT(vocab=256, d_model=args.width, n_heads=8, n_layers=args.layers, seq_len=args.seq,
                checkpoint=checkpoint)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    profile = load_profile("cpu-gloo").for_local_ranks(Mesh(args.mesh).size)
    mesh = Mesh(args.mesh, profile=profile)
    options = CompileOptions.from_kwargs(profile=profile)
    groups = axis_group_names(mesh)
    with pipeline.collections_deferred():
        gm = pipeline.trace_step(model, (tokens, tokens), lm_loss, torch.optim.AdamW(model.parameters()), options)
        chosen = pipeline.choose_plan(gm, mesh, options, {}, groups)
        program = chosen.program
        if program is None:
            pipeline.lower(gm, mesh, (0,) * mesh.ndim, groups, options, chosen.choices)
            program = gm
    timeline = program_timeline(program, mesh.profile)
    return timeline.makespan, timeline.compute_time, timeline.peak_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mesh", default="4")
    args = ap.parse_args()
    print(f"ddlc.zoo GPT: {args.layers} layers of width {args.width}, sequence {args.seq}, batch "
          f"{args.batch}, AdamW, mesh {args.mesh}, cpu-gloo")
    rows = {name: modeled(name == "checkpointed", args) for name in ("plain", "checkpointed")}
    for name, (step, compute, peak) in rows.items():
        print(f"  {name:<13} modeled step {step * 1e3:8.1f} ms  compute {compute * 1e3:8.1f} ms  "
              f"peak {peak / 2**20:8.1f} MiB")
    (step0, compute0, peak0), (step1, compute1, peak1) = rows.values()
    print(f"  checkpointed / plain: step {step1 / step0:.2f}x, compute {compute1 / compute0:.2f}x, "
          f"peak {peak1 / peak0:.2f}x")


if __name__ == "__main__":
    main()
