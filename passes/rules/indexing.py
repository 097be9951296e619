"""Indexing operators: a tensor read (or written) at positions another tensor holds.

The indexed dim of the data tensor never splits (a local piece would need its global
offset); the index tensor may split, and its split carries to the output. A dim that
the data, the index and the output share position by position splits all of them.

- ``gather(self, dim, index)``: the index (and output, of the index's shape) splits on
  any dim; on a dim other than ``dim`` only where it is as long as ``self`` there, and
  then ``self`` splits with it. Linear in ``self``.
- ``scatter_add(self, dim, index, src)``: ``self`` + ``src`` added at the index
  positions. ``index`` and ``src`` split together on ``dim`` (their own positions) with
  the output ``P`` and ``self`` ``P`` with it (each piece adds its part of ``src``); on
  another dim all four split where they are equally long. Linear in ``self`` and
  ``src`` jointly. ``scatter`` (overwrite) splits only on the shared dims, no ``P``.
- ``index_add(self, dim, index, source)``: ``scatter_add`` with a 1-d index of the rows
  of ``source`` along ``dim`` (a mixture of experts' combine, a graph network's messages
  summed into nodes): the index and that dim of ``source`` split together, the output
  ``P`` with ``self`` ``P``; the other dims split ``self``, ``source`` and the output
  where they are equally long. ``index_copy`` and ``index_reduce`` (overwrite, amax, mean)
  and ``scatter_reduce`` split only on those other dims, no ``P``.
- ``searchsorted(sorted_sequence, self)``: each value is looked up alone, so every dim
  of ``self`` splits the output; a 1-d sequence stays ``B``, an n-d one (a sequence per
  row of ``self``) splits with ``self``'s leading dims, its own last dim never.
- ``index_select(self, dim, index)``: the 1-d index splits the output's ``dim``;
  ``self``'s other dims split through. Linear in ``self``.
- ``index.Tensor(self, indices)``: the index tensors broadcast to one index shape that
  replaces the indexed dims (in place if they are adjacent, else in front, as
  torch's advanced indexing does); a split of that shape splits the index tensors
  holding the dim (the others ``B``) and the output; the dims of ``self`` not indexed
  split through. Bool (mask) indices give data-dependent shapes: nothing splits.
  Linear in ``self``.
- ``index_put(self, indices, values, accumulate)``: the adjoint of ``index.Tensor``
  (:func:`index_put`): with ``accumulate`` the index dims split ``values`` and the index
  tensors, the output and ``self`` ``P``.
"""
from __future__ import annotations

import torch

from .core import UNSPLIT, Call, Labels, TensorMeta, aligned, letters

aten = torch.ops.aten
SELF = ({"self"},)


def gather(call: Call) -> Labels:
    meta, index = call["self"], call["index"]
    d = call.dim("dim", meta.ndim)
    labels = letters(index.ndim)
    if index.ndim != meta.ndim:      # 0-d self or index: nothing lines up
        return Labels({"self": UNSPLIT * meta.ndim, "index": UNSPLIT * index.ndim},
                      [UNSPLIT * index.ndim], linear=SELF)
    shared = [i != d and index.shape[i] == meta.shape[i] for i in range(meta.ndim)]
    idx = "".join(c if i == d or shared[i] else UNSPLIT for i, c in enumerate(labels))
    src = "".join(c if shared[i] else UNSPLIT for i, c in enumerate(labels))
    return Labels({"self": src, "index": idx}, [idx], linear=SELF)


def _scatter_labels(call: Call, along_dim: bool) -> tuple[str, str, str]:
    """(self/output, index, src) labels of a scatter."""
    meta, index = call["self"], call["index"]
    src = call.get("src")
    others = [m for m in (index, src) if isinstance(m, TensorMeta)]
    if meta.ndim == 0 or any(m.ndim != meta.ndim for m in others):  # nothing lines up
        return UNSPLIT * meta.ndim, UNSPLIT * index.ndim, UNSPLIT * getattr(src, "ndim", 0)
    d = call.dim("dim", meta.ndim)
    labels = letters(meta.ndim)
    out = "".join(c if i != d and all(m.shape[i] == meta.shape[i] for m in others) else UNSPLIT
                  for i, c in enumerate(labels))
    idx = out
    if along_dim and all(m.shape[d] == index.shape[d] for m in others):
        idx = out[:d] + "z" + out[d + 1:]
    return out, idx, idx


