"""Decoupled all-reduce: reduce-scatter, update on the shard, all-gather; same numbers."""
import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import ddlc
from conftest import DP_BATCH, FAST_GLOO, assert_matches_reference, data_parallel_mlp, reference, replicate_updates
from cost_models.program import program_makespan
from ddlc import pipeline
from ddlc.ir import COLLECTIVE, SHARDING, collective_sequence
from ddlc.options import CompileOptions
from ddlc.simulate import axis_group_names, lower_rank, simulate_steps
from ddlc.zoo import MLP
import passes.decouple
from passes.decouple import auto_placement, decouple


def _kinds(gm, mesh):
    return Counter(k for k, _, _ in collective_sequence(_lowered(gm, mesh)))


def _lowered(gm, mesh):
    return lower_rank(copy.deepcopy(gm), mesh, (0,) * mesh.ndim, axis_group_names(mesh))


def _comm_seconds(gm, mesh):
    """Modeled seconds of all communication in rank 0's program."""
    return sum(COLLECTIVE(n).seconds for n in _lowered(gm, mesh).graph.nodes if COLLECTIVE.has(n))


@pytest.mark.parametrize("placement", ["forward", "backward", "auto"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_decoupled_updates_match_single_device(opt_name, placement):
    gm, mesh, model, data = data_parallel_mlp(opt_name)
    replicate_updates(gm, mesh)
    before, before_seconds = _kinds(gm, mesh), _comm_seconds(gm, mesh)
    done = decouple(gm, mesh, placement, always=True)
    assert sorted(done) == sorted(k for k, _ in model.named_parameters())
    after = _kinds(gm, mesh)
    # the update now runs on 1/p of every parameter, with no extra traffic
    for n in gm.graph.nodes:
        origin = n.meta.get("ddlc_origin")
        val = n.meta.get("val")
        val = val[0] if isinstance(val, list) else val  # an update's new parameter
        if origin and origin.phase == "optimizer" and n.op == "call_function" and val.dim() > 0:
            assert SHARDING(n).outputs[0][0].is_split, n.name
    assert after["all_reduce"] <= before["all_reduce"]
    # the same gradients move: at most a few start-ups more (a dim change may add a step)
    assert _comm_seconds(gm, mesh) <= before_seconds * 1.2
    if placement == "forward":  # parameters and optimizer state stay sharded between steps
        sharded = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["ddlc_role"] != "input"
                   and n.meta["val"].dim() > 0]
        assert all(SHARDING(n).outputs[0][0].is_split for n in sharded)
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, opt_state, _ = simulate_steps(gm, mesh, params, {}, data)
    assert_matches_reference({"losses": losses, "params": params, "opt_state": opt_state},
                             reference("mlp", opt_name, batch=DP_BATCH))


def test_auto_placement_is_searched_only_where_an_update_is_decoupled(monkeypatch):
    """"auto" asks the layer-schedule search (a noticeable part of a second on a large
    model) only once an update is decoupled, and places it as the search made up front
    would."""
    gm, mesh, _, _ = data_parallel_mlp("adamw")
    replicate_updates(gm, mesh)
    up_front = copy.deepcopy(gm)
    placement = auto_placement(up_front, mesh)
    decouple(up_front, mesh, placement, always=True)
    assert decouple(gm, mesh, "auto", always=True)
    assert {n.name: SHARDING(n) for n in gm.graph.nodes if SHARDING.has(n)} == \
        {n.name: SHARDING(n) for n in up_front.graph.nodes if SHARDING.has(n)}
    # the updates are on shards now: nothing is fed by an all-reduce, nothing is searched
    monkeypatch.setattr(passes.decouple, "auto_placement", lambda *a: pytest.fail("searched"))
    decouple(gm, mesh, "auto", always=True)


def test_pinned_parameters_keep_their_placement():
    gm, mesh, model, _ = data_parallel_mlp("sgd")
    pinned = frozenset(n.name for n in gm.graph.nodes if n.meta.get("ddlc_role") == "param")
    decouple(gm, mesh, "forward", pinned, always=True)
    for n in gm.graph.nodes:
        if n.name in pinned:
            assert str(SHARDING(n).outputs[0]) == "(B)"


@pytest.mark.parametrize("profile, decoupled", [
    ("dgx-h100-ib", ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]),
    (FAST_GLOO, ["layers.0.weight", "layers.1.weight"])], ids=["dgx-h100-ib", "gloo"])
