"""passes/views.py: view copies run as views, and every reader that needs a contiguous
tensor of its own still gets one."""
from __future__ import annotations


import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functionalize

import ddlc
from ddlc.ir import collective_sequence
from ddlc.simulate import lower_ranks, run_ranks
from passes.views import views_as_views

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def functional(fn, *args) -> fx.GraphModule:
    """``fn`` traced as ddlc traces a step: views become ``*_copy`` operators."""
    return make_fx(functionalize(fn, remove="mutations_and_views"), tracing_mode="fake")(*args)


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_transposed_weight_feeding_a_matmul_is_a_view():
    gm = functional(lambda x, w: (x @ w.t()).relu(), torch.randn(4, 3), torch.randn(5, 3))
    assert aten.t_copy.default in targets(gm)
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    want = gm(x, w)
    views_as_views(gm)
    assert aten.t.default in targets(gm) and aten.t_copy.default not in targets(gm)
    assert aten.clone.default not in targets(gm)   # mm takes the strided operand as it is
    # BLAS reads a transposed operand with another kernel than a copied one: the sums may
    # round differently (1 ulp on some draws), so equal up to float rounding, not bitwise
    torch.testing.assert_close(gm(x, w), want, rtol=1e-6, atol=1e-6)


def test_a_view_of_a_transposed_tensor_becomes_a_reshape():
    # x.t() is strided: viewing it flat is impossible, so that view copies (a reshape)
    gm = functional(lambda x: (x.t().reshape(-1) * 2), torch.randn(3, 4))
    x = torch.randn(3, 4)
    want = gm(x)
    views_as_views(gm)
    assert aten.t.default in targets(gm)
    assert aten.reshape.default in targets(gm)
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)


def test_an_output_that_is_a_view_gets_its_own_memory():
    gm = functional(lambda x: (x * 2).view(-1), torch.randn(3, 4))
    views_as_views(gm)
    x = torch.randn(3, 4)
    (out,) = [gm(x)]
    assert aten.reshape.default in targets(gm) and aten.clone.default in targets(gm)
    assert out._base is None   # not an alias of the product
    torch.testing.assert_close(out, (x * 2).view(-1))


def test_an_output_that_is_an_item_of_an_unsafe_split_gets_its_own_memory():
    """``unsafe_split``'s items are views of its input (its schema does not say so)."""
    gm = functional(lambda x: torch.unsafe_split(x * 2, 2)[0], torch.randn(4, 3))
    views_as_views(gm)
    x = torch.randn(4, 3)
    out = gm(x)
    assert aten.clone.default in targets(gm) and out._base is None
    torch.testing.assert_close(out, (x * 2)[:2])


def test_a_strided_tensor_is_made_contiguous_once_before_its_collective():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 6, device="meta")
    t = graph.call_function(aten.t_copy.default, (x,))
    t.meta["val"] = torch.empty(6, 4, device="meta")
    sums = []
    for _ in range(2):   # two collectives read it: one clone serves both
        issue = graph.call_function(c10d.all_reduce.default, (t, "sum", "axis0"))
        issue.meta["val"] = torch.empty(6, 4, device="meta")
        wait = graph.call_function(c10d.wait_tensor.default, (issue,))
        wait.meta["val"] = torch.empty(6, 4, device="meta")
        sums.append(wait)
    mm = graph.call_function(aten.mm.default, (t, x))   # reads the view as it is
    mm.meta["val"] = torch.empty(6, 6, device="meta")
    graph.output((sums[0], sums[1], mm))
    gm = views_as_views(fx.GraphModule(torch.nn.Module(), graph))
    assert t.target is aten.t.default
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == 1 and clones[0].args[0] is t
    issues = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    assert all(n.args[0] is clones[0] for n in issues)
    assert mm.args[0] is t


def test_layer_norm_backward_never_reads_strided_statistics():
    graph = fx.Graph()
    args = {}
    for name, shape in (("grad", (2, 3, 4)), ("x", (2, 3, 4)), ("mean", (2, 3, 1)), ("rstd", (3, 2, 1))):
        args[name] = graph.placeholder(name)
        args[name].meta["val"] = torch.empty(shape, device="meta")
    rstd = graph.call_function(aten.transpose_copy.int, (args["rstd"], 0, 1))
    rstd.meta["val"] = torch.empty(2, 3, 1, device="meta")
    back = graph.call_function(aten.native_layer_norm_backward.default,
                               (args["grad"], args["x"], [4], args["mean"], rstd, None, None,
                                [True, False, False]))
    back.meta["val"] = (torch.empty(2, 3, 4, device="meta"), None, None)
    first = graph.call_function(__import__("operator").getitem, (back, 0))
    first.meta["val"] = torch.empty(2, 3, 4, device="meta")
    graph.output((first,))
    gm = views_as_views(fx.GraphModule(torch.nn.Module(), graph))
    read = next(n for n in gm.graph.nodes if n.target is aten.native_layer_norm_backward.default).args[4]
    assert read.target is aten.clone.default and read.args[0].target is aten.transpose.int
    inputs = [torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 1), torch.rand(3, 2, 1) + 0.5]
    want = aten.native_layer_norm_backward.default(
        inputs[0], inputs[1], [4], inputs[2], inputs[3].transpose(0, 1).contiguous(), None, None,
        [True, False, False])[0]
    torch.testing.assert_close(gm(*inputs)[0], want)


