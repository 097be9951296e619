"""Wall time of a compiled data-parallel training step vs. DistributedDataParallel.

Run: ``python bench/runtime.py`` (full, a few minutes) or ``python bench/runtime.py --quick``
(smaller models, fewer steps, < 60 s).

On ``--world-size`` (default 4) local gloo processes started by :func:`ddlc.spawn`, for each
model (a GPT and an MLP from :mod:`ddlc.zoo`) and the same global batch, it times one
training step (forward, loss, backward, gradient communication, AdamW update) of

1. ``ddlc.compile(..., placements={"input0": "(S0)", "input1": "(S0)"}, schedule=True)``:
   the compiled data-parallel step with the communication schedule;
2. the same with ``schedule=False``;
3. ``torch.nn.parallel.DistributedDataParallel`` on the same model, each rank on its
   micro-batch (global batch / world size), with the same AdamW and loss.

The three variants start from the same initial parameters and see the same batches; they
run interleaved (one step of each per round, the order rotating every round) so that
machine noise hits all of them alike. Before each timed step every rank waits at a
barrier; a step's time is the slowest rank's ``time.perf_counter`` interval from leaving
the barrier to having the new parameters, and the reported figure is the median over the
timed steps (rank 0's median is printed too). The losses of every step are compared
(the DDP loss is the mean of the ranks' micro-batch losses, i.e. the global-batch loss).

If this ddlc's ``compile`` has no ``schedule`` argument yet, variant 1 is skipped with a
note and variant 2 is ``compile`` without the argument.

Gloo on CPU implements reduce-scatter as all-reduce + chunk (see shared/TORCH_NOTES.md),
and here the processes share few cores: these timings say nothing about GPU/NCCL behaviour.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ddlc  # noqa: E402
from ddlc.zoo import GPT, MLP, lm_loss  # noqa: E402

PROFILE = os.environ.get("DDLC_PROFILE", "cpu-gloo")  # workers inherit it; see --profile
LR, EPS, WEIGHT_DECAY = 1e-2, 1e-4, 0.01

# name -> (constructor kwargs, global batch); GPT batches are (tokens, next tokens),
# MLP batches are (inputs, regression targets) with an MSE loss.
FULL = {
    "gpt": (dict(vocab=512, d_model=192, n_heads=4, n_layers=3, seq_len=64), 16),
    "mlp": (dict(d_in=256, d_hidden=1024, d_out=64, depth=4), 256),
}
QUICK = {
    "gpt": (dict(vocab=256, d_model=128, n_heads=4, n_layers=2, seq_len=32), 16),
    "mlp": (dict(d_in=128, d_hidden=512, d_out=32, depth=3), 128),
}
VARIANTS = ("ddlc+schedule", "ddlc", "DDP", "eager-no-comm")


# -- model, data, optimizer (identical in every variant) -----------------------------------
def build(name: str, kwargs: dict):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(**kwargs), lm_loss
    return MLP(**kwargs), F.mse_loss


def make_batches(name: str, kwargs: dict, global_batch: int, n: int):
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        shape = (global_batch, kwargs["seq_len"])
        return [(torch.randint(0, kwargs["vocab"], shape, generator=g),
                 torch.randint(0, kwargs["vocab"], shape, generator=g)) for _ in range(n)]
    return [(torch.randn(global_batch, kwargs["d_in"], generator=g),
             torch.randn(global_batch, kwargs["d_out"], generator=g)) for _ in range(n)]


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY)


def count_params(name: str, kwargs: dict) -> int:
    model, _ = build(name, kwargs)
    return sum(p.numel() for p in model.parameters())


# -- the variants ---------------------------------------------------------------------------
def compile_variant(name, kwargs, batch0, schedule, replicate_params=False):
    """``(step_fn, info)`` of a compiled variant."""
    model, loss_fn = build(name, kwargs)
    opt = make_optimizer(model)
    placements = {"input0": "(S0)", "input1": "(S0)"}
    if replicate_params:   # classic data parallelism: every parameter whole on every rank
        placements.update({k: "(B)" for k, _ in model.named_parameters()})
    start = time.perf_counter()
    note = None
    compiled = ddlc.compile(model, (dist.get_world_size(),), batch0, loss_fn, opt,
                            placements=placements, profile=PROFILE, schedule=schedule)
    compile_s = time.perf_counter() - start
    from ddlc.ir import collective_sequence
    seq = collective_sequence(compiled.gm)
    kinds = Counter(k for k, _, _ in seq)
    try:
        param_sbps = Counter(str(compiled._sbp(k)) for k in compiled.params)
    except Exception:  # private helper; only for the printout
        param_sbps = Counter()
    info = dict(compile_s=compile_s, note=note, collectives=dict(kinds),
                comm_bytes=sum(b for _, _, b in seq), param_sbps=dict(param_sbps),
                fingerprint=compiled.fingerprint)
    return (lambda batch: compiled.step(*batch)), info


def ddp_variant(name, kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model, loss_fn = build(name, kwargs)
    # The GPT's only buffer (positions) is constant: don't broadcast it every forward.
    with warnings.catch_warnings():   # broadcast_buffers is deprecated but still the way
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DDP(model, broadcast_buffers=False)
    opt = make_optimizer(ddp)
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(batch):
        x, y = (t.chunk(world)[rank] for t in batch)   # this rank's micro-batch
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()                                  # DDP all-reduces gradients (avg)
        opt.step()
        return loss.detach()

    return step, dict(bucket_cap_mb=25, note=None)


def local_variant(name, kwargs):
    """Reference only: the eager step on this rank's micro-batch with no communication."""
    model, loss_fn = build(name, kwargs)
    opt = make_optimizer(model)
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(batch):
        x, y = (t.chunk(world)[rank] for t in batch)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, dict(note=None)


