"""SBP: how a tensor is distributed on each axis of a device mesh.

Per mesh axis a tensor is ``S(d)`` (split along tensor dim ``d``), ``B``
(broadcast: a full copy) or ``P`` (partial sum: full shape, the value is the
sum over the axis). An :class:`NdSBP` holds one per mesh axis. These are
DTensor's ``Shard(d)``, ``Replicate()`` and ``Partial("sum")``.

Splitting follows DTensor: ``torch.chunk`` semantics (the first pieces get
``ceil(n / p)`` elements), and when several mesh axes split the same tensor
dim, axis 0 splits first (it is the outer index of the pieces).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import SBPError

__all__ = ["SBP", "S", "B", "P", "NdSBP", "parse_sbp", "as_ndsbp", "local_shape", "local_slices",
           "chunk_bounds", "divides", "fills_every_piece", "cuts_unevenly", "plannable", "padded_shape", "from_placements"]


@dataclass(frozen=True, order=True)
class SBP:
    """One axis' distribution. Build with ``S(d)``, ``B`` or ``P``; never directly."""

    kind: int          # 0 = B, 1 = P, 2 = S: the sort order of SBPs
    dim: int = -1      # the split tensor dim for S, else -1

    def __post_init__(self):
        if self.kind not in (0, 1, 2) or (self.kind == 2) != (self.dim >= 0):
            raise SBPError(f"malformed SBP(kind={self.kind}, dim={self.dim}); use S(d), B or P")

    @property
    def is_split(self) -> bool:
        return self.kind == 2

    @property
    def is_broadcast(self) -> bool:
        return self.kind == 0

    @property
    def is_partial(self) -> bool:
        return self.kind == 1

    def __str__(self) -> str:
        return f"S{self.dim}" if self.is_split else "BP"[self.kind]

    __repr__ = __str__

    def to_placement(self):
        from torch.distributed.tensor import Partial, Replicate, Shard  # 0.5 s: only when asked
        if self.is_split:
            return Shard(self.dim)
        return Replicate() if self.is_broadcast else Partial("sum")

    @staticmethod
    def from_placement(placement) -> "SBP":
        from torch.distributed.tensor import Partial, Replicate, Shard
        if isinstance(placement, Shard) and type(placement) is Shard:
            return S(placement.dim)
        if isinstance(placement, Replicate):
            return B
        if isinstance(placement, Partial) and placement.reduce_op == "sum":
            return P
        raise SBPError(f"placement {placement!r} has no SBP equivalent "
                       "(only Shard(d), Replicate() and Partial('sum') do)")


def S(dim: int) -> SBP:
    """Split along tensor dim ``dim`` (non-negative)."""
    if not isinstance(dim, int) or dim < 0:
        raise SBPError(f"S(d) needs a non-negative tensor dim, got {dim!r}")
    return SBP(2, dim)


B = SBP(0)
P = SBP(1)


def _parse_one(text: str) -> SBP:
    t = text.strip()
    if t == "B":
        return B
    if t == "P":
        return P
    if t.startswith("S") and t[1:].isdigit():
        return S(int(t[1:]))
    raise SBPError(f"cannot parse SBP {text!r}: expected B, P or S<dim> such as S0")


