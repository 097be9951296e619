"""Uneven splits in the sharding search: a dim the mesh axis does not divide (an odd
vocabulary, a batch of 7 on 4 ranks) may be cut into ``torch.chunk`` pieces.

Where they are allowed (``ddlc.sbp.plannable``, ``passes.rules.core._fits``): one mesh
axis cuts the dim, every piece is non-empty, and every tensor a signature splits has the
same size at its split dim, so all pieces share bounds. Collectives on such pieces run
padded and are priced at the padded bytes; an all-to-all never takes them. The gold test
is numerics: a GPT with a vocabulary of 67 and a batch of 7 trains like single device on
(4,) and (2, 2) simulated in one process, and on (2, 2) gloo processes.
"""
from __future__ import annotations

import pytest
import torch

import ddlc
from conftest import FAST_GLOO, assert_matches_reference, optimizer, train
from cost_models.boxing import boxing_cost
from ddlc import pipeline
from ddlc.ir import SHARDING
from ddlc.launch import spawn
from ddlc.options import CompileOptions
from ddlc.sbp import cuts_unevenly, divides, parse_sbp, plannable
from ddlc.simulate import simulate_steps
from ddlc.zoo import GPT, lm_loss
from passes.rules import signatures_nd
from passes.rules.checker import make_node

aten = torch.ops.aten
VOCAB, BATCH, SEQ = 67, 7, 16   # 67 = 17 + 17 + 17 + 16 and 7 = 2 + 2 + 2 + 1 on 4 ranks
#: links fast enough against compute that the search shards the vocabulary and the batch
FAST = [1e-6, 1e11]


def test_plannable_placements():
    assert plannable((10, 3), parse_sbp("(S0)"), (4,))          # 3 + 3 + 3 + 1
    assert not plannable((6, 3), parse_sbp("(S0)"), (4,))       # 2 + 2 + 2 + an empty piece
    assert not plannable((10,), parse_sbp("(S0, S0)"), (2, 2))  # two axes on an uneven dim
    assert plannable((8,), parse_sbp("(S0, S0)"), (2, 2)) and plannable((10, 3), parse_sbp("(S0, S1)"), (4, 3))


def _splits(op, *args, mesh=(4,)):
    node, _ = make_node(op, *args)
    return {str(sig) for sig in signatures_nd(node, mesh) if any(x is not None and x[0].is_split
                                                                for x in sig.inputs + sig.outputs)}


def test_uneven_signatures_only_where_every_split_dim_has_one_size():
    # a matmul: m = 10 and n = 6 split on their own; k = 7 splits both operands alike (P)
    got = _splits(aten.mm.default, torch.zeros(10, 7), torch.zeros(7, 11))
    assert got == {"(S0),(B)->(S0)", "(B),(S1)->(S1)", "(S1),(S0)->(P)"}
    # n = 6 would leave the fourth rank an empty piece
    assert _splits(aten.mm.default, torch.zeros(10, 7), torch.zeros(7, 6)) == {"(S0),(B)->(S0)", "(S1),(S0)->(P)"}
    # a view merging the split dim with another: 6 rows on 4 ranks are not 6 * 4 elements' pieces
    assert _splits(aten.view_copy.default, torch.zeros(6, 4), [24]) == set()
    assert _splits(aten.view_copy.default, torch.zeros(10, 4), [40]) == set()
    # ... which an even split allows
    assert _splits(aten.view_copy.default, torch.zeros(8, 4), [32]) == {"(S0)->(S0)"}
    # an uneven dim on two axes
    assert not any("S0, S0" in s for s in _splits(aten.relu.default, torch.zeros(10), mesh=(2, 2)))


def test_uneven_collectives_are_padded_and_never_all_to_all():
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(1e-6, 1e9)])
    gather = boxing_cost((10, 3), 4, parse_sbp("(S0)"), parse_sbp("(B)"), mesh)
    assert [s.kind for s in gather.steps] == ["all_gather"] and gather.steps[0].nbytes == 12 * 3 * 4
    assert [s.kind for s in boxing_cost((12, 8), 4, parse_sbp("(S0)"), parse_sbp("(S1)"), mesh).steps] \
        == ["all_to_all"]
    # 10 rows on 4 ranks: no all-to-all; through the whole tensor instead
    assert [s.kind for s in boxing_cost((10, 4), 4, parse_sbp("(S0)"), parse_sbp("(S1)"), mesh).steps] \
        == ["all_gather", "slice"]


def _model():
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, seq_len=SEQ)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(3)]


def _mesh(shape):
    return ddlc.Mesh(shape, links=[ddlc.LinkModel(*FAST)] * len(shape), profile=FAST_GLOO)


def _unevenly_cut_sizes(gm, mesh) -> set[int]:
    """The sizes of the dims that the plan cuts unevenly somewhere."""
    return {n.meta["val"].shape[d] for n in gm.graph.nodes
            if SHARDING.has(n) and isinstance(n.meta.get("val"), torch.Tensor)
            for d in cuts_unevenly(tuple(n.meta["val"].shape), SHARDING(n).outputs[0], mesh.shape)}