def test_decoupling_only_where_the_backend_makes_it_pay(profile, decoupled):
    """NCCL's ring reduce-scatter + all-gather costs what the all-reduce does, so the
    sharded update is a pure gain; gloo runs the reduce-scatter as a whole all-reduce, so
    on a slow link (no start-up, so no bucket's start-up to save) the all-gather is extra
    traffic that SGD's cheap update of a bias (whose gradient arrives as a partial sum)
    cannot pay for. The weights' gradients arrive already reduce-scattered in this plan:
    their update moves onto the shard at no extra traffic on either backend."""
    gm, _, model, _ = data_parallel_mlp("sgd")
    replicate_updates(gm, ddlc.Mesh((4,)))
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(0.0, 1e8)], profile=profile)
    done = decouple(copy.deepcopy(gm), mesh, "backward")
    assert sorted(done) == decoupled
    assert decouple(gm, mesh, "backward", always=True)  # forced: decoupled all the same


def test_the_decision_is_global_over_the_all_reduce_bucket(monkeypatch):
    """A bucket's start-up is paid once, whoever rides in it. A data-parallel CNN with a
    cross-entropy loss on cpu-gloo, with the largest update (``fc.weight``) already on a
    shard, as the search leaves it where it runs an update on a shard: the reduce-scatter
    and all-gather buckets come anyway, and the other gradients are the all-reduce bucket's
    last members (the loss rides with the count's all-reduce, read in the backward).
    Decoupling any one of them alone adds traffic; decoupling all removes the bucket's
    start-up, and the lowered program models faster than keeping them all-reduced."""
    import passes.decouple as module
    from ddlc.zoo import CNN
    torch.manual_seed(0)
    model = CNN(channels=3, n_classes=16, width=16)
    batch = (torch.randn(32, 3, 16, 16), torch.randint(0, 16, (32,)))
    mesh = ddlc.Mesh((4,), profile="cpu-gloo")
    placements = {"input0": "(S0)", "input1": "(S0)"} | {k: "(B)" for k, _ in model.named_parameters()}
    opts = CompileOptions.from_kwargs(placements=placements, move_activations=False, decouple=False)
    gm = pipeline.trace_step(model, batch, F.cross_entropy, torch.optim.AdamW(model.parameters()), opts)
    pipeline.plan(gm, mesh, opts, pipeline.resolve_placements(gm, opts.placements, 1))
    with monkeypatch.context() as patch:
        patch.setattr(module, "_worth_decoupling", lambda margins, added, removed: ["fc.weight"])
        assert decouple(gm, mesh, "forward") == ["fc.weight"]
    margins = {}
    with monkeypatch.context() as patch:
        patch.setattr(module, "_worth_decoupling", lambda m, added, removed: margins.update(m) or [])
        kept = copy.deepcopy(gm)
        assert decouple(kept, mesh, "forward") == []
    assert margins and all(m > 0 for m in margins.values())  # none pays alone
    rest = copy.deepcopy(gm)
    assert sorted(decouple(rest, mesh, "forward")) == sorted(margins)
    for program in (kept, rest):
        pipeline.lower(program, mesh, (0,), ["axis0"], CompileOptions())
    assert Counter(k for k, _, _ in collective_sequence(kept))["all_reduce"] == 2
    assert Counter(k for k, _, _ in collective_sequence(rest))["all_reduce"] == 1
    assert program_makespan(rest, mesh.profile) < program_makespan(kept, mesh.profile)


