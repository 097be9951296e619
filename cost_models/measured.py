"""Operator times measured on the machine at hand (``compute="measured"``), cached on disk.

The roofline (:mod:`cost_models.compute`) knows FLOPs and bytes but not what one call of an
operator costs on this CPU: the dispatcher and the Python call of every node of the
program, kernels far from peak on small shapes, layouts. In measured mode, every
``(aten op, local input shapes and strides, dtype, other arguments)`` the planner or the
timeline asks about is run once for real: tensors built from the FakeTensor (or meta)
metadata (floats uniform in [0.5, 1.5), so that no NaN or denormal slows a kernel; integer
tensors zero, a valid index anywhere; booleans true), one warm-up call, then the median of
:data:`REPEATS` samples, each a loop long enough to last :data:`MIN_SAMPLE` seconds, on
one intra-op thread (as ``ddlc.spawn``'s workers run; the thread count is part of the
cache key).

Results are kept per hardware profile in a JSON file under :func:`cache_dir`
(``$DDLC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ddlc``, else ``~/.cache/ddlc``), named by the
profile's name and a hash of its numbers, the torch version, the CPU and the thread count,
so another machine or profile never reads them. A file is written atomically and merged
with what other processes wrote meanwhile.

What is not measured falls back to the roofline scaled by what was measured for that op:
``roofline(shapes) x median(measured / roofline)`` over the op's measured shapes (the
plain roofline for an op never measured). That happens for operators whose inputs cannot
be built (an argument that is neither a tensor nor a plain value), whose call fails on
made-up values, and once this process has spent :data:`BUDGET` seconds measuring
(``$DDLC_MEASURE_BUDGET``).

Ranks that share cores: when ``n`` local gloo processes run on ``c < n`` cores, every
rank's compute runs slower than alone. Measured times (taken alone) are multiplied by
:func:`sharing`: the profile's measured contention factor where it has one for this many
local ranks (``ddlc calibrate`` fits it to training steps run with every local rank at
once; :class:`ddlc.mesh.Contention`, whose per-operator overhead is added to every
operator that costs anything), else ``max(1, local ranks / cores)`` (``$DDLC_SHARING``
overrides the factor); the roofline's profile numbers are left alone (a calibrated
profile measured its FLOP/s with every rank running).

In a process group only rank 0 measures (it plans; its peers would measure while the
others compute, which inflates the times): the other ranks read what rank 0 has saved and
otherwise take the scaled roofline. A table is saved every few seconds and at exit
(``flush_all``; ``ddlc.spawn``'s workers end with ``os._exit``, so call it there), merged
with the file: an entry already in the file stays.

A profile is in measured mode when its ``compute`` is "measured" (what
``CompileOptions(compute="measured")`` gives the mesh's profile); :func:`cost_models.compute.op_time`
then calls :func:`measured_time`. Progress (operators measured so far) shows on a terminal.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._ops import OpOverload
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import tree_map

from ddlc.mesh import HardwareProfile

__all__ = ["REPEATS", "MIN_SAMPLE", "BUDGET", "cache_dir", "cache_path", "base_profile",
           "measured_profile", "local_gloo_ranks", "sharing", "cpu_name", "op_key", "measure_op", "MeasuredTable", "table_for",
           "measured_time", "flush_all"]

REPEATS = 5          # samples per op; the median is kept
MIN_SAMPLE = 2e-4    # seconds each sample lasts at least (loops of several calls for tiny ops)
BUDGET = 60.0        # seconds of measuring per process before falling back to the scaled roofline
_SAVE_EVERY = 5.0    # seconds between writes of new measurements


def cache_dir() -> Path:
    """Where measured tables live: ``$DDLC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ddlc``, else
    ``~/.cache/ddlc``."""
    if os.environ.get("DDLC_CACHE_DIR"):
        return Path(os.environ["DDLC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddlc"


def base_profile(profile: HardwareProfile) -> HardwareProfile:
    """The roofline profile under a measured one (the same numbers)."""
    return dataclasses.replace(profile, compute="roofline")


def measured_profile(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` in measured mode."""
    return dataclasses.replace(profile, compute="measured")


def cpu_name() -> str:
    """The CPU model (part of every cache key: another CPU never reads these times)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path(profile: HardwareProfile, threads: int | None = None) -> Path:
    """The file of ``profile``'s measured table on this machine at ``threads`` intra-op
    threads (default: this process's)."""
    base = base_profile(profile)
    numbers = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)
               if f.name not in ("description", "source", "contention")}
    threads = torch.get_num_threads() if threads is None else threads
    ident = json.dumps([repr(numbers), torch.__version__, cpu_name(), os.cpu_count(), threads])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base.name)
    return cache_dir() / f"measured-{safe}-{digest}.json"


