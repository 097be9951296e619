"""The calls of a model's forward that the step is traced as other calls
(:class:`ForwardRewrites`, a ``TorchFunctionMode`` active while the forward and the loss
are traced; :data:`_REWRITES`: torch function -> its rewrite). Each rewrite is torch's own
formula without what the trace cannot hold: a check that reads tensor values, or an
in-place update that the kernel's schema does not declare (batch and instance norm's
running statistics). A rewrite returns :data:`_AS_IS` where the call is traced as it is.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import sources
from .errors import UnsupportedInputError

__all__ = ["ForwardRewrites"]


class ForwardRewrites(TorchFunctionMode):
    """The calls of the forward that the step is traced as other calls (:data:`_REWRITES`:
    function -> rewrite, which returns :data:`_AS_IS` where the call is traced as it is).
    One mode for all of them: every call of the forward passes through it.

    - ``F.batch_norm`` with batch statistics, written as sums over the batch and spatial
      dims: ``mean = sum(x) / n``, ``var = sum((x - mean)^2) / n``. The sharding planner
      turns a sum over a split batch into a partial sum reduced across the ranks that hold
      the batch, so a distributed step normalizes with the statistics of the whole batch,
      as ``nn.SyncBatchNorm`` does, and equals the single-device model; gradients follow
      by autograd through the same sums. The running statistics are updated like torch's
      kernel: ``running = (1 - momentum) * running + momentum * stat`` with the unbiased
      variance. Eval mode (running statistics) goes to torch unchanged.
    - ``F.instance_norm`` with instance statistics and running ones too: torch's kernel
      normalizes a per-sample repeat of the running statistics with ``native_batch_norm``,
      which updates that repeat in place though its schema says nothing of it, and reads
      the new statistics back from it, a dependence the traced graph does not hold (the
      running statistics came out stale, or from one rank's samples only). Written as
      reductions too: each sample's statistics over its spatial dims, the running ones
      moved towards their mean over the samples, as torch's kernel does.
    - ``t.requires_grad_(True)`` on a tensor of the forward does nothing. torch.func
      refuses the call, and it cannot change the step: the transform differentiates with
      respect to the parameters whatever the flags of the tensors in between. Hugging
      Face's ``enable_input_require_grads`` (which ``gradient_checkpointing_enable`` turns
      on) calls it on the input embeddings' output, so that reentrant checkpointing sees an
      input that requires a gradient. Only at the level of the step's own transform
      (:data:`_STEP_LEVEL_ONLY`): the forward's own ``torch.func.grad``, ``vjp`` or
      ``jacrev`` marks its inputs so at a level of its own, and left undone there, its
      gradient came out as zeros (a MAML inner step trained otherwise than eager).
    - ``F.one_hot(labels, num_classes)`` as torch traces it on symbolic values, the classes
      compared with ``arange(num_classes)``: eager's kernel first checks every label's
      range, which reads the values (the trace fails there; a label out of range then gives
      a row of zeros where eager raises). Without ``num_classes`` it is refused: the count
      would come from the values.
    - ``x[i]`` (also ``x[:, i]``, ``x[..., i, 1:]``) with ``i`` a 0-d integer tensor (an
      ``argmax``), which eager reads as an int, as ``index_select`` of ``i`` along the dim it
      indexes, that dim dropped (at the level of the step's own transform only).
    - ``F.embedding(..., sparse=True)`` (not through an ``nn.Embedding``, which
      :func:`ddlc.tracing._check_modules` refuses before tracing) is refused: a sparse gradient.
    - ``F.gaussian_nll_loss`` with a variance tensor: torch's formula (the variance clamped
      to ``eps`` without a gradient through the clamp, ``0.5 * (log var + (x - y)^2 / var)``)
      without its check that no variance is negative, which reads the values.
    - ``p.register_hook(...)`` on a parameter, and ``register_post_accumulate_grad_hook``
      on any tensor, are refused at the user's line: eager adds the hook to the parameter
      itself, where it stays for every later step (and one more at every call that
      registers it again), and runs a post-accumulate hook as ``.grad`` fills, which the
      traced step has none of; the trace saw one call's. A hook on an activation's
      gradient (``h.register_hook(...)``) is traced as it runs; ``h.retain_grad()`` does
      nothing (torch.func refuses it, and the step fills no ``.grad`` for anyone to read).
    - ``torch.normal`` of a mean or standard deviation tensor, as its kernel computes it
      (:func:`_normal`): a fill of a new tensor, which ddlc.rng draws, where the operator
      itself draws numbers that ddlc.rng does not reproduce.
    - ``torch.cov`` and ``torch.corrcoef`` of a real floating tensor without observation
      weights (VICReg's and Barlow Twins' losses): torch's formula, centred product over
      ``observations - correction``, without the check that reads whether that count is
      positive (``aten.equal``, which the trace cannot evaluate: it failed there)."""

    def __init__(self):
        super().__init__()
        #: where the forward registered hooks on activations' gradients (the user's lines),
        #: which run while the backward is traced, where no frame of a forward is
        self.hook_sites: list[str] = []

    def __enter__(self):
        #: the torch.func level of the step's transform, which the forward runs in
        self.level = torch._C._functorch.maybe_current_level()
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.register_hook and (site := sources.caller()):
            self.hook_sites.append(site)
        rewrite = _REWRITES.get(func)
        if rewrite is not None and func in _STEP_LEVEL_ONLY \
                and torch._C._functorch.maybe_current_level() != self.level:
            rewrite = None  # inside a torch.func transform of the forward's own
        if rewrite is not None:
            result = rewrite(*args, **kwargs)
            if result is not _AS_IS:
                return result
        return func(*args, **kwargs)


_AS_IS = object()


def _batch_norm(*args, **kwargs):
    bound = _BATCH_NORM.bind(*args, **kwargs)
    bound.apply_defaults()
    return _batch_norm_by_reductions(**bound.arguments) if bound.arguments["training"] else _AS_IS


def _instance_norm(*args, **kwargs):
    bound = _INSTANCE_NORM.bind(*args, **kwargs)
    bound.apply_defaults()
    if bound.arguments["use_input_stats"] and bound.arguments["running_mean"] is not None:
        return _instance_norm_by_reductions(**bound.arguments)
    return _AS_IS


def _requires_grad(tensor, requires_grad=True):
    return tensor if requires_grad else _AS_IS


def _register_hook(tensor, hook):
    if not (tensor.is_leaf and tensor.requires_grad):
        return _AS_IS  # an activation's gradient: traced as it runs
    raise UnsupportedInputError(
        "the forward registers a hook on a parameter's gradient (p.register_hook), which eager "
        "keeps on the parameter for every later step (one more at each call that registers it "
        "again), and ddlc traces one step: register the hook on the activation the parameter "
        "makes (h = layer(x); h.register_hook(...)), or express it in the loss",
        where=sources.caller())


def _retain_grad(tensor):
    return None  # the step fills no .grad; eager's stays unread by it


def _register_post_accumulate_grad_hook(tensor, hook):
    raise UnsupportedInputError(
        "the forward registers a post-accumulate-grad hook (register_post_accumulate_grad_hook), "
        "which eager runs as .grad fills at every later step; the compiled step computes its "
        "gradients inside the traced program and fills no .grad: express what the hook does in "
        "the loss or the model, or use clip_grad_norm= for clipping",
        where=sources.caller())


def _one_hot(tensor, num_classes=-1):
    if tensor.dtype != torch.int64:
        return _AS_IS  # eager refuses it: so does the trace
    if num_classes < 0:
        raise UnsupportedInputError(
            "F.one_hot without num_classes takes the number of classes from the largest value, "
            "which one static graph cannot: pass num_classes",
            where=sources.caller())
    return (tensor.unsqueeze(-1) == torch.arange(num_classes, device=tensor.device)).to(torch.int64)


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    if sparse:
        raise UnsupportedInputError(
            "F.embedding(..., sparse=True) gives its weight a sparse gradient; ddlc trains with dense "
            "gradients only: pass sparse=False",
            where=sources.caller())
    return _AS_IS


def _gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    if not isinstance(var, torch.Tensor) or reduction not in ("none", "mean", "sum"):
        return _AS_IS
    if var.shape != input.shape:
        if input.shape[:-1] == var.shape:  # one variance per row (homoscedastic)
            var = var.unsqueeze(-1)
        elif not (input.ndim == var.ndim and
                  sum(v for i, v in zip(input.shape, var.shape) if i != v) == 1):
            return _AS_IS  # torch's error for a variance of another size
    var = var.clone()
    with torch.no_grad():  # the gradient passes the clamp as it is (torch's formula)
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


def _cov(input, *, correction=1, fweights=None, aweights=None):
    if fweights is not None or aweights is not None or not input.is_floating_point() or input.ndim > 2:
        return _AS_IS
    x = input if input.ndim == 2 else input.reshape(1, -1)
    observations = x.shape[1]
    centred = x - x.sum(dim=1, keepdim=True) / observations
    # torch divides by 0 where no degree of freedom is left (and warns): inf or nan
    return (centred @ centred.t() / max(observations - correction, 0)).squeeze()


def _corrcoef(input):
    c = _cov(input)
    if c is _AS_IS:
        return _AS_IS
    if c.ndim == 0:
        return c / c
    stddev = torch.diagonal(c).sqrt()
    return (c / stddev.view(-1, 1) / stddev.view(1, -1)).clip(-1, 1)


_BATCH_NORM = inspect.signature(F.batch_norm)
_INSTANCE_NORM = inspect.signature(F.instance_norm)
def _normal(mean, std=1.0, *size, generator=None, out=None, **options):
    """``torch.normal`` of a mean or a standard deviation tensor, as torch's kernel computes
    it (bit for bit): noise drawn into a new contiguous tensor, ``normal_(0, std)`` for a
    number ``std``, else ``normal_(0, 1) * std``, plus the mean. Neither gets a gradient, as
    in eager (its derivative is zero). The draw is then one ddlc.rng reproduces."""
    if size or options or generator is not None or out is not None or not (
            isinstance(mean, torch.Tensor) or isinstance(std, torch.Tensor)):
        return _AS_IS
    mean = mean.detach() if isinstance(mean, torch.Tensor) else mean
    if not isinstance(std, torch.Tensor):
        return torch.empty_like(mean, memory_format=torch.contiguous_format).normal_(0, std).add_(mean)
    std = std.detach()
    if isinstance(mean, torch.Tensor):
        noise = torch.empty(torch.broadcast_shapes(mean.shape, std.shape), dtype=mean.dtype, device=mean.device)
    else:
        noise = torch.empty_like(std, memory_format=torch.contiguous_format)
    return noise.normal_(0, 1).mul_(std).add_(mean)


def _getitem(self, index):
    """``x[..., i, ...]`` with ``i`` a 0-d integer tensor (an ``argmax``), which eager reads
    as an int (a value one static graph cannot hold), as ``index_select`` of ``i`` along the
    dim it indexes, that dim then dropped: the same values and gradient. Only where it is
    the index's one tensor among slices, ints, ``None`` and ``...``; a negative ``i`` counts
    from the end, one out of range fails when the step runs, as in eager."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(item is None or item is Ellipsis or type(item) in (int, slice) or isinstance(item, torch.Tensor)
               for item in items):
        return _AS_IS
    tensors = [p for p, item in enumerate(items) if isinstance(item, torch.Tensor)]
    if len(tensors) != 1 or items[tensors[0]].ndim != 0 or items[tensors[0]].dtype not in _INDEX_DTYPES:
        return _AS_IS
    at = tensors[0]
    consuming = sum(item is not None and item is not Ellipsis for item in items)
    if consuming > self.ndim or sum(item is Ellipsis for item in items) > 1:
        return _AS_IS  # torch's own error
    ellipsis_dims = self.ndim - consuming
    dim = sum(ellipsis_dims if item is Ellipsis else item is not None for item in items[:at])
    kept = sum(ellipsis_dims if item is Ellipsis else type(item) is not int for item in items[:at])
    i = items[at]
    i = torch.where(i < 0, i + self.shape[dim], i).reshape(1)
    sliced = self[items[:at] + (slice(None),) + items[at + 1:]]
    return sliced.index_select(kept, i).squeeze(kept)


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


