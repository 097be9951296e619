"""View-like and data-movement operators: splits follow the dims they move.

All are linear (``P->P``; ``constant_pad_nd`` only with a 0 fill). A reshape keeps a
split when its dim survives whole or is the outermost component of a merged or split
group of dims (size-1 dims ignored); any other split would need data movement and is
refused. ``slice``/``split``/``cat``/``stack``/``select``/``unbind`` never split their
own dim (unless the slice takes the whole dim); every other dim splits through. The
backward and scatter forms (``slice_backward``, ``select_backward``, ``slice_scatter``,
``select_scatter``) split like the forward (their ``input_sizes`` are localized).
``expand`` may split a broadcast dim of its output (the input is ``B`` there), and so
may ``repeat`` on a new leading dim or a size-1 dim (``repeats`` localized); a dim
repeated more than once never splits (the copies interleave the pieces). Padding
(``constant_pad_nd``) never splits a padded dim; ``triu``/``tril`` only split the batch
dims (the mask depends on the row and column of the last two); ``roll`` and ``flip``
never split the dims they move (a roll without dims rolls the flattened tensor: nothing
splits). The diagonal family (``diagonal``, ``diag_embed``, ``diagonal_backward``: a pair
of dims of the full tensor against one diagonal dim, last, on the other side) never
splits the pair or the diagonal; the other dims split through (``input_sizes``
localized).
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


def _drop(labels: str, d: int) -> str:
    return labels[:d] + labels[d + 1:]


def _unsplit(labels: str, d: int) -> str:
    return labels[:d] + UNSPLIT + labels[d + 1:]


def select(call: Call) -> Labels:
    """The selected dim disappears; the others split through."""
    ndim = call["self"].ndim
    labels = _unsplit(letters(ndim), call.dim("dim", ndim))
    return Labels({"self": labels}, [_drop(labels, call.dim("dim", ndim))], linear=SELF)


def select_backward(call: Call) -> Labels:
    """The gradient placed at ``index`` of a zero tensor: the inserted dim never splits."""
    ndim = len(call["input_sizes"])
    d = call.dim("dim", ndim)
    labels = _unsplit(letters(ndim), d)
    return Labels({"grad_output": _drop(labels, d)}, [labels], linear=[{"grad_output"}])


def slice_backward(call: Call) -> Labels:
    """The gradient placed in a zero tensor: the sliced dim stays whole unless the
    slice took all of it."""
    meta = call["grad_output"]
    d = call.dim("dim", meta.ndim)
    labels = letters(meta.ndim)
    if call.outputs[0].shape[d] != meta.shape[d]:
        labels = _unsplit(labels, d)
    return Labels({"grad_output": labels}, [labels], linear=[{"grad_output"}])


def select_scatter(call: Call) -> Labels:
    """``self`` with ``src`` written at ``index`` of ``dim`` (never split there)."""
    ndim = call["self"].ndim
    d = call.dim("dim", ndim)
    labels = _unsplit(letters(ndim), d)
    return Labels({"self": labels, "src": _drop(labels, d)}, [labels], linear=[{"self", "src"}])


def slice_scatter(call: Call) -> Labels:
    """``self`` with ``src`` written into a slice of ``dim`` (split only if it is whole)."""
    meta = call["self"]
    d = call.dim("dim", meta.ndim)
    labels = letters(meta.ndim)
    if call["src"].shape[d] != meta.shape[d]:
        labels = _unsplit(labels, d)
    return Labels({"self": labels, "src": labels}, [labels], linear=[{"self", "src"}])


def unbind(call: Call) -> Labels:
    ndim = call["self"].ndim
    d = call.dim("dim", ndim)
    labels = _unsplit(letters(ndim), d)
    return Labels({"self": labels}, [_drop(labels, d)] * len(call.outputs), linear=SELF)


def stack(call: Call) -> Labels:
    """Equally shaped inputs split together; the new dim never splits."""
    out = call.outputs[0]
    d = call.dim("dim", out.ndim)
    labels = _unsplit(letters(out.ndim), d)
    return Labels({"tensors": [_drop(labels, d)] * len(call.inputs)}, [labels],
                  linear=[{"tensors"}])


def repeat(call: Call) -> Labels:
    """Dims repeated once split through; a new leading dim or a repeated size-1 dim may
    split the output alone (the input is ``B``); other repeated dims never split."""
    meta, repeats = call["self"], list(call["repeats"])
    out_labels = letters(len(repeats))
    offset = len(repeats) - meta.ndim
    src, out = [], list(out_labels)
    for i, n in enumerate(meta.shape):
        r = repeats[offset + i]
        src.append(out_labels[offset + i] if r == 1 else UNSPLIT)
        if r != 1 and n != 1:
            out[offset + i] = UNSPLIT
    return Labels({"self": "".join(src)}, ["".join(out)], linear=SELF)


def constant_pad_nd(call: Call) -> Labels:
    """Padded (or cropped, negative pad) dims never split; linear if the fill is 0."""
    ndim = call["self"].ndim
    pad = list(call["pad"])
    labels = list(letters(ndim))
    for k in range(len(pad) // 2):
        if pad[2 * k] or pad[2 * k + 1]:
            labels[ndim - 1 - k] = UNSPLIT
    labels = "".join(labels)
    return Labels({"self": labels}, [labels], linear=SELF if call["value"] == 0 else ())


def triangle(call: Call) -> Labels:
    """triu/tril: the last two dims never split, the batch dims split through."""
    ndim = call["self"].ndim
    labels = letters(ndim - 2) + UNSPLIT * min(ndim, 2)
    return Labels({"self": labels}, [labels], linear=SELF)


def moved_in_place(call: Call) -> Labels:
    """roll / flip: the dims they roll or reverse never split, the others split through."""
    ndim = call["self"].ndim
    dims = {d % ndim for d in call["dims"]} if call["dims"] else set(range(ndim))
    labels = "".join(UNSPLIT if d in dims else c for d, c in enumerate(letters(ndim)))
    return Labels({"self": labels}, [labels], linear=SELF)


def view_as_real(call: Call) -> Labels:
    """complex ``(...)`` -> real ``(..., 2)``: the new last dim (real, imaginary) never splits."""
    labels = letters(call["self"].ndim)
    return Labels({"self": labels}, [labels + UNSPLIT], linear=SELF)


def view_as_complex(call: Call) -> Labels:
    """real ``(..., 2)`` -> complex ``(...)``: the last dim (real, imaginary) never splits."""
    labels = letters(call["self"].ndim - 1)
    return Labels({"self": labels + UNSPLIT}, [labels], linear=SELF)


def _diagonal_pair(ndim: int, dim1: int, dim2: int) -> tuple[str, str]:
    """(labels of the ``ndim``-d full tensor, of its diagonal): the pair ``dim1``,
    ``dim2`` unsplit, the diagonal's other dims those of the full tensor in order, its
    last dim unsplit."""
    pair = {dim1 % ndim, dim2 % ndim}
    full = "".join(UNSPLIT if i in pair else c for i, c in enumerate(letters(ndim)))
    return full, full.replace(UNSPLIT, "") + UNSPLIT


def diagonal(call: Call) -> Labels:
    full, diag = _diagonal_pair(call["self"].ndim, call.get("dim1", 0), call.get("dim2", 1))
    return Labels({"self": full}, [diag], linear=SELF)


def diag_embed(call: Call) -> Labels:
    full, diag = _diagonal_pair(call["self"].ndim + 1, call.get("dim1", -2), call.get("dim2", -1))
    return Labels({"self": diag}, [full], linear=SELF)


def diagonal_backward(call: Call) -> Labels:
    full, diag = _diagonal_pair(len(call["input_sizes"]), call["dim1"], call["dim2"])
    return Labels({"grad_output": diag}, [full], linear=[{"grad_output"}])


RULES = {
    **dict.fromkeys([aten.diagonal.default, aten.diagonal_copy.default], diagonal),
    aten.diag_embed.default: diag_embed, aten.diagonal_backward.default: diagonal_backward,
    **dict.fromkeys([aten.roll.default, aten.flip.default], moved_in_place),
    **dict.fromkeys([aten.view_as_real.default, aten.view_as_real_copy.default], view_as_real),
    **dict.fromkeys([aten.view_as_complex.default, aten.view_as_complex_copy.default], view_as_complex),
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
                     aten.split_with_sizes_copy.default, aten.unsafe_split.Tensor,
                     aten.unsafe_split_with_sizes.default], split),
    aten.cat.default: cat,
    **dict.fromkeys([aten.select.int, aten.select_copy.int], select),
    aten.select_backward.default: select_backward,
    aten.slice_backward.default: slice_backward,
    aten.select_scatter.default: select_scatter,
    aten.slice_scatter.default: slice_scatter,
    **dict.fromkeys([aten.unbind.int, aten.unbind_copy.int], unbind),
    aten.stack.default: stack,
    aten.repeat.default: repeat,
    aten.constant_pad_nd.default: constant_pad_nd,
    **dict.fromkeys([aten.triu.default, aten.tril.default], triangle),
}


def local_size(call: Call, in_shapes, out_shapes) -> dict:
    """A ``size`` argument becomes the local output shape."""
    return {"size": list(out_shapes[0])}


def local_input_sizes(call: Call, in_shapes, out_shapes) -> dict:
    """A backward's ``input_sizes`` become the local output shape."""
    return {"input_sizes": list(out_shapes[0])}


def local_repeats(call: Call, in_shapes, out_shapes) -> dict:
    """Each repeat count is the local output length over the local input length."""
    repeats, local_in, local_out = list(call["repeats"]), in_shapes[0], out_shapes[0]
    offset = len(repeats) - len(local_in)
    ins = [1] * offset + list(local_in)
    return {"repeats": [o // n if n else r for o, n, r in zip(local_out, ins, repeats)]}


LOCALIZERS = {
    **dict.fromkeys([aten.view.default, aten.view_copy.default, aten._unsafe_view.default,
                     aten.reshape.default, aten._reshape_copy.default,
                     aten.expand.default, aten.expand_copy.default], local_size),
    aten.select_backward.default: local_input_sizes,
    aten.slice_backward.default: local_input_sizes,
    aten.diagonal_backward.default: local_input_sizes,
    aten.repeat.default: local_repeats,
}
