"""``pipeline.choose_plan``: the searched plan checked against data parallelism and replication by the
modeled step of mesh coordinate 0's lowered program; the chosen plan is adopted by every
rank and matches single device."""
import pytest
import torch

import ddlc
from conftest import TOLERANCES, assert_matches_reference, batches, model_and_loss, optimizer, reference
from ddlc import pipeline
from cost_models.program import program_makespan
from ddlc.ir import SHARDING, STEP, collective_sequence
from ddlc.launch import spawn
from ddlc.options import CompileOptions
from ddlc.mesh import load_profile
from distributed_cases import compiled_run_preferring_data_parallel, compiled_run_recording_the_kept_plan

#: a 0.1 us, 10 GB/s link: the search shards these small models instead of replicating them
FAST = ddlc.LinkModel(1e-7, 1e10)


def traced(name: str, batch: int = 4):
    model, loss_fn = model_and_loss(name)
    return pipeline.trace_step(model, batches(name, batch)[0], loss_fn, optimizer("adamw", model),
                               CompileOptions())


def placements(gm) -> dict[tuple[str, str], str]:
    """(role, key) -> the chosen placement of every graph input."""
    by_name = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    return {(i.role, i.key): str(SHARDING(by_name[i.name]).outputs[0]) for i in STEP(gm).inputs}


def is_data_parallel(gm) -> bool:
    chosen = placements(gm)
    return all(sbp == "(B)" for (role, _), sbp in chosen.items() if role == "param") and \
        all(sbp == "(S0)" for (role, _), sbp in chosen.items() if role == "input")


def is_replicated(gm) -> bool:
    return all(sbp == "(B)" for sbp in placements(gm).values())


def test_data_parallel_splits_the_batch_over_every_axis_and_replicates_parameters():
    gm = traced("gpt")
    pins = pipeline.data_parallel_placements(gm, ddlc.Mesh((2, 2)))
    step = STEP(gm)
    assert {str(pins[i.name]) for i in step.inputs if i.role == "param"} == {"(B, B)"}
    assert {str(pins[i.name]) for i in step.inputs if i.role == "input"} == {"(S0, S0)"}
    assert len(pins) == len([i for i in step.inputs if i.role in ("param", "input")])


def test_no_data_parallel_plan_for_a_batch_smaller_than_the_mesh():
    assert pipeline.data_parallel_placements(traced("gpt", batch=2), ddlc.Mesh((4,))) is None


@pytest.mark.parametrize("faster", ["data-parallel", "searched"])
def test_the_plan_whose_program_models_faster_is_kept(monkeypatch, faster):
    mesh = ddlc.Mesh((4,), links=[FAST])
    searched = traced("mlp")
    pipeline.plan(searched, mesh, CompileOptions(), {})
    assert not is_data_parallel(searched)  # else there is nothing to compare

    lowered = {}

    def lowered_step(g, *_, timeline=False):
        if is_replicated(g):  # the replication candidate (this MLP computes little): slowest here
            return 3.0, pipeline.LoweringChoices(2.0, 0.0, None), g, None
        data_parallel = is_data_parallel(g)
        lowered[data_parallel] = pipeline.LoweringChoices(float(data_parallel), 0.0, None)
        return (1.0 if data_parallel == (faster == "data-parallel") else 2.0), lowered[data_parallel], g, None

    monkeypatch.setattr(pipeline, "_lowered_step", lowered_step)
    gm = traced("mlp")
    plan, choices, program, _ = pipeline.choose_plan(gm, mesh, CompileOptions(), {})
    assert choices is lowered[faster == "data-parallel"]
    assert is_data_parallel(program) == (faster == "data-parallel")
    if faster == "data-parallel":
        assert is_data_parallel(gm)
        assert plan.stats["chosen_over_search"] is True
    else:
        assert "chosen_over_search" not in plan.stats
        assert plan.stats["searched_step"] == 1.0 and plan.stats["data_parallel_step"] == 2.0
        assert {n.name: SHARDING(n) for n in gm.graph.nodes if SHARDING.has(n)} == \
            {n.name: SHARDING(n) for n in searched.graph.nodes if SHARDING.has(n)}


