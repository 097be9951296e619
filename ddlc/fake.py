"""Operators run on the metadata of fake values, without the fake mode's dispatch.

A lowering pass that builds or re-runs a node needs its output's shape, strides and dtype,
which the fake tensor mode works out by dispatching every call through its own machinery:
about 200 us a call on the development machine, where the same operator on meta tensors
of the same layouts takes 15-30 us and wrapping its result as a fake tensor 15 more.
:func:`run_on_meta` does the latter for a call whose tensors are all fake: the same meta
kernel the fake mode would run, so the same shapes, strides and dtypes, for operators
whose meta kernel does not answer by device (CPU's eval-mode ``native_batch_norm`` saves
no statistics, its meta kernel does). Nor does it give aliasing (a result is a fresh fake
tensor, never a view of a fake argument). Its callers run the operators a pass builds
itself (concatenations, views and splits of buckets and pieces, the strides of views),
where neither matters.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from .ir import map_leaves

__all__ = ["all_fake", "as_fake", "as_meta", "element_span", "empty_fake", "fresh_fake", "run_on_meta", "strided_fake",
           "tensors_mapped"]


def tensors_mapped(x, f):
    """``x`` with every tensor ``t`` in it replaced by ``f(t)``."""
    return map_leaves(lambda t: f(t) if isinstance(t, torch.Tensor) else t, x)


def as_meta(x):
    """``x`` with every tensor not on the meta device replaced by an empty meta tensor of
    its shape, strides and dtype."""
    def one(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return tensors_mapped(x, one)


def as_fake(x, mode, device: torch.device):
    """``x`` with every tensor replaced by a fake tensor of ``mode`` on ``device`` with its
    shape, strides and dtype (a fake tensor of ``mode`` stays as it is)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor) and t.fake_mode is mode:
            return t
        return strided_fake(mode, t.shape, t.stride(), t.dtype, device, t.storage_offset())
    return tensors_mapped(x, one)


def run_on_meta(fn, args, kwargs, tensors: list[torch.Tensor]):
    """``fn(*args, **kwargs)`` for arguments whose tensors (``tensors``, all fake tensors
    of one mode, at least one) are given as meta tensors of their layouts; the resulting
    tensors are fake tensors of that mode on the arguments' device (the first that is not
    the CPU, as a CPU scalar may join a GPU tensor; else the CPU)."""
    mode = tensors[0].fake_mode
    device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    with unset_fake_temporarily():
        out = fn(*as_meta(args), **as_meta(kwargs))
        return tensors_mapped(out, lambda t: FakeTensor(mode, t, device))


def all_fake(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` is not empty and every one of them a fake tensor of one mode
    (what :func:`run_on_meta` needs)."""
    return bool(tensors) and all(isinstance(t, FakeTensor) and t.fake_mode is tensors[0].fake_mode
                                 for t in tensors)


def element_span(shape, stride) -> int:
    """How many elements of its storage a tensor of ``shape`` and ``stride`` spans, from its
    first element to its last (0 if it has none)."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0


def strided_fake(mode, shape, stride, dtype: torch.dtype, device: torch.device, offset: int = 0,
                 requires_grad: bool = False) -> FakeTensor:
    """A fake tensor of ``mode`` with this layout (shape, strides, storage offset), dtype,
    device and ``requires_grad``, made from a meta tensor directly: 15 us, where dispatch
    through the mode takes about 80."""
    with unset_fake_temporarily():
        meta = torch.empty(offset + element_span(shape, stride), dtype=dtype, device="meta").as_strided(shape, stride, offset)
        fake = FakeTensor(mode, meta, device)
    return fake.requires_grad_() if requires_grad else fake


def empty_fake(mode, shape, dtype: torch.dtype, device: torch.device) -> FakeTensor:
    """A contiguous fake tensor of ``mode`` (``torch.empty(shape, dtype=dtype)`` under it,
    on ``device``), made from a meta tensor directly."""
    with unset_fake_temporarily():
        return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), device)


def fresh_fake(val):
    """A fake tensor of ``val``'s metadata in its fake mode, a value of its own (``val``
    itself if it is no tensor)."""
    if not isinstance(val, torch.Tensor):
        return val
    return strided_fake(val.fake_mode, val.shape, val.stride(), val.dtype, val.device, val.storage_offset(),
                        val.requires_grad)