def _replicated_adamw_mlp(d_in: int, d_hidden: int, mesh) -> tuple:
    """(model, planned step) of a data-parallel AdamW MLP (3 layers, batch 16) on ``mesh``
    with every update replicated: every gradient arrives as a partial sum."""
    torch.manual_seed(0)
    model = MLP(d_in=d_in, d_hidden=d_hidden, d_out=8, depth=3)
    batch = (torch.randn(16, d_in), torch.randn(16, 8))
    placements = {"input0": "(S0)", "input1": "(S0)"} | {k: "(B)" for k, _ in model.named_parameters()}
    opts = CompileOptions.from_kwargs(placements=placements, move_activations=False, decouple=False)
    gm = pipeline.trace_step(model, batch, F.mse_loss, torch.optim.AdamW(model.parameters()), opts)
    pipeline.plan(gm, mesh, opts, pipeline.resolve_placements(gm, opts.placements, 1))
    replicate_updates(gm, mesh)
    return model, gm


@pytest.mark.parametrize("latency, decouples", [(0.0, True), (1.0, False)])
def test_the_start_up_of_the_gathers_decoupling_adds_is_charged(latency, decouples):
    """Decoupling every update of a data-parallel plan (every gradient arrives as a partial
    sum) adds one bucket of all-gathers. On NCCL a reduce-scatter + all-gather moves what
    the all-reduce did, so on a start-up-free link every update moves onto its shard; with
    a start-up far dearer than the update compute the shards save, none does."""
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(latency, 1e9)], profile="dgx-h100-ib")
    model, gm = _replicated_adamw_mlp(16, 32, mesh)
    done = decouple(gm, mesh, "forward")
    assert sorted(done) == (sorted(k for k, _ in model.named_parameters()) if decouples else [])


@pytest.mark.parametrize("latency", [1e-5, 8e-5, 3.2e-4])
def test_decoupling_never_makes_the_lowered_program_model_slower(latency):
    """Gloo runs a reduce-scatter as an all-reduce, so decoupling adds an all-gather bucket
    and puts the decoupled gradients in a reduce-scatter bucket beside the all-reduce one:
    two start-ups. Where the updates decouple, the lowered program models no slower than
    with every gradient all-reduced; at 0.32 ms a start-up (the MLP's updates save less
    than two) none decouples, where charging the all-gather's start-up alone decoupled all
    six and modeled 7% slower."""
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(latency, 1e11)], profile=FAST_GLOO)
    _, gm = _replicated_adamw_mlp(64, 512, mesh)
    plain = copy.deepcopy(gm)
    done = decouple(gm, mesh, "forward")
    assert bool(done) == (latency < 3e-4)
    for program in (gm, plain):
        pipeline.lower(program, mesh, (0,), axis_group_names(mesh), CompileOptions())
    assert program_makespan(gm, mesh.profile) <= program_makespan(plain, mesh.profile)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_clipping_keeps_each_update_to_its_own_parameter(opt_name):
    """With clip_grad_norm every update reads the clipping coefficient, computed from every
    parameter's norm term: the update chain of a parameter stops at it (as at the learning
    rate), so decoupling never re-places another parameter's norm term (which stopped
    compile: "no redistribution of mul from (S0) to (P)"), and the step with
    decouple="always" on a fast link trains like eager clipping."""
    from passes.canonicalize import canonicalize
    from passes.decouple import gradient_scalars, update_chain
    from passes.sharding import shard
    from ddlc.ir import STEP
    from ddlc.sbp import parse_sbp
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 8))
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(3)]
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4)}[opt_name]
    gm = canonicalize(ddlc.trace(model, data[0], F.mse_loss, make(model), clip_grad_norm=0.1))
    shared = gradient_scalars(gm.graph)
    assert shared and all(n.meta["val"].dim() == 0 for n in shared)
    chains = {key: set(update_chain(gm, key)[0]) for key, _ in STEP(gm).optimizer}
    assert all(not (chain & shared) for chain in chains.values())
    assert all(not (a & b) or all(n.meta["val"].dim() == 0 for n in a & b)  # only hyper-parameters
               for k, a in chains.items() for j, b in chains.items() if k < j)
    unclipped = canonicalize(ddlc.trace(model, data[0], F.mse_loss, make(model)))
    assert gradient_scalars(unclipped.graph) == set()
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(1e-7, 1e10)])
    sig = STEP(gm)
    shard(gm, mesh, fixed={sig.input_name("input", k): parse_sbp("(S0)") for k in sig.keys("input")})
    decouple(gm, mesh, "forward", always=True)
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, {}, data)
    opt, want = make(eager), []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(eager(x), y)
        want.append(loss.detach())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.1)
        opt.step()
    torch.testing.assert_close(torch.stack(list(losses)), torch.stack(want), rtol=1e-5, atol=1e-6)
    for k, p in eager.named_parameters():
        torch.testing.assert_close(params[k], p.detach(), rtol=1e-5, atol=1e-6)


