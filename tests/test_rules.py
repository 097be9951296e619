"""SBP rules: every claimed signature holds on simulated shards (passes.rules.checker).

(a) every node of the example training steps, with real values captured by running
the traced step; (b) synthetic calls of the ops the examples do not reach (among them
those Hugging Face GPT-2, BERT, Llama, T5, ViT and Qwen2 and MobileNet-style CNNs bring:
batch norm, depthwise convolution, gather, index, masks, padding, rotary sin/cos...),
and a traced MobileNet-style CNN; (c) hypothesis shapes for the elementwise, matmul and
reshape families; plus the pointwise family by tag, proofs that the checker rejects
wrong rules, the fallback, repeatable enumeration on a large graph (its speed:
bench/rules.py) and the GPU rule data.
"""
import functools
import logging

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ddlc
from conftest import MODELS, OPTIMIZERS, batches, model_and_loss, optimizer
from ddlc.sbp import B, NdSBP, P, S
from passes.rules.checker import capture_values, check_node, check_signature, make_node, node_inputs
from ddlc.zoo import GPT, lm_loss
from passes.canonicalize import canonicalize
from passes.rules import (RULES, NdSignature, Signature, bind, fallback_ops, is_functional, localize_args,
                          rule_for, signatures_1d, signatures_nd, tensor_inputs)
from passes.rules.elementwise import elementwise
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
MESHES = ((2,), (4,), (2, 2))
CASES = ([f"{m}-{o}" for m in MODELS for o in OPTIMIZERS] + [f"{m}-forward" for m in MODELS]
         + [f"{m}-adamw-canonical" for m in MODELS])


def _trace_case(case):
    """The traced graph of ``case`` and every node's value on its second real step."""
    model_name, mode, *canonical = case.split("-")
    model, loss_fn = model_and_loss(model_name)
    batch = batches(model_name)[0]
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    if mode == "forward":
        gm = ddlc.trace(model, batch[:1])
        sig = gm.meta["ddlc_step"]
        return gm, capture_values(gm, sig.flatten(params, buffers, {}, batch[:1]))
    gm = ddlc.trace(model, batch, loss_fn, optimizer(mode, model))
    if canonical:
        gm = canonicalize(gm)
    sig = gm.meta["ddlc_step"]
    state = sig.init_opt_state(params)
    out = sig.unflatten(gm(*sig.flatten(params, buffers, state, batch)))  # non-zero state
    params, state = out["param"], {**state, **out.get("opt_state", {})}
    return gm, capture_values(gm, sig.flatten(params, buffers, state, batch))


@functools.cache
def _examples():
    return {case: _trace_case(case) for case in CASES}


@pytest.fixture
def examples():
    """Every case's graph and values, traced once per process: a module-scoped fixture is
    built again wherever the worker runs another module's tests in between (15 s a time)."""
    return _examples()


@pytest.mark.parametrize("case", CASES)
def test_no_fallback_in_example_graph(examples, case):
    gm, _ = examples[case]
    assert fallback_ops(gm) == []


def _failure(node, exc):
    return f"{node.format_node()}\n    {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def test_every_claimed_signature_holds_on_example_graphs(examples):
    """Each distinct (op, claimed signatures) once, with the values of its first occurrence."""
    seen, failures, checked = set(), [], 0
    for gm, env in examples.values():
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            sigs = signatures_1d(node)
            assert sigs == sorted(sigs) and len(set(sigs)) == len(sigs)
            assert all(len(s.inputs) == len(tensor_inputs(node)) for s in sigs), node
            assert all(len(s.outputs) == len(tree_leaves(node.meta.get("val"))) for s in sigs), node
            key = (node.target, tuple(sigs))
            if key in seen:
                continue
            seen.add(key)
            try:
                checked += check_node(node, node_inputs(node, env), MESHES)
            except Exception as exc:  # a rule whose local op cannot even run is wrong too
                failures.append(_failure(node, exc))
    assert not failures, "\n".join(failures)
    assert checked > 1000


# ---------------------------------------------------------------- synthetic calls

def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _cdist_backward_args():
    x1, x2 = _r(2, 6, 3), _r(2, 4, 3, seed=1)
    return _r(2, 6, 4, seed=2), x1, x2, 2.0, torch.cdist(x1, x2)


def _with_indices(backward, forward, shape, *args, backward_takes_args=True):
    """A max-pooling backward call with the indices its forward (of ``args``) gives."""
    x = _r(*shape)
    out, indices = forward(x, *args)
    return backward, (_r(*out.shape, seed=1), x, *(args if backward_takes_args else ()), indices), {}


def _attention(is_causal):
    q, k, v = _r(2, 4, 8, 8), _r(2, 4, 16, 8, seed=1), _r(2, 4, 16, 8, seed=2)
    return aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, is_causal), {}


def _attention_backward(is_causal):
    op, (q, k, v, *rest), _ = _attention(is_causal)
    out, lse = op(q, k, v, *rest)
    return (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            (_r(*out.shape, seed=3), q, k, v, out, lse, 0.0, is_causal), {})


def _targets(n, classes):
    t = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(n))
    t[1] = -100  # an ignored target
    return t


def _classes(n, classes):
    """Class indices, none ignored (the multi-margin loss has no ignore index)."""
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(n))


def _pixel_targets():
    """Per-pixel classes of a [4, 4, 4] segmentation target, a few of them ignored."""
    t = torch.randint(0, 6, (4, 4, 4), generator=torch.Generator().manual_seed(3))
    t[0, 1, 2] = t[3, 0, 0] = -100
    return t


def _indices(*shape, vocab=10):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(sum(shape)))