def bench_model(rank, name, kwargs, global_batch, warmup, steps, replicate_params):
    world = dist.get_world_size()
    batches = make_batches(name, kwargs, global_batch, warmup + steps)
    fns, infos = {}, {}
    for variant, schedule in (("ddlc+schedule", True), ("ddlc", False)):
        fn, info = compile_variant(name, kwargs, batches[0], schedule, replicate_params)
        if fn is None:
            infos[variant] = dict(note=info)
        else:
            fns[variant], infos[variant] = fn, info
    fns["DDP"], infos["DDP"] = ddp_variant(name, kwargs)
    fns["eager-no-comm"], infos["eager-no-comm"] = local_variant(name, kwargs)
    order = [v for v in VARIANTS if v in fns]
    times = {v: [] for v in order}
    losses = {v: [] for v in order}
    for i in range(warmup + steps):
        k = i % len(order)
        for v in order[k:] + order[:k]:   # rotate which variant runs first in a round
            dist.barrier()
            t0 = time.perf_counter()
            loss = fns[v](batches[i])   # global batch; each variant takes this rank's part
            t1 = time.perf_counter()
            losses[v].append(loss)
            if i >= warmup:
                times[v].append(t1 - t0)
    # DDP's loss is this rank's micro-batch loss: the global loss is the mean over ranks.
    for v in ("DDP", "eager-no-comm"):
        local_losses = torch.stack(losses[v]).to(torch.float64)
        dist.all_reduce(local_losses)
        losses[v] = (local_losses / world).tolist()
    for v in order:
        if v not in ("DDP", "eager-no-comm"):
            losses[v] = [float(x) for x in losses[v]]
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    return dict(order=order, infos=infos, losses=losses, times_by_rank=everyone)


def worker(rank, configs, warmup, steps, replicate_params):
    results = {name: bench_model(rank, name, kwargs, gb, warmup, steps, replicate_params)
               for name, (kwargs, gb) in configs.items()}
    return results if rank == 0 else None


