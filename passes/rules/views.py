"""View-like and data-movement operators: splits follow the dims they move.

All are linear (``P->P``). A reshape keeps a split when its dim survives whole or is
the outermost component of a merged or split group of dims (size-1 dims ignored);
any other split would need data movement and is refused. ``slice``/``split``/``cat``
never split their own dim (unless the slice takes the whole dim); ``expand`` may
split a broadcast dim of its output (the input is ``B`` there).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .core import UNSPLIT, Call, Labels, letters

aten = torch.ops.aten

SELF = ({"self"},)


def reshape_labels(src: Sequence[int], dst: Sequence[int]) -> tuple[str, str]:
    """Labels of a reshape ``src -> dst``: one label per group of dims with equal
    products, on the outermost dim of size > 1 of the group on both sides."""
    a = [i for i, n in enumerate(src) if n != 1]
    b = [j for j, n in enumerate(dst) if n != 1]
    src_lab, dst_lab = [UNSPLIT] * len(src), [UNSPLIT] * len(dst)
    i = j = 0
    while i < len(a) and j < len(b):
        label = letters(1, start=j)
        src_lab[a[i]], dst_lab[b[j]] = label, label
        n, m = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while n != m:
            if n < m:
                n *= src[a[i]]
                i += 1
            else:
                m *= dst[b[j]]
                j += 1
    return "".join(src_lab), "".join(dst_lab)


def reshape(call: Call) -> Labels:
    src, dst = reshape_labels(call["self"].shape, call.outputs[0].shape)
    return Labels({"self": src}, [dst], linear=SELF)


def permute(call: Call) -> Labels:
    """transpose/permute/t: the output dims are a permutation of the input's."""
    ndim = call["self"].ndim
    labels = letters(ndim)
    if call.target is aten.permute_copy.default or call.target is aten.permute.default:
        order = [d % ndim for d in call["dims"]]
    else:
        order = list(range(ndim))
        if ndim >= 2:
            d0, d1 = (call.dim("dim0", ndim), call.dim("dim1", ndim)) if "dim0" in call.args \
                else (0, 1)
            order[d0], order[d1] = order[d1], order[d0]
    return Labels({"self": labels}, ["".join(labels[d] for d in order)], linear=SELF)


def expand(call: Call) -> Labels:
    out = call.outputs[0]
    out_labels = letters(out.ndim)
    offset = out.ndim - call["self"].ndim
    src = "".join(out_labels[offset + i] if n == out.shape[offset + i] else UNSPLIT
                  for i, n in enumerate(call["self"].shape))
    return Labels({"self": src}, [out_labels], linear=SELF)


def unsqueeze(call: Call) -> Labels:
    ndim = call["self"].ndim
    labels = letters(ndim)
    d = call["dim"] % (ndim + 1)
    return Labels({"self": labels}, [labels[:d] + UNSPLIT + labels[d:]], linear=SELF)


def squeeze(call: Call) -> Labels:
    """Drops size-1 dims; which ones follows from the shapes."""
    src, dst = reshape_labels(call["self"].shape, call.outputs[0].shape)
    return Labels({"self": src}, [dst], linear=SELF)


def slice_(call: Call) -> Labels:
    """The sliced dim stays whole unless the slice takes all of it."""
    meta = call["self"]
    d = call.dim("dim", meta.ndim)
    labels = letters(meta.ndim)
    if call.outputs[0].shape[d] != meta.shape[d]:
        labels = labels[:d] + UNSPLIT + labels[d + 1:]
    return Labels({"self": labels}, [labels], linear=SELF)


def split(call: Call) -> Labels:
    meta = call["self"]
    d = call.dim("dim", meta.ndim)
    labels = letters(meta.ndim)
    labels = labels[:d] + UNSPLIT + labels[d + 1:]
    return Labels({"self": labels}, [labels] * len(call.outputs), linear=SELF)


def cat(call: Call) -> Labels:
    out = call.outputs[0]
    d = call.dim("dim", out.ndim)
    labels = letters(out.ndim)
    labels = labels[:d] + UNSPLIT + labels[d + 1:]
    return Labels({"tensors": [labels if m.ndim == out.ndim else UNSPLIT * m.ndim
                               for m in call.inputs]}, [labels], linear=[{"tensors"}])


RULES = {
    **dict.fromkeys([aten.view.default, aten.view_copy.default, aten._unsafe_view.default,
                     aten.reshape.default, aten._reshape_copy.default], reshape),
    **dict.fromkeys([aten.t.default, aten.t_copy.default, aten.transpose.int,
                     aten.transpose_copy.int, aten.permute.default,
                     aten.permute_copy.default], permute),
    **dict.fromkeys([aten.expand.default, aten.expand_copy.default], expand),
    **dict.fromkeys([aten.unsqueeze.default, aten.unsqueeze_copy.default], unsqueeze),
    **dict.fromkeys([aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
                     aten.squeeze_copy.default, aten.squeeze_copy.dim,
                     aten.squeeze_copy.dims], squeeze),
    **dict.fromkeys([aten.slice.Tensor, aten.slice_copy.Tensor], slice_),
    **dict.fromkeys([aten.split.Tensor, aten.split_copy.Tensor, aten.split_with_sizes.default,
                     aten.split_with_sizes_copy.default], split),
    aten.cat.default: cat,
}


def local_size(call: Call, in_shapes, out_shapes) -> dict:
    """A ``size`` argument becomes the local output shape."""
    return {"size": list(out_shapes[0])}


LOCALIZERS = dict.fromkeys([aten.view.default, aten.view_copy.default, aten._unsafe_view.default,
                            aten.reshape.default, aten._reshape_copy.default,
                            aten.expand.default, aten.expand_copy.default], local_size)