def test_a_data_parallel_plan_that_cannot_be_made_is_reported(monkeypatch):
    """Where data parallelism cannot be planned (here: it is made to fail as over a memory
    budget would), the searched plan is kept and its report says why it was not compared."""
    from ddlc.errors import ShardingError
    from ddlc.report import format_report
    mesh = ddlc.Mesh((4,), links=[FAST])
    real_plan = pipeline.plan

    def plan(gm, mesh, options, fixed):
        if not options.move_activations:  # the data-parallel candidate's planning
            raise ShardingError("no sharding fits the memory budget of 1 KiB per device")
        return real_plan(gm, mesh, options, fixed)
    monkeypatch.setattr(pipeline, "plan", plan)
    chosen = pipeline.choose_plan(traced("mlp"), mesh, CompileOptions(), {})
    assert chosen.plan.stats["data_parallel_none"] == "no sharding fits the memory budget of 1 KiB per device"
    text = format_report(chosen.plan, [], _step(), [])
    assert "checked against data parallelism: none could be planned (no sharding fits" in text


def _step():
    from ddlc.report import StepBreakdown
    return StepBreakdown(1e-3, 1e-3, 0.0, 0.0, 1, 2, 1e-3)


def test_the_choices_fit_the_graph_every_rank_lowers():
    """choose_plan lowers a copy of the graph, and lowering's choices name its nodes (their
    order); another rank lowers the shipped graph (``ddlc.portable``), whose namespace
    knows the names of erased nodes, with them. On this ResNet a plain copy named a new
    node ``getitem_63`` that the shipped graph names ``getitem_80``."""
    import torch.nn.functional as F
    from ddlc.portable import from_portable, to_portable
    from ddlc.zoo import resnet18
    torch.manual_seed(0)
    model = resnet18(num_classes=10, width=4)
    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,)))
    gm = pipeline.trace_step(model, batch, F.cross_entropy, optimizer("sgd", model), CompileOptions())
    shipped = from_portable(to_portable(gm))
    mesh = ddlc.Mesh((4,))
    chosen = pipeline.choose_plan(gm, mesh, CompileOptions(), {})
    assert chosen.choices is not None and chosen.choices.order is not None
    decisions = {n.name: SHARDING(n) for n in gm.graph.nodes if SHARDING.has(n)}
    for node in shipped.graph.nodes:
        if node.name in decisions:
            SHARDING.set(node, decisions[node.name])
    # follows the order by node name: a LoweringError if the names differ
    pipeline.lower(shipped, mesh, (1,), ["axis0"], CompileOptions(), chosen.choices)
    assert collective_sequence(shipped) == collective_sequence(chosen.program)


def test_pins_leave_the_searched_plan_alone(monkeypatch):
    monkeypatch.setattr(pipeline, "_lowered_step", lambda *_: pytest.fail("no comparison expected"))
    gm = traced("mlp")
    fixed = pipeline.resolve_placements(gm, {"input0": "(S0)"}, 1)
    assert pipeline.choose_plan(gm, ddlc.Mesh((4,), links=[FAST]), CompileOptions(), fixed).choices is None


def test_a_pin_on_an_unknown_name_lists_the_batch_inputs():
    """A pin on a name the step does not have (a tied weight's second name, a typo) says
    which batch inputs there are and how parameters are named."""
    from ddlc.errors import UnsupportedInputError
    gm = traced("mlp")
    with pytest.raises(UnsupportedInputError, match="the batch inputs are input0, input1; .*tied weight"):
        pipeline.resolve_placements(gm, {"head.weight": "(S0)"}, 1)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [(4,), (2, 2)], ids=["4", "2x2"])
def test_a_data_parallel_plan_chosen_over_the_search_matches_single_device(mesh):
    """Rank 0 prefers data parallelism (its modeled step patched shorter); every rank
    adopts it by node name and the steps match single device."""
    cases = [("gpt", "adamw", "train", None, {"link": (1e-7, 1e10)})]
    world = mesh[0] * (mesh[1] if len(mesh) > 1 else 1)
    per_rank = spawn(compiled_run_preferring_data_parallel, world, mesh, cases, timeout=120, deadline=240)
    got = per_rank[0][0]
    assert got.pop("kept") == "data parallel"
    got.pop("collectives")
    assert got.pop("most_in_flight") <= 1   # gloo's functional collectives must not overlap
    assert_matches_reference(got, reference("gpt", "adamw"), "gpt/adamw",
                             **dict.fromkeys(TOLERANCES, (1e-4, 1e-5)))
    for results in per_rank[1:]:
        for a, b in zip(got["losses"], results[0]["losses"]):
            torch.testing.assert_close(a, b)