def test_a_chain_that_reads_a_partial_sum_is_not_split():
    """A plan may keep an update's intermediate a partial sum (``lerp`` of a second moment
    as ``(P),(P),(B)->(P)``, all-reduced before its ``sqrt``: valid, and found by fuzzing
    random plans). Splitting the node that produces it, or the state it reads as ``P``,
    would need a split turned into a partial sum, which no collective does (lowering
    stopped with a LoweringError on about a third of such plans): that update keeps its
    all-reduce."""
    from ddlc.sbp import B, NdSBP, P, S
    from ddlc.ir import NdSignature
    from passes.decouple import _redistributable

    graph = torch.fx.Graph()
    grad = graph.placeholder("grad")
    moment = graph.call_function(torch.ops.aten.mul.Tensor, (grad, grad))
    mixed = graph.call_function(torch.ops.aten.lerp.Scalar, (moment, moment, 0.5))
    partial, split, whole = NdSBP((P,)), NdSBP((S(0),)), NdSBP((B,))
    as_partial = {grad: NdSignature((), (whole,)), moment: NdSignature((whole, whole), (split,)),
                  mixed: NdSignature((partial, partial), (partial,))}
    as_split = {**as_partial, mixed: NdSignature((split, split), (split,))}
    for node in (grad, moment, mixed):
        node.meta["val"] = torch.empty(4)
    assert not _redistributable([moment, mixed], as_partial)
    assert _redistributable([moment, mixed], as_split)


def test_an_update_whose_new_parameter_is_planned_partial_keeps_its_all_reduce():
    """A plan may take an update's new parameter as a partial sum (its getitem ``(P)``, the
    loop edge then all-reduces it): decoupling that update would read a split as ``P``,
    which no redistribution does (LoweringError on a third of random decoupled plans), so
    it keeps its all-reduce, and the step still matches one device."""
    import operator

    from ddlc.fused_update import OP
    from ddlc.ir import NdSignature
    from ddlc.sbp import parse_sbp
    gm, mesh, model, data = data_parallel_mlp("sgd")
    replicate_updates(gm, mesh)
    update = next(n for n in gm.graph.nodes if n.target is OP)
    item = next(u for u in update.users if u.target is operator.getitem and u.args[1] == 0)
    partial = parse_sbp("(P)")
    SHARDING.set(item, NdSignature((partial,), (partial,)))
    done = decouple(gm, mesh, "backward", always=True)
    assert update.args[2].name not in {i.name for i in gm.meta["ddlc_step"].inputs if i.key in done}
    assert len(done) == len(list(model.parameters())) - 1
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, opt_state, _ = simulate_steps(gm, mesh, params, {}, data)
    assert_matches_reference({"losses": losses, "params": params, "opt_state": opt_state},
                             reference("mlp", "sgd", batch=DP_BATCH))
