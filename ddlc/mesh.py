"""The device mesh and the hardware profiles that price it.

A :class:`Mesh` is a shape ``(p1, ..., pk)``, one name per axis and one
:class:`LinkModel` (α latency, β = 1/bandwidth) per axis. Links come from a
:class:`HardwareProfile` stored as JSON under ``ddlc/profiles``: an axis is
intra-node when the devices it connects (it and every axis inside it) fit in
one node, else inter-node. Axis 0 is the outermost (slowest-varying) axis,
as in ``torch.distributed.device_mesh.DeviceMesh``.
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Collection, Sequence

from .errors import MeshError

__all__ = ["LinkModel", "Contention", "HardwareProfile", "Mesh", "load_profile", "available_profiles"]


@dataclass(frozen=True)
class LinkModel:
    """α-β model of one link: ``latency`` seconds per message, ``bandwidth`` bytes/s, and
    ``overhead`` seconds added to every collective over it, whatever its group size or
    algorithm (where ranks share cores: waking the partners, :class:`Contention`)."""

    latency: float
    bandwidth: float
    overhead: float = 0.0

    def __post_init__(self):
        if not (self.latency >= 0 and self.bandwidth > 0 and self.overhead >= 0):
            raise MeshError(f"link needs latency >= 0, bandwidth > 0 and overhead >= 0, got {self}")

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth


@dataclass(frozen=True)
class Contention:
    """How a training step runs when its ``local_ranks`` local processes share the host's
    cores (gloo ranks on one CPU host), measured by ``ddlc calibrate``: an operator inside
    the step takes ``compute`` times its time measured alone plus ``per_operator`` seconds
    (what a call loses to the other ranks' use of the caches and the scheduler, which
    small operators feel most), a collective ``startup`` times the links' start-ups plus
    ``per_collective`` start-ups of its link whatever its group size (a rank that blocks
    gives its core away and waits to be scheduled again: a ring's steps are not what it
    waits for) and ``transfer`` times its time per byte, and collectives do not overlap
    compute (they need the same cores). The operators' factors apply in measured mode only (the
    roofline's FLOP/s and bandwidths were measured with every rank running); the
    collectives' factors and their not overlapping apply in both modes
    (``HardwareProfile.shared_cores``)."""

    local_ranks: int
    compute: float
    per_operator: float
    startup: float
    transfer: float
    per_collective: float = 0.0


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device compute and per-tier link numbers of one kind of machine."""

    name: str
    devices_per_node: int
    flops: tuple[tuple[str, float], ...]      # achievable FLOP/s per dtype name
    memory_bandwidth: float                   # bytes/s
    memory_capacity: float                    # bytes per device
    intra_node: LinkModel
    inter_node: LinkModel
    description: str = ""
    cache_bytes: float = 0.0                  # an op's first cache_bytes move at cache_bandwidth
    cache_bandwidth: float = 0.0              # bytes/s (0: no cache level modeled)
    emulated: tuple[tuple[str, str], ...] = ()  # collective -> the one the backend runs instead
    compute: str = "roofline"                 # operator times: "roofline", or "measured" here
    source: str = field(default="", compare=False)
    #: collective -> (latency factor, bandwidth factor) on every link: what a measured
    #: profile found that kind's ring fit to be against the all-reduce's (which the links hold)
    collective_factors: tuple[tuple[str, tuple[float, float]], ...] = ()
    #: measured with that many local ranks sharing the cores; see :class:`Contention`
    contention: Contention | None = None

    @property
    def shared_cores(self) -> Contention | None:
        """The contention the cost models apply where the ranks share cores: the measured
        one, in either compute mode (its operator factors in measured mode only)."""
        return self.contention

    def for_local_ranks(self, ranks: int | None) -> "HardwareProfile":
        """This profile for ``ranks`` processes sharing one host (None: not such ranks):
        without its contention unless that was measured for as many ranks."""
        if self.contention is None or self.contention.local_ranks == ranks:
            return self
        return replace(self, contention=None)

    def runs_as(self, collective: str) -> str:
        """The collective the backend really runs for ``collective`` (gloo runs a
        reduce-scatter as an all-reduce and keeps its chunk)."""
        return dict(self.emulated).get(collective, collective)

    def link_for(self, collective: str, link: LinkModel) -> LinkModel:
        """``link`` as ``collective`` runs on it: its start-up and bandwidth scaled by the
        profile's measured factors for that kind (gloo's all-gather and all-to-all run
        slower than the all-reduce ring of the same link predicts), and by the contention's
        ``startup`` and ``transfer`` factors where ranks share cores (:attr:`shared_cores`),
        which also add ``per_collective`` start-ups of the link as its ``overhead`` (none on
        a start-up-free link: :meth:`Mesh.bucketed`)."""
        factors = dict(self.collective_factors).get(collective)
        if factors is not None:
            link = _scaled(link, *factors)
        shared = self.shared_cores
        if shared is not None:
            # a fitted transfer factor of 0 (transfers free) scales the bandwidth by a large finite factor
            link = _scaled(link, shared.startup, 1 / max(shared.transfer, 1e-9), shared.per_collective * link.latency)
        return link

    def flops_for(self, dtype: str) -> float:
        table = dict(self.flops)
        return table.get(dtype.removeprefix("torch."), table["float32"])

    @staticmethod
    def from_dict(d: dict) -> "HardwareProfile":
        """The profile of a JSON object (``ddlc/profiles/*.json``); a field missing, of the
        wrong type or out of range is a :class:`MeshError` naming it."""
        def field(path: str, convert, default=_REQUIRED):
            value = d
            for key in path.split("."):
                if not isinstance(value, dict) or key not in value:
                    if default is _REQUIRED:
                        raise MeshError(f"hardware profile has no field {path!r}")
                    return convert(default)
                value = value[key]
            try:
                return convert(value)
            except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
                raise MeshError(f"hardware profile field {path!r} is mistyped or out of range: {value!r} "
                                f"({e})") from None

        return HardwareProfile(
            name=field("name", _text), devices_per_node=field("devices_per_node", _positive_int),
            flops=field("flops", _flops),
            memory_bandwidth=field("memory_bandwidth", _bandwidth),
            memory_capacity=field("memory_capacity", _positive),
            intra_node=field("links.intra_node", _link), inter_node=field("links.inter_node", _link),
            description=field("description", _text, ""), source=field("source", _text, ""),
            cache_bytes=field("cache.bytes", _non_negative, 0.0),
            cache_bandwidth=field("cache.bandwidth", _non_negative, 0.0),
            emulated=field("emulated_collectives", _emulated, {}),
            compute=field("compute", _compute_mode, "roofline"),
            collective_factors=field("collective_factors", _collective_factors, {}),
            contention=field("contention", _contention, None))


