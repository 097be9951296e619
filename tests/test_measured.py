"""Measured compute mode (cost_models/measured.py): operator times measured on this machine,
cached on disk per hardware profile, with the roofline scaled by the op's measured ratio
for what was not measured; ``compute="measured"`` selects it."""
from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources

import pytest
import torch

import ddlc
from conftest import GLOO_ALONE as GLOO, assert_matches_reference, batches, model_and_loss, optimizer, reference
from cost_models import measured
from cost_models.compute import op_time
from cost_models.program import order_makespan, program_timeline
from ddlc import pipeline
from ddlc.errors import OptionError
from ddlc.mesh import Contention, HardwareProfile, Mesh, load_profile
from ddlc.options import CompileOptions
from ddlc.runtime import _mesh_for_world
from ddlc.simulate import axis_group_names, simulate_steps
from ddlc.zoo import MLP

aten = torch.ops.aten
#: the default CPU profile without its measured contention: operator times as measured alone


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own cache directory and a fresh set of in-memory tables."""
    monkeypatch.setenv("DDLC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DDLC_MEASURE_BUDGET", raising=False)
    monkeypatch.setenv("DDLC_SHARING", "1")
    monkeypatch.setattr(measured, "_TABLES", {})
    return tmp_path / "cache"


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_option_selects_measured_mode_and_keeps_roofline_default():
    assert CompileOptions().compute == "roofline" and CompileOptions().profile is None
    assert load_profile("dgx-h100-ib").compute == "roofline"
    profile = measured.measured_profile(load_profile("dgx-h100-ib"))
    assert profile.compute == "measured" and profile.name == "dgx-h100-ib"
    assert measured.base_profile(profile) == load_profile("dgx-h100-ib")
    with pytest.raises(OptionError, match="compute"):
        CompileOptions(compute="guess")


def test_measured_times_are_positive_and_cached_on_disk(cache):
    profile = measured.measured_profile(GLOO)
    a, b, out = meta(64, 64), meta(64, 64), meta(64, 64)
    t = op_time(aten.mm.default, (a, b), {}, out, profile)
    assert t > 0
    table = measured.table_for(profile)
    assert table.measured == 1 and len(table.entries) == 1
    # the second call is a cache hit: same value, nothing measured again
    assert op_time(aten.mm.default, (a, b), {}, out, profile) == t and table.measured == 1
    measured.flush_all()
    path = measured.cache_path(profile)
    assert path.parent == cache and path.name.startswith("measured-cpu-gloo-")
    entries = json.loads(path.read_text())["entries"]
    assert list(entries.values())[0][1] == t
    # another process (a fresh table) reads it back without measuring
    fresh = measured.MeasuredTable(path)
    assert fresh.seconds(aten.mm.default, (a, b), {}, 1.0) == t and fresh.measured == 0


def test_cache_is_keyed_by_profile_and_thread_count():
    cpu = measured.measured_profile(GLOO)
    dgx = measured.measured_profile(load_profile("dgx-h100-ib"))
    assert measured.cache_path(cpu) != measured.cache_path(dgx)
    assert measured.cache_path(cpu, threads=1) != measured.cache_path(cpu, threads=2)
    assert measured.cache_path(cpu) == measured.cache_path(measured.base_profile(cpu))


def test_non_operators_and_collectives_are_not_measured():
    profile = measured.measured_profile(GLOO)
    x = meta(8, 8)
    assert op_time(lambda *a: None, (x,), {}, x, profile) == 0.0
    # a collective is never run alone (it would wait for its peers): priced by the roofline
    all_reduce = torch.ops._c10d_functional.all_reduce.default
    assert op_time(all_reduce, (x, "sum", "0"), {}, x, profile) == op_time(
        all_reduce, (x, "sum", "0"), {}, x, measured.base_profile(profile))
    assert measured.table_for(profile).measured == 0


def test_views_are_measured_as_they_run(cache):
    """A view moves no byte (the roofline prices it 0) but each call costs its dispatch:
    measured mode times it, far below a copy of the same tensor; a view it has not
    measured (the budget spent) stays free."""
    profile = measured.measured_profile(GLOO)
    x, flat = meta(1024, 1024), meta(1024 * 1024)
    view = op_time(aten.view.default, (x, [1024 * 1024]), {}, flat, profile)
    copy = op_time(aten.clone.default, (x,), {}, x, profile)
    assert measured.table_for(profile).measured == 2
    assert 0 < view < copy / 10
    assert op_time(aten.view.default, (x, [1024, 1024]), {}, x, measured.base_profile(profile)) == 0.0
    measured.table_for(profile).spent = math.inf
    assert op_time(aten.t.default, (x,), {}, x, profile) == 0.0
    assert measured.table_for(profile).measured == 2


def test_unseen_shapes_fall_back_to_the_roofline_scaled_by_the_ops_measured_ratio(cache):
    """Hand-computed: add measured at two shapes as 3x and 5x its roofline; a third shape,
    not measured (budget spent), costs its roofline x median(3, 5) = 4x; an op never
    measured costs its plain roofline."""
    profile = GLOO
    table = measured.MeasuredTable(cache / "t.json", budget=0.0)
    add = aten.add.Tensor
    r1 = op_time(add, (meta(1024), meta(1024)), {}, meta(1024), profile)
    r2 = op_time(add, (meta(4096), meta(4096)), {}, meta(4096), profile)
    for n, r, factor in ((1024, r1, 3.0), (4096, r2, 5.0)):
        key = measured.op_key(add, (meta(n), meta(n)), {})
        table.entries[key] = (str(add), factor * r, r)
    r3 = op_time(add, (meta(2**18), meta(2**18)), {}, meta(2**18), profile)
    assert 3 * 2**20 > profile.cache_bytes   # 3 tensors of 1 MiB: the excess from memory
    assert r3 == pytest.approx(profile.cache_bytes / profile.cache_bandwidth
                               + (3 * 2**20 - profile.cache_bytes) / profile.memory_bandwidth)
    assert table.seconds(add, (meta(2**18), meta(2**18)), {}, r3) == pytest.approx(4.0 * r3)
    assert table.ratio(str(aten.mul.Tensor)) == 1.0
    assert table.seconds(aten.mul.Tensor, (meta(8), meta(8)), {}, 2e-6) == 2e-6
    assert table.measured == 0


def test_an_op_whose_made_up_inputs_fail_falls_back(cache):
    table = measured.MeasuredTable(cache / "t.json")
    # view_copy of 6 elements to 7: the call fails on real tensors
    assert table.seconds(aten.view_copy.default, (meta(6), [7]), {}, 1e-6) == 1e-6
    assert len(table.failed) == 1 and not table.entries


def test_sharing_scales_measured_times(monkeypatch):
    profile = measured.measured_profile(GLOO)
    args, out = (meta(32, 32), meta(32, 32)), meta(32, 32)
    alone = op_time(aten.mm.default, args, {}, out, profile)
    monkeypatch.setenv("DDLC_SHARING", "2")
    assert op_time(aten.mm.default, args, {}, out, profile) == pytest.approx(2 * alone)


def test_keys_distinguish_shapes_dtypes_strides_and_arguments():
    x, y = meta(4, 8), meta(4, 8, dtype=torch.float64)
    t = torch.empty(8, 4, device="meta").t()   # (4, 8), not contiguous
    keys = {measured.op_key(aten.sum.dim_IntList, (z, [d]), {}) for z in (x, y, t) for d in (0, 1)}
    assert len(keys) == 6
    assert measured.op_key(aten.mm.default, (x, object()), {}) is None


def _train_measured(rank):
    torch.manual_seed(0)
    model = MLP(d_in=8, d_hidden=16, d_out=4, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    step = ddlc.compile(model, (2,), (x, y), torch.nn.functional.mse_loss, opt, compute="measured")
    losses = [float(step.step(x, y)) for _ in range(2)]
    measured.flush_all()
    contention = {}
    for local in (2, 8):   # a contention is kept only for as many local ranks as run here
        profile = dataclasses.replace(load_profile("cpu-gloo"), contention=Contention(local, 2.0, 1e-5, 1.0, 1.0))
        mesh, _, _ = _mesh_for_world((2,), CompileOptions.from_kwargs(compute="measured", profile=profile))
        contention[local] = mesh.profile.shared_cores
    return losses, step.mesh.profile.compute, step.timeline().makespan, contention


@pytest.mark.multiprocess
def test_a_plan_in_measured_mode_compiles_and_runs(cache):
    (losses, compute, makespan, contention), _ = ddlc.spawn(_train_measured, 2, timeout=120, deadline=300)
    assert contention == {2: Contention(2, 2.0, 1e-5, 1.0, 1.0), 8: None}
    torch.manual_seed(0)
    model = MLP(d_in=8, d_hidden=16, d_out=4, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    expected = []
    for _ in range(2):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)
    assert compute == "measured" and makespan > 0 and math.isfinite(makespan)
    assert any(cache.glob("measured-cpu-gloo-*.json"))


def test_peers_of_rank0_read_its_file_instead_of_measuring(cache, monkeypatch):
    """In a process group only rank 0 measures; a peer takes the scaled roofline until rank
    0's file has the entry. Saving keeps an entry already in the file."""
    path = cache / "t.json"
    args = (meta(16, 16), meta(16, 16))
    peer = measured.MeasuredTable(path)
    monkeypatch.setattr(measured, "_measures_here", lambda: False)
    assert peer.seconds(aten.mm.default, args, {}, 3e-6) == 3e-6 and peer.measured == 0
    monkeypatch.setattr(measured, "_measures_here", lambda: True)
    rank0 = measured.MeasuredTable(path)
    t = rank0.seconds(aten.mm.default, args, {}, 3e-6)
    rank0.save()
    monkeypatch.setattr(measured, "_measures_here", lambda: False)
    peer._loaded_at = -math.inf   # as if a second had passed since it last read the file
    assert peer.seconds(aten.mm.default, args, {}, 3e-6) == t and peer.measured == 0
    other = measured.MeasuredTable(cache / "elsewhere.json")
    other.entries[measured.op_key(aten.mm.default, args, {})] = (str(aten.mm.default), 1.0, 3e-6)
    other.path, other._dirty = path, True
    other.save()
    assert measured.MeasuredTable(path).seconds(aten.mm.default, args, {}, 3e-6) == t