def test_activation_backwards_whose_meta_strides_differ_from_cpus_get_contiguous_inputs():
    """softplus_backward of a transposed input (Mamba's ``softplus(dt.transpose(1, 2))``):
    the meta kernel lays the output out like the transposed input, the CPU kernel
    contiguous, so a view of it that the meta strides allow fails at run time. Its
    inputs are made contiguous first, where both kernels agree: the program runs and
    gives the functional graph's values."""
    def step(g, x):
        grad = aten.softplus_backward.default(g, x.transpose(1, 2), 1.0, 20.0)
        return grad.transpose(1, 2).view(8 * 16, 64)

    g, x = torch.randn(8, 64, 16), torch.randn(8, 16, 64)
    assert aten.softplus_backward.default(g, x.transpose(1, 2), 1.0, 20.0).stride() != \
        aten.softplus_backward.default(g.to("meta"), x.transpose(1, 2).to("meta"), 1.0, 20.0).stride()
    gm = functional(step, g, x)
    want = gm(g, x)
    views_as_views(gm)
    back = next(n for n in gm.graph.nodes if n.target is aten.softplus_backward.default)
    assert back.args[1].target is aten.clone.default
    torch.testing.assert_close(gm(g, x), want)


def test_fused_attention_reads_dense_rows_and_no_more():
    """A query whose last dimension is strided (a convolution's channels permuted,
    reshaped into heads and transposed) gets a contiguous clone before the CPU flash
    kernel, which reads rows as dense and returns NaN otherwise; heads transposed out of
    a (batch, sequence, heads, dim) tensor keep their dense rows and stay views."""
    def step(c, x):
        strided = c.permute(0, 2, 1).reshape(2, 6, 4, 4).transpose(1, 2)  # last stride 6
        heads = x.view(2, 6, 4, 4).transpose(1, 2)                          # last stride 1
        out, _ = aten._scaled_dot_product_flash_attention_for_cpu.default(strided, heads, heads)
        return out

    c, x = torch.randn(2, 16, 6), torch.randn(2, 6, 16)
    gm = functional(step, c, x)
    want = gm(c, x)
    views_as_views(gm)
    attention = next(n for n in gm.graph.nodes
                     if n.target is aten._scaled_dot_product_flash_attention_for_cpu.default)
    query, key, value = attention.args
    assert query.target is aten.clone.default
    assert key is value and key.target is aten.transpose.int
    torch.testing.assert_close(gm(c, x), want)


def _embedding_bag_of_a_column(weight, idx):
    return aten._embedding_bag.default(weight, idx[:, 0], torch.arange(4), False, 0)[0]


def _embedding_bag_backward_of_a_column(grad, weight, idx):
    column, offsets = idx[:, 0], torch.arange(4)
    _, offset2bag, bag_size, max_indices = aten._embedding_bag.default(weight, column, offsets, False, 0)
    return aten._embedding_bag_backward.default(grad, column, offsets, offset2bag, bag_size,
                                                max_indices, 10, False, 0, False, None)


def _pdist_of_a_transpose(x):
    return aten._pdist_forward.default(x.t(), 2.0)


def _pdist_backward_of_a_transpose(grad, x):
    return aten._pdist_backward.default(grad, x.t(), 2.0, aten._pdist_forward.default(x.t(), 2.0))


def _complex_of_an_expanded_gradient(grad):
    return aten.view_as_complex.default(grad.unsqueeze(-1).expand(4, 6, 2))


def _group_norm_of_a_transpose(x):
    return aten.native_group_norm.default(x.transpose(1, 2), None, None, 2, 16, 6, 4, 1e-5)[0]


def _group_norm_backward_of_transposes(grad, x):
    xt = x.transpose(1, 2)
    _, mean, rstd = aten.native_group_norm.default(xt, torch.ones(16), None, 2, 16, 6, 4, 1e-5)
    return aten.native_group_norm_backward.default(grad.transpose(1, 2), xt, mean, rstd, torch.ones(16),
                                                   2, 16, 6, 4, [True, True, False])[:2]