_REQUIRED = object()
#: the collectives a profile may name (``cost_models.collectives`` prices each)
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def _number(value) -> float:
    """A JSON number, finite (not a flag, a string, NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError("must be a finite number")
    return float(value)


def _positive(value) -> float:
    if not _number(value) > 0:
        raise ValueError("must be a positive number")
    return float(value)


def _bandwidth(value) -> float:
    """A positive number, or infinity: memory traffic free (a compute-bound model)."""
    return math.inf if value == math.inf else _positive(value)


def _non_negative(value) -> float:
    if not _number(value) >= 0:
        raise ValueError("must be a number of 0 or more")
    return float(value)


def _positive_int(value) -> int:
    if _number(value) != int(value) or value < 1:
        raise ValueError("must be a positive whole number")
    return int(value)


def _text(value) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _compute_mode(value) -> str:
    if value not in ("roofline", "measured"):
        raise ValueError("must be roofline or measured")
    return value


def _entries(value, keys: tuple[str, ...], convert) -> dict:
    """A JSON object's ``keys`` (all of them, no other), each converted."""
    if not isinstance(value, dict):
        raise ValueError(f"must be an object of {', '.join(keys)}")
    missing, other = [k for k in keys if k not in value], [k for k in value if k not in keys]
    if missing or other:
        raise ValueError(", ".join([f"missing {k}" for k in missing] + [f"unknown {k}" for k in other]))
    return {k: convert(value[k]) for k in keys}


def _flops(value) -> tuple:
    if not isinstance(value, dict) or "float32" not in value:
        raise ValueError("must be an object of FLOP/s per dtype name, float32 among them")
    return tuple(sorted((_text(k), _positive(x)) for k, x in value.items()))


