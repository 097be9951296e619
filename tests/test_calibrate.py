"""The calibration fits recover known links per collective, and the measured profile loads
as a Mesh whose collectives it prices."""
import json

import pytest
import torch

import ddlc
from ddlc.calibrate import RING, SIZES, collective_groups, fit_errors, fit_ring, measure_compute


def test_fit_recovers_alpha_and_bandwidth_from_ring_times():
    alpha, bandwidth, p = 30e-6, 3e9, 4
    times = [2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bandwidth for n in SIZES]
    fitted_alpha, fitted_bandwidth = fit_ring("all_reduce", SIZES, times, p)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-6)


@pytest.mark.parametrize("kind", sorted(RING))
def test_each_collectives_fit_recovers_its_own_ring(kind):
    alpha, bandwidth, p = 2e-3, 4e8, 4
    a, b = RING[kind](p)
    times = [a * alpha + b * n / bandwidth for n in SIZES]
    fitted_alpha, fitted_bandwidth = fit_ring(kind, SIZES, times, p)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_a_calibrated_profiles_factors_price_its_collectives(tmp_path):
    """What ``calibrate`` writes (the all-reduce's fit as the links, every other kind as
    factors against it) prices each kind as its own fit."""
    from cost_models.collectives import axis_time
    link = {"latency": 1e-3, "bandwidth": 7e8}
    profile = {"name": "here", "devices_per_node": 64, "flops": {"float32": 1e10},
               "memory_bandwidth": 3e9, "memory_capacity": 8e9,
               "links": {"intra_node": link, "inter_node": link},
               "collective_factors": {"all_gather": {"latency": 2.0, "bandwidth": 0.5}}}
    path = tmp_path / "here.json"
    path.write_text(json.dumps(profile))
    mesh = ddlc.Mesh((4,), profile=str(path))
    n = 2**20
    a, b = RING["all_gather"](4)
    assert axis_time("all_gather", n, mesh, 0) == pytest.approx(a * 2e-3 + b * n / 3.5e8)
    a, b = RING["all_reduce"](4)
    assert axis_time("all_reduce", n, mesh, 0) == pytest.approx(a * 1e-3 + b * n / 7e8)


def test_measured_compute_is_positive_and_profile_loads(tmp_path):
    flops, memory, cache = measure_compute(n=128)
    assert flops > 1e6 and memory > 1e6 and cache > 1e6
    profile = {"name": "here", "devices_per_node": 64, "flops": {"float32": flops},
               "memory_bandwidth": memory, "memory_capacity": 8e9,
               "links": {"intra_node": {"latency": 1e-4, "bandwidth": 1e9},
                         "inter_node": {"latency": 1e-4, "bandwidth": 1e9}}}
    path = tmp_path / "here.json"
    path.write_text(json.dumps(profile))
    mesh = ddlc.Mesh((2, 2), profile=str(path))
    assert mesh.profile.flops_for("float32") == flops and mesh.links[0].latency == 1e-4


def test_roofline_uses_the_cache_bandwidth_for_small_ops():
    import torch

    from cost_models.compute import op_time
    from ddlc.mesh import HardwareProfile, LinkModel
    link = LinkModel(1e-5, 1e9)
    base = dict(name="c", devices_per_node=8, flops=(("float32", 1e12),), memory_bandwidth=1e9,
                memory_capacity=1e9, intra_node=link, inter_node=link)
    flat = HardwareProfile(**base)
    cached = HardwareProfile(**base, cache_bytes=2**20, cache_bandwidth=1e10)
    small, large = (torch.empty(n, device="meta") for n in (1024, 2**20))
    add = torch.ops.aten.add.Tensor
    # 3 tensors of 4 KiB fit the cache: 10x faster; of 3 x 4 MiB, the first MiB moves at
    # the cache's bandwidth and the other 11 at memory's
    assert op_time(add, (small, small), {}, small, cached) == pytest.approx(
        op_time(add, (small, small), {}, small, flat) / 10)
    assert op_time(add, (large, large), {}, large, cached) == pytest.approx(2**20 / 1e10 + 11 * 2**20 / 1e9)
    assert op_time(add, (large, large), {}, large, flat) == pytest.approx(12 * 2**20 / 1e9)


