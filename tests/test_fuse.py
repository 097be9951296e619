"""Tensor fusion: bucketed collectives give the same numbers with fewer start-ups."""
import copy

import pytest
import torch

from ddlc.runtime import collective_sequence, lower
from ddlc.simulate import axis_group_names, simulate_steps
from distributed_cases import reference
from passes.decouple import decouple
from passes.fuse import pack, unpack
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