def local_gloo_ranks() -> int | None:
    """How many ranks of this process's gloo process group run on this host
    (``$LOCAL_WORLD_SIZE``, else the world size); None without a gloo process group."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return None
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def sharing(profile: HardwareProfile | None = None) -> float:
    """How much slower an operator runs inside the step than alone: ``$DDLC_SHARING``, else
    ``profile``'s measured contention (``HardwareProfile.shared_cores``), else for a gloo
    process group on this machine ``max(1, local ranks / cores)`` (ranks sharing cores),
    else 1."""
    if os.environ.get("DDLC_SHARING"):
        return float(os.environ["DDLC_SHARING"])
    if profile is not None and profile.shared_cores is not None:
        return profile.shared_cores.compute
    local = local_gloo_ranks()
    return 1.0 if local is None else max(1.0, local / (os.cpu_count() or 1))


# -- keys and real tensors -------------------------------------------------------------

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


class _Unbuildable(Exception):
    """An argument that is neither a tensor nor a plain value: the op is not measured."""


def _tensor_key(t: torch.Tensor) -> str:
    shape, stride = tuple(t.shape), tuple(t.stride())
    expected, step = [], 1
    for n in reversed(shape):
        expected.append(step)
        step *= max(n, 1)
    contiguous = all(s == e for n, s, e in zip(shape, stride, reversed(expected)) if n > 1)
    return f"T({str(t.dtype).removeprefix('torch.')},{list(shape)}" + \
        ("" if contiguous else f",stride={list(stride)}") + ")"


def _key_of(x) -> str:
    if isinstance(x, torch.Tensor):
        return _tensor_key(x)
    if isinstance(x, (list, tuple, immutable_list)):
        return "[" + ",".join(_key_of(v) for v in x) + "]"
    if isinstance(x, (dict, immutable_dict)):
        return "{" + ",".join(f"{k}={_key_of(v)}" for k, v in sorted(x.items())) + "}"
    if isinstance(x, float):
        return repr(x) if math.isfinite(x) else str(x)
    if isinstance(x, _PLAIN):
        return repr(x)
    raise _Unbuildable(type(x).__name__)


def op_key(target, args, kwargs) -> str | None:
    """The cache key of one call: the op, and every argument (tensors by dtype, shape and
    strides where not contiguous); None when an argument cannot be keyed (not measured)."""
    try:
        return f"{target}({_key_of(list(args))};{_key_of(dict(kwargs or {}))})"
    except _Unbuildable:
        return None


def _real(x):
    if isinstance(x, torch.Tensor):
        shape, stride = tuple(x.shape), tuple(x.stride())
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        if x.dtype.is_floating_point or x.dtype.is_complex:
            flat = torch.rand(size, dtype=x.dtype) + 0.5
        elif x.dtype == torch.bool:
            flat = torch.ones(size, dtype=torch.bool)
        else:
            flat = torch.zeros(size, dtype=x.dtype)
        return flat.as_strided(shape, stride)
    if isinstance(x, torch.device):
        return torch.device("cpu")
    return x


def measure_op(target, args, kwargs, repeats: int = REPEATS) -> float:
    """Median seconds of one call of ``target`` on real CPU tensors shaped like the tensors
    of ``args``/``kwargs`` (a warm-up call first; samples loop until MIN_SAMPLE)."""
    real_args, real_kwargs = tree_map(_real, (tuple(args), dict(kwargs or {})))
    with torch.no_grad():
        start = time.perf_counter()
        target(*real_args, **real_kwargs)
        once = time.perf_counter() - start
        loops = max(1, min(1000, int(MIN_SAMPLE / max(once, 1e-7))))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(loops):
                target(*real_args, **real_kwargs)
            samples.append((time.perf_counter() - start) / loops)
    return statistics.median(samples)


# -- the table ---------------------------------------------------------------------------

class MeasuredTable:
    """One profile's measured times on this machine: ``entries[key] = (op, seconds,
    roofline seconds)``, loaded from and saved to ``path``."""

    def __init__(self, path: Path, budget: float | None = None):
        self.path = Path(path)
        self.budget = float(os.environ.get("DDLC_MEASURE_BUDGET", BUDGET)) if budget is None else budget
        self.entries: dict[str, tuple[str, float, float]] = {}
        self.failed: set[str] = set()
        self.spent = 0.0        # seconds this process spent measuring
        self.measured = 0       # ops this process measured
        self._dirty = False
        self._saved_at = self._loaded_at = time.perf_counter()
        self._ratios: dict[str, float] | None = None
        self._bar = None
        self.load()

    # persistence
    def load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        for key, (op, seconds, roofline) in data.get("entries", {}).items():
            self.entries.setdefault(key, (op, float(seconds), float(roofline)))
        self._ratios = None

    def save(self) -> None:
        """Write the table (merged with the file's current entries), atomically."""
        if not self._dirty:
            return
        mine = dict(self.entries)
        self.entries = {}
        self.load()           # what other processes wrote meanwhile; the first measurement stays
        for key, value in mine.items():
            self.entries.setdefault(key, value)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": 1, "torch": torch.__version__, "cpu": cpu_name(), "threads": torch.get_num_threads(),
                "entries": {k: list(v) for k, v in sorted(self.entries.items())}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)
        self._dirty = False
        self._saved_at = time.perf_counter()

    # queries
    def ratio(self, op: str) -> float:
        """median(measured / roofline) over ``op``'s measured shapes; 1 if none."""
        if self._ratios is None:
            by_op: dict[str, list[float]] = {}
            for name, seconds, roofline in self.entries.values():
                if roofline > 0:
                    by_op.setdefault(name, []).append(seconds / roofline)
            self._ratios = {name: statistics.median(rs) for name, rs in by_op.items()}
        return self._ratios.get(op, 1.0)

    def seconds(self, target, args, kwargs, roofline: float) -> float:
        """The measured seconds of this call (measuring it now if it is new and the budget
        allows), else the roofline scaled by the op's measured ratio. Not yet multiplied by
        :func:`sharing`."""
        key = op_key(target, args, kwargs)
        if key is not None and key in self.entries:
            return self.entries[key][1]
        op = str(target)
        if key is not None and not _measures_here():
            if time.perf_counter() - self._loaded_at > 1.0:   # what rank 0 has saved since
                self.load()
                self._loaded_at = time.perf_counter()
            if key in self.entries:
                return self.entries[key][1]
            return roofline * self.ratio(op)
        if key is None or key in self.failed or self.spent >= self.budget:
            return roofline * self.ratio(op)
        start = time.perf_counter()
        try:
            seconds = measure_op(target, args, kwargs)
        except Exception:  # made-up values the op refuses (or a kernel this build lacks)
            self.failed.add(key)
            return roofline * self.ratio(op)
        finally:
            self.spent += time.perf_counter() - start
            self._progress()
        self.entries[key] = (op, seconds, roofline)
        self.measured += 1
        self._ratios, self._dirty = None, True
        if time.perf_counter() - self._saved_at > _SAVE_EVERY:
            self.save()
        return seconds

    def _progress(self) -> None:
        if self._bar is None:
            if not sys.stderr.isatty():
                self._bar = False
            else:
                from tqdm import tqdm
                self._bar = tqdm(desc="measuring ops", unit="op", file=sys.stderr, leave=False)
        if self._bar:
            self._bar.update(1)

    def close(self) -> None:
        self.save()
        if self._bar:
            self._bar.close()
            self._bar = None


