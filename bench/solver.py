"""Sharding search benchmark: coordinate descent vs the exact MILP, and the chosen plan vs
hand-written baselines, on GPT-2-small-width models (hidden 768, 12 heads, seq 1024,
vocab 50304, batch 8, AdamW, profile dgx-h100-ib).

For each (layers, mesh): nodes of the traced step, search seconds of coordinate descent
(``cd s``, build included) and of the exact solver (``exact s``, with a time limit; ``T``
marks a timeout, whose incumbent is used), the objective ratio cd / exact, and the modeled
step time (ms) of the cd plan and of three baselines on the same graph and cost model, as
ratios baseline / cd. Baselines pin the parameters and the batch through ``fixed`` and let
coordinate descent place every other node (the best plan it finds with those placements): ``dp`` batch split on dim 0 over every axis, parameters replicated;
``tp`` Megatron tensor parallel over every axis (qkv / fc weights and biases split on
their output dim, proj / out weights on their input dim, everything else replicated,
batch replicated); ``tpxdp`` data parallel on axis 0 and Megatron on the other axes
(meshes with 2+ axes). ``n/a``: not on this mesh or the placements do not divide the
shapes.

    python bench/solver.py            # 2, 12, 24, 48 layers on (8,), (2, 4), (4, 4, 4)
    python bench/solver.py --quick    # 2 layers on (8,) and (2, 4): under a minute
"""
from __future__ import annotations

import argparse
import time

import torch

import ddlc
from ddlc import B, NdSBP, S
from ddlc.errors import ShardingError
from ddlc.zoo import GPT, lm_loss
from passes.canonicalize import canonicalize
from passes.shared_reads import insert_shared_reads
from passes.sharding import shard

COLUMN = ("attn.qkv.weight", "attn.qkv.bias", "fc.weight", "fc.bias")  # split the output dim
ROW = ("attn.proj.weight", "out.weight")                               # split the input dim


def trace_gpt(layers: int):
    torch.manual_seed(0)
    model = GPT(vocab=50304, d_model=768, n_heads=12, n_layers=layers, seq_len=1024)
    idx = torch.zeros(8, 1024, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters())
    return insert_shared_reads(canonicalize(ddlc.trace(model, (idx, idx), lm_loss, opt)))


def _megatron(key: str, axis_sbp) -> object:
    if key.endswith(COLUMN):
        return S(0)
    if key.endswith(ROW):
        return S(1)
    return axis_sbp


def baseline(gm, kind: str, ndim: int) -> dict[str, NdSBP] | None:
    """``fixed`` placements of parameters and batch for a baseline (None: not on this mesh)."""
    if kind == "tpxdp" and ndim < 2:
        return None
    fixed = {}
    for spec in gm.meta["ddlc_step"].inputs:
        per_axis = []
        for axis in range(ndim):
            dp_axis = kind == "dp" or (kind == "tpxdp" and axis == 0)
            if spec.role == "input":
                per_axis.append(S(0) if dp_axis else B)
            elif spec.role == "param":
                per_axis.append(B if dp_axis else _megatron(spec.key, B))
            else:
                break
        if len(per_axis) == ndim:
            fixed[spec.name] = NdSBP(tuple(per_axis))
    return fixed


def run(layers: int, mesh_shape, exact_limit: float) -> str:
    gm = trace_gpt(layers)
    mesh = ddlc.Mesh(mesh_shape, profile="dgx-h100-ib")
    nodes = sum(1 for n in gm.graph.nodes if n.op != "output")
    start = time.perf_counter()
    cd = shard(gm, mesh)
    cd_s = time.perf_counter() - start
    start = time.perf_counter()
    try:
        exact = shard(gm, mesh, solver="exact", time_limit=exact_limit)
        exact_s = f"{time.perf_counter() - start:.1f}" + ("" if exact.stats["optimal"] else "T")
        ratio = f"{cd.objective / exact.objective:.4f}"
    except ShardingError as e:  # a timeout whose incumbent is unusable, or infeasible
        exact_s, ratio = f"{time.perf_counter() - start:.1f}T", "-"
        print(f"  exact ({mesh_shape}, {layers} layers): {str(e).splitlines()[0]}")
    cells = []
    for kind in ("dp", "tp", "tpxdp"):
        fixed = baseline(gm, kind, mesh.ndim)
        try:
            if fixed is None:
                raise ShardingError("not on this mesh")
            base = shard(gm, mesh, fixed=fixed)
            cells.append(f"{base.objective / cd.objective:.3f}")
        except ShardingError:
            cells.append("n/a")
    return (f"{layers:>6} {str(mesh_shape):>10} {nodes:>7} {cd_s:>8.2f} {exact_s:>9} {ratio:>9} "
            f"{cd.objective * 1e3:>9.2f} " + " ".join(f"{c:>7}" for c in cells))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers on (8,) and (2, 4)")
    parser.add_argument("--exact-limit", type=float, default=None, help="exact solver seconds")
    parser.add_argument("--layers", type=int, nargs="*", default=None)
    parser.add_argument("--meshes", nargs="*", default=None, help='e.g. 8 2x4 4x4x4')
    args = parser.parse_args(argv)
    layers = args.layers or ([2] if args.quick else [2, 12, 24, 48])
    meshes = ([tuple(int(p) for p in m.split("x")) for m in args.meshes] if args.meshes else
              [(8,), (2, 4)] if args.quick else [(8,), (2, 4), (4, 4, 4)])
    limit = args.exact_limit or (10.0 if args.quick else 120.0)
    print(f"{'layers':>6} {'mesh':>10} {'nodes':>7} {'cd s':>8} {'exact s':>9} {'cd/exact':>9} "
          f"{'cd ms':>9} {'dp/cd':>7} {'tp/cd':>7} {'tpxdp/cd':>7}")
    for n in layers:
        for shape in meshes:
            print(run(n, shape, limit), flush=True)


if __name__ == "__main__":
    main()
