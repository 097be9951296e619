"""Wall time of a training step: ddlc against eager, DDP and FSDP2, measured in one run.

Run: ``python bench/runtime.py`` (full, a few minutes) or ``python bench/runtime.py --quick``
(smaller models, fewer steps, about a minute). On GPUs: ``torchrun --nproc-per-node=NGPU
bench/runtime.py``: the launcher's ranks, one GPU each, on NCCL, with larger models (the
``GPU`` table) unless ``--quick``; times are taken after ``torch.cuda.synchronize``.

On ``--world-size`` (default 4) local gloo processes started by :func:`ddlc.spawn`, for each
model (a GPT and an MLP from :mod:`ddlc.zoo`, and a Hugging Face GPT-2 from a small config
with its own loss) and the same global batch, it times one training step (forward, loss,
backward, gradient communication, AdamW update) of

- ``eager``: the single-device model on the whole global batch, on rank 0 alone (the other
  ranks wait): the numbers every other variant must reproduce;
- ``DDP``: ``torch.nn.parallel.DistributedDataParallel``, each rank on its micro-batch
  (global batch / world size);
- ``FSDP2``: ``torch.distributed.fsdp.fully_shard`` on every layer of the model's largest
  ``nn.ModuleList`` and on the root (parameters resharded after forward, its default);
- ``ddlc``: ``ddlc.compile`` with no placements: the plan the search picks;
- ``ddlc-dp``: ``ddlc.compile`` pinned to data parallelism (batch inputs ``(S0)``, every
  parameter ``(B)``, ``move_activations=False``: only gradients, parameters and scalars
  move); decoupling, fusion and scheduling as the cost model decides;
- ``ddlc-inductor``: ddlc's plan with ``backend="inductor"`` (each rank's program compiled
  by Inductor; needs a C++ compiler, else listed as not available);
- ``ddlc-measured``: ``ddlc.compile`` with ``compute="measured"``: the plan the search picks
  with operators priced by their times measured on this machine (rank 0 measures on the
  first compile and caches them) and the profile's measured contention of ranks sharing
  cores (``cpu-gloo`` has one for 4 ranks).

Every variant starts from the same parameters (seed 0) and sees the same batches; they run
interleaved (one step of each per round, the order rotating every round) so machine noise
hits all of them alike. Before each timed step every rank waits at a barrier; a step's time
is the slowest rank's ``time.perf_counter`` interval from leaving the barrier to having the
new parameters (rank 0's for ``eager``), and the reported figure is the median over the
timed steps. Each is printed as a ratio to DDP, and as the median of its per-round ratios
to DDP's step of the same round with that median's 95% interval (:func:`paired_ratio`: an
interval containing 1.00 means this run cannot tell the two apart). Bytes moved per step: ddlc's from its
program's collectives (:func:`ddlc.ir.collective_sequence`); FSDP2's counted on its first
(untimed) step by wrapping the ``torch.distributed`` collectives it calls; DDP's is the bytes of every
gradient, which it all-reduces once a step. All count each collective's whole buffer on one
rank (an all-gather's output, a reduce-scatter's input). The losses of every step are
compared with eager's (DDP's and FSDP2's are the mean of the ranks' micro-batch losses).
A ddlc row also shows its compile time and the step's overhead around the graph
(:func:`step_overhead`: reading hyper-parameters, slicing the batch, flattening).

Gloo on CPU implements reduce-scatter as all-reduce + chunk (see shared/TORCH_NOTES.md),
and here the processes share few cores: these timings say nothing about GPU/NCCL behaviour.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
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
import ddlc.launch  # noqa: E402
from ddlc.inductor import has_compiler  # noqa: E402
from ddlc.ir import collective_sequence  # noqa: E402
from ddlc.zoo import GPT, MLP, lm_loss  # noqa: E402

ON_GPUS = "RANK" in os.environ and torch.cuda.is_available()   # under torchrun with GPUs: NCCL
PROFILE = os.environ.get("DDLC_PROFILE", "dgx-h100-ib" if ON_GPUS else "cpu-gloo")  # see --profile
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if ON_GPUS else torch.device("cpu")
LR, EPS, WEIGHT_DECAY = 1e-2, 1e-4, 0.01

# name -> (constructor kwargs, global batch); GPT batches are (tokens, next tokens), MLP
# batches (inputs, regression targets) with an MSE loss, HF GPT-2 batches a dict with labels.
FULL = {
    "gpt": (dict(vocab=512, d_model=192, n_heads=4, n_layers=3, seq_len=64), 16),
    "mlp": (dict(d_in=256, d_hidden=1024, d_out=64, depth=4), 256),
    "hf-gpt2": (dict(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=64), 16),
}
QUICK = {
    "gpt": (dict(vocab=256, d_model=128, n_heads=4, n_layers=2, seq_len=32), 16),
    "mlp": (dict(d_in=128, d_hidden=512, d_out=32, depth=3), 128),
    "hf-gpt2": (dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=32), 8),
}
#: on GPUs, models large enough that a step is not all kernel launches
GPU = {
    "gpt": (dict(vocab=8192, d_model=1024, n_heads=16, n_layers=8, seq_len=512), 16),
    "mlp": (dict(d_in=1024, d_hidden=4096, d_out=1024, depth=4), 8192),
    "hf-gpt2": (dict(n_embd=768, n_layer=6, n_head=12, vocab_size=8192, n_positions=512), 16),
}
VARIANTS = ("eager", "DDP", "FSDP2", "ddlc", "ddlc-dp", "ddlc-inductor", "ddlc-measured")
UNAVAILABLE: dict[str, str] = {}   # variant -> why it cannot run here (filled by main)
MICRO_BATCHED = ("DDP", "FSDP2")   # variants that step on this rank's micro-batch


# -- model, data, optimizer (identical in every variant) -----------------------------------
def build(name: str, kwargs: dict):
    """``(model, loss_fn)`` with the parameters of seed 0; loss_fn None: the model's own."""
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(**kwargs).to(DEVICE), lm_loss
    if name == "mlp":
        return MLP(**kwargs).to(DEVICE), F.mse_loss
    import transformers
    config = transformers.GPT2Config(**kwargs, n_inner=4 * kwargs["n_embd"], bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).to(DEVICE), None