def _measures_here() -> bool:
    """Whether this process measures: alone, or rank 0 of its process group. Its peers
    would measure while the others compute (inflated times); they read rank 0's file."""
    import torch.distributed as dist
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


_TABLES: dict[Path, MeasuredTable] = {}


def table_for(profile: HardwareProfile) -> MeasuredTable:
    """This process's table for ``profile`` (loaded from the cache on first use)."""
    path = cache_path(profile)
    if path not in _TABLES:
        _TABLES[path] = MeasuredTable(path)
    return _TABLES[path]


def flush_all() -> None:
    """Write every table with new measurements (also run at exit)."""
    for table in _TABLES.values():
        table.close()


atexit.register(flush_all)


def _runs_as_view(target, out) -> bool:
    """Whether the call is an aten view with a tensor output (the roofline prices it 0)."""
    return (isinstance(target, OpOverload) and target.namespace == "aten" and target.is_view
            and isinstance(out, torch.Tensor))


def measured_time(target, args, kwargs, out, profile: HardwareProfile, roofline_time) -> float:
    """Seconds of one call in measured mode. ``roofline_time`` is
    :func:`cost_models.compute.op_time` (passed in: this module does not import it), which
    prices the call on the base profile: 0 there (non-operators, no tensor output) stays 0,
    but for an aten view, which the roofline leaves free (it moves no byte) and which is
    measured as it runs: its dispatch, a few microseconds a call on a CPU (a program of
    small operators runs hundreds of them), or the copy a ``reshape`` of a
    non-contiguous input makes. A view never measured stays free."""
    roofline = roofline_time(target, args, kwargs, out, base_profile(profile))
    if roofline == 0.0 and not _runs_as_view(target, out):
        return 0.0
    shared = profile.shared_cores
    overhead = shared.per_operator if shared is not None else 0.0
    if not isinstance(target, OpOverload) or target.namespace != "aten":
        return roofline + overhead   # only aten ops run alone: never a collective (it would wait for peers)
    return table_for(profile).seconds(target, args, kwargs, roofline) * sharing(profile) + overhead