_REWRITES = {torch.normal: _normal, F.batch_norm: _batch_norm, F.instance_norm: _instance_norm,
             torch.Tensor.__getitem__: _getitem,
             torch.Tensor.requires_grad_: _requires_grad, F.one_hot: _one_hot,
             F.gaussian_nll_loss: _gaussian_nll_loss, F.embedding: _embedding,
             torch.cov: _cov, torch.Tensor.cov: _cov, torch.corrcoef: _corrcoef, torch.Tensor.corrcoef: _corrcoef,
             torch.Tensor.register_hook: _register_hook, torch.Tensor.retain_grad: _retain_grad,
             torch.Tensor.register_post_accumulate_grad_hook: _register_post_accumulate_grad_hook}
#: the calls rewritten only at the level of the step's own transform (see ForwardRewrites)
_STEP_LEVEL_ONLY = frozenset({torch.Tensor.requires_grad_, torch.Tensor.register_hook, torch.Tensor.retain_grad,
                              torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.__getitem__})


def _instance_norm_by_reductions(input, running_mean, running_var, weight, bias, use_input_stats,
                                 momentum, eps):
    dims = list(range(2, input.ndim))
    count = math.prod(input.shape[2:])
    if count <= 1:
        raise UnsupportedInputError(f"InstanceNorm in training mode needs more than one spatial "
                                    f"value per channel, got input of shape {list(input.shape)}")
    per_channel = [1, input.shape[1]] + [1] * (input.ndim - 2)
    mean = input.sum(dims, keepdim=True) / count
    centered = input - mean
    var = (centered * centered).sum(dims, keepdim=True) / count
    out = centered * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.reshape(per_channel)
    if bias is not None:
        out = out + bias.reshape(per_channel)
    samples = input.shape[0]
    _move_running_stats(running_mean, running_var, mean.flatten(1).sum(0) / samples,
                        var.flatten(1).sum(0) / samples, momentum, count)
    return out