def test_a_measured_contention_prices_operators_in_measured_mode_and_collectives_in_both(monkeypatch):
    """Where the profile has a measured contention, measured mode takes operators at its
    compute factor times their time alone plus its per-operator seconds, and collectives at
    its start-up and transfer factors times the links'; ``$DDLC_SHARING`` still overrides
    the compute factor; roofline mode prices its collectives so too, and its operators on
    the roofline alone (whose FLOP/s were measured with every rank running)."""
    monkeypatch.delenv("DDLC_SHARING")
    base = GLOO
    plain = measured.measured_profile(base)
    shared = dataclasses.replace(plain, contention=Contention(4, 2.5, 1e-5, 3.0, 1.5))
    args, out = (meta(32, 32), meta(32, 32)), meta(32, 32)
    alone = op_time(aten.mm.default, args, {}, out, plain)   # no process group: sharing 1
    view = (aten.view.default, (meta(32, 32), [1024]), {}, meta(1024))   # measured as it runs
    view_alone = op_time(*view, plain)
    assert op_time(aten.mm.default, args, {}, out, shared) == pytest.approx(2.5 * alone + 1e-5)
    monkeypatch.setenv("DDLC_SHARING", "3")
    assert op_time(aten.mm.default, args, {}, out, shared) == pytest.approx(3 * alone + 1e-5)
    assert op_time(*view, shared) == pytest.approx(3 * view_alone + 1e-5)
    link = shared.link_for("all_reduce", base.intra_node)
    assert link.latency == pytest.approx(3.0 * base.intra_node.latency)
    assert link.bandwidth == pytest.approx(base.intra_node.bandwidth / 1.5)
    roofline = dataclasses.replace(shared, compute="roofline")
    assert roofline.shared_cores == shared.contention and roofline.link_for("all_reduce", base.intra_node) == link
    assert op_time(aten.mm.default, args, {}, out, roofline) == op_time(aten.mm.default, args, {}, out, base)
    assert measured.cache_path(shared) == measured.cache_path(plain)   # op times do not depend on it


