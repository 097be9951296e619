"""Larger meshes than this machine hosts as processes: every rank's lowered program runs
in one process with exactly simulated collectives, and must match the single device."""
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import ddlc
from ddlc.runtime import collective_sequence, lower
from ddlc.sbp import local_slices, parse_sbp
from ddlc.simulate import axis_group_names, run_ranks
from passes.canonicalize import canonicalize
from passes.sharding import shard
from distributed_cases import batches, model_and_loss, optimizer, reference

CASES = [
    ((2, 4), "mlp", "adamw", {"input0": "(S0, B)", "layers.0.weight": "(B, S0)"}),
    ((2, 4), "gpt", "sgd", {"input0": "(S0, B)"}),
    ((2, 2, 2), "mlp", "sgd", {"input0": "(S0, S0, B)", "layers.1.weight": "(B, B, S1)"}),
    ((2, 2, 2), "cnn", "adamw", {"input0": "(S0, B, B)"}),
]


@pytest.mark.parametrize("mesh_shape,model_name,opt_name,placements", CASES,
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else None)
def test_simulated_ranks_match_single_device(mesh_shape, model_name, opt_name, placements):
    model, loss_fn = model_and_loss(model_name)
    data = batches(model_name)
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer(opt_name, model)))
    sig = gm.meta["ddlc_step"]
    names = {i.key: i.name for i in sig.inputs}
    mesh = ddlc.Mesh(mesh_shape)
    shard(gm, mesh, fixed={names[k]: parse_sbp(v) for k, v in placements.items()})
    coords = list(itertools.product(*(range(p) for p in mesh_shape)))
    graphs = [lower(copy.deepcopy(gm), mesh, c, axis_group_names(mesh)) for c in coords]
    assert all(collective_sequence(g) == collective_sequence(graphs[0]) for g in graphs)
    assert collective_sequence(graphs[0]), "the plan should communicate"

    sbp_of = {n.name: n.meta["ddlc"].outputs[0] for n in gm.graph.nodes if n.op == "placeholder"}
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = {"param": params, "buffer": dict(model.named_buffers()),
             "opt_state": sig.init_opt_state(params)}
    step_losses = []
    for batch in data:
        globals_ = sig.flatten(state["param"], state["buffer"], state["opt_state"], batch)
        inputs = [[t[local_slices(tuple(t.shape), sbp_of[spec.name], mesh_shape, c)].contiguous()
                   for t, spec in zip(globals_, sig.inputs)] for c in coords]
        outs = run_ranks(graphs, mesh, inputs)
        losses = [float(o[0]) for o in outs]
        assert max(losses) - min(losses) < 1e-6  # the loss is B: every rank holds it
        step_losses.append(outs[0][0])
        # reassemble the full new state from the ranks' pieces
        for k, out_spec in enumerate(sig.outputs):
            if out_spec.role not in ("param", "opt_state"):
                continue
            index = [(i.role, i.key) for i in sig.inputs].index((out_spec.role, out_spec.key))
            whole = torch.empty_like(globals_[index])
            sbp = sbp_of[sig.inputs[index].name]
            for c, o in zip(coords, outs):
                whole[local_slices(tuple(whole.shape), sbp, mesh_shape, c)] = o[k]
            state[out_spec.role][out_spec.key] = whole
    want = reference(model_name, opt_name)
    for got, expected in zip(step_losses, want["losses"]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(state["param"][name], value, rtol=1e-4, atol=1e-5)