def _one_linear(batch: int):
    """The traced AdamW step of one Linear(8, 8) on a batch of ``batch`` rows."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return pipeline.trace_step(model, (torch.randn(batch, 8), torch.randn(batch, 8)),
                               torch.nn.functional.mse_loss, torch.optim.AdamW(model.parameters()),
                               CompileOptions())


def test_a_model_smaller_than_a_collective_is_replicated():
    """One Linear(8, 8) on 2 ranks: any plan that communicates pays a gloo start-up (about a
    millisecond with 2 ranks on 2 cores) for microseconds of compute, so the plan kept runs
    the whole step on every rank, and the report says so."""
    from ddlc.report import format_report
    gm = _one_linear(batch=8)
    chosen = pipeline.choose_plan(gm, ddlc.Mesh((2,)), CompileOptions(), {})
    stats = chosen.plan.stats
    assert stats["replicated_chosen"] is True
    assert stats["replicated_step"] < min(stats["searched_step"], stats["data_parallel_step"])
    assert is_replicated(gm)
    assert collective_sequence(chosen.program) == []
    text = format_report(chosen.plan, [], _step(), [])
    assert "checked against data parallelism and replication" in text and "kept replication" in text


def test_replication_is_weighed_where_no_batch_splits_over_every_device():
    """A batch of 2 on 4 devices has no data-parallel plan to compare with; replication was
    then not weighed either, and the one Linear(8, 8) kept a plan that communicates,
    modeled several times slower than running it whole on every rank."""
    gm = _one_linear(batch=2)
    chosen = pipeline.choose_plan(gm, ddlc.Mesh((4,)), CompileOptions(), {})
    stats = chosen.plan.stats
    assert "data_parallel_step" not in stats
    # and the report says why (it said nothing of data parallelism)
    assert "has 4 rows or more to split over the 4 devices" in stats["data_parallel_none"]
    assert stats["replicated_chosen"] is True and stats["replicated_step"] < stats["searched_step"]
    assert is_replicated(gm) and collective_sequence(chosen.program) == []


def test_replication_is_weighed_where_the_searched_plan_leaves_the_inputs_whole_but_communicates():
    """A two-layer MLP on 2x4 (cpu-gloo): the search left every input whole but split the
    batch inside the step, all-reducing a scalar (modeled 5.2 ms). Replication was taken
    for the searched plan and not weighed, though it runs the step in microseconds (``ddlc
    plan`` printed the searched plan)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    gm = pipeline.trace_step(model, (torch.randn(16, 32), torch.randint(0, 10, (16,))),
                             torch.nn.functional.cross_entropy, torch.optim.AdamW(model.parameters()),
                             CompileOptions())
    profile = load_profile("cpu-gloo").for_local_ranks(8)  # as ``ddlc plan`` prices 8 local ranks
    chosen = pipeline.choose_plan(gm, ddlc.Mesh((2, 4), profile=profile), CompileOptions(), {})
    stats = chosen.plan.stats
    assert stats["replicated_chosen"] is True and stats["replicated_step"] < stats["searched_step"]
    assert set(placements(gm).values()) == {"(B, B)"} and collective_sequence(chosen.program) == []


def test_replication_is_not_tried_for_a_model_it_cannot_win(monkeypatch):
    """The zoo GPT of the tests on (4,) with a fast link: its unsharded compute alone is
    modeled longer than the searched plan's step, so no replicated candidate is planned."""
    real = pipeline.plan_pinned

    def plan_pinned(gm, mesh, options, reference, *rest):
        assert not all(str(x) == "(B)" for x in reference.values()), "replication was planned"
        return real(gm, mesh, options, reference, *rest)
    monkeypatch.setattr(pipeline, "plan_pinned", plan_pinned)
    torch.manual_seed(0)
    model, loss_fn = model_and_loss("gpt")
    gm = pipeline.trace_step(model, batches("gpt", 64)[0], loss_fn, optimizer("adamw", model), CompileOptions())
    chosen = pipeline.choose_plan(gm, ddlc.Mesh((4,), links=[FAST]), CompileOptions(), {})
    assert "replicated_step" not in chosen.plan.stats
    # nor the plan searched with start-ups priced: the searched program is within its objective
    assert "startups_priced_step" not in chosen.plan.stats


