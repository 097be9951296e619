"""Reductions, normalizations and losses.

- ``sum``: a split reduced dim gives ``P``; kept dims split through; ``P->P``.
- ``mean``: a reduced dim is never split (a local mean is not a partial sum); ``P->P``.
- other reductions (``amax``, ``any``, ``argmax``, ``max.dim``, ``prod``, ``var``,
  ``logsumexp``, ``linalg_vector_norm``...): a reduced dim is never split (its pieces
  would combine by max, or, or another non-sum), kept dims split through; no ``P``.
- ``count_nonzero``: a split reduced dim gives ``P`` (the pieces' counts add up); kept
  dims split through; not linear (no ``P`` input).
- ``cumsum`` (``cumprod``, ``logcumsumexp``): the scanned dim is never split, the others
  split through; ``cumsum`` is linear (``P->P``). Selections along a dim (``topk``, ``sort``,
  ``cummax``/``cummin``; ``kthvalue``, ``median``, ``mode`` reduce it): that dim is never
  split, the others split through (values and indices alike); no ``P``.
- softmax / log-softmax / ``_safe_softmax``: the softmax dim is never split; no ``P``
  forward, backward linear in the incoming gradient.
- layer norm: the normalized dims are never split; the batch dims split, and in the
  backward the weight/bias gradients are contracted over them (``P``).
- batch norm (input ``[N, C, *]``, per-channel weight, bias and statistics ``[C]``):
  the channel dim splits everything per channel (weight, bias, running and saved
  statistics ``S0``). In inference (``training=False``, the running statistics) every
  other dim splits the input and output alone; the output is affine in the input,
  jointly linear in input, bias and running mean (``P`` together). In training the
  batch statistics span N and the spatial dims, which never split. The backward is
  linear in the incoming gradient; in inference its batch/spatial splits contract into
  the weight and bias gradients (``P``), in training only the channel splits.
- group norm (input ``[N, C, *]``, statistics ``[N, groups]``): the batch splits
  everything but the weight and bias (``N`` localized), whose gradients are contracted
  over it (``P``); channels and space never split (groups span them). The backward is
  linear in the incoming gradient.
- nll, multi-margin and the elementwise losses (mse, smooth L1, Huber, binary
  cross-entropy, soft margin): with ``reduction=sum`` a batch split gives a ``P`` loss (and a ``P``
  total_weight); with ``mean`` the batch dim is never split (a local mean is not a
  partial sum), except in ``nll_loss_backward``, whose gradient rows only scale by the
  (``B``) total weight. nll is linear in its input; every backward in its gradient. The
  per-pixel ``nll_loss2d`` (``[N, C, H, W]``) splits its batch and spatial dims alike.
"""
from __future__ import annotations

import torch

from .core import UNSPLIT, Call, Labels, aligned, letters

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


def _dims(call: Call, ndim: int) -> set[int]:
    """The reduced dims: ``dim`` as an int or a list; None, [] or no ``dim`` is every dim."""
    dims = call.args.get("dim")
    if dims is None or dims == () or dims == []:
        return set(range(ndim))
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    return {d % max(ndim, 1) for d in dims}


def reduce_unsplit(call: Call) -> Labels:
    """A reduction whose pieces do not sum: reduced dims never split, kept dims split
    through (every output: values and indices alike); no ``P``."""
    ndim = call["self"].ndim
    reduced = _dims(call, ndim)
    labels = "".join(UNSPLIT if d in reduced else c for d, c in enumerate(letters(ndim)))
    keep = call.get("keepdim", False)
    out = "".join(c for d, c in enumerate(labels) if keep or d not in reduced)
    return Labels({"self": labels}, [out] * len(call.outputs))


def count_nonzero(call: Call) -> Labels:
    """Reduced dims contract (``P``), kept dims split through; no ``P`` input."""
    ndim = call["self"].ndim
    reduced = _dims(call, ndim)
    labels = letters(ndim)
    return Labels({"self": labels}, ["".join(c for d, c in enumerate(labels) if d not in reduced)])


