"""Measure a hardware profile on the machine at hand (``python -m ddlc calibrate``).

Per device: achievable float32 matmul FLOP/s (one thread per rank, as the
workers run), memory bandwidth (a 64 MiB copy) and cache bandwidth (a copy
whose working set is CACHE_BYTES, which the roofline uses for ops that small). Per link: all-reduce, all-gather, reduce-scatter and all-to-all of
sizes from 4 KiB to 256 MiB on ``world_size`` local gloo processes, timed on every group
of :func:`collective_groups` (the world and the axes of a 2-D mesh, or the axes of
``--mesh``: all the groups of an axis at once, as a plan runs them), each kind fitted over
all of them by non-negative least squares (relative error) to its ring model
(:data:`RING`, the ring's steps by each group's size; each group's own fit is reported
beside it; the
all-reduce's ``t = 2(p-1)·α + 2(p-1)/p · n/bandwidth`` gives the links, every other
kind's fit is stored as its factors against it: ``collective_factors``, which the cost
models apply to that kind on every link; gloo's reduce-scatter, an all-reduce plus a
chunk, is measured and reported, and priced as the all-reduce it runs: :data:`EMULATED`).
Per host: the ranks' contention for its cores (:func:`measure_contention`): the
reference training steps (:data:`REFERENCE`) run on every rank at once and are fitted by
a factor on their modeled compute (operators timed alone), a cost per operator, factors
on their collectives' start-ups and transfers and a cost per collective, the two not
overlapping (``contention``, which measured mode applies: :class:`ddlc.mesh.Contention`).
Prints the profile as JSON (``--out`` writes it), ready for ``Mesh(...,
profile=path)``, with the fit's relative error at every measured size (``fit``; also a
table on stderr); rank 0 shows a progress bar over the sizes on a terminal. Timings are medians over repeats; the result is only as good
as the machine is quiet.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
from scipy.optimize import nnls
from tqdm import tqdm

from .launch import spawn

__all__ = ["RING", "REFERENCE", "measure_compute", "collective_groups", "measure_link", "measure_contention", "fit_ring",
           "fit_errors", "fit_contention", "calibrate", "calibrated_profile"]

SIZES = [2**12, 2**16, 2**20, 2**22, 2**24, 2**26, 2**28]  # bytes: 4 KiB to 256 MiB

#: bytes a size's timed loop moves at most (its repeats shrink above it, to one)
LOOP_BYTES = 2**26


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


CACHE_BYTES = 2**20  # working set of the "fits in cache" measurement (read + write)


def _copy_bandwidth(elements: int, repeats: int = 1) -> float:
    x = torch.randn(elements)
    out = torch.empty_like(x)

    def copy():
        for _ in range(repeats):
            out.copy_(x)
    return 2 * repeats * x.numel() * x.element_size() / _median_seconds(copy)


def measure_compute(n: int = 512) -> tuple[float, float, float]:
    """(float32 matmul FLOP/s, DRAM bandwidth, cache bandwidth for CACHE_BYTES) in bytes/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _median_seconds(lambda: a @ b)
    return flops, _copy_bandwidth(2**24), _copy_bandwidth(CACHE_BYTES // 8, repeats=50)


#: collective -> (start-ups, bandwidth passes) of its ring on p ranks: ``t = a(p)·α + b(p)·n/bandwidth``
RING = {"all_reduce": lambda p: (2 * (p - 1), 2 * (p - 1) / p),
        "all_gather": lambda p: (p - 1, (p - 1) / p),
        "reduce_scatter": lambda p: (p - 1, (p - 1) / p),
        "all_to_all": lambda p: (p - 1, (p - 1) / p**2)}


#: what gloo runs instead: a reduce-scatter is an all-reduce whose chunk each rank keeps.
#: Its own fit is measured and reported, but it is priced as an all-reduce (its fit is
#: about 1.4x an all-reduce on 4 ranks sharing 2 cores): priced on its fit, a 2-D plan's
#: gradients go as all-reduce + slice, whose all-reduces passes/fuse.py does not bucket.
EMULATED = {"reduce_scatter": "all_reduce"}


def _run_collective(kind: str, nbytes: int, group=None):
    """A function that runs one ``kind`` over ``nbytes`` (the whole tensor on the group:
    the gathered result, the reduced input, the exchanged total) on ``group`` (default:
    the world)."""
    p = dist.get_world_size(group)
    whole, piece = torch.ones(nbytes // 4), torch.ones(max(nbytes // 4 // p, 1))
    out = torch.empty_like(whole)
    return {"all_reduce": lambda: dist.all_reduce(whole, group=group),
            "all_gather": lambda: dist.all_gather_single(out[:piece.numel() * p], piece, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(piece, whole[:piece.numel() * p],
                                                                 group=group),
            "all_to_all": lambda: dist.all_to_all_single(out, whole, group=group)}[kind]


def collective_groups(world: int, shape: tuple[int, ...] | None = None) -> list[tuple[str, list[list[int]]]]:
    """The ways calibration groups ``world`` ranks, each as (label, rank groups that run
    their collectives at once, as a plan's axis does): the axes of ``shape`` longer than 1
    (``--mesh``); by default the whole world and the axes of the 2-D mesh of the reference
    steps (:func:`_mesh_2d`), so the links are fitted on the group sizes the plans use."""
    from .mesh import Mesh
    shapes = [shape] if shape is not None else [(world,)] + ([_mesh_2d(world)] if _mesh_2d(world) else [])
    found = []
    for s in shapes:
        mesh = Mesh(s)
        for axis in range(mesh.ndim):
            if mesh.shape[axis] > 1:
                label = "world" if len(s) == 1 and shape is None else f"{mesh} axis {axis}"
                found.append((label, mesh.axis_groups(axis)))
    return found


def _repeated(fn, times: int):
    """A function that calls ``fn`` ``times`` times."""
    def run():
        for _ in range(times):
            fn()
    return run


def _collective_times(rank: int, groups, repeats: int = 10, sizes=SIZES) -> list:
    """Per label of ``groups`` (:func:`collective_groups`), per collective, its seconds at
    each of ``sizes`` bytes on this rank's group, every group running at once; then this
    rank's :func:`measure_compute`."""
    torch.set_num_threads(1)
    mine = []
    for _, ranks in groups:
        made = [dist.new_group(g) for g in ranks]   # every rank makes every group, in order
        mine.append(next(h for g, h in zip(ranks, made) if rank in g))
    times = {}
    quiet = rank != 0 or not sys.stderr.isatty()
    cases = [(i, kind, n) for i in range(len(groups)) for kind in RING for n in sizes]
    for i, kind, nbytes in tqdm(cases, desc="collectives", unit="size", file=sys.stderr, disable=quiet):
        loops = max(1, min(repeats, LOOP_BYTES // nbytes))
        run = _repeated(_run_collective(kind, nbytes, mine[i]), loops)
        dist.barrier()
        times.setdefault(groups[i][0], {}).setdefault(kind, []).append(_median_seconds(run, 3) / loops)
        del run  # its buffers (up to 256 MiB each) go before the next size's are made
    return [times, *measure_compute()]


def _group_sizes(p, count: int) -> list[int]:
    """The group size of each of ``count`` times: ``p`` itself where it is one per time,
    else ``p`` for all."""
    return list(p) if isinstance(p, (list, tuple)) else [p] * count


def fit_ring(kind: str, sizes, times, p) -> tuple[float, float]:
    """(α, bandwidth) of ``kind``'s ring model (:data:`RING`) fitted to its times over
    ``sizes`` bytes on groups of ``p`` ranks (one size for all, or one per time) by
    non-negative least squares in relative error."""
    rings = [RING[kind](q) for q in _group_sizes(p, len(sizes))]
    rows = [[a / t, b * n / t] for n, t, (a, b) in zip(sizes, times, rings)]
    (alpha, beta), _ = nnls(rows, [1.0] * len(sizes))
    return max(alpha, 1e-9), 1.0 / max(beta, 1e-15)


def fit_errors(sizes, times, p, alpha: float, bandwidth: float,
               kind: str = "all_reduce") -> list[dict]:
    """Per size: bytes, group size (``p``, as :func:`fit_ring` takes it), measured and
    modeled seconds of ``kind``'s ring fit, and the relative error (model / measured - 1)."""
    rows = []
    for n, t, q in zip(sizes, times, _group_sizes(p, len(sizes))):
        a, b = RING[kind](q)
        model = a * alpha + b * n / bandwidth
        rows.append({"bytes": n, "ranks": q, "measured": t, "model": model, "error": model / t - 1})
    return rows


def measure_link(world_size: int, shape: tuple[int, ...] | None = None):
    """(α seconds, bandwidth bytes/s of the all-reduce ring, FLOP/s, memory and cache
    bytes/s, per other collective that is not :data:`EMULATED` its (latency, bandwidth)
    factors against the all-reduce's fit, per collective its fitted latency and bandwidth,
    its fit errors, and per group of :func:`collective_groups` each collective's own fit)
    from ``world_size`` gloo ranks measuring at once (each size's time: the slowest
    rank's). Each collective's fit is one over every group (the ring's steps per group
    size), so the links price the group sizes of the plans; each group's own fit is kept
    beside it."""
    groups = collective_groups(world_size, shape)
    results = spawn(_collective_times, world_size, groups, timeout=120, deadline=900)
    fits, errors, per_group = {}, {}, {}
    for kind in RING:
        sizes, times, ps = [], [], []
        for label, ranks in groups:
            p = len(ranks[0])
            measured = [max(r[0][label][kind][i] for r in results) for i in range(len(SIZES))]
            sizes, times, ps = sizes + SIZES, times + measured, ps + [p] * len(SIZES)
            alpha, bandwidth = fit_ring(kind, SIZES, measured, p)
            per_group.setdefault(label, {})[kind] = {"ranks": p, "latency": alpha, "bandwidth": bandwidth}
        fits[kind] = fit_ring(kind, sizes, times, ps)
        errors[kind] = fit_errors(sizes, times, ps, *fits[kind], kind=kind)
    alpha, bandwidth = fits["all_reduce"]
    factors = {kind: {"latency": a / alpha, "bandwidth": bw / bandwidth}
               for kind, (a, bw) in fits.items() if kind not in ("all_reduce", *EMULATED)}
    flops, memory, cache = (statistics.median(r[i] for r in results) for i in (1, 2, 3))
    fitted = {kind: {"latency": a, "bandwidth": bw} for kind, (a, bw) in fits.items()}
    return alpha, bandwidth, flops, memory, cache, factors, fitted, errors, per_group


#: The training steps the contention is fitted to: (label, zoo MLP sizes, global batch,
#: plan), with AdamW: compute-heavy and transfer-heavy data-parallel steps, a deep narrow
#: one (many small operators), the same with every gradient all-reduced on its own (many
#: small collectives: start-ups), a fully sharded one (parameters gathered where used) and
#: two on a 2-D mesh (:func:`_mesh_2d`: batch split on the first axis, Megatron's
#: column / row splits on the second), whose collectives run between operators on groups
#: smaller than the host's ranks: the ring's start-ups and a cost per collective part
#: there. The 2-D steps are left out where the world size has no such mesh.
WIDE = dict(d_in=128, d_hidden=512, d_out=16, depth=6)
NARROW = dict(d_in=64, d_hidden=64, d_out=8, depth=24)
REFERENCE = (("mlp 6x512 dp, batch 4096", WIDE, 4096, "dp"),
             ("mlp 6x512 dp, batch 64", WIDE, 64, "dp"),
             ("mlp 24x64 dp, batch 64", NARROW, 64, "dp"),
             ("mlp 24x64 dp unfused, batch 64", NARROW, 64, "unfused"),
             ("mlp 6x512 fully sharded, batch 256", WIDE, 256, "zero"),
             ("mlp 6x512 2-D, batch 256", WIDE, 256, "2d"),
             ("mlp 24x64 2-D, batch 64", NARROW, 64, "2d"))


def _mesh_2d(world: int) -> tuple[int, int] | None:
    """The 2-D mesh of the reference steps on ``world`` ranks: (2, world / 2), if both
    axes have at least 2 ranks."""
    return (2, world // 2) if world % 2 == 0 and world >= 4 else None


def _reference_plan(model, plan: str, world: int) -> tuple[tuple[int, ...], dict[str, str]]:
    """The mesh shape and the placements of one :data:`REFERENCE` plan of the zoo ``model``
    on ``world`` ranks: the batch split over the ranks ("2d": over the first axis, each
    layer's weight (out, in) split by rows on the second where the layer is even, by
    columns where odd, its bias with the rows), parameters replicated ("zero": split on
    their first dimension where it divides)."""
    if plan == "2d":
        placements = {"input0": "(S0, B)", "input1": "(S0, B)"}
        for key, _ in model.named_parameters():
            even = int(key.split(".")[1]) % 2 == 0
            placements[key] = "(B, S0)" if even else "(B, S1)" if key.endswith("weight") else "(B, B)"
        return _mesh_2d(world), placements
    placements = {"input0": "(S0)", "input1": "(S0)"}
    for key, param in model.named_parameters():
        placements[key] = "(S0)" if plan == "zero" and param.shape[0] % world == 0 else "(B)"
    return (world,), placements


def _reference_step(sizes: dict, batch: int, plan: str, world: int, profile: str):
    """``ddlc.compile`` of one :data:`REFERENCE` step and its batch (seed 0)."""
    import torch.nn.functional as F

    from .runtime import compile
    from .zoo import MLP
    torch.manual_seed(0)
    model = MLP(**sizes)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(batch, sizes["d_in"], generator=g), torch.randn(batch, sizes["d_out"], generator=g))
    mesh, placements = _reference_plan(model, plan, world)
    options = dict(decouple=False) if plan == "2d" else \
        dict(move_activations=False, decouple="always" if plan == "zero" else False, fuse=plan != "unfused")
    step = compile(model, mesh, inputs, F.mse_loss, torch.optim.AdamW(model.parameters()),
                   placements=placements, profile=profile, **options)
    return step, inputs


def _modeled_parts(gm, mesh) -> tuple[float, int, float, float, float]:
    """(compute seconds, operators that cost anything, seconds of the collectives'
    start-ups, seconds of the rest of their time, seconds of one start-up of each
    collective's link) of a lowered program on ``mesh``."""
    from cost_models.collectives import axis_time, priced_as
    from cost_models.program import NodeCosts, program_timeline
    from .ir import COLLECTIVE
    timeline = program_timeline(gm, mesh.profile)
    costs = NodeCosts(mesh.profile)
    operators = sum(1 for n in gm.graph.nodes if n.op == "call_function"
                    and costs.channel(n) is None and costs.seconds(n) > 0)
    collectives = [COLLECTIVE(n) for n in gm.graph.nodes if n.op == "call_function" and costs.channel(n) is not None]
    startups = sum(axis_time(c.kind, 0, mesh, c.axis) for c in collectives)
    startups = min(startups, timeline.communication_time)
    links = sum(priced_as(c.kind, mesh, c.axis)[1].latency for c in collectives if mesh.shape[c.axis] > 1)
    return timeline.compute_time, operators, startups, timeline.communication_time - startups, links


def _reference_times(rank: int, profile: str, reference, cache: str, warmup: int = 3, steps: int = 10) -> list:
    """Per ``reference`` step (as :data:`REFERENCE`): :func:`_modeled_parts` of this rank's program, its
    operators measured alone (rank 0, while its peers wait; no contention) into the
    measured cache directory ``cache``, and this rank's step times with every rank
    stepping (interleaved, after a barrier)."""
    import dataclasses
    import os
    torch.set_num_threads(1)
    world = dist.get_world_size()
    compiled = [_reference_step(sizes, batch, plan, world, profile) for _, sizes, batch, plan in reference]
    os.environ["DDLC_SHARING"] = "1"    # operator times as measured alone
    os.environ["DDLC_CACHE_DIR"] = cache
    modeled = []
    for step, _ in compiled:
        dist.barrier()
        if rank == 0:
            alone = dataclasses.replace(step.mesh.profile, compute="measured", contention=None)
            modeled.append(_modeled_parts(step.gm, step.mesh.with_(profile=alone)))
    dist.barrier()
    times = [[] for _ in compiled]
    for i in range(warmup + steps):
        for k in range(len(compiled)):
            step, inputs = compiled[(k + i) % len(compiled)]
            dist.barrier()
            start = time.perf_counter()
            step.step(*inputs)
            if i >= warmup:
                times[(k + i) % len(compiled)].append(time.perf_counter() - start)
    return [modeled, times]


def measure_contention(world_size: int, profile: dict, reference=REFERENCE) -> dict:
    """The :class:`ddlc.mesh.Contention` of ``world_size`` local gloo ranks on this host:
    the ``reference`` steps (default :data:`REFERENCE`) run on every rank at once (measured: per step the slowest
    rank, median over steps) and are modeled on ``profile`` (this calibration's links) with
    operators timed alone, now (into a cache of this run: times from another hour of a
    shared machine would fit its speed then); the factors are fitted by
    :func:`fit_contention`, collectives not overlapping compute. Returns the profile's
    ``contention`` entry, with the fit per reference step. Steps on a 2-D mesh are left out
    where ``world_size`` has none."""
    import os
    import tempfile
    reference = [r for r in reference if r[3] != "2d" or _mesh_2d(world_size)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        with open(path, "w") as f:
            json.dump(profile, f)
        results = spawn(_reference_times, world_size, path, reference, tmp, timeout=300, deadline=900)
    modeled, steps = results[0][0], len(results[0][1][0])
    measured = [statistics.median(max(r[1][k][i] for r in results) for i in range(steps))
                for k in range(len(reference))]
    factors = fit_contention(modeled, measured)
    fit = []
    for (label, *_), parts, t in zip(reference, modeled, measured):
        model = sum(f * x for f, x in zip(factors, parts))
        fit.append({"step": label, "measured": t, "model": model, "error": model / t - 1,
                    **dict(zip(("compute", "operators", "startups", "transfers", "links"), parts))})
    return {"local_ranks": world_size,
            **dict(zip(("compute", "per_operator", "startup", "transfer", "per_collective"), factors)),
            "fit": fit}


def fit_contention(modeled, measured) -> tuple[float, float, float, float, float]:
    """(compute factor, seconds per operator, start-up factor, transfer factor, start-ups
    per collective), all ``>= 0``, with ``a·C + o·N + s·S + b·B + k·L`` closest to each
    measured step time in relative error (non-negative least squares), for ``modeled``
    tuples (C modeled compute, N operators, S and B the modeled collectives' start-ups and
    the rest of their time, L one start-up of each collective's link summed) of those
    steps. (:class:`ddlc.mesh.Contention`; S grows with the ring's steps, L does not.)"""
    rows = [[x / t for x in parts] for parts, t in zip(modeled, measured)]
    factors, _ = nnls(rows, [1.0] * len(rows))
    return tuple(float(f) for f in factors)


def calibrate(world_size: int = 4, name: str = "calibrated", shape: tuple[int, ...] | None = None) -> dict:
    """The profile of this host for ``world_size`` local gloo ranks (collectives timed on
    the groups of :func:`collective_groups`, ``shape`` the mesh whose axes to time)."""
    alpha, bandwidth, flops, memory, cache, factors, fitted, errors, per_group = \
        measure_link(world_size, shape)
    link = {"latency": alpha, "bandwidth": bandwidth}
    profile = {"name": name,
               "description": f"measured by `python -m ddlc calibrate` with {world_size} local gloo "
                              "processes, one thread each",
               "source": "ddlc.calibrate: median timings, ring fits per collective and a fit of "
                         "the ranks' contention to reference steps, by least squares",
               "devices_per_node": 64, "flops": {"float32": flops, "bfloat16": flops / 2,
                                                  "float16": flops / 2},
               "memory_bandwidth": memory, "memory_capacity": 8.0e9,
               "cache": {"bytes": CACHE_BYTES, "bandwidth": cache},
               "emulated_collectives": EMULATED,
               "links": {"intra_node": link, "inter_node": link},
               "collective_factors": factors,
               "fits": fitted,
               "fits_per_group": per_group,
               "fit": errors}
    profile["contention"] = measure_contention(world_size, profile)
    return profile


def calibrated_profile(world_size: int = 4, refresh: bool = False) -> str:
    """The path of a profile calibrated on this machine for ``world_size`` local gloo ranks:
    measured by :func:`calibrate` on first use (about a minute) and cached beside the
    measured operator tables (:func:`cost_models.measured.cache_dir`), keyed by the CPU,
    core count, torch version and world size; ``refresh`` measures again. Pass it as
    ``profile=``. Only as good as the machine was quiet when it was measured."""
    import hashlib
    import os

    from cost_models.measured import cache_dir, cpu_name
    ident = f"{cpu_name()}|{os.cpu_count()}|{torch.__version__}|{world_size}"
    path = cache_dir() / f"calibrated-{world_size}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}.json"
    if refresh or not path.exists():
        profile = calibrate(world_size, name=f"calibrated-{world_size}")
        profile["measured_at_load_average"] = list(os.getloadavg())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile, indent=2) + "\n")
        os.replace(tmp, path)
    return str(path)


def format_fit(profile: dict) -> str:
    """The fit per collective: its α and bandwidth, then measured vs modeled time per size."""
    link = profile["links"]["intra_node"]
    lines = []
    for kind, rows in profile["fit"].items():
        fit = profile.get("fits", {}).get(kind, link)
        priced = profile.get("emulated_collectives", {}).get(kind)
        lines += [f"{kind} ring fit: latency {fit['latency'] * 1e6:.1f} us, "
                  f"bandwidth {fit['bandwidth'] / 1e9:.3g} GB/s"
                  + (f" (priced as {priced}, which the backend runs)" if priced else "")]
        lines += [f"  {label} ({own[kind]['ranks']} ranks) on its own: latency "
                  f"{own[kind]['latency'] * 1e6:.1f} us, bandwidth {own[kind]['bandwidth'] / 1e9:.3g} GB/s"
                  for label, own in profile.get("fits_per_group", {}).items() if kind in own]
        lines += [f"{'ranks':>5}  {'bytes':>10}  {'measured ms':>11}  {'model ms':>9}  {'error':>7}"]
        lines += [f"{r.get('ranks', ''):>5}  {r['bytes']:>10}  {r['measured'] * 1e3:>11.3f}  "
                  f"{r['model'] * 1e3:>9.3f}  {r['error']:>+7.1%}" for r in rows]
    contention = profile.get("contention")
    if contention:
        lines += [f"contention of {contention['local_ranks']} local ranks: operators "
                  f"{contention['compute']:.2f}x their time alone + {contention['per_operator'] * 1e6:.1f} us, collectives "
                  f"{contention['startup']:.2f}x the links' start-ups plus "
                  f"{contention.get('per_collective', 0.0):.2f} start-ups each and {contention['transfer']:.2f}x their "
                  "transfer time, not overlapping compute",
                  f"{'reference step':>36}  {'measured ms':>11}  {'model ms':>9}  {'error':>7}"]
        lines += [f"{r['step']:>36}  {r['measured'] * 1e3:>11.3f}  {r['model'] * 1e3:>9.3f}  "
                  f"{r['error']:>+7.1%}" for r in contention["fit"]]
    return "\n".join(lines)


def main(args) -> int:
    from .errors import OptionError
    from .mesh import Mesh
    shape = Mesh(args.mesh).shape if getattr(args, "mesh", None) else None
    if args.world_size is not None and args.world_size < 2:
        raise OptionError(f"--world-size {args.world_size}: collectives need 2 processes or more")
    if shape is not None and args.world_size is not None and math.prod(shape) != args.world_size:
        raise OptionError(f"--mesh {args.mesh} has {math.prod(shape)} devices but --world-size is "
                          f"{args.world_size}: give one of them, or both alike")
    world = math.prod(shape) if shape else args.world_size or 4
    profile = calibrate(world, args.name, shape)
    print(format_fit(profile), file=sys.stderr)
    text = json.dumps(profile, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