def make_batches(name: str, kwargs: dict, global_batch: int, n: int):
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return [(torch.randn(global_batch, kwargs["d_in"], generator=g),
                 torch.randn(global_batch, kwargs["d_out"], generator=g)) for _ in range(n)]
    if name == "gpt":
        shape = (global_batch, kwargs["seq_len"])
        return [(torch.randint(0, kwargs["vocab"], shape, generator=g),
                 torch.randint(0, kwargs["vocab"], shape, generator=g)) for _ in range(n)]
    shape = (global_batch, kwargs["n_positions"])
    batches = []
    for _ in range(n):
        ids = torch.randint(0, kwargs["vocab_size"], shape, generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def micro_batch(batch):
    """This rank's part of a global batch (a tuple or a dict of tensors)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if isinstance(batch, dict):
        return {k: v.chunk(world)[rank] for k, v in batch.items()}
    return tuple(t.chunk(world)[rank] for t in batch)


def forward_loss(model, loss_fn, batch):
    if loss_fn is None:
        return model(**batch).loss
    x, y = batch
    return loss_fn(model(x), y)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# -- the variants: each returns (step(global batch) -> loss, info) ---------------------------
def eager_step(model, loss_fn, opt, batch):
    opt.zero_grad(set_to_none=True)
    loss = forward_loss(model, loss_fn, batch)
    loss.backward()
    opt.step()
    return loss.detach()


def eager_variant(name, kwargs, batch0):
    model, loss_fn = build(name, kwargs)
    opt = make_optimizer(model)
    return (lambda batch: eager_step(model, loss_fn, opt, batch)), dict(comm_bytes=0)


def ddp_variant(name, kwargs, batch0):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model, loss_fn = build(name, kwargs)
    with warnings.catch_warnings():   # broadcast_buffers is deprecated but still the way
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DDP(model, broadcast_buffers=False,   # the buffers here are constants
                  device_ids=[DEVICE] if DEVICE.type == "cuda" else None)
    opt = make_optimizer(ddp)
    return ((lambda batch: eager_step(ddp, loss_fn, opt, micro_batch(batch))),
            dict(comm_bytes=param_bytes(model), how="every gradient all-reduced once"))


def fsdp2_variant(name, kwargs, batch0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model, loss_fn = build(name, kwargs)
    mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
    layers = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)),
                 key=lambda m: sum(p.numel() for p in m.parameters()))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(model)
    return ((lambda batch: eager_step(model, loss_fn, opt, micro_batch(batch))),
            dict(count_bytes=True, how=f"fully_shard on {len(layers)} layers and the root"))


def ddlc_variant(name, kwargs, batch0, pin_data_parallel, backend="eager", compute="roofline"):
    model, loss_fn = build(name, kwargs)
    opt = make_optimizer(model)
    placements = {}
    if pin_data_parallel:
        inputs = batch0.keys() if isinstance(batch0, dict) else [f"input{i}" for i in range(len(batch0))]
        placements = {k: "(S0)" for k in inputs}
        placements.update({k: "(B)" for k, _ in model.named_parameters()})
    start = time.perf_counter()
    compiled = ddlc.compile(model, (dist.get_world_size(),), batch0, loss_fn, opt,
                            placements=placements, profile=PROFILE, backend=backend,
                            move_activations=not pin_data_parallel, compute=compute)
    compile_s = time.perf_counter() - start
    seq = collective_sequence(compiled.gm)
    info = dict(compile_s=compile_s, collectives=dict(Counter(k for k, _, _ in seq)),
                comm_bytes=sum(b for _, _, b in seq),
                param_sbps=dict(Counter(str(compiled._sbp(k)) for k in compiled.params)))
    info["overhead_s"] = step_overhead(compiled, batch0)
    if isinstance(batch0, dict):
        return (lambda batch: compiled.step(batch)), info
    return (lambda batch: compiled.step(*batch)), info


def step_overhead(compiled, batch, repeats: int = 50) -> float:
    """Median seconds ``CompiledStep.step`` spends around the graph: reading the optimizer's
    hyper-parameters, checking and slicing the global batch, flattening the inputs and
    state, and splitting the outputs by role (timed on outputs of the right length)."""
    args, kwargs = ((), batch) if isinstance(batch, dict) else (batch, {})
    outputs = [None] * len(compiled.signature.outputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        flat = compiled.signature.flatten(compiled.params, compiled.buffers, compiled.opt_state,
                                          compiled._local_batch(args, kwargs),
                                          compiled._hyperparameters())
        compiled.signature.unflatten(outputs)
        times.append(time.perf_counter() - start)
    assert len(flat) == len(compiled.signature.inputs)
    return statistics.median(times)


BUILDERS = {
    "eager": eager_variant, "DDP": ddp_variant, "FSDP2": fsdp2_variant,
    "ddlc": lambda *a: ddlc_variant(*a, pin_data_parallel=False),
    "ddlc-dp": lambda *a: ddlc_variant(*a, pin_data_parallel=True),
    "ddlc-inductor": lambda *a: ddlc_variant(*a, pin_data_parallel=False, backend="inductor"),
    "ddlc-measured": lambda *a: ddlc_variant(*a, pin_data_parallel=False, compute="measured"),
}

#: torch.distributed collectives FSDP2 calls -> the parameter holding the whole buffer
COUNTED = {"all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
           "reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
           "all_reduce": "tensor"}


@contextlib.contextmanager
def counting_collectives(counter: list):
    """Wrap the collectives of :data:`COUNTED` so each call adds its buffer's bytes."""
    originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}

    def wrap(name, fn):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            buffer = signature.bind(*args, **kwargs).arguments[COUNTED[name]]
            counter[0] += buffer.numel() * buffer.element_size()
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _synchronize():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timed(variant: str, fn, batch):
    _synchronize()
    dist.barrier()
    start = time.perf_counter()
    loss = fn(batch) if variant != "eager" or dist.get_rank() == 0 else None
    _synchronize()
    return loss, time.perf_counter() - start


