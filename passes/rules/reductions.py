"""Reductions, normalizations and losses.

- ``sum``: a split reduced dim gives ``P``; kept dims split through; ``P->P``.
- ``mean``: a reduced dim is never split (a local mean is not a partial sum); ``P->P``.
- softmax / log-softmax: the softmax dim is never split; no ``P`` forward, backward
  linear in the incoming gradient.
- layer norm: the normalized dims are never split; the batch dims split, and in the
  backward the weight/bias gradients are contracted over them (``P``).
- nll / mse loss: with ``reduction=sum`` a batch split gives a ``P`` loss (and a
  ``P`` total_weight); with ``mean`` the batch dim is never split (a local mean is
  not a partial sum), except in ``nll_loss_backward``, whose gradient rows only
  scale by the (``B``) total weight. Losses are linear in the input / gradient.
"""
from __future__ import annotations

import torch

from .core import UNSPLIT, Call, Labels, letters

aten = torch.ops.aten
MEAN, SUM = 1, 2  # aten's Reduction enum


def _reduced_dims(call: Call, ndim: int) -> set[int]:
    dims = call.get("dim")
    return {d % max(ndim, 1) for d in dims} if dims else set(range(ndim))


def sum_(call: Call) -> Labels:
    """Reduced dims contract (``P``), kept dims split through."""
    ndim = call["self"].ndim
    reduced = _reduced_dims(call, ndim)
    labels = letters(ndim)
    keep = call.get("keepdim", False)
    out = "".join(UNSPLIT if d in reduced else c for d, c in enumerate(labels)
                  if keep or d not in reduced)
    return Labels({"self": labels}, [out], linear=[{"self"}])


def mean(call: Call) -> Labels:
    """Reduced dims are never split."""
    ndim = call["self"].ndim
    reduced = _reduced_dims(call, ndim)
    labels = "".join(UNSPLIT if d in reduced else c for d, c in enumerate(letters(ndim)))
    keep = call.get("keepdim", False)
    out = "".join(c for d, c in enumerate(labels) if keep or d not in reduced)
    return Labels({"self": labels}, [out], linear=[{"self"}])


def _except_dim(ndim: int, d: int) -> str:
    labels = letters(ndim)
    return labels[:d] + UNSPLIT + labels[d + 1:]


def softmax(call: Call) -> Labels:
    labels = _except_dim(call["self"].ndim, call.dim("dim", call["self"].ndim))
    return Labels({"self": labels}, [labels])


def softmax_backward(call: Call) -> Labels:
    labels = _except_dim(call["output"].ndim, call.dim("dim", call["output"].ndim))
    return Labels({"grad_output": labels, "output": labels}, [labels], linear=[{"grad_output"}])


def _norm_labels(meta, n_normalized: int) -> tuple[str, str, str]:
    """(input, per-row statistics, parameter) labels of a layer norm."""
    batch = letters(meta.ndim - n_normalized)
    return batch + UNSPLIT * n_normalized, batch + UNSPLIT * n_normalized, UNSPLIT * n_normalized


def layer_norm(call: Call) -> Labels:
    x, stats, param = _norm_labels(call["input"], len(call["normalized_shape"]))
    return Labels({"input": x, "weight": param, "bias": param}, [x, stats, stats])


def layer_norm_backward(call: Call) -> Labels:
    """grad_input splits with the batch; grad_weight/grad_bias contract it (``P``)."""
    x, stats, param = _norm_labels(call["input"], len(call["normalized_shape"]))
    return Labels({"grad_out": x, "input": x, "mean": stats, "rstd": stats,
                   "weight": param, "bias": param}, [x, param, param],
                  linear=[{"grad_out"}, {"weight"}],
                  deps={0: {"grad_out", "input", "mean", "rstd", "weight"},
                        1: {"grad_out", "input", "mean", "rstd"}, 2: {"grad_out"}})


def _loss_batch(call: Call, ndim: int, splittable: bool) -> str:
    """Labels of a loss input: the batch dim (dim 0 of a 2-d input) and class dim."""
    batch = "n" if splittable else UNSPLIT
    return batch + UNSPLIT if ndim == 2 else UNSPLIT * ndim


def nll_loss(call: Call) -> Labels:
    reduction = call["reduction"]
    x = _loss_batch(call, call["self"].ndim, reduction != MEAN)
    target = x[:1] if call["self"].ndim == 2 else ""
    out = target if reduction == 0 else ""
    return Labels({"self": x, "target": target}, [out, ""], linear=[{"self"}],
                  deps={0: {"self", "target", "weight"}, 1: {"target", "weight"}})


def nll_loss_backward(call: Call) -> Labels:
    x = _loss_batch(call, call["self"].ndim, True)
    target = x[:1] if call["self"].ndim == 2 else ""
    grad = target if call["reduction"] == 0 else ""
    return Labels({"grad_output": grad, "self": x, "target": target}, [x],
                  linear=[{"grad_output"}])


def mse_loss(call: Call) -> Labels:
    ndim = call["self"].ndim
    labels = letters(ndim) if call["reduction"] != MEAN else UNSPLIT * ndim
    out = labels if call["reduction"] == 0 else ""
    return Labels({"self": labels, "target": labels}, [out])


def mse_loss_backward(call: Call) -> Labels:
    ndim = call["self"].ndim
    labels = letters(ndim) if call["reduction"] != MEAN else UNSPLIT * ndim
    grad = labels if call["reduction"] == 0 else ""
    return Labels({"grad_output": grad, "self": labels, "target": labels}, [labels],
                  linear=[{"grad_output"}, {"self", "target"}])


RULES = {
    aten.sum.dim_IntList: sum_, aten.sum.default: sum_,
    aten.mean.dim: mean, aten.mean.default: mean,
    aten._softmax.default: softmax, aten._log_softmax.default: softmax,
    aten._softmax_backward_data.default: softmax_backward,
    aten._log_softmax_backward_data.default: softmax_backward,
    aten.native_layer_norm.default: layer_norm,
    aten.native_layer_norm_backward.default: layer_norm_backward,
    aten.nll_loss_forward.default: nll_loss,
    aten.nll_loss_backward.default: nll_loss_backward,
    aten.mse_loss.default: mse_loss,
    aten.mse_loss_backward.default: mse_loss_backward,
}
