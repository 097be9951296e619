"""Run views as views: give the view copies of a lowered graph back their view form.

Tracing functionalizes views away (``remove="mutations_and_views"``): every ``view``,
``t``, ``transpose``, ``expand``, ``slice``, ``split`` ... of the model is a ``*_copy``
operator that allocates and copies its output. In a graph without mutation an alias
reads the same values, so this pass, the last of lowering, turns each of those copies
back into the view it came from (:data:`VIEW_FORMS`; ``as_strided_copy``, which reads
storage, stays a copy), in one walk in program order that keeps the strides every
tensor will have at run time (each operator run on ``meta`` tensors; an operator that
cannot run there, a collective or a random draw, makes a fresh contiguous tensor):

- a ``view_copy`` becomes a ``reshape``, a view wherever its input's strides at run time
  allow one and a copy exactly where they do not: the meta kernels that predict strides
  here sometimes predict other strides than the CPU kernels give (a float64 model whose
  norm computes in float32: a backward ``_to_copy`` keeps a permuted layout its meta
  kernel calls contiguous), and a ``view`` would then fail; an ``_unsafe_view`` whose
  input's predicted strides do not allow a view becomes a ``reshape`` too;
- a transposed matrix product read by nothing else, ``t(mm(a, b))``, becomes
  ``mm(t(b), t(a))``: the same values, contiguous. Tracing records a Linear weight's
  gradient so (the weight was a contiguous copy when autograd chose its formula; eager
  autograd computes ``mm(t(dy), x)``), and as a view it would be a transposed gradient
  that the update or a collective copies;
- a reader that needs a contiguous tensor of its own gets a contiguous clone of a
  strided input, made once before its first such reader: every collective (gloo and
  NCCL send contiguous buffers), every call of a Python function (``ddlc.comm``'s
  boxing pieces, ``ddlc.rng`` draws), ``native_layer_norm_backward`` (wrong values on
  CPU from strided ``mean``/``rstd``, see TORCH_NOTES.md), the activation backwards whose
  meta kernels predict other strides than the CPU kernels and the kernels that refuse a
  strided input (:data:`_CONTIGUOUS_READERS`), every operator of the
  optimizer update (a gradient that arrives as a transposed view is made contiguous
  once, as autograd's AccumulateGrad does, instead of slowing every elementwise operator
  of the update) and the graph's outputs,
  which become the step's new parameters, buffers and optimizer state and so must own
  their memory (an output that is a view is cloned too); the fused attention kernels,
  which need less, get the clone only where an input's last dimension is not dense
  (:data:`_ROW_READERS`, :func:`_layout_needed`).

Values are unchanged (each alias reads what its copy held); the collective sequence and
the node order are those of the scheduled program. A graph with a mutating operator is
left as it is.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import fx
from torch._ops import OpOverload

from torch._subclasses.fake_tensor import FakeTensor

from ddlc.fake import as_fake, as_meta
from ddlc.ir import ORIGIN, in_update, is_mutating, leaves, map_leaves

__all__ = ["UNANNOTATED_VIEWS", "VIEW_FORMS", "views_as_views"]

_aten = torch.ops.aten

#: ``*_copy`` operator -> the view it copies (same arguments)
VIEW_FORMS = {
    _aten.view_copy.default: _aten.view.default,
    _aten.t_copy.default: _aten.t.default,
    _aten.transpose_copy.int: _aten.transpose.int,
    _aten.permute_copy.default: _aten.permute.default,
    _aten.expand_copy.default: _aten.expand.default,
    _aten.unsqueeze_copy.default: _aten.unsqueeze.default,
    _aten.squeeze_copy.dim: _aten.squeeze.dim,
    _aten.squeeze_copy.dims: _aten.squeeze.dims,
    _aten.squeeze_copy.default: _aten.squeeze.default,
    _aten.slice_copy.Tensor: _aten.slice.Tensor,
    _aten.select_copy.int: _aten.select.int,
    _aten.split_copy.Tensor: _aten.split.Tensor,
    _aten.split_with_sizes_copy.default: _aten.split_with_sizes.default,
    _aten.unbind_copy.int: _aten.unbind.int,
    _aten.alias_copy.default: _aten.alias.default,
    _aten.detach_copy.default: _aten.detach.default,
    _aten.diagonal_copy.default: _aten.diagonal.default,
    _aten.unfold_copy.default: _aten.unfold.default,
}
#: operators whose items are views of their input though their schema does not say so
#: (autograd treats them as new tensors; ``nn.LSTM``'s and ``nn.GRU``'s backward,
#: ``torch.unsafe_chunk``): tracing keeps them, and writing into an item writes into the input
UNANNOTATED_VIEWS = frozenset({_aten.unsafe_split.Tensor, _aten.unsafe_split_with_sizes.default})
#: views that need view-compatible strides; a ``reshape`` where the input lacks them
_STRIDE_BOUND = (_aten.view.default, _aten._unsafe_view.default)
#: what a contiguous clone keeps of its input's meta (the value, where it comes from)
_COPIED_META = ("val", "tensor_meta", ORIGIN.name)
#: operators given contiguous inputs: ``native_layer_norm_backward`` reads them as
#: contiguous buffers; the activation backwards' meta kernels give a strided input's
#: strides to the output where the CPU kernel makes it contiguous (Mamba's
#: ``softplus_backward`` of a transposed input), so a view after them would fail at run
#: time; the others need contiguous inputs where eager's composites and backward formulas
#: call ``.contiguous()`` first (which tracing, seeing the contiguous ``*_copy`` values,
#: does not record): ``_embedding_bag`` reads strided indices (a DLRM's ``idx[:, k]``) as
#: dense, wrong values, and its backward refuses them, as do ``_pdist_*`` (``F.pdist`` of a
#: transposed tensor) and ``view_as_complex`` (the backward of ``view_as_real`` given an
#: expanded gradient); ``native_group_norm`` refuses a tensor not dense in its suggested
#: memory format and its backward reads the gradient in the input's format unchecked
#: (wrong values: a transposed Linear output, or a channels-last input beside a
#: contiguous gradient); ``_weight_norm_interface`` reads a strided ``v`` as dense (wrong
#: values, and heap corruption on CPU)
_CONTIGUOUS_READERS = frozenset({
    _aten.native_layer_norm_backward.default, _aten.softplus_backward.default,
    _aten.elu_backward.default, _aten.hardtanh_backward.default, _aten.hardsigmoid_backward.default,
    _aten.hardswish_backward.default, _aten.logit_backward.default,
    _aten._embedding_bag.default, _aten._embedding_bag_forward_only.default,
    _aten._embedding_bag_backward.default, _aten._embedding_bag_dense_backward.default,
    _aten._embedding_bag_per_sample_weights_backward.default,
    _aten._pdist_forward.default, _aten._pdist_backward.default, _aten.view_as_complex_copy.default,
    _aten.native_group_norm.default, _aten.native_group_norm_backward.default,
    _aten._weight_norm_interface.default, _aten._weight_norm_interface_backward.default,
    _aten.nll_loss2d_backward.default})
#: operator name prefixes of fused vendor kernels, which read their inputs as contiguous
#: buffers whatever their strides (an LSTM's ``mkldnn_rnn_layer`` given its transposed
#: input as a view computed another sequence: wrong losses, even on one device)
_VENDOR_KERNELS = ("mkldnn_", "_mkldnn", "cudnn_", "_cudnn", "miopen_", "_miopen", "_thnn_fused")
#: operator name prefixes of the fused attention kernels, which read their inputs' last
#: dimension as dense rows: torch's SDPA dispatch chooses them only for inputs whose last
#: stride is 1 (``sdp_utils``; eager runs the math kernel otherwise), and the CPU flash
#: kernel given another stride returns wrong values (a query that is a convolution's
#: output permuted, reshaped into heads and transposed: NaN losses)
_ROW_READERS = ("_scaled_dot_product_flash", "_scaled_dot_product_efficient",
                "_scaled_dot_product_cudnn", "_scaled_dot_product_fused", "_flash_attention",
                "_efficient_attention")


#: operators whose output layout the device's kernel chooses (the CPU convolution, oneDNN's,
#: gives a channels-last output for a channels-last input or a 1x1 weight, where the meta
#: kernel calls it contiguous): predicted through the fake mode, which asks the backend
#: (``torch._C._conv_determine_backend_memory_format``); on meta, the query and key of a
#: convolution's output read by a fused attention kernel were taken for dense rows (NaN
#: losses) and a group norm after one refused its input at run time
_BACKEND_LAYOUTS = frozenset({_aten.convolution.default, _aten._convolution.default,
                              _aten.convolution_backward.default})


def views_as_views(gm: fx.GraphModule) -> fx.GraphModule:
    """Turn ``gm``'s view copies into views in place (see the module docstring)."""
    graph = gm.graph
    if any(is_mutating(n) for n in graph.nodes):
        return gm
    walk = _Walk(graph)
    for node in list(graph.nodes):
        walk.visit(node)
    graph.lint()
    gm.recompile()
    return gm