def test_collectives_do_not_overlap_compute_where_ranks_share_cores():
    """With a contention (factors 1: the same task times), every collective runs on the
    compute stream: the makespan is the sum of all tasks, where without it the schedule
    hides communication behind the backward pass; the makespan-only arithmetic agrees.
    Roofline-priced, so that the program (and what it hides) does not depend on operator
    times measured on a loaded machine; the gradients' all-reduces unbucketed, so that each
    is issued as its gradient is ready (one bucket at the end would hide nothing)."""
    torch.manual_seed(0)
    model = MLP(d_in=64, d_hidden=256, d_out=8, depth=4)
    batch = (torch.randn(64, 64), torch.randn(64, 8))
    opts = CompileOptions.from_kwargs(fuse=False)
    gm = pipeline.trace_step(model, batch, torch.nn.functional.mse_loss,
                             torch.optim.SGD(model.parameters(), lr=0.1), opts)
    base = dataclasses.replace(GLOO, compute="roofline")
    mesh = Mesh((4,), profile=base)
    pipeline.plan(gm, mesh, opts, pipeline.resolve_placements(gm, {"input0": "(S0)"}, 1))
    pipeline.lower(gm, mesh, (0,), axis_group_names(mesh), opts)
    plain = program_timeline(gm, base)
    shared_profile = dataclasses.replace(base, contention=Contention(4, 1.0, 0.0, 1.0, 1.0))
    shared = program_timeline(gm, shared_profile)
    total = sum(plain.busy(s) for s in plain.streams)
    assert len(plain.streams) > 1 and shared.streams == ["compute"]
    assert plain.makespan < total - 1e-6     # something was hidden
    assert shared.makespan == pytest.approx(total)
    assert order_makespan(list(gm.graph.nodes), shared_profile) == pytest.approx(shared.makespan)