@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_uneven_plans_train_like_single_device_simulated(shape):
    model, data, mesh = _model(), _batches(), _mesh(shape)
    options = CompileOptions.from_kwargs()
    gm = pipeline.trace_step(model, data[0], lm_loss, optimizer("adamw", model), options)
    pipeline.plan(gm, mesh, options, {})
    assert _unevenly_cut_sizes(gm, mesh) == {BATCH, VOCAB}
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, state, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data)
    want = train(_model(), lm_loss, "adamw", data)
    assert_matches_reference({"losses": losses, "params": params, "opt_state": state}, want, str(shape))


def test_a_plan_whose_redistribution_passes_through_uneven_pieces_lowers_every_rank():
    """Data parallelism pinned on (2, 2) under ``dgx-h100-ib``: the 5-element output bias's
    gradient goes from ``(P, P)`` to ``(B, B)`` by a reduce-scatter on axis 0 (pieces of 3
    and 2), an all-reduce on axis 1 and an all-gather on axis 0. Every planned placement
    divides, but that route does not: coordinate 0's program (its pieces 3 long) cannot be
    every rank's, and ``ddlc.compile`` stopped with an internal ``LoweringError``
    retargeting it. The route's placements count as the plan's, so each rank lowers its
    own, and the step trains like the single device."""
    def masked_mean(out, target):
        mask = (target > 0).float()
        return ((out - target) ** 2 * mask).sum() / mask.sum().clamp(min=1)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g)) for _ in range(3)]
    def sgd(net):
        return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net, mesh = model(), ddlc.Mesh((2, 2), profile="dgx-h100-ib")
    options = CompileOptions.from_kwargs(profile="dgx-h100-ib", move_activations=False)
    gm = pipeline.trace_step(net, data[0], masked_mean, sgd(net), options)
    pinned = {"input0": "(S0, S0)", "input1": "(S0, S0)"} | {k: "(B, B)" for k, _ in net.named_parameters()}
    pipeline.plan(gm, mesh, options, pipeline.resolve_placements(gm, pinned, 2))
    assert all(SHARDING(n).output == parse_sbp("(B, B)") for n in gm.graph.nodes if n.op == "placeholder"
               and n.meta["val"].ndim == 1)  # the biases and their momenta whole
    assert [str(step.after) for step in boxing_cost((5,), 4, parse_sbp("(P, P)"), parse_sbp("(B, B)"), mesh).steps] \
        == ["(S0, P)", "(S0, B)", "(B, B)"]
    assert not pipeline.splits_evenly(gm, mesh)
    params = {k: v.detach() for k, v in net.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, {}, data)
    eager = model()
    opt, want = sgd(eager), []
    for x, y in data:
        opt.zero_grad()
        loss = masked_mean(eager(x), y)
        loss.backward()
        opt.step()
        want.append(loss.detach())
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(eager.named_parameters())})


def _compiled_gpt(rank, shape):
    model, data = _model(), _batches()
    step = ddlc.compile(model, _mesh(shape), data[0], lm_loss, optimizer("adamw", model))
    losses = [step.step(*b) for b in data]
    uneven = sorted(k for k in step.params
                    if not divides(step._global_shape(k), step._sbp(k), step.mesh.shape))
    return {"losses": losses, "params": step.state_dict(), "opt_state": step.optimizer_state(),
            "local": {k: tuple(v.shape) for k, v in step.params.items()}, "uneven": uneven}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", [(2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_uneven_plans_train_like_single_device_on_gloo(shape):
    per_rank = spawn(_compiled_gpt, 4, shape, timeout=150, deadline=220)
    want = train(_model(), lm_loss, "adamw", _batches())
    for rank, got in enumerate(per_rank):
        assert_matches_reference({k: got[k] for k in ("losses", "params", "opt_state")}, want, f"rank {rank}")
    if shape == (4,):  # the vocabulary is cut unevenly: the last rank's piece of the head is short
        assert per_rank[0]["uneven"] == ["head.weight"]
        assert [got["local"]["head.weight"][0] for got in per_rank] == [17, 17, 17, 16]


def test_why_a_placement_that_cuts_unevenly_is_refused():
    from ddlc.sbp import parse_sbp, why_not_plannable
    assert why_not_plannable((6, 12), parse_sbp("(S0)"), (4,)) == (
        "torch.chunk cuts dim 0 (6) into pieces of [2, 2, 2, 0] over the 4 devices of mesh axis 0: "
        "a device would get none")
    assert why_not_plannable((6, 12), parse_sbp("(S0, S0)"), (2, 2)).endswith(
        "split by one mesh axis only, not by axes [0, 1] (e.g. (S0, B))")
    assert why_not_plannable((6, 12), parse_sbp("(B, S0, S0)"), (1, 2, 2)).endswith("(e.g. (B, S0, B))")
    assert why_not_plannable((10, 12), parse_sbp("(S0)"), (4,)) == ""  # 3, 3, 3, 1: planned
