"""Rewrite mean reductions into sum / count so they shard as partial sums.

A mean over a split dim is not a partial sum (each rank divides by its local
count), so a data-parallel loss would force the logits to be gathered. Here
``nll_loss_forward(..., reduction=mean)`` (and the per-pixel ``nll_loss2d_forward``)
becomes the sum-reduction loss divided by its ``total_weight`` output; the elementwise
losses (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy``,
``soft_margin_loss``, and their backwards) and ``mean`` (``mean.dim``, and ``x.mean()``)
become their sum forms divided by the static element count, and ``multi_margin_loss``
(and its backward) its sum form divided by its rows. All are exact.
``ones_like`` / ``zeros_like`` of a scalar read its metadata from the earliest input
that has the same (:func:`_rewrite_like_of_scalar`), so the loss's last arithmetic
feeds only the output. Indexing by whole ranges (``arange``) in dim order is a view
(:func:`_rewrite_index_by_aranges`: transformers' padding masks), so it shards.
``squeeze`` names the dims it drops, those of size 1 in the whole tensor
(:func:`_rewrite_squeeze_to_dims`), so a rank's piece keeps a split dim of one element.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten
MEAN, SUM = 1, 2  # aten's Reduction enum

__all__ = ["canonicalize"]


def _with_val(node: fx.Node, fn, *args) -> fx.Node:
    """Set ``node.meta["val"]`` by running ``fn`` on fake values of its inputs."""
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]) or nullcontext():
        node.meta["val"] = fn(*vals)
    return node


def _emit(graph: fx.Graph, target, args: tuple, like: fx.Node, **kwargs) -> fx.Node:
    """A new ``target(*args, **kwargs)`` node at the insertion point, with its fake value
    and the origin of the node it replaces (``like``)."""
    node = graph.call_function(target, args, kwargs)
    _with_val(node, lambda *vals: target(*vals, **kwargs), *args)
    _copy_origin(node, like)
    return node


def _copy_origin(dst: fx.Node, src: fx.Node) -> None:
    for key in ("ddlc_origin", "stack_trace"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def _rewrite_nll_mean(graph: fx.Graph, node: fx.Node) -> None:
    x, target, weight, reduction, ignore_index = node.args
    if reduction != MEAN:
        return
    node.args = (x, target, weight, SUM, ignore_index)
    _with_val(node, node.target, *node.args)
    loss_users = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    weight_users = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    if weight is None and isinstance(target, fx.Node):
        # without class weights the total weight is the count of targets not ignored: from
        # the target alone, so that a plan keeping the (small) target whole counts on every
        # rank instead of all-reducing a partial count that backward waits for
        with graph.inserting_before(node):
            kept = _emit(graph, aten.ne.Scalar, (target, ignore_index), node)
            total = _emit(graph, aten.sum.default, (kept,), node, dtype=x.meta["val"].dtype)
        for getter in weight_users:
            getter.replace_all_uses_with(total)
            graph.erase_node(getter)
    else:
        with graph.inserting_after(node):
            total = weight_users[0] if weight_users else graph.call_function(operator.getitem, (node, 1))
            if not weight_users:
                total.meta["val"] = node.meta["val"][1]
                _copy_origin(total, node)
    for getter in loss_users:
        getter.meta["val"] = node.meta["val"][0]
        anchor = max(getter, total, key=lambda n: _position(graph, n))
        with graph.inserting_after(anchor):
            mean = _emit(graph, aten.div.Tensor, (getter, total), node)
        getter.replace_all_uses_with(mean, delete_user_cb=lambda u: u is not mean)


#: floating dtypes whose reductions torch accumulates in float32 (its "opmath" type): a
#: sum in the dtype itself overflows (float16 past 65504) or loses digits (bfloat16)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _replace_by_sum_over_count(graph: fx.Graph, node: fx.Node, sum_target, sum_args: tuple,
                               count: int) -> None:
    """Replace mean ``node`` by ``sum_target(*sum_args) / count``; in a low-precision dtype
    the sum and the division run in float32 and the quotient is cast back, as eager's
    mean accumulates."""
    dtype = node.meta["val"].dtype
    low = {"dtype": torch.float32} if dtype in _LOW_PRECISION else {}
    with graph.inserting_before(node):
        total = _emit(graph, sum_target, sum_args, node, **low)
        mean = _emit(graph, aten.div.Scalar, (total, count), node)
        if low:
            mean = _emit(graph, aten._to_copy.default, (mean,), node, dtype=dtype)
    node.replace_all_uses_with(mean)
    graph.erase_node(node)


def _rewrite_mean_dim(graph: fx.Graph, node: fx.Node) -> None:
    x, dims, *rest = node.args
    keepdim = rest[0] if rest else node.kwargs.get("keepdim", False)
    if node.kwargs.get("dtype") is not None or len(rest) > 1:
        return
    shape = x.meta["val"].shape
    count = math.prod(shape[d] for d in (dims if dims else range(len(shape))))
    _replace_by_sum_over_count(graph, node, aten.sum.dim_IntList, (x, dims, keepdim), count)


def _rewrite_mean_all(graph: fx.Graph, node: fx.Node) -> None:
    """``x.mean()`` -> ``x.sum() / numel`` (``mean.default``, no dtype)."""
    if node.kwargs.get("dtype") is not None:
        return
    x = node.args[0]
    _replace_by_sum_over_count(graph, node, aten.sum.default, (x,), x.meta["val"].numel())


def _reduction(node: fx.Node) -> tuple[int, int]:
    """(position, value) of ``node``'s ``reduction`` argument (its default where not given)."""
    schema = node.target._schema
    i = next(i for i, a in enumerate(schema.arguments) if a.name == "reduction")
    if i < len(node.args):
        return i, node.args[i]
    return i, node.kwargs.get("reduction", schema.arguments[i].default_value)


