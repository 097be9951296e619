"""canonicalize rewrites mean reductions exactly and keeps the graph runnable."""
import pytest
import torch
import torch.nn.functional as F

import ddlc
from ddlc.ir import output_scalars
from ddlc.printing import op_summary
from ddlc.zoo import GPT, lm_loss
from passes.canonicalize import ELEMENTWISE_LOSS_BACKWARDS, ELEMENTWISE_LOSSES, canonicalize

aten = torch.ops.aten


def _run(gm, model, batch):
    sig = gm.meta["ddlc_step"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    return gm(*sig.flatten(params, dict(model.named_buffers()), sig.init_opt_state(params), batch))


def _reduction(node):
    """The ``reduction`` argument of a loss node (its default where not given)."""
    schema = node.target._schema.arguments
    args = {a.name: a.default_value for a in schema if a.has_default_value()}
    args.update(zip((a.name for a in schema), node.args))
    return {**args, **node.kwargs}["reduction"]


def test_mean_loss_becomes_sum_over_total_weight():
    """Without class weights the total weight is the count of targets not ignored, counted
    from the target (a plan keeping the target whole counts on every rank); ignored
    targets (-100) included, the step computes what it did."""
    torch.manual_seed(0)
    model = GPT(n_layers=1)
    targets = torch.randint(0, 64, (2, 16))
    targets[0, :5] = -100
    batch = (torch.randint(0, 64, (2, 16)), targets)
    gm = ddlc.trace(model, batch, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    before = _run(gm, model, batch)
    canonicalize(gm)
    (nll,) = [n for n in gm.graph.nodes if n.target == aten.nll_loss_forward.default]
    assert nll.args[3] == 2  # reduction=sum
    assert all(u.args[1] == 0 for u in nll.users)  # its total weight is read no more
    (count,) = [n for n in gm.graph.nodes
                if n.target == aten.sum.default and n.args[0].target == aten.ne.Scalar]
    assert count.args[0].args == (nll.args[1], -100) and count.kwargs["dtype"] == torch.float32
    readers = {u.target for u in count.users}
    assert readers == {aten.div.Tensor, aten.nll_loss_backward.default}
    after = _run(gm, model, batch)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


def test_a_class_weighted_mean_loss_divides_by_its_total_weight():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    weight = torch.tensor([1.0, 2.0, 0.5, 3.0])
    batch = (torch.randn(6, 8), torch.tensor([0, 1, 2, 3, -100, 1]))
    gm = ddlc.trace(model, batch, lambda out, y: F.cross_entropy(out, y, weight=weight),
                    torch.optim.SGD(model.parameters(), lr=0.1))
    before = _run(gm, model, batch)
    canonicalize(gm)
    (nll,) = [n for n in gm.graph.nodes if n.target == aten.nll_loss_forward.default]
    assert {u.args[1] for u in nll.users} == {0, 1}  # the loss sum and its total weight
    after = _run(gm, model, batch)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


class MeanModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).mean(dim=1)


def test_mean_dim_becomes_sum_div():
    torch.manual_seed(0)
    model = MeanModel()
    x, y = torch.randn(4, 8), torch.randn(4)
    gm = ddlc.trace(model, (x, y), F.mse_loss)
    assert op_summary(gm)["aten.mean"] >= 1
    before = _run(gm, model, (x, y))
    canonicalize(gm)
    assert "aten.mean" not in op_summary(gm)
    reductions = [n.args[-1] for n in gm.graph.nodes if "mse_loss" in str(n.target)]
    assert reductions == [2, 2]  # forward and backward now sum
    for a, b in zip(before, _run(gm, model, (x, y))):
        torch.testing.assert_close(a, b)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("loss", [
    lambda o, y: ((o - y) ** 2).mean(), F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    lambda o, y: F.binary_cross_entropy(o.sigmoid(), y.sigmoid(), weight=torch.ones(8) * 0.5),
    F.binary_cross_entropy_with_logits, F.soft_margin_loss,
    lambda o, y: F.multi_margin_loss(o, y.argmax(1), p=2, margin=0.5, weight=torch.linspace(0.5, 1.5, 8))],
    ids=["mean", "l1", "smooth_l1", "huber", "bce_weight", "bce_logits", "soft_margin", "multi_margin"])
def test_the_mean_of_an_elementwise_loss_becomes_its_sum_over_the_count(loss):
    """``x.mean()`` and the mean-reduced elementwise losses (and their backwards) become
    sums divided by the element count, so a batch split sums them as partial sums (they
    kept the batch whole: data parallelism without moved activations was refused)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = ddlc.trace(model, (x, y), loss, torch.optim.SGD(model.parameters(), lr=0.1))
    before = _run(gm, model, (x, y))
    canonicalize(gm)
    assert "aten.mean" not in op_summary(gm)
    losses = [n for n in gm.graph.nodes if n.target in (*ELEMENTWISE_LOSSES, *ELEMENTWISE_LOSS_BACKWARDS)]
    assert all(_reduction(n) == 2 for n in losses)
    for a, b in zip(before, _run(gm, model, (x, y))):
        torch.testing.assert_close(a, b)


def test_a_low_precision_mean_sums_in_float32_as_eager_accumulates():
    """A float16 mean of large values: its sum overflows float16 (65504) where eager's
    mean, accumulated in float32, does not; the rewrite sums and divides in float32, then
    casts back (the loss was inf). The mean-reduced losses are left as they are there."""
    model = torch.nn.Linear(8, 8).half()
    x, y = torch.full((64, 8), 30.0, dtype=torch.float16), torch.zeros(64, 8, dtype=torch.float16)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()

    def loss(o, t):
        return ((o - t) ** 2).mean().sqrt()
    gm = ddlc.trace(model, (x, y), loss, torch.optim.SGD(model.parameters(), lr=0.1))
    before = _run(gm, model, (x, y))
    canonicalize(gm)
    assert "aten.mean" not in op_summary(gm)
    after = _run(gm, model, (x, y))
    assert torch.isfinite(after[0]) and torch.equal(before[0], after[0])
    gm = canonicalize(ddlc.trace(model, (x, y), F.smooth_l1_loss, torch.optim.SGD(model.parameters(), lr=0.1)))
    losses = [n for n in gm.graph.nodes if n.target in (*ELEMENTWISE_LOSSES, *ELEMENTWISE_LOSS_BACKWARDS)]
    assert len(losses) == 2 and all(_reduction(n) == 1 for n in losses)  # kept: a float16 sum may overflow


def test_the_backward_seed_reads_the_loss_sum_so_the_loss_division_feeds_only_the_output():
    torch.manual_seed(0)
    model = GPT(n_layers=1)
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    gm = ddlc.trace(model, batch, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    before = _run(gm, model, batch)
    canonicalize(gm)
    (seed,) = [n for n in gm.graph.nodes if n.target == aten.ones_like.default]
    (division,) = [n for n in gm.graph.nodes if n.target == aten.div.Tensor and n.meta["val"].dim() == 0]
    assert seed.args[0] is division.args[0]  # the sum, not sum / count
    assert output_scalars(gm.graph) == {division}
    for a, b in zip(before, _run(gm, model, batch)):
        torch.testing.assert_close(a, b)


class MaskByRanges(torch.nn.Module):
    """Indexes its mask as transformers' mask functions do, ``mask[batch_idx, kv_idx]`` with
    ``batch_idx = arange(B)[:, None, None]`` and ``kv_idx = arange(S)[None, None, :] + 0``,
    then (``shuffled``) by a permutation, which is not a view."""

    def __init__(self, shuffled: bool = False):
        super().__init__()
        self.fc, self.shuffled = torch.nn.Linear(6, 6), shuffled

    def forward(self, x, mask):
        b, s = mask.shape
        rows = torch.arange(b)[:, None, None]
        cols = torch.arange(s)[None, None, :] + 0
        if self.shuffled:
            cols = torch.arange(s - 1, -1, -1)[None, None, :]
        keep = mask.bool()[rows, cols]  # (b, 1, s)
        return (self.fc(x) * keep).sum(-1)


def test_indexing_by_whole_aranges_in_dim_order_becomes_a_view():
    # transformers' padding masks: a view of the mask shards with the batch, where
    # indexing by values needed the mask whole on every rank (found on Mistral, OPT,
    # Gemma ...: no data-parallel plan without moving activations)
    torch.manual_seed(0)
    x, mask, y = torch.randn(4, 6, 6), torch.ones(4, 6, dtype=torch.long), torch.randn(4, 6)
    mask[:2, :3] = 0
    for shuffled, views in ((False, True), (True, False)):
        model = MaskByRanges(shuffled)
        gm = ddlc.trace(model, (x, mask, y), F.mse_loss)
        assert op_summary(gm)["aten.index"] == 1
        before = _run(gm, model, (x, mask, y))
        canonicalize(gm)
        assert ("aten.index" not in op_summary(gm)) == views
        for a, b in zip(before, _run(gm, model, (x, mask, y))):
            torch.testing.assert_close(a, b)


def test_squeeze_names_the_dims_of_size_one_in_the_whole_tensor():
    """A rank's piece of ``(4, 1)`` split over 4 ranks is ``(1, 1)``: an implicit
    ``squeeze()`` there would drop the split dim too (a LoweringError for ``model(x).squeeze()``
    with a batch of one per rank; tests/test_simulated_ranks.py runs it)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import functionalize

    def fn(x):
        return x.squeeze() * 2, x.squeeze(1) + 1, x.squeeze(0) - 1, x.squeeze((0, -1)).sum()

    x = torch.randn(4, 1)
    gm = make_fx(functionalize(fn, remove="mutations_and_views"), tracing_mode="fake")(x)
    want = gm(x)
    canonicalize(gm)
    squeezes = [n for n in gm.graph.nodes if "squeeze" in str(n.target)]
    assert [(n.target, n.args[1]) for n in squeezes] == [(aten.squeeze_copy.dims, [1])] * 2 + \
        [(aten.squeeze_copy.dims, [])] + [(aten.squeeze_copy.dims, [1])]
    for got, expected in zip(gm(x), want):
        torch.testing.assert_close(got, expected)