def _move_running_stats(running_mean, running_var, mean, var, momentum, count) -> None:
    """torch's kernels' update: ``running = (1 - momentum) * running + momentum * stat``,
    the variance made unbiased over the ``count`` values it was computed from. A 0-d
    tensor ``momentum`` is a factor the step computes (a cumulative average's, see
    :func:`ddlc.tracing._batch_norms_traceable`)."""
    with torch.no_grad():
        if isinstance(momentum, torch.Tensor):
            running_mean.mul_(1 - momentum).add_(mean * momentum)
            running_var.mul_(1 - momentum).add_(var * (momentum * count / (count - 1)))
        else:
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            running_var.mul_(1 - momentum).add_(var, alpha=momentum * count / (count - 1))


def _batch_norm_by_reductions(input, running_mean, running_var, weight, bias, training, momentum, eps):
    dims = [0, *range(2, input.ndim)]
    count = input.numel() // input.shape[1]
    if count <= 1:
        raise UnsupportedInputError(f"BatchNorm in training mode needs more than one value per "
                                    f"channel, got input of shape {list(input.shape)}")

    def per_channel(t):
        return t.reshape([1, input.shape[1]] + [1] * (input.ndim - 2))

    mean = input.sum(dims) / count
    centered = input - per_channel(mean)
    var = (centered * centered).sum(dims) / count
    out = centered * per_channel(torch.rsqrt(var + eps))
    if weight is not None:
        out = out * per_channel(weight)
    if bias is not None:
        out = out + per_channel(bias)
    if running_mean is not None:
        _move_running_stats(running_mean, running_var, mean, var, momentum, count)
    # laid out as torch's kernels lay out theirs: channels-last for a channels-last input,
    # else contiguous (a transposed (N, C, L) too), which a random fill of it follows
    return out.contiguous(memory_format=_suggested_format(input))


def _suggested_format(t: torch.Tensor) -> torch.memory_format:
    """The memory format torch's batch norm kernels give their output for input ``t``."""
    for ndim, channels_last in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if t.ndim == ndim and t.is_contiguous(memory_format=channels_last) and not t.is_contiguous():
            return channels_last
    return torch.contiguous_format
