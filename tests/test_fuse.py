"""Tensor fusion and partitioning: bucketed collectives give the same numbers with fewer
start-ups, split ones the same numbers in pieces; the sizes come from the timeline model."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import ddlc
from cost_models.collectives import collective_time
from cost_models.program import program_timeline
from ddlc.runtime import collective_sequence, lower
from ddlc.sbp import parse_sbp
from ddlc.simulate import axis_group_names, simulate_steps
from ddlc.zoo import MLP
from distributed_cases import reference
from passes.canonicalize import canonicalize
from passes.decouple import decouple
from passes.fuse import pack, unpack
from passes.schedule import is_issue
from passes.sharding import shard
from test_decouple import BATCH, _planned, _replicate_updates


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
def test_pack_unpack_round_trip_matches_per_tensor_collectives(kind):
    p, g = 4, torch.Generator().manual_seed(0)
    ranks = [[torch.randn(8, 3, generator=g), torch.randn(4, generator=g)] for _ in range(p)]
    if kind == "all_gather":
        ranks = [[t[:2], t[1:2]] for t, _ in ranks]
    expected, fused = [], []
    for r in range(p):
        if kind == "all_reduce":
            expected.append([sum(x[i] for x in ranks) for i in range(2)])
        elif kind == "reduce_scatter":
            expected.append([sum(x[i] for x in ranks).chunk(p)[r] for i in range(2)])
        else:
            expected.append([torch.cat([x[i] for x in ranks]) for i in range(2)])
    buffers = [pack(kind, x, p) for x in ranks]
    for r in range(p):
        if kind == "all_reduce":
            out = sum(buffers)
        elif kind == "reduce_scatter":
            out = sum(buffers).chunk(p)[r]
        else:
            out = torch.cat(buffers)
        fused.append(unpack(kind, out, [e.shape for e in expected[r]], p))
    for e, f in zip(expected, fused):
        for a, b in zip(e, f):
            torch.testing.assert_close(a, b)


def test_fused_buckets_train_like_single_device():
    gm, mesh, model, data = _planned("adamw")
    _replicate_updates(gm, mesh)
    decouple(gm, mesh, "forward")
    plain = collective_sequence(lower(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh), fuse=False))
    fused = collective_sequence(lower(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh),
                                      fuse=float("inf")))
    assert len(fused) < len(plain)
    assert sum(b for _, _, b in fused) == sum(b for _, _, b in plain)  # same bytes, fewer start-ups
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _ = simulate_steps(gm, mesh, params, {}, data, fuse=float("inf"))
    want = reference("mlp", "adamw", batch=BATCH)
    for got, expected in zip(losses, want["losses"]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5)


PIECE = 128  # bytes: splits the test MLP's collectives of weights and of a bias


def _pieces(gm):
    """Split collective name -> (kind, number of pieces) in ``gm``."""
    return {n.meta["ddlc_piece"][0]: (n.meta["ddlc"].kind, n.meta["ddlc_piece"][2])
            for n in gm.graph.nodes if "ddlc_piece" in n.meta}


@pytest.mark.parametrize("ag_placement, kinds", [(None, {"all_reduce", "reduce_scatter", "all_gather"}),
                                                  ("forward", {"reduce_scatter", "all_gather"})])
def test_split_collectives_train_like_single_device(ag_placement, kinds):
    gm, mesh, model, data = _planned("adamw")
    _replicate_updates(gm, mesh)
    if ag_placement:
        decouple(gm, mesh, ag_placement)
    lowered = {size: lower(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh), fuse=False, partition=size)
               for size in (False, PIECE)}
    whole, split = (collective_sequence(g) for g in lowered.values())
    pieces = _pieces(lowered[PIECE])
    assert {kind for kind, _ in pieces.values()} == kinds
    assert len(split) == len(whole) + sum(k - 1 for _, k in pieces.values())
    assert sum(b for _, _, b in split) == sum(b for _, _, b in whole)
    seconds = {}  # each piece pays its own start-up
    for node in lowered[PIECE].graph.nodes:
        if "ddlc_piece" in node.meta:
            seconds[node.meta["ddlc_piece"][0]] = seconds.get(node.meta["ddlc_piece"][0], 0) + node.meta["ddlc"].seconds
    for node in lowered[False].graph.nodes:
        if node.name in pieces:
            kind, k = pieces[node.name]
            startup = collective_time(kind, 0, 4, mesh.links[0], "ring")
            assert seconds[node.name] == pytest.approx(node.meta["ddlc"].seconds + (k - 1) * startup)
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _ = simulate_steps(gm, mesh, params, {}, data, fuse=False, partition=PIECE)
    want = reference("mlp", "adamw", batch=BATCH)
    for got, expected in zip(losses, want["losses"]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5)


def _wide_mlp():
    """A data-parallel MLP whose 256x256 output layer's gradient is the one large collective."""
    torch.manual_seed(0)
    model = MLP(32, 256, 256)
    batch = (torch.randn(32, 32), torch.randn(32, 256))
    gm = canonicalize(ddlc.trace(model, batch, F.mse_loss, torch.optim.AdamW(model.parameters())))
    names = {i.key: i.name for i in gm.meta["ddlc_step"].inputs}
    pins = dict.fromkeys(["input0", "input1"], "(S0)") | {k: "(B)" for k, _ in model.named_parameters()}
    shard(gm, ddlc.Mesh((4,), links=[ddlc.LinkModel(1e-7, 1e10)]),
          fixed={names[k]: parse_sbp(v) for k, v in pins.items()})
    _replicate_updates(gm, ddlc.Mesh((4,)))
    return gm


@pytest.mark.parametrize("latency, splits", [(1e-6, True), (1e-3, False)])
def test_piece_size_is_chosen_by_the_timeline_model(latency, splits):
    """On a slow link, splitting the large collective lets the optimizer's first, urgent
    collective go between its pieces, which pays for the extra start-ups unless each
    start-up costs a millisecond."""
    gm = _wide_mlp()
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(latency, 1e8)])
    chosen = lower(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh))
    whole = lower(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh), partition=False)
    made = program_timeline(chosen, mesh.profile).makespan
    assert (chosen.meta["ddlc_piece_bytes"] < math.inf) == splits == bool(_pieces(chosen))
    if splits:
        assert made < program_timeline(whole, mesh.profile).makespan
        issues = [n for n in chosen.graph.nodes if is_issue(n)]
        split_at = [i for i, n in enumerate(issues) if "ddlc_piece" in n.meta]
        between = issues[split_at[0]:split_at[-1]]
        assert any("ddlc_piece" not in n.meta for n in between)  # interleaved between pieces