def _with_sum(node: fx.Node, i: int) -> None:
    """Make ``node``'s reduction (argument ``i``) a sum, given positionally."""
    args = list(node.args) + [node.target._schema.arguments[j].default_value
                              for j in range(len(node.args), i)]
    kwargs = {k: v for k, v in node.kwargs.items() if k != "reduction"}
    node.args, node.kwargs = (*args[:i], SUM, *args[i + 1:]), kwargs


def _terms(loss, x: torch.Tensor) -> int:
    """How many terms ``loss``'s mean over input ``x`` averages: its elements, or for the
    multi-margin loss its rows."""
    if loss in (aten.multi_margin_loss.default, aten.multi_margin_loss_backward.default):
        return x.shape[0] if x.ndim == 2 else 1
    return x.numel()


def _rewrite_loss_mean(graph: fx.Graph, node: fx.Node) -> None:
    """An elementwise loss with ``reduction=mean`` -> its ``sum`` form / numel (float32 and
    float64 only: the kernel's sum in a low-precision dtype may overflow where the mean
    does not)."""
    i, reduction = _reduction(node)
    if reduction != MEAN or node.args[0].meta["val"].dtype in _LOW_PRECISION:
        return
    _with_sum(node, i)
    _with_val(node, lambda *vals: node.target(*vals, **node.kwargs), *node.args)
    count = _terms(node.target, node.args[0].meta["val"])
    with graph.inserting_after(node):
        mean = _emit(graph, aten.div.Scalar, (node, count), node)
    node.replace_all_uses_with(mean, delete_user_cb=lambda u: u is not mean)


def _rewrite_loss_backward_mean(graph: fx.Graph, node: fx.Node) -> None:
    """Its backward with ``reduction=mean`` -> the ``sum`` form of ``grad / numel`` (as
    the forward, not in a low-precision dtype)."""
    i, reduction = _reduction(node)
    if reduction != MEAN or node.args[1].meta["val"].dtype in _LOW_PRECISION:
        return
    grad, x = node.args[0], node.args[1]
    with graph.inserting_before(node):
        scaled = _emit(graph, aten.div.Scalar, (grad, _terms(node.target, x.meta["val"])), node)
    _with_sum(node, i)
    node.args = (scaled, *node.args[1:])


def _rewrite_like_of_scalar(graph: fx.Graph, node: fx.Node) -> None:
    """``ones_like(loss)`` (backward's seed) reads only the shape, dtype and device of a
    scalar: take them from the first of its inputs that has the same ones, as far back
    as that goes (the loss's ``sum`` rather than ``sum / count``). Then the arithmetic
    after the loss's all-reduce feeds only the output (:func:`ddlc.ir.output_scalars`),
    and the all-reduce can wait for a gradient bucket."""
    x = node.args[0]

    def same(a) -> bool:
        va, vx = a.meta.get("val"), x.meta.get("val")
        return isinstance(va, torch.Tensor) and va.shape == vx.shape and va.dtype == vx.dtype \
            and va.device == vx.device

    while isinstance(x, fx.Node) and x.op == "call_function" and x.meta["val"].dim() == 0:
        source = next((a for a in x.all_input_nodes if same(a)), None)
        if source is None:
            break
        x = source
    node.args = (x, *node.args[1:])


#: Operators that keep the values of their first input in order, only adding or
#: dropping unit dims (or reshaping a tensor whose dims are all unit but one).
_UNIT_DIM_VIEWS = (aten.unsqueeze_copy.default, aten.squeeze_copy.dim, aten.squeeze_copy.dims,
                   aten.squeeze_copy.default, aten.view_copy.default, aten._unsafe_view.default)


