"""``passes.shared_reads``: an activation that several operators read is redistributed once
for all of them, the search charges that once, and lowering runs exactly that."""
import pytest
import torch
import torch.nn.functional as F

import ddlc
from conftest import assert_matches_reference, reference
from cost_models.boxing import boxing_seconds
from ddlc import pipeline
from ddlc.ir import COLLECTIVE, ORIGIN, SHARED_READ, SHARDING
from ddlc.launch import spawn
from ddlc.options import CompileOptions
from ddlc.simulate import axis_group_names
from ddlc.zoo import MLP
from passes.canonicalize import canonicalize
from passes.sharding import build_problem, shard
from distributed_cases import compiled_run
from test_runtime import GLOO_TOLERANCES

#: Megatron's MLP on 4 devices: layer 0 split by output features, layer 1 by input
#: features, so layer 1's output is a partial sum (P) that GELU reads whole in forward and
#: its derivative reads whole in backward
MEGATRON = {"input0": "(B)", "layers.0.weight": "(S0)", "layers.0.bias": "(S0)",
            "layers.1.weight": "(S1)"}
FAST = ddlc.LinkModel(1e-7, 1e10)


def _traced(shared: bool):
    torch.manual_seed(0)
    model = MLP(depth=3)
    batch = (torch.randn(8, 32), torch.randn(8, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if shared:
        return pipeline.trace_step(model, batch, F.mse_loss, opt, CompileOptions())
    return canonicalize(ddlc.trace(model, batch, F.mse_loss, opt))


def _planned(shared: bool):
    gm = _traced(shared)
    mesh = ddlc.Mesh((4,), links=[FAST])
    plan = shard(gm, mesh, fixed=pipeline.resolve_placements(gm, MEGATRON, 1))
    return gm, mesh, plan


def _partial_output(gm) -> torch.fx.Node:
    """Layer 1's matmul: the forward node whose output is P."""
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default
               and str(SHARDING(n).outputs[0]) == "(P)"]
    return node


def test_an_alias_stands_between_a_tensor_and_its_readers():
    gm = _traced(shared=True)
    aliases = [n for n in gm.graph.nodes if SHARED_READ.get(n, False)]
    assert aliases
    for alias in aliases:
        (source,) = alias.all_input_nodes
        assert list(source.users) == [alias]      # every reader reads the alias
        assert len(alias.users) >= 2
        assert all(ORIGIN(u).phase in ("forward", "backward") for u in alias.users)
    # parameters and gradients entering the update keep their edges (bucketed traffic)
    assert not any(a.all_input_nodes[0].op == "placeholder" and a.all_input_nodes[0].name.startswith("p_")
                   for a in aliases)


def test_the_partial_sum_is_all_reduced_once_for_both_readers():
    gm, mesh, plan = _planned(shared=True)
    partial = _partial_output(gm)
    (alias,) = partial.users
    assert SHARED_READ(alias)
    assert str(SHARDING(alias).outputs[0]) == "(B)"
    phases = sorted(ORIGIN(u).phase for u in alias.users)
    assert phases == ["backward", "forward"]
    assert all(str(SHARDING(u).inputs[0]) == "(B)" for u in alias.users if u.args[0] is alias)

    # the objective charges that all-reduce once: one less than pricing each edge alone
    # (the same plan without the alias, the loss's all-reduce priced alike)
    plain = _traced(shared=False)
    problem = build_problem(plain, mesh, pipeline.resolve_placements(plain, MEGATRON, 1),
                            lone_scalars=plan.stats.get("lone_scalar_axes", ()))
    signature = {n.name: SHARDING(n) for n in gm.graph.nodes if SHARDING.has(n)}
    same_plan = [cands.index(signature[members[0].name])
                 for cands, members in zip(problem.candidates, problem.members)]
    plain_objective = problem.objective(same_plan)
    val = partial.meta["val"]
    all_reduce = boxing_seconds(tuple(val.shape), val.element_size(), SHARDING(partial).outputs[0],
                                SHARDING(alias).outputs[0], mesh)
    assert all_reduce > 0
    assert plain_objective - plan.objective == pytest.approx(all_reduce, rel=1e-6)


def test_lowering_runs_the_shared_redistribution_and_drops_the_aliases():
    gm, mesh, _ = _planned(shared=True)
    partial = _partial_output(gm).name
    options = CompileOptions(schedule=False, fuse=False, partition=False)
    pipeline.lower(gm, mesh, (0,), axis_group_names(mesh), options)
    assert not any(SHARED_READ.get(n, False) for n in gm.graph.nodes)
    reduced = [n for n in gm.graph.nodes if COLLECTIVE.has(n) and COLLECTIVE(n).kind == "all_reduce"
               and n.args[0].name == partial]
    assert len(reduced) == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_plan_with_shared_reads_matches_single_device_on_4_ranks():
    cases = [("mlp_deep", "adamw", "train", MEGATRON, {"link": (1e-7, 1e10)})]
    (got,), *_ = spawn(compiled_run, 4, (4,), cases, timeout=120, deadline=300)
    assert "all_reduce" in got.pop("collectives")
    got.pop("most_in_flight")
    assert_matches_reference(got, reference("mlp_deep", "adamw"), **GLOO_TOLERANCES)


def test_no_alias_for_a_tensor_that_autograds_view_replays_read():
    """A replay of a view (``as_strided``) reads its input through eager's strides, which
    lowering restores after a redistribution on the replay's own edge: a tensor that
    replays read keeps its edges (an alias's redistribution would hand them row-major
    data)."""
    from ddlc.ir import STRIDED_READERS
    from test_simulated_ranks import _SolvedInPlaces
    torch.manual_seed(0)
    model = _SolvedInPlaces().double()
    batch = (torch.randn(8, 16, 16, dtype=torch.float64), torch.randint(0, 3, (8,)))
    gm = pipeline.trace_step(model, batch, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                             CompileOptions())
    replayed = [n for n in gm.graph.nodes if n.op == "call_function" and len(n.users) >= 2
                and any(u.target in STRIDED_READERS for u in n.users)]
    assert replayed   # read by two replays: it would have had an alias
    assert not any(SHARED_READ.get(n, False) and any(u.target in STRIDED_READERS for u in n.users)
                   for n in gm.graph.nodes)
