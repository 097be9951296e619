"""Local pieces of boxing steps that are not single collectives.

These run inside compiled per-rank graphs (``call_function`` targets) next to
``torch.ops._c10d_functional`` nodes; each works on the local tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .sbp import chunk_bounds

__all__ = ["local_chunk", "keep_on_first", "with_layout", "all_to_all_dims", "moved", "padded", "narrowed"]

_c10d = torch.ops._c10d_functional


def moved(x: torch.Tensor, source: int, destination: int) -> torch.Tensor:
    """``x.movedim(source, destination)`` as a contiguous copy (collectives and some CPU
    kernels, e.g. layer-norm backward, need contiguous inputs)."""
    return x.movedim(source, destination).contiguous()


def local_chunk(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """``B -> S(dim)``: this rank's piece ``index`` of ``parts`` along ``dim`` (a copy;
    torch.chunk's bounds, so trailing pieces of an uneven dim are short or empty)."""
    start, stop = chunk_bounds(x.shape[dim], parts, index)
    return x.narrow(dim, start, stop - start).contiguous()


def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended along dim 0 up to ``rows`` (the even size a
    collective on an uneven shard needs)."""
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


def narrowed(x: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``x``: a collective's padded result, unpadded (a
    contiguous view when ``x`` is contiguous)."""
    return x.narrow(0, 0, rows)


def with_layout(x: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``x``'s values in a tensor of strides ``stride`` (the layout eager gave it)."""
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)


def keep_on_first(x: torch.Tensor, is_first: bool) -> torch.Tensor:
    """``B -> P``: the value on the axis' first rank, zeros elsewhere (sum = x)."""
    return x.clone() if is_first else torch.zeros_like(x)


def all_to_all_dims(x: torch.Tensor, split_dim: int, cat_dim: int, group_size: int,
                    group_name: str) -> torch.Tensor:
    """``S(cat_dim) -> S(split_dim)`` on one axis: send piece r of ``split_dim`` to rank r,
    concatenate what arrives along ``cat_dim`` in rank order."""
    pieces = torch.stack(x.chunk(group_size, split_dim)).flatten(0, 1).contiguous()
    splits = [pieces.shape[0] // group_size] * group_size
    received = _c10d.wait_tensor(_c10d.all_to_all_single(pieces, splits, splits, group_name))
    return torch.cat(received.unflatten(0, (group_size, -1)).unbind(0), dim=cat_dim)