SYNTHETIC = {
    "bmm": lambda: (aten.bmm.default, (_r(4, 2, 6), _r(4, 6, 8)), {}),
    "baddbmm": lambda: (aten.baddbmm.default, (_r(8), _r(4, 2, 6), _r(4, 6, 8)),
                        {"beta": 0.5, "alpha": 2.0}),
    "linear": lambda: (aten.linear.default, (_r(4, 2, 6), _r(8, 6), _r(8)), {}),
    "addmm_full_bias": lambda: (aten.addmm.default, (_r(4, 8), _r(4, 6), _r(6, 8)), {"beta": 0.5}),
    "permute_copy": lambda: (aten.permute_copy.default, (_r(2, 4, 6), [2, 0, 1]), {}),
    "expand_copy": lambda: (aten.expand_copy.default, (_r(4, 1), [2, 4, 6]), {}),
    "unsqueeze_copy": lambda: (aten.unsqueeze_copy.default, (_r(4, 6), 1), {}),
    "view_as_real_copy": lambda: (aten.view_as_real_copy.default, (torch.complex(_r(4, 6), _r(4, 6, seed=1)),), {}),
    "view_as_complex_copy": lambda: (aten.view_as_complex_copy.default, (_r(4, 6, 2),), {}),
    "squeeze_copy": lambda: (aten.squeeze_copy.dim, (_r(4, 1, 6), 1), {}),
    "split_with_sizes_copy": lambda: (aten.split_with_sizes_copy.default, (_r(4, 6), [2, 4], 1), {}),
    "slice_step": lambda: (aten.slice_copy.Tensor, (_r(4, 8), 1, 1, 7, 2), {}),
    "cat_dim0": lambda: (aten.cat.default, ([_r(2, 4), _r(6, 4, seed=1)], 0), {}),
    "clone": lambda: (aten.clone.default, (_r(4, 6),), {}),
    "detach": lambda: (aten.detach.default, (_r(4, 6),), {}),
    "alias": lambda: (aten.alias.default, (_r(4, 6),), {}),
    "add_scalar": lambda: (aten.add.Scalar, (_r(4, 6), 2.0), {}),
    "add_broadcast": lambda: (aten.add.Tensor, (_r(4, 1, 6), _r(6)), {"alpha": 0.5}),
    "sub_scalar": lambda: (aten.sub.Scalar, (_r(4, 6), 2.0), {}),
    "mul_scalar": lambda: (aten.mul.Scalar, (_r(4, 6), 3.0), {}),
    "mul_broadcast": lambda: (aten.mul.Tensor, (_r(4, 6), _r(4, 1)), {}),
    "div_scalar": lambda: (aten.div.Scalar, (_r(4, 6), 3.0), {}),
    "neg": lambda: (aten.neg.default, (_r(4, 6),), {}),
    "pow_tensor_scalar": lambda: (aten.pow.Tensor_Scalar, (_r(4, 6), 2), {}),
    "rsub_tensor": lambda: (aten.rsub.Tensor, (_r(4, 6), _r(6)), {"alpha": 2.0}),
    "lerp_tensor": lambda: (aten.lerp.Tensor, (_r(4, 6), _r(4, 6, seed=1), _r(6).sigmoid()), {}),
    "addcdiv": lambda: (aten.addcdiv.default, (_r(4, 6), _r(4, 6, seed=1), _r(4, 6).exp()),
                        {"value": 0.5}),
    "where": lambda: (aten.where.self, (_r(4, 6) > 0, _r(4, 6, seed=1), _r(6)), {}),
    "to_float64": lambda: (aten._to_copy.default, (_r(4, 6),), {"dtype": torch.float64}),
    "copy_broadcast": lambda: (aten.copy.default, (_r(4, 6), _r(6, seed=1)), {}),
    "sum_default": lambda: (aten.sum.default, (_r(4, 6),), {}),
    "sum_dims": lambda: (aten.sum.dim_IntList, (_r(2, 4, 6), [0, 2]), {}),
    "mean_dim": lambda: (aten.mean.dim, (_r(2, 4, 6), [1], True), {}),
    "softmax": lambda: (aten._softmax.default, (_r(4, 6), 1, False), {}),
    "softmax_backward": lambda: (aten._softmax_backward_data.default,
                                 (_r(4, 6), _r(4, 6, seed=1).softmax(0), 0, torch.float32), {}),
    "layer_norm_2d": lambda: (aten.native_layer_norm.default,
                              (_r(4, 2, 6), [2, 6], _r(2, 6), _r(2, 6, seed=1), 1e-5), {}),
    "layer_norm_backward": lambda: (
        aten.native_layer_norm_backward.default,
        (_r(4, 6, seed=2), _r(4, 6), [6],
         *aten.native_layer_norm.default(_r(4, 6), [6], _r(6), _r(6, seed=1), 1e-5)[1:],
         _r(6), _r(6, seed=1), [True, True, True]), {}),
    "nll_sum": lambda: (aten.nll_loss_forward.default,
                        (_r(8, 6).log_softmax(1), _targets(8, 6), None, 2, -100), {}),
    "nll_none": lambda: (aten.nll_loss_forward.default,
                         (_r(8, 6).log_softmax(1), _targets(8, 6), None, 0, -100), {}),
    "nll_backward_sum": lambda: (aten.nll_loss_backward.default,
                                 (_r(), _r(8, 6), _targets(8, 6), None, 2, -100,
                                  torch.tensor(7.0)), {}),
    "nll2d_sum": lambda: (aten.nll_loss2d_forward.default,
                          (_r(4, 6, 4, 4).log_softmax(1), _pixel_targets(), None, 2, -100), {}),
    "nll2d_none": lambda: (aten.nll_loss2d_forward.default,
                           (_r(4, 6, 4, 4).log_softmax(1), _pixel_targets(), None, 0, -100), {}),
    "nll2d_mean_weighted": lambda: (aten.nll_loss2d_forward.default,
                                    (_r(4, 6, 4, 4).log_softmax(1), _pixel_targets(), _r(6).exp(), 1, -100), {}),
    "nll2d_backward_sum": lambda: (aten.nll_loss2d_backward.default,
                                   (_r(), _r(4, 6, 4, 4), _pixel_targets(), None, 2, -100,
                                    torch.tensor(60.0)), {}),
    "nll2d_backward_mean": lambda: (aten.nll_loss2d_backward.default,
                                    (_r(), _r(4, 6, 4, 4), _pixel_targets(), None, 1, -100,
                                     torch.tensor(60.0)), {}),
    "mse_sum": lambda: (aten.mse_loss.default, (_r(4, 6), _r(4, 6, seed=1), 2), {}),
    "mse_backward_sum": lambda: (aten.mse_loss_backward.default,
                                 (_r(), _r(4, 6), _r(4, 6, seed=1), 2), {}),
    "smooth_l1_sum": lambda: (aten.smooth_l1_loss.default, (_r(4, 6), _r(4, 6, seed=1), 2, 0.5), {}),
    "smooth_l1_none": lambda: (aten.smooth_l1_loss.default, (_r(4, 6), _r(4, 6, seed=1), 0, 0.5), {}),
    "smooth_l1_backward_sum": lambda: (aten.smooth_l1_loss_backward.default,
                                       (_r(), _r(4, 6), _r(4, 6, seed=1), 2, 0.5), {}),
    "huber_sum": lambda: (aten.huber_loss.default, (_r(4, 6), _r(4, 6, seed=1), 2, 0.5), {}),
    "huber_backward_none": lambda: (aten.huber_loss_backward.default,
                                    (_r(4, 6, seed=2), _r(4, 6), _r(4, 6, seed=1), 0, 0.5), {}),
    "soft_margin_sum": lambda: (aten.soft_margin_loss.default, (_r(4, 6), _r(4, 6, seed=1).sign(), 2), {}),
    "soft_margin_target_broadcast": lambda: (aten.soft_margin_loss.default, (_r(4, 6), _r(6, seed=1).sign(), 2), {}),
    "soft_margin_target_broadcast_none": lambda: (aten.soft_margin_loss.default,
                                                  (_r(4, 6), _r(4, 1, seed=1).sign(), 0), {}),
    "soft_margin_backward_sum": lambda: (aten.soft_margin_loss_backward.default,
                                         (_r(), _r(4, 6), _r(4, 6, seed=1).sign(), 2), {}),
    "bce_sum_weight_broadcast": lambda: (aten.binary_cross_entropy.default,
                                         (_r(4, 6).sigmoid(), _r(4, 6, seed=1).sigmoid(), _r(1, 6).abs(), 2), {}),
    "bce_none_weight": lambda: (aten.binary_cross_entropy.default,
                                (_r(4, 6).sigmoid(), _r(4, 6, seed=1).sigmoid(), _r(4, 6, seed=2).abs(), 0), {}),
    "bce_backward_sum": lambda: (aten.binary_cross_entropy_backward.default,
                                 (_r(), _r(4, 6).sigmoid(), _r(4, 6, seed=1).sigmoid(), _r(6).abs(), 2), {}),
    "multi_margin_sum": lambda: (aten.multi_margin_loss.default, (_r(8, 6), _classes(8, 6), 1, 1.0, None, 2), {}),
    "multi_margin_none_weighted": lambda: (aten.multi_margin_loss.default,
                                           (_r(8, 6), _classes(8, 6), 2, 0.5, _r(6).exp(), 0), {}),
    "multi_margin_backward_sum": lambda: (aten.multi_margin_loss_backward.default,
                                          (_r(), _r(8, 6), _classes(8, 6), 1, 1.0, None, 2), {}),
    "embedding_1d": lambda: (aten.embedding.default, (_r(10, 4), _indices(8)), {}),
    "embedding_backward": lambda: (aten.embedding_dense_backward.default,
                                   (_r(2, 4, 6), _indices(2, 4), 10, -1, False), {}),
    "attention_noncausal": lambda: _attention(False),
    "attention_noncausal_backward": lambda: _attention_backward(False),
    "attention_causal_backward": lambda: _attention_backward(True),
    "conv_transposed": lambda: (aten.convolution.default,
                                (_r(2, 4, 5, 5), _r(4, 6, 3, 3), _r(6), [1, 1], [0, 0], [1, 1],
                                 True, [0, 0], 1), {}),
    "conv_groups": lambda: (aten.convolution.default,
                            (_r(2, 4, 5, 5), _r(6, 2, 3, 3), _r(6), [1, 1], [1, 1], [1, 1],
                             False, [0, 0], 2), {}),
    "conv_backward_no_input_grad": lambda: (
        aten.convolution_backward.default,
        (_r(2, 6, 5, 5), _r(2, 4, 5, 5), _r(6, 4, 3, 3), [6], [1, 1], [1, 1], [1, 1], False,
         [0, 0], 1, [False, True, True]), {}),
    "max_pool_3d_input": lambda: (aten.max_pool2d_with_indices.default, (_r(4, 6, 6), [2, 2]), {}),
    # per-plane spatial operators: pooling, padding, upsampling, pixel shuffle (U-Nets,
    # GANs, super-resolution, video models)
    "avg_pool2d": lambda: (aten.avg_pool2d.default, (_r(4, 4, 6, 6), [3, 3], [2, 2], [1, 1], True), {}),
    "avg_pool2d_backward": lambda: (aten.avg_pool2d_backward.default,
                                    (_r(4, 4, 3, 3, seed=1), _r(4, 4, 6, 6), [2, 2], [2, 2], [0, 0],
                                     False, True, None), {}),
    "avg_pool3d": lambda: (aten.avg_pool3d.default, (_r(4, 4, 4, 4, 4), [2, 2, 2]), {}),
    "max_pool3d": lambda: (aten.max_pool3d_with_indices.default, (_r(4, 4, 4, 4, 4), [2, 2, 2]), {}),
    "max_pool3d_backward": lambda: _with_indices(aten.max_pool3d_with_indices_backward.default,
                                                 aten.max_pool3d_with_indices.default, (4, 4, 4, 4, 4),
                                                 [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False),
    "adaptive_max_pool2d": lambda: (aten.adaptive_max_pool2d.default, (_r(4, 4, 6, 6), [3, 3]), {}),
    "adaptive_max_pool2d_backward": lambda: _with_indices(aten.adaptive_max_pool2d_backward.default,
                                                          aten.adaptive_max_pool2d.default, (4, 4, 6, 6), [3, 3],
                                                          backward_takes_args=False),
    "adaptive_avg_pool3d_backward": lambda: (aten._adaptive_avg_pool3d_backward.default,
                                             (_r(4, 4, 2, 2, 2, seed=1), _r(4, 4, 4, 4, 4)), {}),
    "reflection_pad2d": lambda: (aten.reflection_pad2d.default, (_r(4, 4, 6, 6), [1, 2, 2, 1]), {}),
    "reflection_pad2d_backward": lambda: (aten.reflection_pad2d_backward.default,
                                          (_r(4, 4, 9, 9, seed=1), _r(4, 4, 6, 6), [1, 2, 2, 1]), {}),
    "reflection_pad1d_unbatched": lambda: (aten.reflection_pad1d.default, (_r(4, 6), [2, 2]), {}),
    "replication_pad3d": lambda: (aten.replication_pad3d.default, (_r(4, 4, 3, 3, 3), [1, 1, 1, 1, 1, 1]), {}),
    "replication_pad1d_backward": lambda: (aten.replication_pad1d_backward.default,
                                           (_r(4, 4, 9, seed=1), _r(4, 4, 6), [2, 1]), {}),
    "upsample_nearest2d": lambda: (aten.upsample_nearest2d.default, (_r(4, 4, 3, 3), [6, 6]), {}),
    "upsample_nearest2d_backward": lambda: (aten.upsample_nearest2d_backward.default,
                                            (_r(4, 4, 6, 6), [6, 6], [4, 4, 3, 3]), {}),
    "upsample_bilinear2d": lambda: (aten.upsample_bilinear2d.default, (_r(4, 4, 3, 3), [5, 7], True), {}),
    "upsample_bilinear2d_backward": lambda: (aten.upsample_bilinear2d_backward.default,
                                             (_r(4, 4, 5, 7), [5, 7], [4, 4, 3, 3], False), {}),
    "upsample_bicubic2d": lambda: (aten.upsample_bicubic2d.default, (_r(4, 4, 3, 3), [6, 6], False), {}),
    "upsample_linear1d": lambda: (aten.upsample_linear1d.default, (_r(4, 4, 5), [10], True), {}),
    "upsample_trilinear3d_backward": lambda: (aten.upsample_trilinear3d_backward.default,
                                              (_r(4, 4, 4, 4, 4), [4, 4, 4], [4, 4, 2, 2, 2], False), {}),
    "pixel_shuffle": lambda: (aten.pixel_shuffle.default, (_r(4, 8, 3, 3), 2), {}),
    "pixel_unshuffle": lambda: (aten.pixel_unshuffle.default, (_r(4, 2, 6, 6), 2), {}),
    "im2col": lambda: (aten.im2col.default, (_r(4, 4, 6, 6), [2, 2], [1, 1], [0, 0], [2, 2]), {}),
    "im2col_unbatched": lambda: (aten.im2col.default, (_r(4, 6, 6), [3, 3], [1, 1], [1, 1], [1, 1]), {}),
    "col2im": lambda: (aten.col2im.default, (_r(4, 16, 9), [6, 6], [2, 2], [1, 1], [0, 0], [2, 2]), {}),
    "roll": lambda: (aten.roll.default, (_r(4, 4, 6, 6), [2, -1], [2, 3]), {}),
    "roll_flattened": lambda: (aten.roll.default, (_r(4, 6), [3]), {}),
    "flip": lambda: (aten.flip.default, (_r(4, 4, 6), [-1, 1]), {}),
    "grid_sampler_2d": lambda: (aten.grid_sampler_2d.default,
                                (_r(4, 4, 5, 5), _r(4, 3, 6, 2, seed=1).tanh(), 0, 0, False), {}),
    "grid_sampler_2d_backward": lambda: (aten.grid_sampler_2d_backward.default,
                                         (_r(4, 4, 3, 6, seed=2), _r(4, 4, 5, 5), _r(4, 3, 6, 2, seed=1).tanh(),
                                          0, 1, True, [True, True]), {}),
    "grid_sampler_3d": lambda: (aten.grid_sampler_3d.default,
                                (_r(4, 4, 3, 3, 3), _r(4, 2, 2, 2, 3, seed=1).tanh(), 0, 0, False), {}),
    "affine_grid": lambda: (aten.affine_grid_generator.default, (_r(4, 2, 3), [4, 3, 5, 6], False), {}),
    "affine_grid_backward": lambda: (aten.affine_grid_generator_backward.default,
                                     (_r(4, 5, 6, 2), [4, 3, 5, 6], False), {}),
    "group_norm": lambda: (aten.native_group_norm.default,
                           (_r(4, 6, 3, 3), _r(6, seed=1), _r(6, seed=2), 4, 6, 9, 2, 1e-5), {}),
    "group_norm_backward": lambda: (
        aten.native_group_norm_backward.default,
        (_r(4, 6, 3, 3, seed=3), _r(4, 6, 3, 3),
         *aten.native_group_norm.default(_r(4, 6, 3, 3), _r(6, seed=1), None, 4, 6, 9, 2, 1e-5)[1:],
         _r(6, seed=1), 4, 6, 9, 2, [True, True, True]), {}),
    "zeros_like": lambda: (aten.zeros_like.default, (_r(4, 6),), {}),
    "ones_like": lambda: (aten.ones_like.default, (_r(4, 6),), {}),
    "full_like": lambda: (aten.full_like.default, (_r(4, 6), 3.0), {}),
    "full": lambda: (aten.full.default, ([4, 6], 2.0), {}),
    "zeros": lambda: (aten.zeros.default, ([4, 6],), {}),
    "ones": lambda: (aten.ones.default, ([4, 6],), {}),
    "new_zeros": lambda: (aten.new_zeros.default, (_r(3), [4, 6]), {}),
    "scalar_tensor": lambda: (aten.scalar_tensor.default, (2.0,), {}),
    "arange": lambda: (aten.arange.start, (2, 10), {}),
}


def _unit(*shape, seed=0):
    """Values in (0, 1): inside every domain the unary ops below need."""
    return _r(*shape, seed=seed).sigmoid()


def _mask(*shape, seed=0):
    return _r(*shape, seed=seed + 7) > 0


INT_MAX = 9223372036854775807


def _bn_args(c=6, affine=True):
    w, b = (_r(c, seed=1), _r(c, seed=2)) if affine else (None, None)
    return w, b, _r(c, seed=3), _r(c, seed=4).exp()


def _bn_backward(train):
    x, w, (_, _, rm, rv) = _r(4, 6, 3, 3), _r(6, seed=1), _bn_args()
    if train:
        _, save_mean, save_invstd = aten.native_batch_norm.default(x, w, None, None, None, True, 0.1, 1e-5)
        rm = rv = None
    else:
        save_mean = save_invstd = torch.empty(0)
    return (aten.native_batch_norm_backward.default,
            (_r(4, 6, 3, 3, seed=5), x, w, rm, rv, save_mean, save_invstd, train, 1e-5,
             [True, True, True]), {})


# the ops real models (Hugging Face GPT-2, BERT, Llama, T5, ViT, Qwen2; MobileNet-style CNNs)
# bring beyond the examples', one call or more each
SYNTHETIC.update({
    # elementwise, pointwise by tag (nonlinear unless LINEAR_IN says otherwise)
    **{f"unary_{op.__name__}": (lambda op=op: (op, (_unit(4, 6),), {})) for op in (
        aten.silu.default, aten.sin.default, aten.cos.default, aten.abs.default, aten.erf.default,
        aten.log1p.default, aten.expm1.default, aten.sign.default, aten.square.default,
        aten.rsqrt.default, aten.logical_not.default, aten.hardswish.default)},
    "abs_int": lambda: (aten.abs.default, (_indices(4, 6) - 5,), {}),
    "minimum_broadcast": lambda: (aten.minimum.default, (_r(4, 6), _r(6, seed=1)), {}),
    "maximum": lambda: (aten.maximum.default, (_r(4, 6), _r(4, 6, seed=1)), {}),
    "ge_tensor": lambda: (aten.ge.Tensor, (_r(4, 6), _r(4, 1, seed=1)), {}),
    "gt_scalar": lambda: (aten.gt.Scalar, (_r(4, 6), 0), {}),
    "lt_scalar_int": lambda: (aten.lt.Scalar, (_indices(4, 6), 5), {}),
    "le_tensor_mask": lambda: (aten.le.Tensor, (_indices(1, 1, 1, 8), _indices(1, 1, 8, 1)), {}),
    "eq_tensor": lambda: (aten.eq.Tensor, (_indices(4, 6), _indices(6)), {}),
    "ne_scalar": lambda: (aten.ne.Scalar, (_indices(4, 6), 3), {}),
    "logical_and": lambda: (aten.logical_and.default, (_mask(4, 6), _mask(6, seed=1)), {}),
    # integer partial sums are exact (a count over a split batch); booleans never P
    "sum_count_of_mask": lambda: (aten.sum.default, (_mask(4, 6),), {}),
    "sum_int_dim": lambda: (aten.sum.dim_IntList, (_indices(4, 6), [0]), {}),
    "add_int": lambda: (aten.add.Tensor, (_indices(4, 6), _indices(4, 6, vocab=7)), {}),
    "bitwise_and_0d": lambda: (aten.bitwise_and.Tensor, (torch.tensor(True), _mask(1, 1, 8, 8)), {}),
    "bitwise_or_scalar_first": lambda: (aten.bitwise_or.Scalar_Tensor, (3, _indices(4, 6)), {}),
    "clamp": lambda: (aten.clamp.default, (_r(4, 6), -0.5, 0.5), {}),
    "clamp_min": lambda: (aten.clamp_min.default, (_r(4, 6), 0.0), {}),
    "clamp_tensor": lambda: (aten.clamp.Tensor, (_r(4, 6), _r(6, seed=1) - 1, _r(4, 1, seed=2) + 1), {}),
    "hardtanh": lambda: (aten.hardtanh.default, (_r(4, 6), 0.0, 6.0), {}),
    "where_scalar_other_zero": lambda: (aten.where.ScalarOther, (_mask(4, 6), _r(4, 6), 0.0), {}),
    "masked_fill_zero": lambda: (aten.masked_fill.Scalar, (_r(4, 6), _mask(6), 0.0), {}),
    "masked_fill_value": lambda: (aten.masked_fill.Scalar, (_r(4, 6), _mask(4, 1), -1e4), {}),
    "masked_fill_tensor": lambda: (aten.masked_fill.Tensor, (_r(4, 6), _mask(4, 6), torch.tensor(-2.0)), {}),
    "frexp_two_outputs": lambda: (aten.frexp.Tensor, (_r(4, 6),), {}),
    # unary backward ops: linear in the incoming gradient
    "tanh_backward": lambda: (aten.tanh_backward.default, (_r(4, 6), _r(4, 6, seed=1).tanh()), {}),
    "sigmoid_backward": lambda: (aten.sigmoid_backward.default, (_r(4, 6), _unit(4, 6, seed=1)), {}),
    "silu_backward": lambda: (aten.silu_backward.default, (_r(4, 6), _r(6, seed=1)), {}),
    "hardtanh_backward": lambda: (aten.hardtanh_backward.default,
                                  (_r(4, 6), _r(4, 6, seed=1), -1.0, 1.0), {}),
    "leaky_relu_backward": lambda: (aten.leaky_relu_backward.default,
                                    (_r(4, 6), _r(4, 6, seed=1), 0.1, False), {}),
    # random ops, with arguments that make them deterministic
    "native_dropout_p0": lambda: (aten.native_dropout.default, (_r(4, 6), 0.0, True), {}),
    "native_dropout_eval": lambda: (aten.native_dropout.default, (_r(4, 6), 0.5, False), {}),
    "native_dropout_backward": lambda: (aten.native_dropout_backward.default,
                                        (_r(4, 6), _mask(4, 6), 2.0), {}),
    "bernoulli_p1": lambda: (aten.bernoulli.p, (_r(4, 6), 1.0), {}),
    "bernoulli_0_1_probabilities": lambda: (aten.bernoulli.default, (_mask(4, 6).float(),), {}),
    "randint_one_value": lambda: (aten.randint.low, (3, 4, [4, 6]), {}),
    "normal_std0": lambda: (aten.normal.float_float, (1.5, 0.0, [4, 6]), {}),
    "uniform_point": lambda: (aten.uniform.default, (_r(4, 6), 2.0, 2.0), {}),
    # indexing
    "gather_dim1": lambda: (aten.gather.default, (_r(4, 6), 1, _indices(4, 3, vocab=6)), {}),
    "gather_dim0_same_shape": lambda: (aten.gather.default, (_r(4, 6), 0, _indices(4, 6, vocab=4)), {}),
    "gather_fewer_rows": lambda: (aten.gather.default, (_r(4, 6), 1, _indices(2, 8, vocab=6)), {}),
    "scatter_add_dim0": lambda: (aten.scatter_add.default,
                                 (_r(6, 4), 0, _indices(8, 4, vocab=6), _r(8, 4, seed=1)), {}),
    "scatter_add_dim1": lambda: (aten.scatter_add.default,
                                 (_r(4, 6), 1, _indices(4, 4, vocab=6), _r(4, 6, seed=1)), {}),
    "scatter_value": lambda: (aten.scatter.value, (_r(4, 6), 1, _indices(4, 2, vocab=6), 0.5), {}),
    # a graph network's messages reduced into nodes, a mixture of experts' combine
    "scatter_reduce_amax": lambda: (aten.scatter_reduce.two, (_r(6, 4), 0, _indices(8, 4, vocab=6),
                                                              _r(8, 4, seed=1), "amax"), {}),
    "scatter_reduce_mean_dim1": lambda: (aten.scatter_reduce.two, (_r(4, 6), 1, _indices(4, 6, vocab=6),
                                                                   _r(4, 6, seed=1), "mean"), {"include_self": False}),
    "index_add_dim0": lambda: (aten.index_add.default, (_r(6, 4), 0, _indices(8, vocab=6), _r(8, 4, seed=1)),
                               {"alpha": 0.5}),
    "index_add_dim1": lambda: (aten.index_add.default, (_r(4, 6, 2), 1, _indices(8, vocab=6),
                                                        _r(4, 8, 2, seed=1)), {}),
    "index_add_0d": lambda: (aten.index_add.default, (_r(), 0, torch.tensor([0]), _r(seed=1)), {}),
    "index_copy": lambda: (aten.index_copy.default, (_r(6, 4), 0, torch.tensor([4, 1, 3]), _r(3, 4, seed=1)), {}),
    "index_reduce_mean": lambda: (aten.index_reduce.default, (_r(6, 4), 0, _indices(8, vocab=6),
                                                              _r(8, 4, seed=1), "mean"), {}),
    # pairwise distances (a triplet loss's hard negatives) and their backward
    "cdist": lambda: (aten._cdist_forward.default, (_r(6, 3), _r(4, 3, seed=1), 2.0, None), {}),
    "cdist_batched_p1": lambda: (aten._cdist_forward.default, (_r(2, 6, 3), _r(2, 4, 3, seed=1), 1.0, None), {}),
    "cdist_backward": lambda: (aten._cdist_backward.default, _cdist_backward_args(), {}),
    "eye": lambda: (aten.eye.m, (4, 6), {}),
    # a covariance's diagonal (VICReg, W-MSE), its gradient, a batch of diagonal matrices
    "diagonal": lambda: (aten.diagonal_copy.default, (_r(3, 4, 4),), {"dim1": 1, "dim2": 2}),
    "diagonal_offset": lambda: (aten.diagonal_copy.default, (_r(4, 3, 5),), {"offset": 1, "dim1": 0, "dim2": 2}),
    "diagonal_backward": lambda: (aten.diagonal_backward.default, (_r(3, 4), [3, 4, 4], 0, 1, 2), {}),
    "diag_embed": lambda: (aten.diag_embed.default, (_r(3, 4),), {"offset": -1}),
    # bucketing values by sorted boundaries (a bucketed relative position, a quantizer)
    "searchsorted_1d": lambda: (aten.searchsorted.Tensor, (torch.linspace(-2, 2, 9), _r(4, 6)), {}),
    "searchsorted_rows": lambda: (aten.searchsorted.Tensor, (torch.sort(_r(4, 9)).values, _r(4, 6, seed=1)),
                                  {"right": True}),
    "count_nonzero_all": lambda: (aten.count_nonzero.default, (_indices(4, 6, vocab=3),), {}),
    "count_nonzero_dim1": lambda: (aten.count_nonzero.dim_IntList, (_indices(4, 6, 2, vocab=3), [1]), {}),
    "logcumsumexp": lambda: (aten.logcumsumexp.default, (_r(4, 6), 1), {}),
    "floor_divide": lambda: (aten.floor_divide.default, (_indices(4, 6, vocab=9), torch.tensor(4)), {}),
    "index_select": lambda: (aten.index_select.default, (_r(4, 6), 1, _indices(4, vocab=6)), {}),
    "index_select_dim0": lambda: (aten.index_select.default, (_r(4, 6), 0, _indices(8, vocab=4)), {}),
    # 0-d tensors (a cummax backward's scatter_add): the rules raised while planning
    "index_select_0d": lambda: (aten.index_select.default, (_r(), 0, torch.tensor([0])), {}),
    "scatter_add_0d": lambda: (aten.scatter_add.default, (_r(), 0, torch.tensor(0), _r()), {}),
    "index_broadcast_indices": lambda: (aten.index.Tensor, (_r(4, 8), [
        _indices(4, 1, 1, 1, vocab=4), _indices(1, 1, 1, 8, vocab=8)]), {}),
    "index_after_none": lambda: (aten.index.Tensor, (_r(4, 6, 2), [None, _indices(4, 2, vocab=6)]), {}),
    "index_non_adjacent": lambda: (aten.index.Tensor, (_r(4, 6, 2), [
        _indices(2, 4, vocab=4), None, _indices(4, vocab=2)]), {}),
    # index_put: an embedding-style backward (accumulate into zeros at ids of a batch),
    # broadcast and non-adjacent indices, an overwrite, and values that broadcast
    "index_put_accumulate": lambda: (aten.index_put.default, (_r(10, 6), [_indices(4, 8, vocab=10)],
                                                             _r(4, 8, 6, seed=1), True), {}),
    "index_put_broadcast": lambda: (aten.index_put.default, (_r(4, 8, 2), [
        _indices(4, 1, vocab=4), _indices(1, 6, vocab=8)], _r(4, 6, 2, seed=1), True), {}),
    "index_put_non_adjacent": lambda: (aten.index_put.default, (_r(4, 6, 2), [
        _indices(3, vocab=4), None, _indices(3, vocab=2)], _r(3, 6, seed=1), True), {}),
    "index_put_overwrite": lambda: (aten.index_put.default, (_r(10, 6), [torch.randperm(
        10, generator=torch.Generator().manual_seed(0))[:4]], _r(4, 6, seed=1), False), {}),
    "index_put_broadcast_values": lambda: (aten.index_put.default, (_r(10, 6), [_indices(4, vocab=10)],
                                                                   _r(6, seed=1), True), {}),
    # views and data movement
    "select_copy": lambda: (aten.select_copy.int, (_r(4, 2, 6), 1, 0), {}),
    "select_last": lambda: (aten.select.int, (_r(4, 6), 0, -1), {}),
    "select_backward": lambda: (aten.select_backward.default, (_r(4, 6), [4, 2, 6], 1, 1), {}),
    "slice_backward": lambda: (aten.slice_backward.default,
                               (_r(4, 2, 6), [4, 4, 6], 1, 2, INT_MAX, 1), {}),
    "slice_backward_whole": lambda: (aten.slice_backward.default, (_r(4, 6), [4, 6], 1, 0, INT_MAX, 1), {}),
    "select_scatter": lambda: (aten.select_scatter.default, (_r(4, 2, 6), _r(4, 6, seed=1), 1, 0), {}),
    "slice_scatter": lambda: (aten.slice_scatter.default,
                              (_r(4, 8), _r(4, 4, seed=1), 1, 2, 6, 1), {}),
    "unbind": lambda: (aten.unbind.int, (_r(4, 3, 6), 1), {}),
    "stack": lambda: (aten.stack.default, ([_r(4, 6), _r(4, 6, seed=1)], 1), {}),
    "repeat": lambda: (aten.repeat.default, (_r(4, 1, 6), [2, 1, 4, 1]), {}),
    "repeat_twice": lambda: (aten.repeat.default, (_r(4, 6), [2, 1]), {}),
    "constant_pad_nd": lambda: (aten.constant_pad_nd.default, (_r(2, 4, 4, 4), [1, 1, 2, 0], 0.0), {}),
    "constant_pad_nd_value": lambda: (aten.constant_pad_nd.default, (_r(4, 6), [1, 2], -1.0), {}),
    "constant_pad_nd_crop": lambda: (aten.constant_pad_nd.default, (_r(2, 4, 6, 6), [-1, -1, -1, -1]), {}),
    "triu": lambda: (aten.triu.default, (_r(2, 4, 6), 1), {}),
    "tril": lambda: (aten.tril.default, (_r(4, 6), -1), {}),
    "unsafe_view": lambda: (aten._unsafe_view.default, (_r(4, 6), [2, 2, 6]), {}),
    "expand": lambda: (aten.expand.default, (_r(4, 1), [2, 4, 6]), {}),
    "squeeze_dims": lambda: (aten.squeeze.dims, (_r(4, 1, 6, 1), [1, 3]), {}),
    "split_with_sizes": lambda: (aten.split_with_sizes.default, (_r(4, 6), [1, 3], 0), {}),
    # nn.LSTM's and nn.GRU's backward split the gradients so (it fell back to all-B)
    "unsafe_split": lambda: (aten.unsafe_split.Tensor, (_r(4, 6), 2, 1), {}),
    "unsafe_split_with_sizes": lambda: (aten.unsafe_split_with_sizes.default, (_r(4, 6), [1, 3], 0), {}),
    # reductions, scans, softmax
    "amax": lambda: (aten.amax.default, (_r(4, 6, 2), [1], True), {}),
    "amax_all": lambda: (aten.amax.default, (_r(4, 6),), {}),
    "any_dim": lambda: (aten.any.dim, (_mask(4, 6), 1), {}),
    "any": lambda: (aten.any.default, (_mask(4, 6),), {}),
    "argmax": lambda: (aten.argmax.default, (_r(4, 6), 1), {}),
    "max_dim": lambda: (aten.max.dim, (_r(4, 6), 0, True), {}),
    "linalg_vector_norm": lambda: (aten.linalg_vector_norm.default, (_r(4, 6), 2, [1], True), {}),
    "norm_dim": lambda: (aten.norm.ScalarOpt_dim, (_r(4, 6, 2), 2, [1], False), {}),  # F.pairwise_distance
    "norm_all": lambda: (aten.norm.Scalar, (_r(4, 6), 1), {}),
    "var_correction": lambda: (aten.var.correction, (_r(4, 6), [0]), {"correction": 1}),
    "aminmax": lambda: (aten.aminmax.default, (_r(4, 6),), {"dim": 0}),
    "var_mean_all": lambda: (aten.var_mean.correction, (_r(4, 6),), {}),
    "logsumexp": lambda: (aten.logsumexp.default, (_r(4, 6, 2), [2], False), {}),
    "prod_dim": lambda: (aten.prod.dim_int, (_r(4, 6), 1), {}),
    "cumprod": lambda: (aten.cumprod.default, (_unit(4, 6) + 0.5, 0), {}),
    "cumsum": lambda: (aten.cumsum.default, (_r(4, 6), 1), {}),
    "cumsum_int": lambda: (aten.cumsum.default, (_indices(4, 6), 0), {}),
    "topk": lambda: (aten.topk.default, (_r(4, 6), 2), {}),  # along the last dim
    "topk_dim0_smallest": lambda: (aten.topk.default, (_r(4, 6, 2), 3, 0, False), {}),
    "sort": lambda: (aten.sort.default, (_r(4, 6), 0, True), {}),
    "sort_stable": lambda: (aten.sort.stable, (_r(4, 6),), {"stable": True, "dim": 1}),
    "cummax": lambda: (aten.cummax.default, (_r(4, 6), 1), {}),
    "cummin": lambda: (aten.cummin.default, (_r(4, 6, 2), 0), {}),
    "kthvalue": lambda: (aten.kthvalue.default, (_r(4, 6), 2, 1, True), {}),
    "median_dim": lambda: (aten.median.dim, (_r(4, 6), 0), {}),
    "nanmedian_dim": lambda: (aten.nanmedian.dim, (_r(4, 6), 1, True), {}),
    "mode": lambda: (aten.mode.default, (_indices(4, 6), 1), {}),
    "safe_softmax": lambda: (aten._safe_softmax.default, (_r(4, 6), 1), {}),
    "log_softmax": lambda: (aten._log_softmax.default, (_r(4, 6), 0, False), {}),
    "log_softmax_backward": lambda: (aten._log_softmax_backward_data.default,
                                     (_r(4, 6), _r(4, 6, seed=1).log_softmax(1), 1, torch.float32), {}),
    "nll_mean": lambda: (aten.nll_loss_forward.default,
                         (_r(8, 6).log_softmax(1), _targets(8, 6), None, 1, -100), {}),
    "nll_backward_mean": lambda: (aten.nll_loss_backward.default,
                                  (_r(), _r(8, 6), _targets(8, 6), None, 1, -100, torch.tensor(7.0)), {}),
    "mse_mean": lambda: (aten.mse_loss.default, (_r(4, 6), _r(4, 6, seed=1), 1), {}),
    "multi_margin_mean": lambda: (aten.multi_margin_loss.default, (_r(8, 6), _classes(8, 6), 1, 1.0, None, 1), {}),
    "multi_margin_backward_mean": lambda: (aten.multi_margin_loss_backward.default,
                                           (_r(), _r(8, 6), _classes(8, 6), 1, 1.0, None, 1), {}),
    # batch norm: inference (running statistics) and training (batch statistics)
    "batch_norm_eval": lambda: (aten.native_batch_norm.default,
                                (_r(4, 6, 3, 3), *_bn_args(), False, 0.1, 1e-5), {}),
    "batch_norm_eval_2d_no_affine": lambda: (aten.native_batch_norm.default,
                                             (_r(8, 6), *_bn_args(affine=False), False, 0.1, 1e-5), {}),
    "batch_norm_legit_no_training": lambda: (aten._native_batch_norm_legit_no_training.default,
                                             (_r(4, 6, 3, 3), *_bn_args(), 0.1, 1e-5), {}),
    "batch_norm_functional_eval": lambda: (aten._native_batch_norm_legit_functional.default,
                                           (_r(4, 6, 3), *_bn_args(), False, 0.1, 1e-5), {}),
    "batch_norm_train_no_stats": lambda: (aten.native_batch_norm.default,
                                          (_r(4, 6, 3, 3), *_bn_args()[:2], None, None, True, 0.1, 1e-5), {}),
    "batch_norm_legit_no_stats": lambda: (aten._native_batch_norm_legit.no_stats,
                                          (_r(4, 6, 3), *_bn_args()[:2], True, 0.1, 1e-5), {}),
    "batch_norm_functional_train": lambda: (aten._native_batch_norm_legit_functional.default,
                                            (_r(4, 6, 3), *_bn_args(), True, 0.1, 1e-5), {}),
    "batch_norm_backward_eval": lambda: _bn_backward(False),
    "batch_norm_backward_train": lambda: _bn_backward(True),
    # grouped (depthwise) convolution, embedding with a padding row
    "conv_depthwise": lambda: (aten.convolution.default,
                               (_r(2, 4, 3, 3), _r(8, 1, 3, 3), _r(8), [1, 1], [1, 1], [1, 1],
                                False, [0, 0], 4), {}),
    "conv_depthwise_transposed": lambda: (aten.convolution.default,
                                          (_r(2, 4, 2, 2), _r(4, 2, 2, 2), None, [1, 1], [0, 0], [1, 1],
                                           True, [0, 0], 4), {}),
    "conv_depthwise_backward": lambda: (aten.convolution_backward.default,
                                        (_r(2, 4, 3, 3), _r(2, 4, 3, 3), _r(4, 1, 3, 3), [4], [1, 1],
                                         [1, 1], [1, 1], False, [0, 0], 4, [True, True, True]), {}),
    "embedding_backward_padding_idx": lambda: (aten.embedding_dense_backward.default,
                                               (_r(2, 4, 6), _indices(2, 4), 10, 2, False), {}),
    # factories
    "fill_scalar": lambda: (aten.fill.Scalar, (_r(4, 6), 1.0), {}),
    "fill_scalar_zero": lambda: (aten.fill.Scalar, (_r(4, 6), 0), {}),
    "fill_tensor": lambda: (aten.fill.Tensor, (_r(4, 6), torch.tensor(2.5)), {}),
    "full_like_zero": lambda: (aten.full_like.default, (_r(4, 6), 0.0), {}),
})


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_every_claimed_signature_holds_on_synthetic_calls(name):
    op, args, kwargs = SYNTHETIC[name]()
    node, inputs = make_node(op, *args, **kwargs)
    assert signatures_1d(node)[0].inputs == (B,) * len(inputs)
    check_node(node, inputs, MESHES)


# ---------------------------------------------------------------- what the rules claim

def _claims(op, *args, **kwargs):
    node, _ = make_node(op, *args, **kwargs)
    return {str(s) for s in signatures_1d(node)}


def test_integer_sums_may_be_partial_and_booleans_never_are():
    """A count over a split batch (``mask.sum()``: int64) is a partial sum, exact, so a
    label-smoothed cross-entropy's count of the targets not ignored all-reduces as a scalar;
    an ``add`` of booleans is an or, never claimed ``P``."""
    assert "S0->P" in _claims(aten.sum.default, _mask(4, 6))
    assert "P,P->P" in _claims(aten.add.Tensor, _indices(4, 6), _indices(4, 6))
    assert not any("P" in s for s in _claims(aten.add.Tensor, _mask(4, 6), _mask(4, 6)))
    # a cast rounds each rank's piece alone: a floating P never becomes an integer P
    assert "P->P" in _claims(aten._to_copy.default, _indices(4, 6), dtype=torch.float32)
    assert "P->P" not in _claims(aten._to_copy.default, _r(4, 6), dtype=torch.int8)
    assert "B,P->P" not in _claims(aten.copy.default, _indices(4, 6), _r(4, 6))


def test_a_tensor_read_twice_is_partial_at_both_readings_or_at_neither():
    """``mul(g, g)`` (AdamW's squared gradient) as ``(B),(P)->(P)`` sums ``g * g_i`` over the
    ranks: where ``g`` is rounding noise (a key bias's gradient, which softmax cancels) that
    sum came out negative, and AdamW's ``sqrt`` of it made every loss NaN (a random plan of
    an HF BERT on (3,)). ``mul(g, h)`` keeps those signatures."""
    graph = torch.fx.Graph()
    g, h = graph.placeholder("g"), graph.placeholder("h")
    g.meta["val"], h.meta["val"] = torch.empty(4, 6), torch.empty(4, 6)
    square = graph.call_function(aten.mul.Tensor, (g, g))
    product = graph.call_function(aten.mul.Tensor, (g, h))
    for node in (square, product):
        node.meta["val"] = torch.empty(4, 6)
    squares = {str(s) for s in signatures_nd(square, (2,))}
    products = {str(s) for s in signatures_nd(product, (2,))}
    mixed = {"(B),(P)->(P)", "(P),(B)->(P)"}
    assert mixed <= products and squares == products - mixed
    squares_2d = {str(s) for s in signatures_nd(square, (2, 2))}
    assert squares_2d and not any("(B, P),(P, P)" in s or "(P, B),(B, B)" in s for s in squares_2d)


def test_matmul_claims_the_six_signatures():
    assert _claims(aten.mm.default, _r(4, 6), _r(6, 8)) == {
        "S0,B->S0", "B,S1->S1", "S1,S0->P", "P,B->P", "B,P->P", "B,B->B"}
    node, _ = make_node(aten.mm.default, _r(4, 6), _r(6, 8))
    mixed = [s for s in signatures_nd(node, (2, 2)) if str(s) == "(S0, S1),(B, S0)->(S0, P)"]
    assert [str(s.axis(1)) for s in mixed] == ["S1,S0->P"]
    assert _claims(aten.addmm.default, _r(8), _r(4, 6), _r(6, 8)) == {
        "B,S0,B->S0", "S0,B,S1->S1", "P,S1,S0->P", "P,P,B->P", "P,B,P->P", "B,B,B->B"}


def test_elementwise_partial_only_where_linear():
    add = _claims(aten.add.Tensor, _r(4, 6), _r(6))
    assert "P,P->P" in add and "P,B->P" not in add and "S0,B->S0" in add
    assert not any("P" in s for s in _claims(aten.add.Tensor, _r(4, 6), 1.0))
    assert {"P,B->P", "B,P->P"} < _claims(aten.mul.Tensor, _r(4, 6), _r(4, 6))
    assert "P,P->P" not in _claims(aten.mul.Tensor, _r(4, 6), _r(4, 6))
    div = _claims(aten.div.Tensor, _r(4, 6), _r(4, 6))
    assert "P,B->P" in div and "B,P->P" not in div
    assert not any("P" in s for s in _claims(aten.gelu.default, _r(4, 6)))


def test_view_splits_only_outermost_component():
    merge = _claims(aten.view_copy.default, _r(4, 6, 2), [24, 2])
    assert {"S0->S0", "S2->S1"} < merge and "S1->S0" not in merge
    split = _claims(aten.view_copy.default, _r(24), [4, 6])
    assert split == {"B->B", "P->P", "S0->S0"}


def test_loss_reduction_decides_batch_split():
    x, t = _r(8, 6).log_softmax(1), _targets(8, 6)
    mean = _claims(aten.nll_loss_forward.default, x, t, None, 1, -100)
    assert mean == {"B,B->B,B", "P,B->P,B"}
    assert "S0,S0->P,P" in _claims(aten.nll_loss_forward.default, x, t, None, 2, -100)
    backward = _claims(aten.nll_loss_backward.default, _r(), x, t, None, 1, -100, torch.tensor(7.0))
    assert "B,S0,S0,B->S0" in backward


def test_embedding_claims():
    claims = _claims(aten.embedding.default, _r(10, 4), _indices(8))
    assert claims == {"B,B->B", "B,S0->S0", "S1,B->S1", "P,B->P"}
    grad = _claims(aten.embedding_dense_backward.default, _r(8, 4), _indices(8), 10, -1, False)
    assert "S0,S0->P" in grad


def test_factories():
    assert _claims(aten.zeros.default, [4, 6]) == {"->B", "->P", "->S0", "->S1"}
    assert _claims(aten.full.default, [4, 6], 2.0) == {"->B", "->S0", "->S1"}
    assert "P->B" in _claims(aten.ones_like.default, _r())
    assert _claims(aten.arange.default, 8) == {"->B"}
    # new_* read only self's dtype and device: self may come split any way (T5 and BART
    # shift their labels into input_ids.new_zeros(input_ids.shape), the batch split)
    assert {"S0->S0", "S1->S0", "S0->S1", "P->B", "B->P"} <= _claims(aten.new_zeros.default, _r(4, 6), [4, 6])


def test_pointwise_ops_are_elementwise_by_tag():
    """Every functional pointwise overload has the elementwise rule by its tag (these few
    are named nowhere); in-place and out= overloads get none."""
    unnamed = {aten.atan2.default: (_r(4, 6), _r(6, seed=1)), aten.hypot.default: (_r(4, 6), _r(4, 1)),
               aten.logaddexp.default: (_r(4, 6), _r(4, 6, seed=1)),
               aten.special_i0e.default: (_r(4, 6),), aten.copysign.Tensor: (_r(4, 6), _r(6, seed=1)),
               aten.fmod.Scalar: (_r(4, 6), 0.7), aten.isnan.default: (_r(4, 6),),
               aten.bitwise_xor.Scalar_Tensor: (5, _indices(4, 6))}
    for op, args in unnamed.items():
        assert op not in RULES and rule_for(op) is elementwise, op
        node, inputs = make_node(op, *args)
        assert len(signatures_1d(node)) > 1
        check_node(node, inputs, ((2,), (2, 2)), nd_limit=4)
    for op in (aten.sin_.default, aten.sin.out, aten.add_.Tensor, aten.add.out, aten.masked_fill_.Scalar):
        assert rule_for(op) is None, op
    everything = [getattr(packet, name) for packet in map(lambda n: getattr(aten, n), dir(aten))
                  if isinstance(packet, torch._ops.OpOverloadPacket) for name in packet.overloads()]
    pointwise = [op for op in everything if torch.Tag.pointwise in op.tags and is_functional(op)]
    assert len(pointwise) > 200
    assert all(rule_for(op) is not None for op in pointwise)


def test_pointwise_claims():
    assert _claims(aten.tanh_backward.default, _r(4, 6), _r(4, 6)) >= {"P,B->P", "S0,S0->S0"}
    assert "B,P->P" not in _claims(aten.tanh_backward.default, _r(4, 6), _r(4, 6))
    assert not any("P" in s for s in _claims(aten.sin.default, _r(4, 6)))
    assert not any("P" in s for s in _claims(aten.ge.Tensor, _r(4, 6), _r(4, 6)))   # bool output
    assert "P,B->P" in _claims(aten.masked_fill.Scalar, _r(4, 6), _mask(4, 6), 0.0)
    assert not any("P" in s for s in _claims(aten.masked_fill.Scalar, _r(4, 6), _mask(4, 6), -1e4))
    assert _claims(aten.native_dropout.default, _r(4, 6), 0.1, True) == {
        "B->B,B", "P->P,B", "S0->S0,S0", "S1->S1,S1"}
    assert _claims(aten.bernoulli.p, _r(4, 6), 0.1) == {"B->B", "P->B", "S0->S0", "S1->S1"}
    assert _claims(aten.randn.default, [4, 6]) == {"->B", "->S0", "->S1"}
    assert _claims(aten.empty.memory_format, [4, 6]) == {"->B", "->S0", "->S1"}


def test_batch_norm_and_depthwise_claims():
    x, (w, b, rm, rv) = _r(4, 6, 3, 3), _bn_args()
    inference = _claims(aten.native_batch_norm.default, x, w, b, rm, rv, False, 0.1, 1e-5)
    assert {"S0,B,B,B,B->S0,B,B", "S1,S0,S0,S0,S0->S1,B,B", "S3,B,B,B,B->S3,B,B",
            "P,B,P,P,B->P,B,B"} < inference
    training = _claims(aten.native_batch_norm.default, x, w, b, None, None, True, 0.1, 1e-5)
    assert training == {"B,B,B->B,B,B", "S1,S0,S0->S1,S0,S0"}
    op, args, _ = _bn_backward(False)
    assert {"S0,S0,B,B,B,B,B->S0,P,P", "P,B,B,B,B,B,B->P,P,P"} < _claims(op, *args)
    depthwise = _claims(aten.convolution.default, _r(2, 4, 3, 3), _r(8, 1, 3, 3), _r(8),
                        [1, 1], [1, 1], [1, 1], False, [0, 0], 4)
    assert "S1,S0,S0->S1" in depthwise
    grouped = _claims(aten.convolution.default, _r(2, 4, 3, 3), _r(6, 2, 3, 3), _r(6),
                      [1, 1], [1, 1], [1, 1], False, [0, 0], 2)
    assert not any("S1" in s for s in grouped)   # 2 channels a group: pieces could cut a group


def test_indexing_and_view_claims():
    assert "S0,S0->S0" in _claims(aten.gather.default, _r(4, 6), 1, _indices(4, 3, vocab=6))
    assert "S0,S0->S0" not in _claims(aten.gather.default, _r(4, 6), 1, _indices(2, 3, vocab=6))
    assert "B,S0->S1" in _claims(aten.index_select.default, _r(4, 6), 1, _indices(4, vocab=6))
    assert not any("S1" in s.split("->")[0] for s in _claims(aten.cumsum.default, _r(4, 6), 1))
    assert _claims(aten.triu.default, _r(2, 4, 6)) == {"B->B", "P->P", "S0->S0"}
    assert "S1->S1" not in _claims(aten.constant_pad_nd.default, _r(4, 6), [1, 0], 0.0)
    assert "P->P" not in _claims(aten.constant_pad_nd.default, _r(4, 6), [1, 0], 1.0)
    assert "S1->S1" not in _claims(aten.repeat.default, _r(4, 6), [1, 2])


def test_index_add_claims():
    # a mixture of experts' combine: each rank adds the rows of its tokens (P); an
    # overwrite or an amax never splits along the index
    added = _claims(aten.index_add.default, _r(6, 4), 0, _indices(8, vocab=6), _r(8, 4))
    assert {"P,S0,S0->P", "S1,B,S1->S1", "P,B,P->P"} <= added
    copied = _claims(aten.index_copy.default, _r(6, 4), 0, torch.tensor([4, 1, 3]), _r(3, 4))
    assert copied == {"B,B,B->B", "S1,B,S1->S1"}
    assert _claims(aten.scatter_reduce.two, _r(6, 4), 0, _indices(8, 4, vocab=6), _r(8, 4), "amax") \
        == {"B,B,B->B", "S1,S1,S1->S1"}


def test_count_nonzero_claims():
    # a count over a split dim adds up (an integer P); a P input does not
    claims = _claims(aten.count_nonzero.dim_IntList, _indices(4, 6, vocab=3), [1])
    assert {"S0->S0", "S1->P"} <= claims and "P->P" not in claims
    # a log-sum-exp scan splits the other dims only
    assert _claims(aten.logcumsumexp.default, _r(4, 6), 1) == {"B->B", "S0->S0"}


def test_diagonal_claims():
    # the batch of a batch of matrices splits; the pair of dims and the diagonal never
    assert _claims(aten.diagonal_copy.default, _r(3, 4, 4), 0, 1, 2) == {"B->B", "S0->S0", "P->P"}
    assert _claims(aten.diag_embed.default, _r(3, 4)) == {"B->B", "S0->S0", "P->P"}
    assert _claims(aten.diagonal_backward.default, _r(3, 4), [3, 4, 4], 0, 1, 2) == {"B->B", "S0->S0", "P->P"}


def test_searchsorted_claims():
    assert _claims(aten.searchsorted.Tensor, torch.linspace(-2, 2, 9), _r(4, 6)) == {"B,B->B", "B,S0->S0",
                                                                                    "B,S1->S1"}
    assert _claims(aten.searchsorted.Tensor, torch.sort(_r(4, 9)).values, _r(4, 6)) == {"B,B->B", "S0,S0->S0",
                                                                                       "B,S1->S1"}


def test_cdist_claims():
    # either set of rows splits the distances; the gradient of x1 sums over x2's rows
    assert {"S0,B->S0", "B,S0->S1"} <= _claims(aten._cdist_forward.default, _r(6, 3), _r(4, 3), 2.0, None)
    assert {"S2,B,S1,S2->P", "S1,S1,B,S1->S1"} <= _claims(aten._cdist_backward.default, *_cdist_backward_args())


def test_index_put_claims():
    # the backward of weight[ids] (Whisper's positions, Swin's relative position bias):
    # ids and values split together, each rank adds its part (P); an overwrite never
    # splits its indices (the ranks would each keep the others' old values)
    ids = _indices(4, 8, vocab=10)
    added = _claims(aten.index_put.default, _r(10, 6), [ids], _r(4, 8, 6), True)
    assert {"P,S0,S0->P", "P,S1,S1->P", "S1,B,S2->S1"} <= added
    written = _claims(aten.index_put.default, _r(10, 6), [ids], _r(4, 8, 6), False)
    assert written == {"B,B,B->B", "P,B,P->P", "S1,B,S2->S1"}


def test_empty_splits_like_other_sized_factories():
    """Checked with uninitialized memory filled deterministically (integers: the max value)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for op, args in ((aten.empty.memory_format, ([4, 6],)), (aten.new_empty.default, (_r(2), [4, 6]))):
            node, inputs = make_node(op, *args, dtype=torch.int64)
            outputs = {s.outputs for s in signatures_1d(node)}
            assert outputs == {(B,), (S(0),), (S(1),)}    # never P: the values are undefined
            check_node(node, inputs, MESHES)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_localize_args_rewrites_shape_arguments():
    node, _ = make_node(aten.view_copy.default, _r(4, 6), [24])
    assert localize_args(node, [(2, 6)], [(12,)]) == ((node.args[0], [12]), {})
    node, _ = make_node(aten.full.default, [4, 6], 2.0)
    assert localize_args(node, [], [(4, 3)])[0] == ([4, 3], 2.0)
    op, args, kwargs = SYNTHETIC["conv_backward_no_input_grad"]()
    node, _ = make_node(op, *args, **kwargs)
    assert localize_args(node, [(2, 3, 5, 5), (2, 4, 5, 5), (3, 4, 3, 3)], [None, None, None])[0][3] == [3]
    node, _ = make_node(aten.slice_backward.default, _r(4, 2, 6), [4, 4, 6], 1, 2, INT_MAX, 1)
    assert localize_args(node, [(2, 2, 6)], [(2, 4, 6)])[0][1] == [2, 4, 6]
    node, _ = make_node(aten.repeat.default, _r(4, 1, 6), [2, 1, 4, 1])
    assert localize_args(node, [(4, 1, 3)], [(1, 4, 4, 3)])[0][1] == [1, 1, 4, 1]
    op, args, kwargs = SYNTHETIC["conv_depthwise_backward"]()
    node, _ = make_node(op, *args, **kwargs)
    (_, _, _, bias_sizes, *_, groups, _), _ = localize_args(
        node, [(2, 2, 3, 3), (2, 2, 3, 3), (2, 1, 3, 3)], [None, None, None])
    assert (bias_sizes, groups) == ([2], 2)


#: Ops whose output values are undefined (uninitialized memory): only their rule data is tested.
UNDEFINED_VALUES = {aten.empty_like.default, aten.empty.memory_format, aten.new_empty.default}


def test_mobilenet_style_cnn_has_rules_that_hold(examples):
    """Batch norm in inference, depthwise convolution, ReLU6 (hardtanh), F.pad and SiLU
    traced in a training step: no op falls back, and every claimed signature holds of the
    ops the example graphs lack (and of the depthwise convolutions)."""
    in_examples = {n.target for gm, _ in examples.values() for n in gm.graph.nodes}
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU6(),
                          nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.BatchNorm2d(4), nn.ReLU6(),
                          nn.ZeroPad2d(1), nn.Conv2d(4, 8, 1), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 5)).eval()
    for m in model.modules():   # non-trivial running statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
    batch = (torch.randn(4, 3, 4, 4), torch.randint(0, 5, (4,)))
    gm = ddlc.trace(model, batch, torch.nn.functional.cross_entropy,
                    torch.optim.SGD(model.parameters(), lr=0.1))
    assert fallback_ops(gm) == []
    sig = gm.meta["ddlc_step"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    env = capture_values(gm, sig.flatten(params, dict(model.named_buffers()), {}, batch))
    seen, failures = set(), []
    for node in gm.graph.nodes:
        is_op = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        key = (node.target, tuple(signatures_1d(node))) if is_op else None
        if key is None or key in seen or node.target in UNDEFINED_VALUES \
                or (node.target in in_examples and bind(node).get("groups", 1) == 1):
            continue
        seen.add(key)
        try:
            check_node(node, node_inputs(node, env), ((2,), (2, 2)), nd_limit=6)
        except Exception as exc:
            failures.append(_failure(node, exc))
    assert not failures, "\n".join(failures)
    assert {aten.native_batch_norm.default, aten.native_batch_norm_backward.default,
            aten.convolution.default, aten.convolution_backward.default, aten.hardtanh.default,
            aten.constant_pad_nd.default, aten.silu.default} <= {target for target, _ in seen}


# ---------------------------------------------------------------- the checker can fail

def _nd(*entries):
    return tuple(None if x is None else NdSBP((x,)) for x in entries)


WRONG = {
    "softmax over its split dim": (aten._softmax.default, (_r(4, 6), 1, False), ((S(1),), (S(1),))),
    "add(P, B) -> P": (aten.add.Tensor, (_r(4, 6), _r(4, 6, seed=1)), ((P, B), (P,))),
    "mul(P, P) -> P": (aten.mul.Tensor, (_r(4, 6), _r(4, 6, seed=1)), ((P, P), (P,))),
    "view of an inner dim": (aten.view_copy.default, (_r(4, 6), [24]), ((S(1),), (S(0),))),
    "mean over a split dim -> P": (aten.mean.dim, (_r(4, 6), [0]), ((S(0),), (P,))),
    "nll mean over a split batch -> P": (
        aten.nll_loss_forward.default, (_r(8, 6).log_softmax(1), _targets(8, 6), None, 1, -100),
        ((S(0), S(0)), (P, P))),
    "causal attention over split queries": (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        (_r(2, 4, 8, 8), _r(2, 4, 8, 8, seed=1), _r(2, 4, 8, 8, seed=2), 0.0, True),
        ((S(2), B, B), (S(2), S(2)))),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_checker_rejects_a_wrong_rule(name):
    op, args, (ins, outs) = WRONG[name]
    node, inputs = make_node(op, *args)
    wrong = NdSignature(_nd(*ins), _nd(*outs))
    assert wrong not in signatures_nd(node, (2,))
    with pytest.raises(AssertionError):
        check_signature(node, wrong, (2,), inputs)


# ---------------------------------------------------------------- property-based shapes

DIMS = st.sampled_from([1, 2, 3, 4, 6, 8])
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
          aten.rsub.Tensor, aten.lerp.Scalar]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shape=st.lists(DIMS, min_size=0, max_size=3), data=st.data())
def test_elementwise_broadcasting_property(shape, data):
    op = data.draw(st.sampled_from(BINARY))
    other = [data.draw(st.sampled_from([1, n])) for n in shape][data.draw(st.integers(0, len(shape))):]
    args = (_r(*shape), _r(*other, seed=1) + 2) + ((0.3,) if op is aten.lerp.Scalar else ())
    if data.draw(st.booleans()):
        args = (args[1], args[0]) + args[2:]
    node, inputs = make_node(op, *args)
    check_node(node, inputs, MESHES, nd_limit=8)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(b=DIMS, m=DIMS, k=DIMS, n=DIMS, data=st.data())
def test_matmul_property(b, m, k, n, data):
    op = data.draw(st.sampled_from(["mm", "addmm", "bmm", "baddbmm"]))
    calls = {"mm": (aten.mm.default, (_r(m, k), _r(k, n))),
             "addmm": (aten.addmm.default, (_r(n), _r(m, k), _r(k, n))),
             "bmm": (aten.bmm.default, (_r(b, m, k), _r(b, k, n))),
             "baddbmm": (aten.baddbmm.default, (_r(b, 1, n), _r(b, m, k), _r(b, k, n)))}
    op, args = calls[op]
    node, inputs = make_node(op, *args)
    check_node(node, inputs, MESHES, nd_limit=8)


def _regroup(draw, factors):
    cuts = sorted(draw(st.sets(st.integers(1, len(factors) - 1)))) if len(factors) > 1 else []
    bounds = zip([0] + cuts, cuts + [len(factors)])
    return [int(torch.tensor(factors[a:b]).prod()) for a, b in bounds]


@st.composite
def reshapes(draw):
    """Two shapes of equal size: groupings of the same factors (in either order)."""
    factors = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=5))
    other = draw(st.permutations(factors)) if draw(st.booleans()) else factors
    return _regroup(draw, factors), _regroup(draw, other)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(shapes=reshapes())
def test_reshape_property(shapes):
    src, dst = shapes
    node, inputs = make_node(aten.view_copy.default, _r(*src), dst)
    check_node(node, inputs, MESHES, nd_limit=8)


# ---------------------------------------------------------------- fallback, speed, GPU data

def test_unknown_op_falls_back_to_all_b_and_logs_once():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ddlc.rules")
    logger.addHandler(handler)
    try:
        for n in (5, 7):
            node, _ = make_node(aten.rot90.default, _r(n, 3), 1, [0, 1])
            assert signatures_1d(node) == [Signature((B,), (B,))]
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "no SBP rule for aten.rot90.default: it falls back to all-B"]
    assert fallback_ops(torch.fx.GraphModule({}, node.graph)) == ["aten.rot90.default"]


def test_enumeration_is_repeatable_on_a_6_layer_gpt():
    """A second enumeration (from the caches) gives the first's signatures. Its speed, cold
    and warm, is measured by ``bench/rules.py`` (on 12 layers)."""
    model = GPT(vocab=128, d_model=64, n_heads=4, n_layers=6, seq_len=32)
    batch = (torch.randint(0, 128, (8, 32)),) * 2
    gm = ddlc.trace(model, batch, lm_loss, torch.optim.AdamW(model.parameters()))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(nodes) > 1000
    first = [signatures_nd(n, (2, 4)) for n in nodes]
    assert [signatures_nd(n, (2, 4)) for n in nodes] == first


def _meta(*shape):
    return torch.empty(*shape, device="meta")


def _gpu_attention_nodes():
    """GPU attention calls on meta tensors (their kernels cannot run on this CPU build)."""
    q, lse, e = _meta(2, 4, 16, 8), _meta(2, 4, 16), _meta(0)
    grads = (q, q, q)
    return [
        make_node(aten._scaled_dot_product_flash_attention.default, q, q, q)[0],
        make_node(aten._scaled_dot_product_efficient_attention.default, q, q, q, None, True)[0],
        make_node(aten._scaled_dot_product_cudnn_attention.default, q, q, q, None, True)[0],
        make_node(aten._scaled_dot_product_flash_attention_backward.default,
                  q, q, q, q, q, lse, e, e, 16, 16, 0.0, False, e, e, val=grads)[0],
        make_node(aten._scaled_dot_product_efficient_attention_backward.default,
                  q, q, q, q, None, q, _meta(2, 4, 32), e, e, 0.0, [True, True, True, False],
                  val=grads + (e,))[0],
        make_node(aten._scaled_dot_product_cudnn_attention_backward.default,
                  q, q, q, q, q, _meta(2, 4, 16, 1), e, e, e, e, e, 16, 16, 0.0, False,
                  val=grads)[0],
    ]


def test_gpu_attention_rule_data_is_consistent():
    for node in _gpu_attention_nodes():
        sigs = signatures_1d(node)
        n_in, leaves = len(tensor_inputs(node)), tree_leaves(node.meta["val"])
        assert all(len(s.inputs) == n_in and len(s.outputs) == len(leaves) for s in sigs)
        main = [i for i, a in enumerate(tensor_inputs(node)) if a.meta["val"].shape[:2] == (2, 4)]
        for d in (0, 1):  # batch and heads split every [b, h, ...] tensor, the rest stay B
            (sig,) = [s for s in sigs if S(d) in s.inputs]
            assert [i for i, x in enumerate(sig.inputs) if x == S(d)] == main
            assert sig.outputs[0] == S(d)
            assert all(x in (None, B, S(d)) for x in sig.outputs)
        is_backward = "backward" in str(node.target)
        assert any(P in s.outputs for s in sigs) == is_backward
        assert not any(S(2) in s.inputs or S(3) in s.inputs for s in sigs)


def test_leaves_and_map_leaves_are_pytree_s_over_fx_arguments():
    """``ddlc.ir.leaves`` / ``map_leaves`` walk fx's containers themselves: the same leaves
    in the same order as ``tree_leaves``, and the same containers as ``tree_map``."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list
    from torch.utils._pytree import tree_leaves, tree_map

    from ddlc.ir import leaves, map_leaves
    t = torch.zeros(2)
    trees = [None, 1, (1, None, [t, 2.0]), {"a": (t, None), "b": [slice(1, 2)]},
             immutable_list([1, immutable_dict(x=t)]), torch.return_types.max((t, t)),
             (torch.float32, "s", True), ()]
    tag = lambda x: ("leaf", type(x).__name__)   # noqa: E731
    for tree in trees:
        assert [id(x) for x in leaves(tree)] == [id(x) for x in tree_leaves(tree)]
        mine, theirs = map_leaves(tag, tree), tree_map(tag, tree)
        assert mine == theirs and type(mine) is type(theirs)