def _whole_arange_dim(index, size: int, rank: int) -> int | None:
    """Where ``index`` (a node of an ``aten.index.Tensor`` index list, of an output of
    ``rank`` dims) holds ``arange(size)`` along one dim and has unit dims elsewhere: that
    dim's position in the output (broadcasting aligns the right ends); -1 where ``size``
    is 1 (every value is 0, any position); None where it is anything else. ``arange(n) +
    0`` (transformers adds a zero offset) counts as ``arange(n)``."""
    if not isinstance(index, fx.Node):
        return None
    val = index.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in (torch.int64, torch.int32) \
            or any(n not in (1, size) for n in val.shape) or val.numel() != size:
        return None
    source = index
    while source.op == "call_function" and (
            source.target in _UNIT_DIM_VIEWS
            or (source.target in (aten.add.Tensor, aten.sub.Tensor) and source.args[1:] == (0,))):
        source = source.args[0]
    arange = source.op == "call_function" and (
        (source.target is aten.arange.default and source.args == (size,))
        or (source.target is aten.arange.start and source.args == (0, size))
        or (source.target is aten.arange.start_step and source.args in ((0, size), (0, size, 1))))
    if not arange:
        return None
    if size == 1:
        return -1
    return rank - val.dim() + list(val.shape).index(size)


def _rewrite_index_by_aranges(graph: fx.Graph, node: fx.Node) -> None:
    """``x[i0, i1, ...]`` where every index is the whole ``arange`` of its dim of ``x``,
    given unit dims, with the ranges in dim order (transformers' mask functions:
    ``attention_mask[batch_idx, kv_idx]``, ``batch_idx = arange(B)[:, None, None, None]``):
    ``out[b, 0, 0, k] = x[b, k]``, so the result is ``x`` viewed with those unit dims. A
    view shards with ``x`` (a split batch stays split), where indexing by values needs
    ``x`` whole on every rank."""
    x, indices = node.args[:2]
    shape, out = tuple(x.meta["val"].shape), node.meta["val"]
    if len(indices) != len(shape) or not isinstance(out, torch.Tensor):
        return
    positions = [_whole_arange_dim(i, n, out.dim()) for i, n in zip(indices, shape)]
    if None in positions:
        return
    placed = [p for p in positions if p != -1]
    expected = [1] * out.dim()
    for p, n in zip(positions, shape):
        if p != -1:
            expected[p] = n
    if placed != sorted(set(placed)) or list(out.shape) != expected:
        return
    with graph.inserting_before(node):
        view = _emit(graph, aten.view_copy.default, (x, list(out.shape)), node)
    node.replace_all_uses_with(view)
    graph.erase_node(node)


def _rewrite_squeeze_to_dims(graph: fx.Graph, node: fx.Node) -> None:
    """``squeeze`` (all size-1 dims, or one given dim) names the dims it drops: those of
    size 1 in the whole tensor. Run on a rank's piece, an implicit squeeze would also drop
    a split dim whose piece has one element (a batch of 4 on 4 ranks)."""
    x = node.args[0]
    shape = x.meta["val"].shape
    asked = range(len(shape)) if node.target in (aten.squeeze_copy.default, aten.squeeze.default) \
        else node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    dims = sorted({d % max(len(shape), 1) for d in asked if len(shape) and shape[d] == 1})
    node.target = aten.squeeze.dims if node.target in _SQUEEZE_VIEWS else aten.squeeze_copy.dims
    node.args = (x, dims)


_SQUEEZE_VIEWS = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise KeyError(node)


#: losses computed term by term (element by element; the multi-margin loss row by row),
#: then reduced (``reduction``: none, mean or sum)
ELEMENTWISE_LOSSES = (aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
                      aten.binary_cross_entropy.default, aten.soft_margin_loss.default,
                      aten.multi_margin_loss.default)
ELEMENTWISE_LOSS_BACKWARDS = (aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default,
                              aten.huber_loss_backward.default, aten.binary_cross_entropy_backward.default,
                              aten.soft_margin_loss_backward.default, aten.multi_margin_loss_backward.default)

REWRITES = {
    aten.nll_loss_forward.default: _rewrite_nll_mean,
    aten.nll_loss2d_forward.default: _rewrite_nll_mean,
    aten.mean.dim: _rewrite_mean_dim,
    aten.mean.default: _rewrite_mean_all,
    **dict.fromkeys(ELEMENTWISE_LOSSES, _rewrite_loss_mean),
    **dict.fromkeys(ELEMENTWISE_LOSS_BACKWARDS, _rewrite_loss_backward_mean),
    aten.ones_like.default: _rewrite_like_of_scalar,
    aten.zeros_like.default: _rewrite_like_of_scalar,
    aten.index.Tensor: _rewrite_index_by_aranges,
    **dict.fromkeys([aten.squeeze_copy.default, aten.squeeze_copy.dim, aten.squeeze_copy.dims,
                     *_SQUEEZE_VIEWS], _rewrite_squeeze_to_dims),
}


def canonicalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Apply every rewrite in REWRITES in place; return ``gm``."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in REWRITES:
            REWRITES[node.target](gm.graph, node)
    gm.graph.lint()
    gm.recompile()
    return gm
