"""Measure a hardware profile on the machine at hand (``python -m ddlc calibrate``).

Per device: achievable float32 matmul FLOP/s (one thread per rank, as the
workers run), memory bandwidth (a 64 MiB copy) and cache bandwidth (a copy
whose working set is CACHE_BYTES, which the roofline uses for ops that small). Per link: all-reduce, all-gather, reduce-scatter and all-to-all of
sizes from 4 KiB to 16 MiB on ``world_size`` local gloo processes, each fitted by
non-negative least squares (relative error) to its ring model (:data:`RING`; the
all-reduce's ``t = 2(p-1)·α + 2(p-1)/p · n/bandwidth`` gives the links, every other
kind's fit is stored as its factors against it: ``collective_factors``, which the cost
models apply to that kind on every link; gloo's reduce-scatter, an all-reduce plus a
chunk, is measured and reported, and priced as the all-reduce it runs: :data:`EMULATED`).
Prints the profile as JSON (``--out`` writes it), ready for ``Mesh(...,
profile=path)``, with the fit's relative error at every measured size (``fit``; also a
table on stderr); rank 0 shows a progress bar over the sizes on a terminal. Timings are medians over repeats; the result is only as good
as the machine is quiet.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from scipy.optimize import nnls
from tqdm import tqdm

from .launch import spawn

__all__ = ["RING", "measure_compute", "measure_link", "fit_ring", "fit_errors",
           "calibrate", "calibrated_profile"]

SIZES = [2**12, 2**16, 2**20, 2**22, 2**24]  # bytes


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


def _run_collective(kind: str, nbytes: int):
    """A function that runs one ``kind`` over ``nbytes`` (the whole tensor on the group:
    the gathered result, the reduced input, the exchanged total) on the default group."""
    p = dist.get_world_size()
    whole, piece = torch.ones(nbytes // 4), torch.ones(max(nbytes // 4 // p, 1))
    out = torch.empty_like(whole)
    return {"all_reduce": lambda: dist.all_reduce(whole),
            "all_gather": lambda: dist.all_gather_into_tensor(out[:piece.numel() * p], piece),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(piece, whole[:piece.numel() * p]),
            "all_to_all": lambda: dist.all_to_all_single(out, whole)}[kind]


def _collective_times(rank: int, repeats: int = 10) -> list:
    torch.set_num_threads(1)
    times = {}
    quiet = rank != 0 or not sys.stderr.isatty()
    cases = [(kind, n) for kind in RING for n in SIZES]
    for kind, nbytes in tqdm(cases, desc="collectives", unit="size", file=sys.stderr, disable=quiet):
        one = _run_collective(kind, nbytes)

        def run():
            for _ in range(repeats):
                one()
        dist.barrier()
        times.setdefault(kind, []).append(_median_seconds(run, 3) / repeats)
    return [times, *measure_compute()]


def fit_ring(kind: str, sizes, times, p: int) -> tuple[float, float]:
    """(α, bandwidth) of ``kind``'s ring model (:data:`RING`) fitted to its times over
    ``sizes`` bytes by non-negative least squares in relative error."""
    a, b = RING[kind](p)
    rows = [[a / t, b * n / t] for n, t in zip(sizes, times)]
    (alpha, beta), _ = nnls(rows, [1.0] * len(sizes))
    return max(alpha, 1e-9), 1.0 / max(beta, 1e-15)


def fit_errors(sizes, times, p: int, alpha: float, bandwidth: float,
               kind: str = "all_reduce") -> list[dict]:
    """Per size: bytes, measured and modeled seconds of ``kind``'s ring fit, and the
    relative error (model / measured - 1)."""
    a, b = RING[kind](p)
    rows = []
    for n, t in zip(sizes, times):
        model = a * alpha + b * n / bandwidth
        rows.append({"bytes": n, "measured": t, "model": model, "error": model / t - 1})
    return rows


def measure_link(world_size: int) -> tuple[float, float, float, float, float, dict, dict, dict]:
    """(α seconds, bandwidth bytes/s of the all-reduce ring, FLOP/s, memory and cache
    bytes/s, per other collective that is not :data:`EMULATED` its (latency, bandwidth)
    factors against the all-reduce's fit, per collective its fitted latency and bandwidth,
    and its fit errors) from ``world_size`` gloo ranks measuring at once (each size's
    time: the slowest rank's)."""
    results = spawn(_collective_times, world_size, timeout=120, deadline=900)
    fits, errors = {}, {}
    for kind in RING:
        times = [max(r[0][kind][i] for r in results) for i in range(len(SIZES))]
        fits[kind] = fit_ring(kind, SIZES, times, world_size)
        errors[kind] = fit_errors(SIZES, times, world_size, *fits[kind], kind=kind)
    alpha, bandwidth = fits["all_reduce"]
    factors = {kind: {"latency": a / alpha, "bandwidth": bw / bandwidth}
               for kind, (a, bw) in fits.items() if kind not in ("all_reduce", *EMULATED)}
    flops, memory, cache = (statistics.median(r[i] for r in results) for i in (1, 2, 3))
    fitted = {kind: {"latency": a, "bandwidth": bw} for kind, (a, bw) in fits.items()}
    return alpha, bandwidth, flops, memory, cache, factors, fitted, errors


def calibrate(world_size: int = 4, name: str = "calibrated") -> dict:
    alpha, bandwidth, flops, memory, cache, factors, fitted, errors = measure_link(world_size)
    link = {"latency": alpha, "bandwidth": bandwidth}
    return {"name": name,
            "description": f"measured by `python -m ddlc calibrate` with {world_size} local gloo "
                           "processes, one thread each",
            "source": "ddlc.calibrate: median timings, ring fits per collective by least squares",
            "devices_per_node": 64, "flops": {"float32": flops, "bfloat16": flops / 2,
                                               "float16": flops / 2},
            "memory_bandwidth": memory, "memory_capacity": 8.0e9,
            "cache": {"bytes": CACHE_BYTES, "bandwidth": cache},
            "emulated_collectives": EMULATED,
            "links": {"intra_node": link, "inter_node": link},
            "collective_factors": factors,
            "fits": fitted,
            "fit": errors}


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
                  + (f" (priced as {priced}, which the backend runs)" if priced else ""),
                  f"{'bytes':>10}  {'measured ms':>11}  {'model ms':>9}  {'error':>7}"]
        lines += [f"{r['bytes']:>10}  {r['measured'] * 1e3:>11.3f}  {r['model'] * 1e3:>9.3f}  "
                  f"{r['error']:>+7.1%}" for r in rows]
    return "\n".join(lines)


def main(args) -> int:
    profile = calibrate(args.world_size, args.name)
    print(format_fit(profile), file=sys.stderr)
    text = json.dumps(profile, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