def scan(call: Call) -> Labels:
    """cumsum/cumprod/logcumsumexp: the scanned dim never splits; cumsum is linear."""
    ndim = call["self"].ndim
    labels = _except_dim(ndim, call.dim("dim", ndim)) if ndim else ""
    linear = [{"self"}] if call.target is aten.cumsum.default else []
    return Labels({"self": labels}, [labels], linear=linear)


def along_dim(call: Call) -> Labels:
    """topk/sort/cummax/cummin: the dim they select or order along never splits, the
    others split through (every output: values and indices); no ``P``."""
    ndim = call["self"].ndim
    labels = _except_dim(ndim, call.dim("dim", ndim)) if ndim else ""
    return Labels({"self": labels}, [labels] * len(call.outputs))


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


CHANNEL = "C"


def _bn_input(call: Call, name: str, training: bool) -> str:
    """Labels of a batch norm's ``[N, C, *]`` tensor: ``C`` on the channel dim 1; the
    other dims split only in inference."""
    return "".join(CHANNEL if d == 1 else UNSPLIT if training else letters(1, start=d)
                   for d in range(call[name].ndim))


def _bn_stat(call: Call, meta) -> str:
    """A per-channel tensor (saved statistics): ``C`` when it is ``[C]``; an empty
    placeholder (inference on CPU saves ``[0]``) never splits."""
    if meta is None:
        return ""
    if meta.ndim == 1 and meta.shape[0] == call["input"].shape[1]:
        return CHANNEL
    return UNSPLIT * meta.ndim


def batch_norm(call: Call) -> Labels:
    """native_batch_norm / _native_batch_norm_legit*: (output, save_mean, save_invstd
    [, running_mean_out, running_var_out]); in inference the saved statistics are
    placeholders that depend on nothing and the running ones pass through."""
    training = bool(call.get("training", False))
    x = _bn_input(call, "input", training)
    inputs = {"input": x, "weight": CHANNEL, "bias": CHANNEL, "running_mean": CHANNEL,
              "running_var": CHANNEL}
    outputs = [x] + [_bn_stat(call, m) for m in call.outputs[1:]]
    if training:
        return Labels(inputs, outputs)
    deps = {1: (), 2: (), 3: {"running_mean"}, 4: {"running_var"}}
    return Labels(inputs, outputs, linear=[{"input", "bias", "running_mean"}],
                  deps={k: v for k, v in deps.items() if k < len(outputs)})


def batch_norm_backward(call: Call) -> Labels:
    """(grad_input, grad_weight, grad_bias), ``train`` choosing batch or running
    statistics. grad_input is linear in the weight too; in inference grad_weight is
    jointly linear in the input and running mean (``(x - mean) * invstd``)."""
    training = bool(call["train"])
    x = _bn_input(call, "input", training)
    inputs = {"grad_out": x, "input": x, "weight": CHANNEL, "running_mean": CHANNEL,
              "running_var": CHANNEL, "save_mean": _bn_stat(call, call.get("save_mean")),
              "save_invstd": _bn_stat(call, call.get("save_invstd"))}
    if training:
        deps = {0: {"grad_out", "input", "weight", "save_mean", "save_invstd"},
                1: {"grad_out", "input", "save_mean", "save_invstd"}, 2: {"grad_out"}}
        linear = [{"grad_out"}, {"weight"}]
    else:
        deps = {0: {"grad_out", "weight", "running_var"},
                1: {"grad_out", "input", "running_mean", "running_var"}, 2: {"grad_out"}}
        linear = [{"grad_out"}, {"weight"}, {"input", "running_mean"}]
    return Labels(inputs, [x, CHANNEL, CHANNEL], linear=linear, deps=deps)