def test_calibrated_profile_is_measured_on_first_use_then_cached(tmp_path, monkeypatch):
    import ddlc.calibrate as calibrate
    monkeypatch.setenv("DDLC_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(world_size, name):
        calls.append(world_size)
        link = {"latency": 2e-4, "bandwidth": 7e8}
        return {"name": name, "devices_per_node": 64, "flops": {"float32": 1e10},
                "memory_bandwidth": 4e9, "memory_capacity": 8e9,
                "links": {"intra_node": link, "inter_node": link}}
    monkeypatch.setattr(calibrate, "calibrate", fake)
    path = calibrate.calibrated_profile(4)
    assert calibrate.calibrated_profile(4) == path and calls == [4]   # second call: the cache
    assert path.startswith(str(tmp_path))
    mesh = ddlc.Mesh((2, 2), profile=path)
    assert mesh.profile.name == "calibrated-4" and mesh.links[0].latency == 2e-4
    calibrate.calibrated_profile(4, refresh=True)
    assert calls == [4, 4]


def test_contention_fit_recovers_known_factors():
    """Five factors from seven steps; the 2-D steps' collectives (on 2 of 4 ranks: one
    ring step for every three of the whole group's) tell start-ups from a cost per
    collective."""
    from ddlc.calibrate import fit_contention
    modeled = [(80e-3, 250, 5e-3, 50e-3, 2e-3), (4e-3, 250, 5e-3, 50e-3, 2e-3), (4.5e-3, 990, 4e-3, 4e-3, 1e-3),
               (4.5e-3, 990, 40e-3, 4e-3, 12e-3), (8e-3, 250, 6e-3, 33e-3, 3e-3),
               (9e-3, 260, 4e-3, 20e-3, 5e-3), (5e-3, 1000, 8e-3, 3e-3, 10e-3)]
    measured = [2.5 * c + 8e-6 * n + 0.5 * s + 1.2 * b + 3.0 * k for c, n, s, b, k in modeled]
    assert fit_contention(modeled, measured) == pytest.approx((2.5, 8e-6, 0.5, 1.2, 3.0), rel=1e-6)


def test_the_2d_reference_steps_split_the_batch_and_the_layers_over_two_axes():
    """On 4 ranks a 2-D reference plan is (2, 2), batch on the first axis, each weight
    split on the second (rows, columns alternately), and the planner lowers it to
    collectives on the second axis's groups; on 2 ranks there is none."""
    from ddlc import pipeline
    from ddlc.calibrate import NARROW, _mesh_2d, _reference_plan
    from ddlc.ir import COLLECTIVE
    from ddlc.mesh import Mesh
    from ddlc.options import CompileOptions
    from ddlc.simulate import axis_group_names
    from ddlc.zoo import MLP
    model = MLP(**NARROW)
    shape, placements = _reference_plan(model, "2d", 4)
    assert shape == (2, 2) and _mesh_2d(2) is None and _mesh_2d(6) == (2, 3)
    assert placements["layers.0.weight"] == "(B, S0)" and placements["layers.1.weight"] == "(B, S1)"
    assert placements["layers.1.bias"] == "(B, B)" and placements["input0"] == "(S0, B)"
    batch = (torch.randn(64, NARROW["d_in"]), torch.randn(64, NARROW["d_out"]))
    options = CompileOptions.from_kwargs(decouple=False)
    gm = pipeline.trace_step(model, batch, torch.nn.functional.mse_loss, torch.optim.AdamW(model.parameters()),
                             options)
    mesh = Mesh(shape)
    pipeline.plan(gm, mesh, options, pipeline.resolve_placements(gm, placements, 2))
    pipeline.lower(gm, mesh, (0, 0), axis_group_names(mesh), options)
    axes = {COLLECTIVE(n).axis for n in gm.graph.nodes if COLLECTIVE.has(n)}
    assert axes == {0, 1}    # gradients over the batch axis, activations over the layers' axis


def test_the_report_shows_the_contention_fit():
    from ddlc.calibrate import format_fit
    link = {"latency": 1e-3, "bandwidth": 7e8}
    profile = {"links": {"intra_node": link}, "fit": {},
               "contention": {"local_ranks": 4, "compute": 2.4, "per_operator": 1.3e-5, "startup": 0.5,
                              "transfer": 1.4, "per_collective": 3.1,
                              "fit": [{"step": "mlp dp", "measured": 0.05, "model": 0.052, "error": 0.04}]}}
    text = format_fit(profile)
    assert "operators 2.40x their time alone + 13.0 us" in text
    assert "0.50x the links' start-ups plus 3.10 start-ups each" in text
    assert "mlp dp" in text and "+4.0%" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_contention_is_measured_on_reference_steps_and_loads_into_a_profile(tmp_path, monkeypatch):
    """Two small reference steps on 2 gloo ranks: each is compiled, modeled (compute,
    operators, start-ups, transfers) and timed, the fit is recorded per step, and the
    profile with the contention loads and prices in measured mode on 2 ranks only."""
    from ddlc.calibrate import measure_contention
    from ddlc.mesh import HardwareProfile
    monkeypatch.setenv("DDLC_CACHE_DIR", str(tmp_path))
    link = {"latency": 1e-3, "bandwidth": 7e8}
    profile = {"name": "here", "devices_per_node": 64, "flops": {"float32": 1e10},
               "memory_bandwidth": 3e9, "memory_capacity": 8e9,
               "links": {"intra_node": link, "inter_node": link}}
    tiny = dict(d_in=8, d_hidden=16, d_out=4, depth=4)
    reference = (("tiny dp", tiny, 16, "dp"), ("tiny dp unfused", tiny, 16, "unfused"), ("tiny 2-D", tiny, 16, "2d"))
    contention = measure_contention(2, profile, reference)   # no 2-D mesh of 2 ranks: that step left out
    assert contention["local_ranks"] == 2 and [r["step"] for r in contention["fit"]] == ["tiny dp", "tiny dp unfused"]
    fused, unfused = contention["fit"]
    assert all(r["measured"] > 0 and r["compute"] > 0 and r["operators"] > 0 for r in (fused, unfused))
    assert unfused["startups"] > fused["startups"] > 0   # one all-reduce per gradient, not a bucket
    assert unfused["links"] > fused["links"] > 0 and "per_collective" in contention
    assert not list(tmp_path.rglob("measured-*"))   # timed afresh, in a cache of its own
    loaded = HardwareProfile.from_dict(profile | {"contention": contention, "compute": "measured"})
    assert loaded.shared_cores.per_operator == contention["per_operator"]
    assert loaded.for_local_ranks(2) is loaded and loaded.for_local_ranks(4).contention is None


def test_one_fit_over_groups_of_several_sizes_recovers_the_link():
    """Times of 4-rank and 2-rank rings of one link: fitted together, each with its ring's
    steps, they give that link back, and the errors name each row's group size."""
    alpha, bandwidth = 5e-4, 1e9
    sizes, times, ranks = [], [], []
    for p in (4, 2):
        a, b = RING["all_gather"](p)
        sizes += SIZES
        times += [a * alpha + b * n / bandwidth for n in SIZES]
        ranks += [p] * len(SIZES)
    fitted = fit_ring("all_gather", sizes, times, ranks)
    assert fitted == pytest.approx((alpha, bandwidth), rel=1e-6)
    rows = fit_errors(sizes, times, ranks, *fitted, kind="all_gather")
    assert [r["ranks"] for r in rows] == ranks
    assert max(abs(r["error"]) for r in rows) < 1e-6


def test_collectives_are_timed_on_the_world_and_on_each_axis():
    assert collective_groups(4) == [("world", [[0, 1, 2, 3]]),
                                    ("2x2(dp,tp) axis 0", [[0, 2], [1, 3]]),
                                    ("2x2(dp,tp) axis 1", [[0, 1], [2, 3]])]
    assert collective_groups(2) == [("world", [[0, 1]])]
    assert collective_groups(8, (2, 1, 4)) == [("2x1x4(dp,tp,pp) axis 0", [[0, 4], [1, 5], [2, 6], [3, 7]]),
                                               ("2x1x4(dp,tp,pp) axis 2", [[0, 1, 2, 3], [4, 5, 6, 7]])]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_every_group_of_an_axis_times_its_collectives_at_once():
    """4 gloo ranks build every group of each axis (the same groups in the same order on
    every rank, or they would hang) and time each collective on their own."""
    from ddlc.calibrate import _collective_times
    from ddlc.launch import spawn
    groups = collective_groups(4)
    results = spawn(_collective_times, 4, groups, 2, [4096, 65536], timeout=120, deadline=170)
    for times, *compute in results:
        assert sorted(times) == sorted(label for label, _ in groups)
        for per_kind in times.values():
            assert sorted(per_kind) == sorted(RING)
            assert all(len(t) == 2 and min(t) > 0 for t in per_kind.values())
        assert all(x > 0 for x in compute)