class _Walk:
    """The walk in program order. ``layout`` holds, for each node whose run-time strides
    differ from its traced value's (a view, or a reader of one), meta tensors with those
    strides; every other node has its traced value's layout, so only those run on meta."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.layout: dict[fx.Node, object] = {}
        self.contiguous: dict[fx.Node, fx.Node] = {}   # strided node -> its contiguous clone
        self.aliases: set[fx.Node] = set()   # nodes whose value is a view of another's

    def visit(self, node: fx.Node) -> None:
        if node.op == "output":
            self.give_contiguous(node, owned=True)
        if node.op != "call_function":
            return
        if node.target in VIEW_FORMS and isinstance(self.value(node.args[0]), torch.Tensor):
            node.target = VIEW_FORMS[node.target]
            if node.target in _STRIDE_BOUND:  # a view where the run-time strides allow one
                node.target = _aten.reshape.default
        if _transposes_a_product(node):
            self.transpose_operands(node)
            return
        needed = _layout_needed(node)
        if needed is not None:
            self.give_contiguous(node, owned=False, fine=needed)
        moved = node.target in VIEW_FORMS.values() or any(
            a in self.layout for a in node.all_input_nodes)
        if moved:
            out = self.run_on_meta(node)
            if out is None and node.target in _STRIDE_BOUND:
                node.target = _aten.reshape.default
                out = self.run_on_meta(node)
            if out is not None and not _same_layout(out, node.meta.get("val")):
                self.layout[node] = out
        if _is_view(node) or (node.target is operator.getitem and node.args[0] in self.aliases):
            self.aliases.add(node)

    def transpose_operands(self, node: fx.Node) -> None:
        """Replace ``node`` = ``t(mm(a, b))`` by ``mm(t(b), t(a))``, the same values made
        contiguous by the product itself (BLAS reads transposed operands in place), and
        visit the new nodes."""
        product = node.args[0]
        a, b = product.args
        with self.graph.inserting_before(node):
            new = [self.graph.call_function(_aten.t.default, (x,)) for x in (b, a)]
            new.append(self.graph.call_function(_aten.mm.default, tuple(new)))
        for made, val in zip(new, (b.meta["val"].t(), a.meta["val"].t(), node.meta["val"])):
            made.meta["val"] = val
            if ORIGIN.has(product):
                ORIGIN.set(made, ORIGIN(product))
        node.replace_all_uses_with(new[2])
        self.graph.erase_node(node)
        self.graph.erase_node(product)
        for n in new:
            self.visit(n)

    def value(self, node):
        """``node``'s value with its run-time strides (meta or fake tensors), or None."""
        return self.layout[node] if node in self.layout else node.meta.get("val")

    def run_on_meta(self, node: fx.Node):
        """``node``'s output on meta tensors of its inputs' run-time layouts (through the
        fake mode for :data:`_BACKEND_LAYOUTS`), or None where its operator cannot run there
        (or refuses those strides)."""
        traced = node.meta.get("val")
        faked = node.target in _BACKEND_LAYOUTS and isinstance(traced, FakeTensor)
        convert = (lambda t: as_fake(t, traced.fake_mode, traced.device)) if faked else as_meta
        args, kwargs = map_leaves(lambda a: convert(self.value(a)) if isinstance(a, fx.Node) else a,
                                (node.args, node.kwargs))
        try:
            if faked:
                with traced.fake_mode:
                    return node.target(*args, **kwargs)
            return node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - no meta kernel, a collective, a draw, bad strides
            return None

    def give_contiguous(self, reader: fx.Node, owned: bool,
                        fine: Callable[[torch.Tensor], bool] = torch.Tensor.is_contiguous) -> None:
        """Replace each tensor input of ``reader`` whose run-time layout is not ``fine``
        (with ``owned``, also each alias) by its contiguous clone, made once before the
        first reader that needs it."""
        def fix(arg):
            if not isinstance(arg, fx.Node):
                return arg
            value = self.value(arg)
            if not isinstance(value, torch.Tensor):
                return arg
            if fine(value) and not (owned and arg in self.aliases):
                return arg
            if arg not in self.contiguous:
                with self.graph.inserting_before(reader):
                    clone = self.graph.call_function(_aten.clone.default, (arg,),
                                                     {"memory_format": torch.contiguous_format})
                clone.meta = {k: arg.meta[k] for k in _COPIED_META if k in arg.meta}
                if in_update(reader):  # it runs with the update, wherever that is scheduled
                    ORIGIN.set(clone, ORIGIN(reader))
                if "val" in clone.meta and not clone.meta["val"].is_contiguous():
                    self.layout[clone] = torch.empty(value.shape, dtype=value.dtype, device="meta")
                self.contiguous[arg] = clone
            return self.contiguous[arg]

        reader.args = tuple(map_leaves(fix, list(reader.args)))
        reader.kwargs = {k: map_leaves(fix, v) for k, v in reader.kwargs.items()}