@dataclass(frozen=True, order=True)
class NdSBP:
    """One :class:`SBP` per mesh axis, e.g. ``NdSBP((S(0), B))`` printed ``(S0, B)``."""

    per_axis: tuple[SBP, ...]

    def __post_init__(self):
        object.__setattr__(self, "per_axis", tuple(self.per_axis))
        if not all(isinstance(x, SBP) for x in self.per_axis):
            raise SBPError(f"NdSBP needs SBP entries, got {self.per_axis!r}")

    @staticmethod
    def broadcast(ndim: int) -> "NdSBP":
        return NdSBP((B,) * ndim)

    def __len__(self) -> int:
        return len(self.per_axis)

    def __iter__(self):
        return iter(self.per_axis)

    def __getitem__(self, axis: int) -> SBP:
        return self.per_axis[axis]

    def replace(self, axis: int, sbp: SBP) -> "NdSBP":
        items = list(self.per_axis)
        items[axis] = sbp
        return NdSBP(tuple(items))

    @property
    def has_partial(self) -> bool:
        return any(x.is_partial for x in self.per_axis)

    def split_factor(self, dim: int, mesh_shape: Sequence[int]) -> int:
        """How many pieces tensor dim ``dim`` is cut into across all axes."""
        f = 1
        for sbp, p in zip(self.per_axis, mesh_shape):
            if sbp.is_split and sbp.dim == dim:
                f *= p
        return f

    def check_rank(self, ndim: int) -> None:
        for x in self.per_axis:
            if x.is_split and x.dim >= ndim:
                raise SBPError(f"{self} splits dim {x.dim} of a {ndim}-d tensor")

    def to_placements(self) -> tuple:
        return tuple(x.to_placement() for x in self.per_axis)

    @staticmethod
    def from_placements(placements: Iterable) -> "NdSBP":
        return NdSBP(tuple(SBP.from_placement(p) for p in placements))

    def __str__(self) -> str:
        return "(" + ", ".join(map(str, self.per_axis)) + ")"

    __repr__ = __str__


from_placements = NdSBP.from_placements


def parse_sbp(text: str) -> NdSBP:
    """Parse ``"(S0, B)"``, ``"S0,B"`` or ``"B"`` into an :class:`NdSBP`."""
    body = text.strip().removeprefix("(").removesuffix(")")
    parts = [p for p in body.split(",") if p.strip()]
    if not parts:
        raise SBPError(f"cannot parse SBP {text!r}: it is empty")
    return NdSBP(tuple(_parse_one(p) for p in parts))


def as_ndsbp(value) -> NdSBP:
    """A user's placement as an :class:`NdSBP`: an NdSBP, a string :func:`parse_sbp` reads,
    or a sequence of :class:`SBP` (one per mesh axis); anything else is an SBPError."""
    if isinstance(value, NdSBP):
        return value
    if isinstance(value, str):
        return parse_sbp(value)
    if isinstance(value, (tuple, list)) and value and all(isinstance(x, SBP) for x in value):
        return NdSBP(tuple(value))
    raise SBPError(f"{value!r} is not a placement: give a string such as '(S0, B)' or a sequence "
                   "of S(d), B and P, one per mesh axis")


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's [start, stop) of piece ``index`` of ``parts`` over ``n``."""
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(start + size, n)


def _check(shape: Sequence[int], sbp: NdSBP, mesh_shape: Sequence[int]) -> None:
    if len(sbp) != len(mesh_shape):
        raise SBPError(f"{sbp} has {len(sbp)} axes but the mesh {tuple(mesh_shape)} has {len(mesh_shape)}")
    sbp.check_rank(len(shape))


def local_slices(shape: Sequence[int], sbp: NdSBP, mesh_shape: Sequence[int],
                 coord: Sequence[int]) -> tuple[slice, ...]:
    """The slice of the global tensor held at mesh coordinate ``coord``."""
    _check(shape, sbp, mesh_shape)
    bounds = [(0, n) for n in shape]
    for axis, x in enumerate(sbp):
        if x.is_split:
            lo, hi = bounds[x.dim]
            a, b = chunk_bounds(hi - lo, mesh_shape[axis], coord[axis])
            bounds[x.dim] = (lo + a, lo + b)
    return tuple(slice(a, b) for a, b in bounds)


def local_shape(shape: Sequence[int], sbp: NdSBP, mesh_shape: Sequence[int],
                coord: Sequence[int] | None = None) -> tuple[int, ...]:
    """Shape of the local piece at ``coord`` (default: the first, i.e. largest, piece)."""
    coord = coord if coord is not None else (0,) * len(mesh_shape)
    return tuple(s.stop - s.start for s in local_slices(shape, sbp, mesh_shape, coord))


def divides(shape: Sequence[int], sbp: NdSBP, mesh_shape: Sequence[int]) -> bool:
    """True when every split cuts its dim into equal pieces at every step."""
    _check(shape, sbp, mesh_shape)
    sizes = list(shape)
    for axis, x in enumerate(sbp):
        if x.is_split:
            if sizes[x.dim] % mesh_shape[axis]:
                return False
            sizes[x.dim] //= mesh_shape[axis]
    return True