def _group_norm_input(call: Call, name: str) -> str:
    return "n" + UNSPLIT * (call[name].ndim - 1)


def group_norm(call: Call) -> Labels:
    """native_group_norm: (output, mean, rstd), the statistics ``[N, groups]``."""
    x = _group_norm_input(call, "input")
    return Labels({"input": x, "weight": UNSPLIT, "bias": UNSPLIT}, [x, "n" + UNSPLIT, "n" + UNSPLIT])


def group_norm_backward(call: Call) -> Labels:
    """(grad_input, grad_weight, grad_bias): the parameter gradients sum over the batch."""
    x = _group_norm_input(call, "grad_out")
    inputs = {"grad_out": x, "input": x, "mean": "n" + UNSPLIT, "rstd": "n" + UNSPLIT, "weight": UNSPLIT}
    return Labels(inputs, [x, UNSPLIT, UNSPLIT], linear=[{"grad_out"}],
                  deps={0: {"grad_out", "input", "mean", "rstd", "weight"},
                        1: {"grad_out", "input", "mean", "rstd"}, 2: {"grad_out"}})


def group_norm_batch(call: Call, in_shapes, out_shapes) -> dict:
    """``N`` is the local batch (the first tensor's dim 0)."""
    return {"N": in_shapes[0][0]}


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


def _pixels(splittable: bool) -> tuple[str, str]:
    """Labels of nll_loss2d's input ``[N, C, H, W]`` and target ``[N, H, W]``: every pixel
    is a term of its own, so batch and space split where the reduction allows."""
    x = "n" + UNSPLIT + "hw" if splittable else UNSPLIT * 4
    return x, x[0] + x[2:]


def nll_loss2d(call: Call) -> Labels:
    reduction = call["reduction"]
    x, target = _pixels(reduction != MEAN)
    return Labels({"self": x, "target": target}, [target if reduction == 0 else "", ""], linear=[{"self"}],
                  deps={0: {"self", "target", "weight"}, 1: {"target", "weight"}})


def nll_loss2d_backward(call: Call) -> Labels:
    x, target = _pixels(True)
    grad = target if call["reduction"] == 0 else ""
    return Labels({"grad_output": grad, "self": x, "target": target}, [x], linear=[{"grad_output"}])


def _elementwise_loss_labels(call: Call) -> tuple[str, dict[str, str]]:
    """(the labels of ``self``, and per other tensor argument (``target``, ``weight``) its
    labels) of an elementwise loss: every dim splits unless the reduction is a mean (a
    local mean is not a partial sum; ``passes/canonicalize.py`` makes most means sums); an
    argument broadcast along a dim (size 1 there, or missing) never splits it."""
    ndim = call["self"].ndim
    labels = letters(ndim) if call["reduction"] != MEAN else UNSPLIT * ndim
    return labels, {name: aligned(call.args[name], call["self"].shape, labels)
                    for name in ("target", "weight") if call.args.get(name) is not None}


def elementwise_loss(call: Call) -> Labels:
    """mse / smooth L1 / Huber / binary cross-entropy / soft margin: elementwise, then
    summed (``P`` over a split dim) or kept (``reduction=none``)."""
    labels, others = _elementwise_loss_labels(call)
    out = labels if call["reduction"] == 0 else ""
    if len(out) != call.outputs[0].ndim:  # the input broadcast up to the target: kept whole
        return Labels({}, [UNSPLIT * call.outputs[0].ndim])
    return Labels({"self": labels, **others}, [out])


def elementwise_loss_backward(call: Call) -> Labels:
    """Their backwards: linear in the incoming gradient (mse's jointly in input and
    target too)."""
    labels, others = _elementwise_loss_labels(call)
    grad = labels if call["reduction"] == 0 else ""
    linear = [{"grad_output"}] + ([{"self", "target"}] if call.target is aten.mse_loss_backward.default else [])
    return Labels({"grad_output": grad, "self": labels, **others}, [labels], linear=linear)