def _transposes_a_product(node: fx.Node) -> bool:
    """Whether ``node`` transposes a matrix product read by nothing else: the weight
    gradient ``t(mm(t(x), dy))`` that tracing records where the weight was a contiguous
    copy (eager autograd, seeing the transposed weight, computes ``mm(t(dy), x)``). As a
    view it would be a transposed gradient that the update or a collective copies."""
    if node.target is not _aten.t.default:
        return False
    (product,) = node.all_input_nodes
    return (product.target is _aten.mm.default and len(product.users) == 1
            and isinstance(node.meta.get("val"), torch.Tensor)
            and all(isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                    for a in product.args))


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, OpOverload) and (
        node.target.is_view or node.target is _aten.reshape.default or node.target in UNANNOTATED_VIEWS)


def _layout_needed(node: fx.Node) -> Callable[[torch.Tensor], bool] | None:
    """What the run-time layout of each tensor input of ``node`` must satisfy (an input
    that does not is given a contiguous clone), or None: any layout does."""
    target = node.target
    if target is operator.getitem:
        return None
    if not isinstance(target, OpOverload):
        return torch.Tensor.is_contiguous  # a Python function: ddlc.comm's boxing pieces, ddlc.rng's draws
    if target.namespace == "_c10d_functional" or target in _CONTIGUOUS_READERS \
            or target.__name__.startswith(_VENDOR_KERNELS):
        return torch.Tensor.is_contiguous
    if target.__name__.startswith(_ROW_READERS):
        return _dense_rows
    # the update reads each gradient in its parameter's (contiguous) layout, as autograd's
    # AccumulateGrad makes it: a transposed weight gradient read by the ten or so
    # elementwise operators of an AdamW update costs each of them 15x (1M floats on CPU)
    return torch.Tensor.is_contiguous if in_update(node) and not target.is_view else None


def _dense_rows(value: torch.Tensor) -> bool:
    """Whether ``value``'s last dimension is dense (stride 1, or at most one element)."""
    return value.dim() == 0 or value.shape[-1] <= 1 or value.stride(-1) == 1


def _same_layout(a, b) -> bool:
    """Whether two values (tensors or trees of them) have the same shapes and strides."""
    left, right = leaves(a), leaves(b)
    return len(left) == len(right) and all(
        not isinstance(x, torch.Tensor) or (isinstance(y, torch.Tensor) and x.shape == y.shape
                                            and x.stride() == y.stride())
        for x, y in zip(left, right))
