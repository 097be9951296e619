"""SBP rules: every claimed signature holds on simulated shards (passes.rules.checker).

(a) every node of the example training steps, with real values captured by running
the traced step; (b) synthetic calls of the ops the examples do not reach; (c)
hypothesis shapes for the elementwise, matmul and reshape families; plus proofs
that the checker rejects wrong rules, the fallback, repeatable enumeration on a large
graph (its speed: bench/rules.py) and the GPU rule data.
"""
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
from passes.rules import (NdSignature, Signature, fallback_ops, localize_args, signatures_1d,
                          signatures_nd, tensor_inputs)
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


@pytest.fixture(scope="module")
def examples():
    return {case: _trace_case(case) for case in CASES}


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
    "mse_sum": lambda: (aten.mse_loss.default, (_r(4, 6), _r(4, 6, seed=1), 2), {}),
    "mse_backward_sum": lambda: (aten.mse_loss_backward.default,
                                 (_r(), _r(4, 6), _r(4, 6, seed=1), 2), {}),
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


def test_localize_args_rewrites_shape_arguments():
    node, _ = make_node(aten.view_copy.default, _r(4, 6), [24])
    assert localize_args(node, [(2, 6)], [(12,)]) == ((node.args[0], [12]), {})
    node, _ = make_node(aten.full.default, [4, 6], 2.0)
    assert localize_args(node, [], [(4, 3)])[0] == ([4, 3], 2.0)
    op, args, kwargs = SYNTHETIC["conv_backward_no_input_grad"]()
    node, _ = make_node(op, *args, **kwargs)
    assert localize_args(node, [(2, 3, 5, 5), (2, 4, 5, 5), (3, 4, 3, 3)], [None, None, None])[0][3] == [3]


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
            node, _ = make_node(aten.cumsum.default, _r(n, 3), 0)
            assert signatures_1d(node) == [Signature((B,), (B,))]
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "no SBP rule for aten.cumsum.default: it falls back to all-B"]
    assert fallback_ops(torch.fx.GraphModule({}, node.graph)) == ["aten.cumsum.default"]


def test_enumeration_is_repeatable_on_a_12_layer_gpt():
    """A second enumeration (from the caches) gives the first's signatures. Its speed, cold
    and warm, is measured by ``bench/rules.py``."""
    model = GPT(vocab=128, d_model=64, n_heads=4, n_layers=12, seq_len=32)
    batch = (torch.randint(0, 128, (8, 32)),) * 2
    gm = ddlc.trace(model, batch, lm_loss, torch.optim.AdamW(model.parameters()))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(nodes) > 3000
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