def fills_every_piece(n: int, parts: int) -> bool:
    """Whether ``torch.chunk`` cuts ``n`` into ``parts`` pieces none of which is empty
    (``n = 10`` into 4: 3, 3, 3, 1; ``n = 6`` into 4: 2, 2, 2 and an empty fourth)."""
    return n % parts == 0 or -(-n // parts) * (parts - 1) < n


def cuts_unevenly(shape: Sequence[int], sbp: NdSBP, mesh_shape: Sequence[int]) -> set[int]:
    """The dims that some mesh axis of ``sbp`` cuts into unequal pieces."""
    _check(shape, sbp, mesh_shape)
    sizes, uneven = list(shape), set()
    for axis, x in enumerate(sbp):
        if x.is_split:
            if sizes[x.dim] % mesh_shape[axis]:
                uneven.add(x.dim)
            sizes[x.dim] = -(-sizes[x.dim] // mesh_shape[axis])
    return uneven


def plannable(shape: Sequence[int], sbp: NdSBP, mesh_shape: Sequence[int]) -> bool:
    """Whether the sharding search may place a ``shape`` tensor ``sbp``: every split
    divides its dim (:func:`divides`), or a dim that does not divide is cut by one mesh
    axis alone into non-empty ``torch.chunk`` pieces (an uneven split: lowering pads
    its collectives to the largest piece, :func:`padded_shape`)."""
    if divides(shape, sbp, mesh_shape):
        return True
    for d in cuts_unevenly(shape, sbp, mesh_shape):
        axes = [axis for axis, x in enumerate(sbp) if x.is_split and x.dim == d]
        if len(axes) > 1 or not fills_every_piece(shape[d], mesh_shape[axes[0]]):
            return False
    return True


def why_not_plannable(shape: Sequence[int], sbp: NdSBP, mesh_shape: Sequence[int]) -> str:
    """Why :func:`plannable` refuses ``sbp`` for ``shape``, in words ("" where it does not)."""
    for d in sorted(cuts_unevenly(shape, sbp, mesh_shape)):
        axes = [axis for axis, x in enumerate(sbp) if x.is_split and x.dim == d]
        if len(axes) > 1:
            one_axis = NdSBP(tuple(B if axis in axes[1:] else x for axis, x in enumerate(sbp)))
            return (f"dim {d} ({shape[d]}) does not divide, and a dim that does not divide may be "
                    f"split by one mesh axis only, not by axes {axes} (e.g. {one_axis})")
        parts = mesh_shape[axes[0]]
        if not fills_every_piece(shape[d], parts):
            size = -(-shape[d] // parts)
            pieces = [max(0, min(size, shape[d] - i * size)) for i in range(parts)]
            return (f"torch.chunk cuts dim {d} ({shape[d]}) into pieces of {pieces} over the "
                    f"{parts} devices of mesh axis {axes[0]}: a device would get none")
    return ""


def padded_shape(shape: Sequence[int], sbp: NdSBP, axis: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with the dim ``d`` that ``sbp`` splits on mesh ``axis`` zero-padded so that
    ``axis`` cuts it evenly (DTensor's padding for a collective on an uneven shard): each of
    the ``f`` equal pieces the other axes cut ``d`` into grows from ``m`` to
    ``ceil(m / p) * p``, ``p`` the axis size. The other axes must cut ``d`` evenly."""
    _check(shape, sbp, mesh_shape)
    d, p = sbp[axis].dim, mesh_shape[axis]
    if not sbp[axis].is_split:
        raise SBPError(f"{sbp} does not split a dim on mesh axis {axis}")
    f = sbp.split_factor(d, mesh_shape) // p
    if shape[d] % f:
        raise SBPError(f"{sbp} splits dim {d} of {tuple(shape)} unevenly on a mesh axis other "
                       f"than {axis}: no padding makes axis {axis}'s pieces equal")
    padded = list(shape)
    padded[d] = f * -(-(shape[d] // f) // p) * p
    return tuple(padded)