def bench_model(name, kwargs, global_batch, warmup, steps):
    world = dist.get_world_size()
    batches = [{k: v.to(DEVICE) for k, v in b.items()} if isinstance(b, dict)
               else tuple(t.to(DEVICE) for t in b)
               for b in make_batches(name, kwargs, global_batch, warmup + steps)]
    fns, infos = {}, {}
    for variant in VARIANTS:
        if variant in UNAVAILABLE:
            infos[variant] = dict(note=UNAVAILABLE[variant])
            continue
        try:
            fns[variant], infos[variant] = BUILDERS[variant](name, kwargs, batches[0])
        except Exception as e:  # noqa: BLE001 - reported in the table, and the run fails
            first = str(e).splitlines()[0] if str(e) else ""
            infos[variant] = dict(note=f"FAILED to build: {type(e).__name__}: {first[:300]}", failed=True)
    order = list(fns)
    times = {v: [] for v in order}
    losses = {v: [] for v in order}
    for i in range(warmup + steps):
        k = i % len(order)
        for v in order[k:] + order[:k]:   # rotate which variant runs first in a round
            if i == 0 and infos[v].pop("count_bytes", False):   # count on the first, untimed step
                counter = [0]
                with counting_collectives(counter):
                    loss, seconds = timed(v, fns[v], batches[i])
                infos[v]["comm_bytes"] = counter[0]
            else:
                loss, seconds = timed(v, fns[v], batches[i])
            losses[v].append(loss)
            if i >= warmup:
                times[v].append(seconds)
    for v in [v for v in MICRO_BATCHED if v in order]:   # the global loss: the mean of the
        # equal micro-batches' losses
        local = torch.stack(losses[v]).to(torch.float64)
        dist.all_reduce(local)
        losses[v] = (local / world).tolist()   # NCCL reduces on the GPU: .tolist() after
    for v in order:
        if v not in MICRO_BATCHED:
            losses[v] = [float(x) for x in losses[v]] if losses[v][0] is not None else None
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    return dict(order=order, infos=infos, losses=losses, times_by_rank=everyone)