def _group_norm_backward_of_a_channels_last_input(grad, x):
    xc = x.permute(0, 3, 1, 2)   # channels-last, the gradient contiguous
    _, mean, rstd = aten.native_group_norm.default(xc, None, None, 2, 8, 25, 4, 1e-5)
    return aten.native_group_norm_backward.default(grad, xc, mean, rstd, None, 2, 8, 25, 4,
                                                   [True, False, False])[0]


def _group_norm_of_a_size_one_dim(x):
    # channels-last by strides, contiguous by torch's suggested memory format: refused
    return aten.native_group_norm.default(x.transpose(1, 2).unsqueeze(-1), None, None, 2, 8, 6, 4, 1e-5)[0]


def _weight_norm_of_a_transpose(v, g):
    return aten._weight_norm_interface.default(v.t(), g, 0)[0]


def _attention_of_a_convolution_of_a_channels_last_view(x, w):
    # the CPU convolution of an NHWC image permuted to NCHW gives a channels-last output,
    # which its meta kernel calls contiguous: rows of length H * W read as dense (NaN)
    h = aten.convolution.default(x.permute(0, 3, 1, 2), w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    q = h.flatten(2).unsqueeze(1)
    return aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)[0]


def _group_norm_of_a_convolution_of_a_channels_last_view(x, w):
    h = aten.convolution.default(x.permute(0, 3, 1, 2), w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    return aten.native_group_norm.default(h.flatten(2), None, None, 2, 8, 16, 4, 1e-5)[0]  # raises


_LAYOUT_CASES = {  # kernel given a view eager's composites or backward formulas make contiguous
    "embedding_bag": (_embedding_bag_of_a_column,                 # wrong values
                      lambda: (torch.randn(10, 3), torch.randint(0, 10, (8, 2)))),
    "embedding_bag_backward": (_embedding_bag_backward_of_a_column,  # raises
                               lambda: (torch.randn(4, 3), torch.randn(10, 3), torch.randint(0, 10, (8, 2)))),
    "pdist": (_pdist_of_a_transpose, lambda: (torch.randn(6, 8),)),  # raises
    "pdist_backward": (_pdist_backward_of_a_transpose, lambda: (torch.randn(28), torch.randn(6, 8))),
    "view_as_complex": (_complex_of_an_expanded_gradient, lambda: (torch.randn(4, 6),)),  # raises
    "group_norm": (_group_norm_of_a_transpose, lambda: (torch.randn(2, 6, 16),)),  # raises
    "group_norm_backward": (_group_norm_backward_of_transposes,   # wrong values
                            lambda: (torch.randn(2, 6, 16), torch.randn(2, 6, 16))),
    "group_norm_backward_mixed_formats": (_group_norm_backward_of_a_channels_last_input,  # wrong values
                                          lambda: (torch.randn(2, 8, 5, 5), torch.randn(2, 5, 5, 8))),
    "group_norm_size_one_dim": (_group_norm_of_a_size_one_dim, lambda: (torch.randn(2, 6, 8),)),  # raises
    "weight_norm": (_weight_norm_of_a_transpose,  # wrong values
                    lambda: (torch.randn(6, 5), torch.rand(5, 1) + 0.5)),
    "attention_of_a_convolution": (_attention_of_a_convolution_of_a_channels_last_view,  # NaN
                                   lambda: (torch.randn(2, 4, 4, 6), torch.randn(8, 6, 1, 1))),
    "group_norm_of_a_convolution": (_group_norm_of_a_convolution_of_a_channels_last_view,
                                    lambda: (torch.randn(2, 4, 4, 6), torch.randn(8, 6, 1, 1))),
}


@pytest.mark.parametrize("case", sorted(_LAYOUT_CASES))
def test_kernels_that_need_a_layout_get_it(case):
    """Each kernel here, given as a view the strided tensor eager would have made
    contiguous first, raises or returns other values on CPU (the weight norm's kernel may
    also corrupt the heap, so the views are not run here); views_as_views gives it a
    contiguous clone, and the program gives the functional graph's values."""
    fn, make = _LAYOUT_CASES[case]
    torch.manual_seed(0)
    args = make()
    gm = functional(fn, *args)
    want = gm(*args)
    views_as_views(gm)
    torch.testing.assert_close(gm(*args), want)


def test_a_graph_that_mutates_is_left_alone():
    def fn(x):
        y = x.t()
        out = torch.zeros(4, 3)
        out.add_(y)
        return out
    gm = make_fx(fn)(torch.randn(3, 4))
    before = targets(gm)
    views_as_views(gm)
    assert targets(gm) == before


@pytest.mark.timeout(240)
def test_gpt_on_simulated_ranks_gives_the_same_numbers_and_collectives(monkeypatch):
    """The zoo GPT's programs on (2,2): every output equal with views (the pipeline's last
    pass) and with copies (lowered without it), the collective sequence unchanged, and
    most view copies gone."""
    from ddlc import pipeline
    from passes.canonicalize import canonicalize
    from passes.sharding import shard
    from ddlc.ir import SHARDING, STEP
    from ddlc.sbp import local_slices, parse_sbp
    from ddlc.zoo import GPT, lm_loss
    import itertools
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=8)
    x, y = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    gm = canonicalize(ddlc.trace(model, (x, y), lm_loss, torch.optim.AdamW(model.parameters())))
    sig, mesh = STEP(gm), ddlc.Mesh((2, 2))
    shard(gm, mesh, fixed={sig.input_name("input", k): parse_sbp("(S0, B)") for k in sig.keys("input")})
    viewed = lower_ranks(gm, mesh, fuse=False, partition=False)
    monkeypatch.setattr(pipeline, "views_as_views", lambda g: g)
    copies = lower_ranks(gm, mesh, fuse=False, partition=False)
    params = {k: v.detach() for k, v in model.named_parameters()}
    full = sig.flatten(params, dict(model.named_buffers()), sig.init_opt_state(params), (x, y))
    sbp = {n.name: SHARDING(n).outputs[0] for n in gm.graph.nodes if n.op == "placeholder"}
    pieces = [[t[local_slices(tuple(t.shape), sbp[i.name], mesh.shape, c)].contiguous()
               for t, i in zip(full, sig.inputs)] for c in itertools.product(range(2), range(2))]
    def own(ranks):  # each run and rank its own inputs: a program may overwrite its state
        return [[t.clone() for t in rank] for rank in ranks]
    for want, got in zip(run_ranks(copies, mesh, own(pieces)), run_ranks(viewed, mesh, own(pieces))):
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
            if isinstance(b, torch.Tensor):
                assert b._base is None   # outputs own their memory
    for a, b in zip(copies, viewed):
        assert collective_sequence(a) == collective_sequence(b)
        left = sum(str(t).endswith("_copy.default") or "_copy." in str(t) for t in targets(b))
        assert left < sum("_copy." in str(t) for t in targets(a)) / 4