# -- report -----------------------------------------------------------------------------------
def report(name, kwargs, global_batch, world, r):
    order, infos, losses = r["order"], r["infos"], r["losses"]
    per_rank = r["times_by_rank"]
    # a step takes as long as its slowest rank
    step_max = {v: [max(ts[v][i] for ts in per_rank) for i in range(len(per_rank[0][v]))]
                for v in order}
    med = {v: statistics.median(step_max[v]) for v in order}
    med0 = {v: statistics.median(per_rank[0][v]) for v in order}
    print(f"\n== {name.upper()} {kwargs}: {count_params(name, kwargs):,} parameters, global batch "
          f"{global_batch} ({global_batch // world} per rank)")
    for v in VARIANTS:
        info = infos.get(v, {})
        if v not in order:
            print(f"  {v:14s} NOT AVAILABLE: {info.get('note')}")
            continue
        if v == "DDP":
            desc = "torch DDP, default buckets (25 MiB), broadcast_buffers=False"
        elif v == "eager-no-comm":
            desc = ("reference only: eager step on the micro-batch, no communication (each rank "
                    "trains its own copy; its loss after step 1 is not comparable)")
        else:
            sbps = ", ".join(f"{n}x{s}" for s, n in sorted(info["param_sbps"].items()))
            colls = ", ".join(f"{n} {k}" for k, n in sorted(info["collectives"].items()))
            desc = (f"compiled in {info['compile_s']:.1f} s; per step {colls or 'no collectives'} "
                    f"({info['comm_bytes'] / 2**20:.2f} MiB); params {sbps}")
        print(f"  {v:14s} {desc}")
        if info.get("note"):
            print(f"  {'':14s} NOTE: {info['note']}")
    print(f"  {'variant':14s} {'median ms':>10s} {'rank0 ms':>9s} {'p25 ms':>8s} {'p75 ms':>8s} "
          f"{'max ms':>8s}"
          f"  {'|loss - DDP| step 1':>20s} {'max over steps':>15s}")
    for v in order:
        d1 = abs(losses[v][0] - losses["DDP"][0])
        dmax = max(abs(a - b) for a, b in zip(losses[v], losses["DDP"]))
        dmax = f"{dmax:15.2e}" if v != "eager-no-comm" else f"{'-':>15s}"
        q1, _, q3 = statistics.quantiles(step_max[v], n=4, method="inclusive") if len(step_max[v]) > 1 else [med[v]] * 3
        print(f"  {v:14s} {med[v] * 1e3:10.1f} {med0[v] * 1e3:9.1f} {q1 * 1e3:8.1f} {q3 * 1e3:8.1f} "
              f"{max(step_max[v]) * 1e3:8.1f}  {d1:20.2e} {dmax}")
    print("  first-step loss: " + ", ".join(f"{v} {losses[v][0]:.6f}" for v in order))
    ok = all(abs(losses[v][0] - losses["DDP"][0]) <= 1e-5 * max(1.0, abs(losses["DDP"][0]))
             for v in order)
    print("  first-step losses " + ("MATCH (rel. tol 1e-5)" if ok else "DIFFER (rel. tol 1e-5)"))
    ratios = []
    for a, b in (("ddlc+schedule", "DDP"), ("ddlc", "DDP"), ("ddlc+schedule", "ddlc")):
        if a in med and b in med:
            ratios.append(f"({a})/({b}) = {med[a] / med[b]:.3f}")
        else:
            ratios.append(f"({a})/({b}) = n/a")
    print("  ratios of median step times: " + ";  ".join(ratios))
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer steps (< 60 s)")
    ap.add_argument("--warmup", type=int, help="untimed steps per variant (default 3; quick 2)")
    ap.add_argument("--steps", type=int, help="timed steps per variant (default 15; quick 5)")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--profile", help="hardware profile name or JSON path the search plans for "
                    "(e.g. one written by `python -m ddlc calibrate --out FILE`)")
    ap.add_argument("--models", default="gpt,mlp", help="comma-separated subset of gpt,mlp")
    ap.add_argument("--replicate-params", action="store_true",
                    help="also pin every parameter to (B) (classic data parallelism); by default "
                         "only the batch inputs are pinned and the sharding search places the "
                         "parameters")
    args = ap.parse_args(argv)
    if args.profile:
        os.environ["DDLC_PROFILE"] = args.profile
        global PROFILE
        PROFILE = args.profile
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    steps = args.steps if args.steps is not None else (5 if args.quick else 15)
    table = QUICK if args.quick else FULL
    configs = {m: table[m] for m in args.models.split(",")}
    world = args.world_size
    for name, (_, gb) in configs.items():
        if gb % world:
            ap.error(f"global batch {gb} of {name} does not divide by world size {world}")

    print(f"ddlc runtime benchmark{' (--quick)' if args.quick else ''}: torch {torch.__version__}, "
          f"backend gloo (CPU), world size {world} local processes (ddlc.spawn, 1 intra-op thread "
          f"each) on a machine with {os.cpu_count()} CPU cores"
          + (" - oversubscribed: ranks share cores" if world > (os.cpu_count() or 1) else ""))
    print(f"timed: one training step (forward, loss, backward, gradient communication, AdamW "
          f"lr={LR} eps={EPS} wd={WEIGHT_DECAY}) of (1) ddlc.compile data-parallel "
          f"(mesh ({world},), batch inputs pinned to (S0), "
          + ("every parameter pinned to (B)" if args.replicate_params else
             "parameters placed by the sharding search")
          + f", profile {PROFILE}) with schedule=True, "
          f"(2) same with schedule=False, (3) torch DDP on the same per-rank micro-batch, and, "
          f"as a compute-only reference, the eager step on the micro-batch without communication; "
          f"{warmup} warm-up + {steps} timed steps each, interleaved; barrier before every step; "
          f"step time = max over ranks of time.perf_counter around the step; median over steps.")
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.2f}"
          + (f" - WARNING: other processes are competing for the {os.cpu_count()} cores; "
             "expect noisy timings" if load > 1 else ""))
    print("CAVEAT: gloo implements reduce-scatter as all-reduce + chunk, and the ranks are CPU "
          "processes sharing cores: these timings say nothing about GPU/NCCL behaviour.")
    start = time.perf_counter()
    results = ddlc.spawn(worker, world, configs, warmup, steps, args.replicate_params,
                         timeout=300, deadline=3000)[0]
    ok = True
    for name, (kwargs, gb) in configs.items():
        ok &= report(name, kwargs, gb, world, results[name])
    print(f"\ntotal wall time {time.perf_counter() - start:.1f} s (including process start-up "
          f"and compilation); load average at the end {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