def worker(rank, configs, warmup, steps, unavailable):
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)   # the local ranks share the cores
    else:
        torch.cuda.set_device(DEVICE)
    UNAVAILABLE.update(unavailable)   # a spawned worker starts from the module's defaults
    results = {name: bench_model(name, kwargs, gb, warmup, steps)
               for name, (kwargs, gb) in configs.items()}
    return results if rank == 0 else None


# -- report -----------------------------------------------------------------------------------
def paired_ratio(times, reference, level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high) of the per-round ratios ``times[i] / reference[i]`` of two
    variants timed in the same rounds, with the distribution-free interval of that median
    at ``level`` (order statistics k and n + 1 - k, k from the binomial distribution of the
    sign test: at least ``level`` coverage from 6 rounds on at 95%; below, (min, max)).
    Pairing a round's two steps cancels the machine's drift between rounds,
    which the ratio of the two medians does not."""
    from scipy.stats import binom
    ratios = sorted(t / r for t, r in zip(times, reference))
    n = len(ratios)
    k = max(1, int(binom.ppf((1 - level) / 2, n, 0.5)))  # P(Binom(n, 1/2) < k) <= (1 - level) / 2
    return statistics.median(ratios), ratios[k - 1], ratios[n - k]


def describe(variant: str, info: dict) -> str:
    if "collectives" in info:
        sbps = ", ".join(f"{n}x{s}" for s, n in sorted(info["param_sbps"].items()))
        colls = ", ".join(f"{n} {k}" for k, n in sorted(info["collectives"].items()))
        return (f"compiled in {info['compile_s']:.1f} s; step overhead {info['overhead_s'] * 1e6:.0f} us; "
                f"{colls or 'no collectives'}; params {sbps}")
    return info.get("how", "single device, global batch" if variant == "eager" else "")


def report(name, kwargs, global_batch, world, r):
    order, infos, losses = r["order"], r["infos"], r["losses"]
    per_rank = r["times_by_rank"]
    steps = {v: [max(ts[v][i] for ts in per_rank) if v != "eager" else per_rank[0][v][i]
                 for i in range(len(per_rank[0][v]))] for v in order}   # slowest rank's
    med = {v: statistics.median(steps[v]) for v in order}
    model, _ = build(name, kwargs)
    print(f"\n== {name} {kwargs}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"global batch {global_batch} ({global_batch // world} per rank)")
    print(f"  {'variant':14s} {'median ms':>10s} {'/ DDP':>7s} {'p25 ms':>8s} {'p75 ms':>8s} "
          f"{'paired / DDP [95% CI]':>22s} {'MiB/step':>9s} {'max |loss - eager|':>19s}  notes")
    ok = True
    for v in VARIANTS:
        info = infos[v]
        if v not in order:
            print(f"  {v:14s} {'NOT AVAILABLE':>10s}  {info['note']}")
            ok &= not info.get("failed", False)
            continue
        q1, _, q3 = statistics.quantiles(steps[v], n=4, method="inclusive") \
            if len(steps[v]) > 1 else [med[v]] * 3
        diff = max(abs(a - b) for a, b in zip(losses[v], losses["eager"]))
        ok &= diff <= 1e-4 * max(1.0, abs(losses["eager"][0]))
        paired = "%.2f [%.2f, %.2f]" % paired_ratio(steps[v], steps["DDP"])
        print(f"  {v:14s} {med[v] * 1e3:10.1f} {med[v] / med['DDP']:7.2f} {q1 * 1e3:8.1f} "
              f"{q3 * 1e3:8.1f} {paired:>22s} {info['comm_bytes'] / 2**20:9.2f} {diff:19.2e}  "
              f"{describe(v, info)}")
    print("  losses " + ("MATCH eager's at every step (rel. tol 1e-4)" if ok else
                         "DIFFER from eager's (rel. tol 1e-4)"))
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    ap.add_argument("--warmup", type=int, help="untimed steps per variant (default 3; quick 2)")
    ap.add_argument("--steps", type=int, help="timed steps per variant (default 15; quick 5)")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--profile", help="hardware profile name or JSON path the search plans for "
                    "(e.g. one written by `python -m ddlc calibrate --out FILE`)")
    ap.add_argument("--no-inductor", action="store_true", help="skip the Inductor variant "
                    "(its compile takes a minute or more per model here)")
    ap.add_argument("--skip", default="", help="comma-separated variants not to run "
                    f"(of {','.join(VARIANTS[2:])}; eager and DDP are the references)")
    ap.add_argument("--models", default="gpt,mlp,hf-gpt2", help="comma-separated subset of "
                    "gpt,mlp,hf-gpt2")
    args = ap.parse_args(argv)
    global PROFILE
    if args.profile:
        os.environ["DDLC_PROFILE"] = PROFILE = args.profile
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    steps = args.steps if args.steps is not None else (5 if args.quick else 15)
    table = QUICK if args.quick else GPU if ON_GPUS else FULL
    configs = {m: table[m] for m in args.models.split(",")}
    for variant in filter(None, args.skip.split(",")):
        if variant not in VARIANTS[2:]:
            ap.error(f"--skip {variant}: not one of {', '.join(VARIANTS[2:])}")
        UNAVAILABLE[variant] = "skipped (--skip)"
    if args.no_inductor:
        UNAVAILABLE["ddlc-inductor"] = "skipped (--no-inductor)"
    elif not has_compiler():
        UNAVAILABLE["ddlc-inductor"] = "no C++ compiler on PATH (Inductor's CPU kernels need one)"
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.world_size
    for name, (_, gb) in configs.items():
        if gb % world:
            ap.error(f"global batch {gb} of {name} does not divide by world size {world}")
    rank = int(os.environ.get("RANK", 0))
    where = (f"NCCL, {world} rank(s) on {torch.cuda.get_device_name(DEVICE)}" if ON_GPUS else
             f"gloo (CPU), {world} local processes (1 intra-op thread each) on {os.cpu_count()} CPU cores")
    if rank == 0:
        print(f"ddlc runtime benchmark{' (--quick)' if args.quick else ''}: torch {torch.__version__}, "
              f"{where}; profile {PROFILE}; {warmup} warm-up + {steps} timed steps per variant, "
              f"interleaved; step time = slowest rank's, median over steps")
        print(f"load average at start: {os.getloadavg()[0]:.2f}")
        if not ON_GPUS:
            print("CAVEAT: gloo implements reduce-scatter as all-reduce + chunk, and the ranks are "
                  "CPU processes sharing cores: these timings say nothing about GPU/NCCL behaviour.")
    start = time.perf_counter()
    # under torchrun this process is one rank of the launcher's job (ddlc.launch.run joins
    # its process group); otherwise ddlc.spawn starts the local gloo workers
    results = ddlc.launch.run(worker, world, configs, warmup, steps, dict(UNAVAILABLE), timeout=900,
                              deadline=3000)
    if rank != 0:
        return 0
    ok = True
    for name, (kwargs, gb) in configs.items():
        ok &= report(name, kwargs, gb, world, results[name])
    print(f"\ntotal wall time {time.perf_counter() - start:.1f} s (including process start-up "
          f"and compilation); load average at the end {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