def multi_margin_loss(call: Call) -> Labels:
    """Each row ``[N, C]`` is a term of its own (its target a class index): the batch
    splits unless the reduction is a mean (``P`` with ``sum``); classes never split."""
    reduction = call["reduction"]
    x = _loss_batch(call, call["self"].ndim, reduction != MEAN)
    target = x[:1] if call["self"].ndim == 2 else ""
    return Labels({"self": x, "target": target}, [target if reduction == 0 else ""])


def multi_margin_loss_backward(call: Call) -> Labels:
    """Its backward, linear in the incoming gradient; with a mean it divides by the batch,
    which a split would divide by its piece instead (``passes/canonicalize.py`` makes the
    mean a sum first)."""
    x = _loss_batch(call, call["self"].ndim, call["reduction"] != MEAN)
    target = x[:1] if call["self"].ndim == 2 else ""
    grad = target if call["reduction"] == 0 else ""
    return Labels({"grad_output": grad, "self": x, "target": target}, [x], linear=[{"grad_output"}])


REDUCE_UNSPLIT = [
    aten.amax.default, aten.amin.default, aten.aminmax.default,
    aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims,
    aten.argmax.default, aten.argmin.default, aten.max.default, aten.min.default,
    aten.max.dim, aten.min.dim, aten.prod.default, aten.prod.dim_int,
    aten.logsumexp.default, aten.var.correction, aten.std.correction,
    aten.var_mean.correction, aten.std_mean.correction, aten.linalg_vector_norm.default,
    aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype,
    aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default,
]

RULES = {
    aten.sum.dim_IntList: sum_, aten.sum.default: sum_,
    aten.mean.dim: mean, aten.mean.default: mean,
    aten._softmax.default: softmax, aten._log_softmax.default: softmax,
    aten._safe_softmax.default: softmax,
    aten._softmax_backward_data.default: softmax_backward,
    aten._log_softmax_backward_data.default: softmax_backward,
    aten.native_layer_norm.default: layer_norm,
    aten.native_layer_norm_backward.default: layer_norm_backward,
    aten.nll_loss_forward.default: nll_loss,
    aten.nll_loss_backward.default: nll_loss_backward,
    aten.nll_loss2d_forward.default: nll_loss2d,
    aten.nll_loss2d_backward.default: nll_loss2d_backward,
    aten.multi_margin_loss.default: multi_margin_loss,
    aten.multi_margin_loss_backward.default: multi_margin_loss_backward,
    **dict.fromkeys([aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
                     aten.binary_cross_entropy.default, aten.soft_margin_loss.default], elementwise_loss),
    **dict.fromkeys([aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default,
                     aten.huber_loss_backward.default, aten.binary_cross_entropy_backward.default,
                     aten.soft_margin_loss_backward.default], elementwise_loss_backward),
    **dict.fromkeys(REDUCE_UNSPLIT, reduce_unsplit),
    aten.cumsum.default: scan, aten.cumprod.default: scan, aten.logcumsumexp.default: scan,
    aten.count_nonzero.dim_IntList: count_nonzero, aten.count_nonzero.default: count_nonzero,
    **dict.fromkeys([aten.topk.default, aten.sort.default, aten.sort.stable, aten.cummax.default,
                     aten.cummin.default], along_dim),
    **dict.fromkeys([aten.native_batch_norm.default, aten._native_batch_norm_legit_no_training.default,
                     aten._native_batch_norm_legit.no_stats,
                     aten._native_batch_norm_legit_functional.default], batch_norm),
    aten.native_batch_norm_backward.default: batch_norm_backward,
    aten.native_group_norm.default: group_norm,
    aten.native_group_norm_backward.default: group_norm_backward,
}

LOCALIZERS = {aten.native_group_norm.default: group_norm_batch,
              aten.native_group_norm_backward.default: group_norm_batch}