def test_the_update_reads_each_gradient_in_its_parameters_layout():
    """A Linear weight's gradient is traced as a transposed product, ``t(mm(t(x), dy))``;
    it is computed as ``mm(t(dy), x)``, as eager autograd does, so it comes out in its
    parameter's layout with no copy, and no operator of the AdamW update reads a strided
    tensor."""
    from ddlc.ir import ORIGIN
    from ddlc.zoo import MLP
    from passes.canonicalize import canonicalize
    from passes.sharding import shard
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    batch = (torch.randn(8, 16), torch.randn(8, 8))
    mesh = ddlc.Mesh((1,))
    gm = canonicalize(ddlc.trace(model, batch, torch.nn.functional.mse_loss,
                                 torch.optim.AdamW(model.parameters())))
    shard(gm, mesh)
    (program,) = lower_ranks(gm, mesh)
    seen = {}

    class Layouts(fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            origin = ORIGIN.get(node)
            if node.op == "call_function" and origin is not None and origin.phase == "optimizer" \
                    and not getattr(node.target, "is_view", False) and node.target is not aten.clone.default:
                for a in node.all_input_nodes:
                    if isinstance(self.env[a], torch.Tensor):
                        seen[(node.name, a.name)] = self.env[a].is_contiguous()
            return out

    inputs = [torch.rand(tuple(i.meta["val"].shape)) + 0.1 for i in program.graph.find_nodes(op="placeholder")]
    Layouts(program).run(*inputs)
    assert seen and all(seen.values()), [k for k, ok in seen.items() if not ok]
    clones = [n for n in program.graph.nodes if n.target is aten.clone.default
              and getattr(ORIGIN.get(n.args[0]), "phase", None) == "backward"]
    assert not clones  # no gradient needed a contiguous copy
    products = [n for n in program.graph.nodes if n.target is aten.mm.default
                and all(a.target is aten.t.default for a in n.all_input_nodes)]
    assert len(products) == 2  # the two weight gradients, mm(t(dy), x)
    assert not any(n.target is aten.t.default and n.args[0].target is aten.mm.default
                   for n in program.graph.nodes)