def _link(value) -> LinkModel:
    if not isinstance(value, dict):
        raise ValueError("must be an object of latency, bandwidth (and overhead)")
    numbers = _entries({"overhead": 0.0, **value}, ("latency", "bandwidth", "overhead"), _number)
    try:
        return LinkModel(**numbers)
    except MeshError as e:
        raise ValueError(str(e)) from None


def _emulated(value) -> tuple:
    if not isinstance(value, dict) or any(k not in COLLECTIVE_KINDS or v not in COLLECTIVE_KINDS
                                          for k, v in value.items()):
        raise ValueError(f"must map collectives to the ones run instead, of {', '.join(COLLECTIVE_KINDS)}")
    return tuple(sorted(value.items()))


def _collective_factors(value) -> tuple:
    if not isinstance(value, dict) or any(k not in COLLECTIVE_KINDS for k in value):
        raise ValueError(f"must be an object keyed by collectives, of {', '.join(COLLECTIVE_KINDS)}")
    return tuple(sorted((kind, tuple(_entries(f, ("latency", "bandwidth"), _positive).values()))
                        for kind, f in value.items()))


def _contention(d) -> Contention | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError("must be an object of local_ranks, compute, per_operator, startup, transfer "
                         "(and per_collective), or null")
    fields = {k: v for k, v in d.items() if k != "fit"}  # ``ddlc calibrate``'s record of its fit
    numbers = _entries({"per_collective": 0.0, **fields}, ("local_ranks", "compute", "per_operator", "startup",
                                                            "transfer", "per_collective"), _non_negative)
    return Contention(_positive_int(d["local_ranks"]), numbers["compute"], numbers["per_operator"],
                      numbers["startup"], numbers["transfer"], numbers["per_collective"])


@functools.lru_cache(maxsize=1024)
def _scaled(link: LinkModel, latency: float, bandwidth: float, overhead: float = 0.0) -> LinkModel:
    """``link`` with its latency and bandwidth times these factors, ``overhead`` seconds more."""
    return LinkModel(link.latency * latency, link.bandwidth * bandwidth, link.overhead + overhead)