def _added(labels: tuple[str, str, str], source: str) -> Labels:
    """``self`` plus ``source`` added at the index positions, from its (self/output, index,
    source) labels: the output ``P`` with ``self``; linear in both jointly."""
    out, idx, src = labels
    return Labels({"self": out, "index": idx, source: src}, [out], addends=["self"],
                  linear=[{"self", source}])


def scatter_add(call: Call) -> Labels:
    return _added(_scatter_labels(call, along_dim=True), "src")


def scatter(call: Call) -> Labels:
    out, idx, src = _scatter_labels(call, along_dim=False)
    inputs = {"self": out, "index": idx}
    if isinstance(call.get("src"), TensorMeta):
        inputs["src"] = src
    return Labels(inputs, [out])


def _index_labels(call: Call, along_dim: bool) -> tuple[str, str, str]:
    """(self/output, index, source) labels of ``index_add``/``index_copy``/``index_reduce``
    (a 1-d ``index`` of the rows of ``source`` along ``dim``)."""
    meta, index, source = call["self"], call["index"], call["source"]
    if meta.ndim == 0 or source.ndim != meta.ndim or index.ndim != 1:  # nothing lines up
        return UNSPLIT * meta.ndim, UNSPLIT * index.ndim, UNSPLIT * source.ndim
    d = call.dim("dim", meta.ndim)
    out = "".join(c if i != d and source.shape[i] == meta.shape[i] else UNSPLIT
                  for i, c in enumerate(letters(meta.ndim)))
    if not along_dim:
        return out, UNSPLIT, out
    return out, "z", out[:d] + "z" + out[d + 1:]


def index_add(call: Call) -> Labels:
    return _added(_index_labels(call, along_dim=True), "source")


def index_overwrite(call: Call) -> Labels:
    """``index_copy`` and ``index_reduce``: the dims other than ``dim`` only."""
    out, idx, src = _index_labels(call, along_dim=False)
    return Labels({"self": out, "index": idx, "source": src}, [out])


def searchsorted(call: Call) -> Labels:
    sequence, values = call["sorted_sequence"], call["self"]
    labels = letters(values.ndim)
    if sequence.ndim == 1:
        rows = UNSPLIT
    elif sequence.ndim == values.ndim and sequence.shape[:-1] == values.shape[:-1]:
        rows = labels[:-1] + UNSPLIT
    else:  # nothing lines up
        rows, labels = UNSPLIT * sequence.ndim, UNSPLIT * values.ndim
    inputs = {"sorted_sequence": rows, "self": labels}
    if isinstance(call.get("sorter"), TensorMeta):
        inputs["sorter"] = rows
    return Labels(inputs, [labels])


def index_select(call: Call) -> Labels:
    meta, index = call["self"], call["index"]
    if meta.ndim == 0:  # a 0-d self: nothing to split
        return Labels({"self": "", "index": UNSPLIT * index.ndim}, [""])
    d = call.dim("dim", meta.ndim)
    labels = letters(meta.ndim)
    src = labels[:d] + UNSPLIT + labels[d + 1:]
    idx = "z" if index.ndim == 1 else UNSPLIT * index.ndim
    out = src[:d] + (idx or UNSPLIT) + src[d + 1:] if meta.ndim else ""
    return Labels({"self": src, "index": idx}, [out], linear=SELF)