def test_the_plan_searched_with_start_ups_priced_is_kept_where_the_search_left_them_out():
    """The search prices parameter traffic as bucketed, without start-ups, but a bucket
    shares one only among collectives of one kind, axis and time. The tests' wide MLP (32 -
    1024 x2 - 16, batch 8) on (2, 2) on the default CPU profile (4 gloo ranks on 2 cores):
    the searched plan's program pays start-ups its objective did not see, so the plan
    searched with every start-up priced is weighed too; its program models faster than
    the searched plan's, data parallelism's and replication's, and is kept."""
    gm = traced("mlp_wide")
    mesh = ddlc.Mesh((2, 2))
    chosen = pipeline.choose_plan(gm, mesh, CompileOptions(), {})
    stats = chosen.plan.stats
    assert stats["searched_step"] > stats["startups_priced_step"] * 1.2
    assert stats["startups_priced_chosen"] is True
    assert stats["startups_priced_step"] < min(stats["data_parallel_step"], stats["replicated_step"])
    assert program_makespan(chosen.program, mesh.profile) == pytest.approx(stats["startups_priced_step"])
    # replanning priced so gives the kept plan again: gm holds it
    again = pipeline.named_alike_copy(gm)
    pipeline.plan(again, mesh, CompileOptions(), {}, bucket_traffic=False)
    assert pipeline.decisions_of(again) == pipeline.decisions_of(gm)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_plan_searched_with_start_ups_priced_matches_single_device():
    """The plan above, kept by rank 0 and adopted by every rank of (2, 2) gloo processes,
    matches single device."""
    cases = [("mlp_wide", "adamw", "train", None)]
    per_rank = spawn(compiled_run_recording_the_kept_plan, 4, (2, 2), cases, timeout=120, deadline=240)
    got = per_rank[0][0]
    assert got.pop("kept") == "start-ups priced"
    assert got.pop("collectives")
    assert got.pop("most_in_flight") <= 1
    assert_matches_reference(got, reference("mlp_wide", "adamw"), "mlp_wide/adamw",
                             **dict.fromkeys(TOLERANCES, (1e-4, 1e-5)))
    for results in per_rank[1:]:
        for a, b in zip(got["losses"], results[0]["losses"]):
            torch.testing.assert_close(a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [(4,), (2, 2)], ids=["4", "2x2"])
def test_a_replicated_plan_matches_single_device(mesh):
    """The tests' CNN on 4 gloo ranks is modeled fastest replicated (its searched plan
    paid start-ups for tiny collectives): every rank adopts it and the steps match single
    device, with no collective."""
    cases = [("cnn", "adamw", "train", None)]
    per_rank = spawn(compiled_run_recording_the_kept_plan, 4, mesh, cases, timeout=120, deadline=240)
    got = per_rank[0][0]
    assert got.pop("kept") == "replicated"
    assert got.pop("collectives") == []
    assert got.pop("most_in_flight") == 0
    assert_matches_reference(got, reference("cnn", "adamw"), "cnn/adamw",
                             **dict.fromkeys(TOLERANCES, (1e-4, 1e-5)))
    for results in per_rank[1:]:
        for a, b in zip(got["losses"], results[0]["losses"]):
            torch.testing.assert_close(a, b)


def test_collections_deferred_restores_the_collector_even_on_an_error():
    """pipeline.collections_deferred: no cyclic collection within; the collector as it was
    on entry afterwards, also when the work inside raises (and left off if it was off)."""
    import gc

    from ddlc.pipeline import collections_deferred

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collections_deferred():
            assert not gc.isenabled()
            raise RuntimeError("a pass failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collections_deferred():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