def available_profiles() -> list[str]:
    files = resources.files("ddlc").joinpath("profiles").iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def load_profile(name_or_path: str | HardwareProfile) -> HardwareProfile:
    """A profile by name (``cpu-gloo``, ``dgx-h100-ib``) or by JSON file path."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    if name_or_path.endswith(".json"):
        try:
            with open(name_or_path) as f:
                d = json.load(f)
        except OSError as e:
            raise MeshError(f"cannot read hardware profile {name_or_path!r}: {e.strerror}") from None
        except ValueError as e:
            raise MeshError(f"hardware profile {name_or_path!r} is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise MeshError(f"hardware profile {name_or_path!r} holds a JSON {type(d).__name__}, "
                            "not an object of the profile's fields")
        return HardwareProfile.from_dict(d)
    if name_or_path not in available_profiles():
        raise MeshError(f"unknown hardware profile {name_or_path!r}; "
                        f"known: {', '.join(available_profiles())} (or pass a .json path)")
    text = resources.files("ddlc").joinpath("profiles").joinpath(name_or_path + ".json").read_text()
    return HardwareProfile.from_dict(json.loads(text))


_DEFAULT_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "tp", "pp")}


#: the most mesh axes ddlc plans for (a 4-axis mesh already takes the search a minute on
#: a small model)
MAX_AXES = 4


@dataclass(frozen=True)
class Mesh:
    """Devices arranged as ``shape`` with ``axis_names`` and a link model per axis."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    links: tuple[LinkModel, ...]
    profile: HardwareProfile

    def __init__(self, shape: Sequence[int] | str, axis_names: Sequence[str] | None = None,
                 profile: str | HardwareProfile = "cpu-gloo",
                 links: Sequence[LinkModel] | None = None):
        shape = _parse_shape(shape)
        if len(shape) > MAX_AXES:
            raise MeshError(
                f"mesh {shape} has {len(shape)} axes; ddlc plans meshes of at most {MAX_AXES} (an "
                "operator's candidate placements multiply per axis: the search of a 5-axis mesh "
                "took minutes and exhausted memory for a 3-layer MLP). Merge axes whose devices "
                "share a link, e.g. 2x2x2x2x2 as 4x2x4")
        names = tuple(axis_names) if axis_names is not None else _default_names(len(shape))
        if len(names) != len(shape):
            raise MeshError(f"mesh {shape} has {len(shape)} axes but {len(names)} names {names}")
        if len(set(names)) != len(names) or not all(
                isinstance(n, str) and n.isidentifier() for n in names):
            raise MeshError(f"mesh axis names must be distinct identifiers, got {names}")
        prof = load_profile(profile)
        if links is None:
            links = tuple(prof.intra_node if math.prod(shape[i:]) <= prof.devices_per_node
                          else prof.inter_node for i in range(len(shape)))
        elif len(links) != len(shape):
            raise MeshError(f"mesh {shape} needs {len(shape)} link models, got {len(links)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "links", tuple(links))
        object.__setattr__(self, "profile", prof)

    # -- construction ------------------------------------------------------
    @staticmethod
    def of(spec, **kwargs) -> "Mesh":
        """A Mesh from a Mesh, a shape tuple, a string ``"2x4"`` or a DeviceMesh."""
        if isinstance(spec, Mesh):
            return spec if not kwargs else spec.with_(**kwargs)
        if type(spec).__name__ == "DeviceMesh":
            return Mesh.from_device_mesh(spec, **kwargs)
        return Mesh(spec, **kwargs)

    @staticmethod
    def from_device_mesh(device_mesh, profile: str | HardwareProfile | None = None) -> "Mesh":
        names = device_mesh.mesh_dim_names or _default_names(device_mesh.ndim)
        if profile is None:
            profile = "cpu-gloo" if device_mesh.device_type == "cpu" else "dgx-h100-ib"
        return Mesh(tuple(device_mesh.mesh.shape), names, profile)

    def bucketed(self, axes: Collection[int] | None = None) -> "Mesh":
        """This mesh with start-up-free links on ``axes`` (default: all): the price of
        traffic whose collectives get bucketed (a bucket's one start-up is shared by all its
        tensors)."""
        axes = range(self.ndim) if axes is None else axes
        return Mesh(self.shape, self.axis_names, self.profile,
                    links=tuple(LinkModel(0.0, link.bandwidth) if a in axes else link
                                for a, link in enumerate(self.links)))

    def with_(self, **kwargs) -> "Mesh":
        args = dict(shape=self.shape, axis_names=self.axis_names, profile=self.profile)
        args.update(kwargs)
        return Mesh(**args)

    # -- queries -----------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name_or_index: str | int) -> int:
        if isinstance(name_or_index, int):
            if not -self.ndim <= name_or_index < self.ndim:
                raise MeshError(f"mesh {self} has no axis {name_or_index}")
            return name_or_index % self.ndim
        if name_or_index not in self.axis_names:
            raise MeshError(f"mesh {self} has no axis named {name_or_index!r}")
        return self.axis_names.index(name_or_index)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of a global rank (row-major, axis 0 outermost)."""
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} is outside mesh {self} of {self.size} devices")
        coord = []
        for p in reversed(self.shape):
            coord.append(rank % p)
            rank //= p
        return tuple(reversed(coord))

    def rank_of(self, coord: Sequence[int]) -> int:
        r = 0
        for c, p in zip(coord, self.shape):
            r = r * p + c
        return r

    def axis_groups(self, axis: int) -> list[list[int]]:
        """The rank groups that communicate along ``axis``, in deterministic order."""
        groups: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coordinate(r)
            groups.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        return [groups[k] for k in sorted(groups)]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.size:
            raise MeshError(f"mesh {self} needs {self.size} processes but the world size is "
                            f"{world_size}; launch with --nproc-per-node={self.size} or change the mesh")

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + "(" + ",".join(self.axis_names) + ")"


def _default_names(ndim: int) -> tuple[str, ...]:
    return _DEFAULT_NAMES.get(ndim, tuple(f"a{i}" for i in range(ndim)))


def _parse_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, str):
        text = shape.strip().strip("()").strip().removesuffix(",")  # Python's one-tuple: "(4,)"
        parts = re.split(r"\s*[x×,*]\s*", text) if text else []
        if not parts or not all(p.isascii() and p.isdigit() for p in parts):
            raise MeshError(f"cannot parse mesh shape {shape!r}: write it like '2x4' or '(2, 4)'")
        shape = tuple(int(p) for p in parts)
    try:
        shape = tuple(shape)
    except TypeError:
        shape = (shape,)
    if not shape or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in shape):
        raise MeshError(f"mesh shape must be a non-empty tuple of positive ints, got {shape!r}")
    return shape

