"""Fidelity of the cost model: modeled step time against measured, plan by plan.

Run: ``python bench/fidelity.py`` (all four models, a few minutes) or ``--models gpt,mlp``,
``--quick`` (smaller models, fewer steps). ``--compute roofline`` prices with the roofline
instead of the measured operator times; ``--profile FILE`` plans for a calibrated profile
(``python -m ddlc calibrate --out FILE``); ``--profile calibrated --recalibrate`` calibrates
this machine first, in the same run (about a minute), so that links and contention are
measured at the hour of the steps.

For the zoo GPT, MLP and CNN and Hugging Face's ``GPT2LMHeadModel`` (a small config, its
own loss), each of these plans is compiled with ``ddlc.compile`` on ``--world-size`` 4
local gloo ranks and run for the same batches:

==============  =====  ===================================================================
plan            mesh   how it is pinned
==============  =====  ===================================================================
dp              (4,)   batch inputs ``(S0)``, every parameter ``(B)``, ``decouple=False``
dp+decoupled    (4,)   the same with ``decouple="always"`` (reduce-scatter, update on the
                       shard, all-gather)
megatron        (4,)   batch inputs ``(B)``; Megatron's column / row splits of the
                       attention and MLP weights (and the vocabulary split of the
                       embedding and head); the rest ``(B)``
2d              (2,2)  batch inputs ``(S0, B)``; parameters ``(B, megatron's split)``
zero            (4,)   batch inputs ``(S0)``, every parameter ``(S0)`` where its first dim
                       divides (else ``(B)``, listed): parameters, gradients and optimizer
                       state sharded, parameters gathered where used (ZeRO-3 / FSDP)
ddlc (4,)       (4,)   nothing pinned: the search places everything
ddlc (2,2)      (2,2)  nothing pinned
==============  =====  ===================================================================

``dp``, ``dp+decoupled`` and ``zero`` also pass ``move_activations=False``: only
parameters, gradients and scalars move. The search still places each optimizer update, and
in "dp" it may shard some (their gradients reduce-scattered, parameters gathered; the row
then says so).

ddlc's choice is the unpinned plan of the mesh shape whose lowered program has the least
modeled step (what ``ddlc plan --mesh 4`` picks); it is marked ``*``. Where its program
is, on every rank, the very code of the fastest measured plan's (data parallelism found by
the search, say), the report says so: its gap is then two runs of one program.

The modeled step time of a plan is the slowest rank's ``compiled.timeline().makespan``
(the timeline model over that rank's lowered program). The measured step time is, per
step, the slowest rank's ``time.perf_counter`` interval from leaving a barrier to having
the step's loss; plans run interleaved (one step of each per round, the order rotating) so
that machine noise hits all alike; the median over the timed steps is reported.

Before the ranks start, this process traces, plans and lowers rank 0's program of every
plan once with the same options, so that measured mode (``compute="measured"``,
:mod:`cost_models.measured`) times every operator here, alone, on one thread, and the
ranks read the cache instead of measuring while their peers compute. The cache is a
temporary directory of this run unless ``--keep-cache``: operator times measured at
another hour of a shared VM would price this hour's steps at that hour's speed. Ranks sharing cores
(4 ranks on 2) are accounted by the profile's measured contention where it has one for
``--world-size`` local ranks (:class:`ddlc.mesh.Contention`: operators and collectives
slower by the factors ``ddlc calibrate`` fitted, collectives not overlapping compute),
else by operators ``ranks / cores`` times slower (:func:`cost_models.measured.sharing`).

Attribution: after the timed steps every rank runs its program once more under a
node-timing interpreter: seconds in compute nodes against seconds in collectives and
their waits; the table sets the modeled compute (the compute tasks' total time) beside
the measured compute, and the modeled exposed communication beside the rest. The
interpreter adds a few microseconds per node, so its compute is an upper bound.

Printed: every plan's modeled and measured milliseconds and their ratio, the median
absolute error (|modeled / measured - 1|), Spearman's rank correlation between the
modeled and the measured order, and whether ddlc's choice is the fastest measured plan
or within 5 % of it; where it is not the fastest, also the median of the per-round ratios
of the two with its 95% interval (``bench/runtime.py``'s :func:`paired_ratio`).
``--json OUT`` keeps the rows (``bench/plots.py`` draws them).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import fx  # noqa: E402

import ddlc  # noqa: E402
from ddlc.zoo import CNN, GPT, MLP, lm_loss  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime import paired_ratio  # noqa: E402

LR, EPS = 1e-3, 1e-4
TARGET_ERROR, TARGET_RHO, TARGET_CHOICE = 0.15, 0.9, 0.05

FULL = {
    "gpt": (dict(vocab=512, d_model=192, n_heads=4, n_layers=3, seq_len=64), 16),
    "mlp": (dict(d_in=256, d_hidden=1024, d_out=64, depth=4), 256),
    "cnn": (dict(channels=3, n_classes=16, width=16), 32),
    "gpt2": (dict(n_embd=128, n_layer=2, n_head=4, n_inner=512, vocab_size=512, n_positions=64), 16),
}
QUICK = {
    "gpt": (dict(vocab=256, d_model=128, n_heads=4, n_layers=2, seq_len=32), 16),
    "mlp": (dict(d_in=128, d_hidden=512, d_out=32, depth=3), 128),
    "cnn": (dict(channels=3, n_classes=16, width=8), 16),
    "gpt2": (dict(n_embd=64, n_layer=2, n_head=4, n_inner=256, vocab_size=256, n_positions=32), 16),
}
SEQ = {"gpt2": 64}
PLANS = ("dp", "dp+decoupled", "megatron", "2d", "zero", "ddlc (4,)", "ddlc (2,2)")


# -- models and batches -----------------------------------------------------------------
def build(name: str, kwargs: dict):
    """(model, loss_fn or None: the model's own loss)."""
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(**kwargs), lm_loss
    if name == "mlp":
        return MLP(**kwargs), F.mse_loss
    if name == "cnn":
        return CNN(**kwargs), F.cross_entropy
    import transformers
    config = transformers.GPT2Config(**kwargs, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), None


def make_batches(name: str, kwargs: dict, global_batch: int, n: int) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        if name == "gpt":
            shape = (global_batch, kwargs["seq_len"])
            out.append((torch.randint(0, kwargs["vocab"], shape, generator=g),
                        torch.randint(0, kwargs["vocab"], shape, generator=g)))
        elif name == "mlp":
            out.append((torch.randn(global_batch, kwargs["d_in"], generator=g),
                        torch.randn(global_batch, kwargs["d_out"], generator=g)))
        elif name == "cnn":
            out.append((torch.randn(global_batch, kwargs["channels"], 16, 16, generator=g),
                        torch.randint(0, kwargs["n_classes"], (global_batch,), generator=g)))
        else:
            ids = torch.randint(0, kwargs["vocab_size"], (global_batch, kwargs["n_positions"]),
                                generator=g)
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def input_keys(batch) -> list[str]:
    """The placement keys of the batch entries (a dict batch: its own keys)."""
    return list(batch) if isinstance(batch, dict) else [f"input{i}" for i in range(len(batch))]


def megatron_split(name: str, pname: str, shape: tuple) -> str | None:
    """Megatron's split of one parameter on a tensor-parallel axis: "S0", "S1" or None (B)."""
    def column(weight_dim: int):   # split the output features
        return f"S{weight_dim}"
    if name == "gpt":
        if pname.endswith(("attn.qkv.weight", "attn.qkv.bias", ".fc.weight", ".fc.bias")):
            return column(0)           # nn.Linear weight is (out, in)
        if pname.endswith(("attn.proj.weight", ".out.weight")):
            return "S1"                # row parallel: split the input features
        if pname in ("tok.weight", "head.weight"):
            return "S0"                # vocabulary parallel
        return None
    if name == "mlp":
        i = int(pname.split(".")[1])
        if pname.endswith("weight"):
            return "S0" if i % 2 == 0 else "S1"
        return "S0" if i % 2 == 0 else None
    if name == "cnn":
        if pname.startswith("conv1."):
            return "S0"                # output channels
        if pname == "conv2.weight":
            return "S1"                # input channels: partial sums
        return None
    # gpt2: transformers' Conv1D weight is (in, out)
    if pname.endswith(("attn.c_attn.weight", "mlp.c_fc.weight")):
        return "S1"
    if pname.endswith(("attn.c_attn.bias", "mlp.c_fc.bias")):
        return "S0"
    if pname.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
        return "S0"
    if pname == "transformer.wte.weight":
        return "S0"
    return None


def plan_options(name: str, model, batch, plan: str, world: int) -> tuple[tuple, dict, str]:
    """(mesh shape, compile options, note) of one plan kind."""
    params = {k: tuple(p.shape) for k, p in model.named_parameters()}
    keys = input_keys(batch)
    note = ""
    if plan in ("dp", "dp+decoupled"):
        placements = {k: "(S0)" for k in keys} | {k: "(B)" for k in params}
        return (world,), dict(placements=placements, move_activations=False,
                              decouple=False if plan == "dp" else "always"), note
    if plan == "megatron":
        placements = {k: "(B)" for k in keys}
        for k, shape in params.items():
            s = megatron_split(name, k, shape)
            placements[k] = f"({s})" if s and shape[int(s[1])] % world == 0 else "(B)"
        return (world,), dict(placements=placements), note
    if plan == "2d":
        shape2 = (2, world // 2)
        placements = {k: "(S0, B)" for k in keys}
        for k, shape in params.items():
            s = megatron_split(name, k, shape)
            placements[k] = f"(B, {s})" if s and shape[int(s[1])] % shape2[1] == 0 else "(B, B)"
        return shape2, dict(placements=placements), note
    if plan == "zero":
        placements = {k: "(S0)" for k in keys}
        whole = []
        for k, shape in params.items():
            if shape and shape[0] % world == 0:
                placements[k] = "(S0)"
            else:
                placements[k] = "(B)"
                whole.append(k)
        if whole:
            note = f"{len(whole)} parameter(s) kept (B), first dim not divisible by {world}: " \
                   + ", ".join(whole[:4]) + (" ..." if len(whole) > 4 else "")
        return (world,), dict(placements=placements, decouple="always", move_activations=False), note
    if plan == "ddlc (4,)":
        return (world,), {}, note
    if plan == "ddlc (2,2)":
        return (2, world // 2), {}, note
    raise ValueError(plan)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)


def compile_plan(name, kwargs, batch, plan, world, common):
    model, loss_fn = build(name, kwargs)
    shape, options, note = plan_options(name, model, batch, plan, world)
    compiled = ddlc.compile(model, shape, batch, loss_fn, make_optimizer(model), **options, **common)
    return compiled, note


def call(compiled, batch):
    return compiled.step(batch) if isinstance(batch, dict) else compiled.step(*batch)


# -- attribution: a node-timing run of one rank's program ---------------------------------
class NodeTimer(fx.Interpreter):
    """Runs a program node by node and keeps each node's seconds, over the runs (a few
    microseconds per node more than the program runs on its own)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.seconds = defaultdict(list)

    def run_node(self, n):
        start = time.perf_counter()
        out = super().run_node(n)
        self.seconds[n].append(time.perf_counter() - start)
        return out


def flat_inputs(compiled, batch) -> list:
    """The flat inputs of ``compiled``'s program for one step on ``batch``."""
    args, kwargs = ((batch,), {}) if isinstance(batch, dict) else (tuple(batch), {})
    return compiled.signature.flatten(compiled.params, compiled.buffers, compiled.opt_state,
                                      compiled._local_batch(args, kwargs), compiled._hyperparameters())


def timed_components(compiled, batch, runs: int = 3) -> tuple[float, float]:
    """(compute seconds, communication seconds) of this rank's program, medians over
    ``runs`` node-timed runs."""
    from cost_models.program import is_collective
    flat = flat_inputs(compiled, batch)
    timer = NodeTimer(compiled.gm)
    for _ in range(runs):
        dist.barrier()
        with torch.no_grad():
            timer.run(*flat)
    calls = [n for n in compiled.gm.graph.nodes if n.op == "call_function"]
    comm = {n for n in calls if is_collective(n) or "wait_tensor" in str(n.target)}
    compute = [sum(timer.seconds[n][i] for n in calls if n not in comm) for i in range(runs)]
    communication = [sum(timer.seconds[n][i] for n in comm) for i in range(runs)]
    return statistics.median(compute), statistics.median(communication)


# -- the ranks ------------------------------------------------------------------------------
def bench_model(rank, name, kwargs, global_batch, warmup, steps, common):
    world = dist.get_world_size()
    batches = make_batches(name, kwargs, global_batch, warmup + steps + 1)
    compiled, info = {}, {}
    for plan in PLANS:
        start = time.perf_counter()
        try:
            c, note = compile_plan(name, kwargs, batches[0], plan, world, common)
        except Exception as e:  # a plan ddlc cannot express: say so, do not fake it
            info[plan] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        from cost_models.measured import flush_all
        flush_all()      # rank 0's measurements, for its peers' timelines
        dist.barrier()
        tl = c.timeline()
        from ddlc.ir import collective_sequence
        seq = collective_sequence(c.gm)
        info[plan] = dict(note=note, compile_s=time.perf_counter() - start, mesh=list(c.mesh.shape),
                          modeled=tl.makespan, modeled_compute=tl.compute_time,
                          objective=c.plan.objective,
                          collectives=dict(Counter(k for k, _, _ in seq)),
                          comm_bytes=sum(b for _, _, b in seq),
                          program=hashlib.sha256(c.gm.code.encode()).hexdigest())
        compiled[plan] = c
    order = [p for p in PLANS if p in compiled]
    times = {p: [] for p in order}
    losses = {p: [] for p in order}
    for i in range(warmup + steps):
        k = i % len(order)
        for p in order[k:] + order[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = call(compiled[p], batches[i])
            t1 = time.perf_counter()
            losses[p].append(float(loss))
            if i >= warmup:
                times[p].append(t1 - t0)
    parts = {}
    for p in order:
        try:
            parts[p] = timed_components(compiled[p], batches[-1])
        except Exception as e:
            parts[p] = (float("nan"), float("nan"))
            info[p]["attribution_error"] = f"{type(e).__name__}: {e}"[:200]
    from cost_models.measured import flush_all
    flush_all()   # workers end with os._exit: no atexit
    everyone = [None] * world
    dist.all_gather_object(everyone, dict(times=times, info=info, parts=parts))
    return dict(order=order, losses=losses, ranks=everyone)


def worker(rank, configs, warmup, steps, common):
    return {name: bench_model(rank, name, kwargs, gb, warmup, steps, common)
            for name, (kwargs, gb) in configs.items()}


# -- warming the measured cache in this process ---------------------------------------------
def prewarm(configs, world, common) -> float:
    """Trace, plan (``choose_plan``, as ``ddlc.compile`` does) and lower rank 0's program of
    every plan here (one thread, alone), so that measured mode times its operators before
    the ranks start. Returns the seconds spent."""
    from ddlc import pipeline
    from ddlc.mesh import Mesh
    from ddlc.options import CompileOptions
    from ddlc.simulate import axis_group_names
    from cost_models.measured import flush_all, table_for
    from cost_models.program import program_timeline
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        for name, (kwargs, gb) in configs.items():
            batch = make_batches(name, kwargs, gb, 1)[0]
            for plan in PLANS:
                model, loss_fn = build(name, kwargs)
                shape, options, _ = plan_options(name, model, batch, plan, world)
                opts = CompileOptions.from_kwargs(**options, **common)
                try:
                    gm = pipeline.trace_step(model, batch, loss_fn, make_optimizer(model), opts)
                    mesh = Mesh(shape, profile=opts.profile or "cpu-gloo")
                    mesh = mesh.with_(profile=dataclasses.replace(mesh.profile, compute=opts.compute))
                    fixed = pipeline.resolve_placements(gm, opts.placements, mesh.ndim)
                    groups = axis_group_names(mesh)
                    # as ddlc.compile plans: the search weighed against data parallelism and
                    # replication, whose operators (a replicated step's whole batch) count too
                    chosen = pipeline.choose_plan(gm, mesh, opts, fixed, groups)
                    program = chosen.program
                    if program is None:
                        pipeline.lower(gm, mesh, (0,) * mesh.ndim, groups, opts, chosen.choices)
                        program = gm
                    program_timeline(program, mesh.profile)
                except Exception as e:
                    print(f"  prewarm {name} {plan}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        flush_all()
        if common.get("compute") == "measured":
            table = table_for(mesh.profile)
            print(f"measured cache {table.path}: {len(table.entries)} operator calls, "
                  f"{table.measured} measured now in {table.spent:.1f} s", flush=True)
    finally:
        torch.set_num_threads(threads)
    return time.perf_counter() - start


# -- statistics and the report --------------------------------------------------------------
def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def report(name, kwargs, result) -> dict:
    order, ranks = result["order"], result["ranks"]
    info = {p: ranks[0]["info"][p] for p in PLANS}
    rows = []
    for p in order:
        per_step = [max(r["times"][p][i] for r in ranks) for i in range(len(ranks[0]["times"][p]))]
        modeled = max(r["info"][p]["modeled"] for r in ranks)
        modeled_compute = max(r["info"][p]["modeled_compute"] for r in ranks)
        slowest = max(range(len(ranks)), key=lambda i: ranks[i]["parts"][p][0] + ranks[i]["parts"][p][1])
        compute, comm = ranks[slowest]["parts"][p]
        measured = statistics.median(per_step)
        q1, _, q3 = statistics.quantiles(per_step, n=4, method="inclusive")
        rows.append(dict(model=name, plan=p, mesh=info[p]["mesh"], modeled=modeled, measured=measured,
                         q1=q1, q3=q3, ratio=modeled / measured, modeled_compute=modeled_compute,
                         measured_compute=compute, measured_comm=comm,
                         objective=info[p]["objective"], note=info[p].get("note", ""),
                         collectives=info[p]["collectives"], comm_bytes=info[p]["comm_bytes"],
                         loss=result["losses"][p][0], per_step=per_step))
    # dp, dp+decoupled and zero move no activation (move_activations=False), but the search
    # still places each optimizer update: where it shards one, that gradient is
    # reduce-scattered and the parameter gathered, more bytes than one all-reduce
    model, _ = build(name, kwargs)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for r in rows:
        if r["plan"] == "dp" and r["collectives"].get("reduce_scatter"):
            r["note"] = ((r["note"] + "; ") if r["note"] else "") + (
                f"the search shards part of the update: {r['comm_bytes'] / 2**20:.2f} MiB moved per "
                f"step against {param_bytes / 2**20:.2f} MiB of parameters")
    unpinned = [r for r in rows if r["plan"].startswith("ddlc")]
    chosen = min(unpinned, key=lambda r: r["modeled"])["plan"] if unpinned else None
    by_objective = min(unpinned, key=lambda r: r["objective"])["plan"] if unpinned else None
    print(f"\n== {name.upper()} {kwargs}")
    print(f"  {'plan':14s} {'mesh':6s} {'modeled ms':>10s} {'measured ms':>11s} {'p25-p75 ms':>13s} "
          f"{'ratio':>6s}   {'compute ms model/meas':>21s} {'comm ms model/meas':>19s}  collectives")
    for r in rows:
        mark = "*" if r["plan"] == chosen else " "
        mesh = "x".join(map(str, r["mesh"]))
        colls = ", ".join(f"{n} {k}" for k, n in sorted(r["collectives"].items())) or "none"
        print(f" {mark}{r['plan']:14s} {mesh:6s} {r['modeled'] * 1e3:10.2f} {r['measured'] * 1e3:11.2f} "
              f"{r['q1'] * 1e3:6.1f}-{r['q3'] * 1e3:<6.1f} {r['ratio']:6.2f}   "
              f"{r['modeled_compute'] * 1e3:9.2f} /{r['measured_compute'] * 1e3:9.2f}  "
              f"{(r['modeled'] - r['modeled_compute']) * 1e3:8.2f} /{r['measured_comm'] * 1e3:8.2f}  "
              f"{colls} ({r['comm_bytes'] / 2**20:.2f} MiB)")
        if r["note"]:
            print(f"  {'':14s} note: {r['note']}")
    for p in PLANS:
        if "error" in info[p]:
            print(f"  {p:14s} NOT RUN: {info[p]['error']}")
    losses = [r["loss"] for r in rows]
    spread = max(losses) - min(losses) if losses else 0.0
    print(f"  first-step loss of every plan within {spread:.1e} of each other")
    errors = [abs(r["ratio"] - 1) for r in rows]
    rho = spearman([r["modeled"] for r in rows], [r["measured"] for r in rows])
    fastest = min(r["measured"] for r in rows)
    chosen_row = next(r for r in rows if r["plan"] == chosen) if chosen else None
    gap = chosen_row["measured"] / fastest - 1 if chosen_row else float("nan")
    objective_gap = next(r for r in rows if r["plan"] == by_objective)["measured"] / fastest - 1 \
        if by_objective else float("nan")
    print(f"  median |modeled/measured - 1| {statistics.median(errors):.1%} (target <= "
          f"{TARGET_ERROR:.0%}); Spearman rank correlation {rho:.2f} (target >= {TARGET_RHO}); "
          f"ddlc's choice {chosen} measured {gap:+.1%} against the fastest plan "
          f"({min(rows, key=lambda r: r['measured'])['plan']}; target <= {TARGET_CHOICE:.0%})")
    print(f"  (* = the mesh shape of least modeled step, as `ddlc plan --mesh 4` picks; by the "
          f"planner objective alone: {by_objective}, measured {objective_gap:+.1%} against the fastest)")
    fastest_row = min(rows, key=lambda r: r["measured"])

    def program(plan):   # every rank's code
        return tuple(r["info"][plan]["program"] for r in ranks)
    same = chosen_row is not None and chosen_row is not fastest_row \
        and program(chosen) == program(fastest_row["plan"])
    if chosen_row is not None and chosen_row is not fastest_row:
        paired = paired_ratio(chosen_row["per_step"], fastest_row["per_step"])
        print(f"  (paired by round, {chosen} against {fastest_row['plan']}: {paired[0] - 1:+.1%}, 95% "
              f"interval {paired[1] - 1:+.1%} to {paired[2] - 1:+.1%})")
    if same:   # the gap is two runs of one program
        print(f"  ({chosen} runs the very program of {fastest_row['plan']} on every rank: its "
              f"{gap:+.1%} is the noise between two runs of one program)")
    return dict(rows=rows, median_error=statistics.median(errors), rho=rho, chosen=chosen, gap=gap,
                chosen_by_objective=by_objective, gap_by_objective=objective_gap,
                chosen_is_fastest_program=same)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    ap.add_argument("--models", default="gpt,mlp,cnn,gpt2")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per plan (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per plan (default 10)")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--compute", choices=("measured", "roofline"), default="measured")
    ap.add_argument("--profile", default=None, help="hardware profile name or JSON path; "
                    "'calibrated': calibrate this machine on first use and cache it")
    ap.add_argument("--recalibrate", action="store_true",
                    help="with --profile calibrated: calibrate now (about a minute) rather than "
                    "reuse a cached calibration, which holds the speed of the hour it was made")
    ap.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                    help="skip measuring in this process first: rank 0 measures while it plans "
                    "(faster; its peers may run meanwhile, which inflates those times)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="price operators from the on-disk measured cache ($DDLC_CACHE_DIR or "
                    "~/.cache/ddlc) where it has them; default: measure them all in this run, "
                    "since a cache from another hour holds another speed of a shared machine")
    ap.add_argument("--json", default=None, help="write the rows here (bench/plots.py reads it)")
    args = ap.parse_args(argv)
    if args.recalibrate and args.profile != "calibrated":
        ap.error("--recalibrate needs --profile calibrated")
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    steps = args.steps if args.steps is not None else (5 if args.quick else 10)
    table = QUICK if args.quick else FULL
    configs = {m: table[m] for m in args.models.split(",")}
    world = args.world_size
    common = {"compute": args.compute}
    if args.profile == "calibrated":   # measured on first use, then cached (ddlc.calibrate)
        from ddlc.calibrate import calibrated_profile
        args.profile = calibrated_profile(world, refresh=args.recalibrate)
        print(f"calibrated profile {args.profile}")
    if args.profile:
        common["profile"] = args.profile
    if not args.keep_cache:   # the ranks inherit it (ddlc.spawn passes the environment);
        # after the calibrated profile, which is cached there on first use
        fresh = tempfile.TemporaryDirectory(prefix="ddlc-fidelity-")
        os.environ["DDLC_CACHE_DIR"] = fresh.name
    contention = ddlc.Mesh((world,), profile=args.profile or "cpu-gloo").profile.contention
    if os.environ.get("DDLC_SHARING"):
        cores = f"operators x{os.environ['DDLC_SHARING']} ($DDLC_SHARING)"
    elif args.compute == "measured" and contention and contention.local_ranks == world:
        cores = (f"the profile's contention: operators x{contention.compute:.2f} "
                 f"+ {contention.per_operator * 1e6:.1f} us, collectives' start-ups x{contention.startup:.2f} "
                 f"plus {contention.per_collective:.2f} start-ups each and transfers "
                 f"x{contention.transfer:.2f}, not overlapping")
    else:
        cores = f"operators x{max(1.0, world / (os.cpu_count() or 1)):.2f} (ranks / cores)"
    print(f"ddlc cost-model fidelity{' (--quick)' if args.quick else ''}: torch {torch.__version__}, "
          f"gloo, {world} local ranks (1 thread each) on {os.cpu_count()} cores, compute "
          f"{args.compute}, profile {args.profile or 'cpu-gloo'}; sharing the cores: {cores}; "
          f"{warmup} warm-up + {steps} timed steps per plan, interleaved; step = slowest rank; "
          f"median over steps")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    start = time.perf_counter()
    if args.compute == "measured" and args.prewarm:
        print(f"prewarm (trace, plan, lower rank 0 of every plan in this process): "
              f"{prewarm(configs, world, common):.1f} s; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results = ddlc.spawn(worker, world, configs, warmup, steps, common, timeout=600, deadline=3600)[0]
    summary = {}
    for name, (kwargs, _) in configs.items():
        summary[name] = report(name, kwargs, results[name])
    rows = [r for s in summary.values() for r in s["rows"]]
    errors = [abs(r["ratio"] - 1) for r in rows]
    print(f"\nall models: median |modeled/measured - 1| {statistics.median(errors):.1%} over "
          f"{len(rows)} plans; rank correlation per model "
          + ", ".join(f"{n} {s['rho']:.2f}" for n, s in summary.items())
          + "; ddlc's choice against the fastest: "
          + ", ".join(f"{n} {s['gap']:+.1%}"
                      + (" (the fastest plan's program)" if s["chosen_is_fastest_program"] else "")
                      for n, s in summary.items()))
    print(f"total wall time {time.perf_counter() - start:.0f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(compute=args.compute, profile=args.profile or "cpu-gloo", world=world,
                           load=os.getloadavg(), summary=summary), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
