"""Measure a hardware profile on the machine at hand (``python -m ddlc calibrate``).

Per device: achievable float32 matmul FLOP/s (one thread per rank, as the
workers run), memory bandwidth (a 64 MiB copy) and cache bandwidth (a copy
whose working set is CACHE_BYTES, which the roofline uses for ops that small). Per link: an all-reduce of
sizes from 4 KiB to 16 MiB on ``world_size`` local gloo processes, fitted by
non-negative least squares (relative error) to the ring model ``t = 2(p-1)·α + 2(p-1)/p · n/bandwidth``.
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

__all__ = ["measure_compute", "measure_link", "fit_ring_all_reduce", "fit_errors", "calibrate",
           "calibrated_profile"]

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


def _all_reduce_times(rank: int, repeats: int = 10) -> list:
    torch.set_num_threads(1)
    times = []
    quiet = rank != 0 or not sys.stderr.isatty()
    for nbytes in tqdm(SIZES, desc="all-reduce sizes", unit="size", file=sys.stderr, disable=quiet):
        t = torch.ones(nbytes // 4)

        def run():
            for _ in range(repeats):
                dist.all_reduce(t)
        dist.barrier()
        times.append(_median_seconds(run, 3) / repeats)
    return [times, *measure_compute()]


def fit_ring_all_reduce(sizes, times, p: int) -> tuple[float, float]:
    """(α, bandwidth) of ``t = 2(p-1)·α + 2(p-1)/p · n/bandwidth`` fitted to all-reduce
    times of ``sizes`` bytes by non-negative least squares in relative error."""
    rows = [[2.0 * (p - 1) / t, 2.0 * (p - 1) / p * n / t] for n, t in zip(sizes, times)]
    (alpha, beta), _ = nnls(rows, [1.0] * len(sizes))
    return max(alpha, 1e-9), 1.0 / max(beta, 1e-15)


def fit_errors(sizes, times, p: int, alpha: float, bandwidth: float) -> list[dict]:
    """Per size: bytes, measured and modeled seconds of the ring fit, and the relative error
    (model / measured - 1)."""
    rows = []
    for n, t in zip(sizes, times):
        model = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bandwidth
        rows.append({"bytes": n, "measured": t, "model": model, "error": model / t - 1})
    return rows


def measure_link(world_size: int) -> tuple[float, float, float, float, float, list[dict]]:
    """(α seconds, bandwidth bytes/s, FLOP/s, memory and cache bytes/s, fit errors) from
    ``world_size`` gloo ranks measuring at the same time."""
    results = spawn(_all_reduce_times, world_size, timeout=120, deadline=600)
    times = [max(r[0][i] for r in results) for i in range(len(SIZES))]
    alpha, bandwidth = fit_ring_all_reduce(SIZES, times, world_size)
    flops, memory, cache = (statistics.median(r[i] for r in results) for i in (1, 2, 3))
    return alpha, bandwidth, flops, memory, cache, fit_errors(SIZES, times, world_size, alpha, bandwidth)


def calibrate(world_size: int = 4, name: str = "calibrated") -> dict:
    alpha, bandwidth, flops, memory, cache, errors = measure_link(world_size)
    link = {"latency": alpha, "bandwidth": bandwidth}
    return {"name": name,
            "description": f"measured by `python -m ddlc calibrate` with {world_size} local gloo "
                           "processes, one thread each",
            "source": "ddlc.calibrate: median timings, ring all-reduce fit by least squares",
            "devices_per_node": 64, "flops": {"float32": flops, "bfloat16": flops / 2,
                                               "float16": flops / 2},
            "memory_bandwidth": memory, "memory_capacity": 8.0e9,
            "cache": {"bytes": CACHE_BYTES, "bandwidth": cache},
            "emulated_collectives": {"reduce_scatter": "all_reduce"},  # gloo: all-reduce + chunk
            "links": {"intra_node": link, "inter_node": link},
            "fit": {"all_reduce": errors}}


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
        lines += [f"{kind} ring fit: latency {link['latency'] * 1e6:.1f} us, bandwidth "
                  f"{link['bandwidth'] / 1e9:.3g} GB/s",
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