def _advanced(meta: TensorMeta, entries: list, gathered: TensorMeta) -> tuple[str, list[str], str, str] | None:
    """Labels of advanced indexing ``self[indices]`` (``self``: ``meta``), whose result is
    ``gathered``: (``self``, each index, the result, the result's index dims); None for
    bool (mask) indices or none at all, whose shapes depend on values."""
    positions = [i for i, m in enumerate(entries) if isinstance(m, TensorMeta)]
    tensors = [entries[i] for i in positions]
    if not tensors or any(m.dtype in (torch.bool, torch.uint8) for m in tensors):
        return None
    n_index = max(m.ndim for m in tensors)
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0      # where the index dims sit in the result
    out_labels = letters(gathered.ndim)
    index_labels = out_labels[start:start + n_index]
    # the result's dim of each dim of self that is not indexed, in order
    rest = [i for i in range(meta.ndim) if i not in positions]
    out_dims = [i if i < start else i - len(positions) + n_index for i in rest] if adjacent \
        else [n_index + k for k in range(len(rest))]
    src = [UNSPLIT] * meta.ndim
    for i, j in zip(rest, out_dims):
        src[i] = out_labels[j]
    indices = [aligned(m, gathered.shape[start:start + n_index], index_labels)
               if isinstance(m, TensorMeta) else "" for m in entries]
    return "".join(src), indices, out_labels, index_labels


def _unsplit(entries: list) -> list[str]:
    return [UNSPLIT * m.ndim if isinstance(m, TensorMeta) else "" for m in entries]


def index(call: Call) -> Labels:
    meta, out = call["self"], call.outputs[0]
    entries = list(call["indices"])
    labels = _advanced(meta, entries, out)
    if labels is None:
        return Labels({"self": UNSPLIT * meta.ndim, "indices": _unsplit(entries)},
                      [UNSPLIT * out.ndim], linear=SELF)
    src, indices, out_labels, _ = labels
    return Labels({"self": src, "indices": indices}, [out_labels], linear=SELF)


def index_put(call: Call) -> Labels:
    """``self[indices] = values`` (``accumulate``: ``+=``), the adjoint of :func:`index`:
    ``values`` has the shape ``self[indices]`` has (else nothing splits). The dims of
    ``self`` not indexed split with ``values``' through them. With ``accumulate`` the
    index dims split ``values`` and the index tensors together, and the output is ``P``
    with ``self`` ``P`` (each rank adds its part: the backward of ``weight[ids]``);
    overwriting, they never split. Linear in ``self`` and ``values`` jointly."""
    meta, values = call["self"], call["values"]
    entries = list(call["indices"])
    shaped = isinstance(values, TensorMeta) and _gathers_to(meta, entries, values)
    labels = _advanced(meta, entries, values) if shaped else None
    linear = [{"self", "values"}] if isinstance(values, TensorMeta) else SELF
    if labels is None:
        inputs = {"self": UNSPLIT * meta.ndim, "indices": _unsplit(entries)}
        if isinstance(values, TensorMeta):
            inputs["values"] = UNSPLIT * values.ndim
        return Labels(inputs, [UNSPLIT * meta.ndim], linear=linear)
    src, indices, value_labels, index_labels = labels
    if not call.get("accumulate", False):
        value_labels = "".join(UNSPLIT if c in index_labels else c for c in value_labels)
        indices = [UNSPLIT * len(lab) for lab in indices]
    return Labels({"self": src, "indices": indices, "values": value_labels}, [src],
                  addends=["self"], linear=linear)


def _gathers_to(meta: TensorMeta, entries: list, values: TensorMeta) -> bool:
    """Whether ``values`` has exactly the shape of ``self[indices]`` (no broadcasting)."""
    try:
        with torch.device("meta"):
            like = torch.empty(meta.shape)[tuple(torch.zeros(m.shape, dtype=torch.long)
                                                 if isinstance(m, TensorMeta) else slice(None)
                                                 for m in entries)]
    except (IndexError, RuntimeError):
        return False
    return tuple(like.shape) == tuple(values.shape)


RULES = {
    aten.gather.default: gather,
    aten.scatter_add.default: scatter_add,
    aten.scatter.src: scatter, aten.scatter.value: scatter, aten.scatter_reduce.two: scatter,
    aten.index_add.default: index_add, aten.searchsorted.Tensor: searchsorted,
    aten.index_copy.default: index_overwrite, aten.index_reduce.default: index_overwrite,
    aten.index_select.default: index_select,
    aten.index.Tensor: index,
    aten.index_put.default: index_put,
}