def test_a_contentions_cost_per_collective_is_start_ups_of_the_link_whatever_the_group():
    """``per_collective`` start-ups of the (kind-scaled) link become the link's overhead, on
    top of the scaled ring: an all-reduce over 2 ranks and one over 4 pay the same extra;
    a start-up-free (bucketed) link pays none."""
    from cost_models.collectives import axis_time
    base = dataclasses.replace(GLOO, collective_factors=(("all_gather", (1.5, 1.0)),))
    shared = dataclasses.replace(base, contention=Contention(4, 1.0, 0.0, 0.5, 1.0, per_collective=4.0))
    assert shared.link_for("all_reduce", base.intra_node).overhead == pytest.approx(4.0 * base.intra_node.latency)
    assert shared.link_for("all_gather", base.intra_node).overhead == pytest.approx(6.0 * base.intra_node.latency)
    alpha = base.intra_node.latency
    for shape in ((4,), (2, 2)):
        before, after = Mesh(shape, profile=dataclasses.replace(base, contention=Contention(4, 1, 0, 0.5, 1))), \
            Mesh(shape, profile=shared)
        for axis in range(len(shape)):
            assert axis_time("all_reduce", 4096, after, axis) == pytest.approx(
                axis_time("all_reduce", 4096, before, axis) + 4.0 * alpha)
    bucketed = Mesh((4,), profile=shared).bucketed()
    assert bucketed.profile.link_for("all_reduce", bucketed.links[0]).overhead == 0.0
    older = json.loads((resources.files("ddlc") / "profiles" / "cpu-gloo.json").read_text())
    older["contention"] = {"local_ranks": 4, "compute": 2, "per_operator": 0, "startup": 1, "transfer": 1}
    assert HardwareProfile.from_dict(older).contention.per_collective == 0   # a profile from before it


def test_a_contention_holds_only_for_as_many_local_ranks_as_it_was_measured_for():
    shared = dataclasses.replace(GLOO, contention=Contention(4, 2.0, 1e-5, 1.0, 1.0))
    assert shared.for_local_ranks(4) is shared
    assert shared.for_local_ranks(8).contention is None and shared.for_local_ranks(None).contention is None
    assert GLOO.for_local_ranks(4) is GLOO


def test_a_plan_priced_with_the_contention_matches_single_device():
    """The whole pipeline in measured mode with ``cpu-gloo``'s contention for 4 ranks
    (collectives serialised with compute in every timeline the lowering searches), on 4
    simulated ranks with AdamW: the same losses and parameters as one device."""
    profile = measured.measured_profile(load_profile("cpu-gloo"))
    assert profile.shared_cores is not None and profile.shared_cores.local_ranks == 4
    model, loss_fn = model_and_loss("gpt")
    data = batches("gpt")
    opts = CompileOptions.from_kwargs(compute="measured")
    gm = pipeline.trace_step(model, data[0], loss_fn, optimizer("adamw", model), opts)
    mesh = Mesh((4,), profile=profile)
    pipeline.plan(gm, mesh, opts, pipeline.resolve_placements(gm, {}, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data,
                                          compute="measured")
    assert_matches_reference({"losses": losses, "params": params}, reference("gpt", "adamw"))
