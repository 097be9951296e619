"""Collective ordering: issue early, wait late, same sequence on every rank, static checks,
a cap on live bytes, optimizer updates inside backward."""
import copy
import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

import ddlc
from conftest import (FAST_GLOO, GLOO_ALONE, assert_matches_reference, batches, model_and_loss, most_in_flight,
                      optimizer, replicate_updates, train)
from cost_models.program import live_bytes
from ddlc.errors import LoweringError
from ddlc.ir import COLLECTIVE, collective_sequence, is_collective as is_issue, is_wait
from ddlc.simulate import axis_group_names, lower_rank, simulate_steps
from ddlc.zoo import GPT, MLP, lm_loss
from passes.canonicalize import canonicalize
from passes.decouple import decouple
from passes.schedule import UPDATES, _eager, check_waits, schedule
from passes.sharding import shard
from passes.waits import wait_at_once

DP_GPT = {"input0": "(S0, S0)", "input1": "(S0, S0)"}


def _planned(mesh_shape, fixed_by_key):
    torch.manual_seed(0)
    model = GPT()
    batch = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    gm = canonicalize(ddlc.trace(model, batch, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1,
                                                                       momentum=0.9)))
    names = {i.key: i.name for i in gm.meta["ddlc_step"].inputs}
    mesh = ddlc.Mesh(mesh_shape, profile=GLOO_ALONE)  # collectives may overlap compute
    shard(gm, mesh, fixed={names[k]: ddlc.sbp.parse_sbp(v) for k, v in fixed_by_key.items()})
    return gm, mesh


@pytest.fixture(scope="module")
def planned():
    return _planned((2, 2), DP_GPT)


def _lowered(planned, coord, scheduled=True, **kw):
    """Rank ``coord``'s program, unfused unless asked (these tests isolate the scheduler)."""
    gm, mesh = planned
    return lower_rank(copy.deepcopy(gm), mesh, coord, ["g0", "g1"], schedule=scheduled, **{"fuse": False, **kw})


def _gaps(gm):
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    return {n.name: pos[next(iter(n.users))] - pos[n] for n in gm.graph.nodes if is_issue(n)}


def test_issue_early_wait_late(planned):
    plain, scheduled = _lowered(planned, (0, 0), False), _lowered(planned, (0, 0))
    before, after = _gaps(plain), _gaps(scheduled)
    assert before and all(gap == 1 for gap in before.values())  # inserted issue;wait pairs
    assert sum(after.values()) > 10 * len(after)  # waits moved far from their issues
    pos = {n: i for i, n in enumerate(scheduled.graph.nodes)}
    inputs_end = max(i for n, i in pos.items() if n.op == "placeholder")
    eager = _eager(list(scheduled.graph.nodes))
    for node in scheduled.graph.nodes:
        if is_issue(node):
            wait = next(iter(node.users))
            first_reader = min(pos[u] for u in wait.users)
            between = list(scheduled.graph.nodes)[pos[wait] + 1:first_reader]
            assert all(is_wait(n) for n in between)  # waited right before it is read
            if not any(is_wait(a) for a in node.all_input_nodes):  # not chained on another
                # issued as soon as its input exists: only other issues and their input
                # copies may come between its producer and it
                producer = max([inputs_end] + [pos[a] for a in node.all_input_nodes])
                between = list(scheduled.graph.nodes)[producer + 1:pos[node]]
                assert all(n in eager for n in between), [n.name for n in between]


def test_every_rank_gets_the_same_collective_sequence(planned):
    sequences = [collective_sequence(_lowered(planned, c)) for c in itertools.product(range(2), range(2))]
    assert sequences[0] and all(s == sequences[0] for s in sequences)


def test_schedule_is_deterministic(planned):
    a, b = _lowered(planned, (1, 0)), _lowered(planned, (1, 0))
    assert [n.name for n in a.graph.nodes] == [n.name for n in b.graph.nodes]


def test_inflight_cap_keeps_at_most_one_collective_outstanding(planned):
    assert most_in_flight(_lowered(planned, (0, 1), max_inflight_bytes=1)) <= 1


def test_check_waits_rejects_reading_a_collective_before_its_wait(planned):
    gm = _lowered(planned, (0, 0))
    issue = next(n for n in gm.graph.nodes if is_issue(n))
    wait = next(iter(issue.users))
    for user in list(wait.users):
        user.replace_input_with(wait, issue)
    with pytest.raises(LoweringError, match="read before"):
        check_waits(gm)


def test_a_gloo_rank_waits_for_each_collective_at_once(planned):
    """passes.waits: the scheduled program with every wait moved to right after its
    collective (gloo's functional collectives must not overlap); the collective sequence,
    the other nodes' order and the data flow stay."""
    scheduled = _lowered(planned, (0, 0))
    before = [n.name for n in scheduled.graph.nodes]
    assert max(_gaps(scheduled).values()) > 1
    waited = wait_at_once(copy.deepcopy(scheduled))
    assert set(_gaps(waited).values()) == {1}
    assert collective_sequence(waited) == collective_sequence(scheduled)
    after = [n.name for n in waited.graph.nodes]
    waits = {n.name for n in scheduled.graph.nodes if is_wait(n)}
    assert [n for n in after if n not in waits] == [n for n in before if n not in waits]
    check_waits(waited)


def test_scheduled_graph_still_runs_the_same_locally():
    """On a 1-device mesh nothing is communicated: scheduling must not change the numbers."""
    torch.manual_seed(0)
    model = MLP()
    batch = (torch.randn(8, 32), torch.randn(8, 16))
    gm = canonicalize(ddlc.trace(model, batch, F.mse_loss, torch.optim.AdamW(model.parameters())))
    mesh = ddlc.Mesh((1,))
    shard(gm, mesh)
    sig = gm.meta["ddlc_step"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    flat = sig.flatten(params, {}, sig.init_opt_state(params), batch)
    expected = gm(*flat)
    got = schedule(lower_rank(copy.deepcopy(gm), mesh, (0,), ["g"], schedule=False))(*flat)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)


def test_scheduling_hides_communication_in_the_modeled_timeline(planned):
    from cost_models.program import program_timeline
    mesh = planned[1]
    plain = program_timeline(_lowered(planned, (0, 0), False), mesh.profile)
    scheduled = program_timeline(_lowered(planned, (0, 0)), mesh.profile)
    assert plain.exposed_communication > 0
    assert scheduled.makespan < plain.makespan
    assert scheduled.exposed_communication < plain.exposed_communication
    assert scheduled.makespan >= scheduled.lower_bound - 1e-12


def _wide_mlp(steps):
    """A 3-block MLP of width 64 (hidden 128) and ``steps`` batches of 64 rows."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return MLP(64, 128, 64, depth=3), [(torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g))
                                       for _ in range(steps)]


@pytest.fixture(scope="module")
def prefetching():
    """A decoupled data-parallel MLP: its next-forward all-gathers, issued early, hold every
    layer's full weight at once, which raises the peak. Also the single-device run of its
    two steps."""
    model, data = _wide_mlp(2)
    gm = canonicalize(ddlc.trace(model, data[0], F.mse_loss, optimizer("adamw", model)))
    names = {i.key: i.name for i in gm.meta["ddlc_step"].inputs}
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(1e-7, 1e10)], profile=FAST_GLOO)
    pins = dict.fromkeys(["input0", "input1"], "(S0)") | {k: "(B)" for k, _ in model.named_parameters()}
    shard(gm, mesh, fixed={names[k]: ddlc.sbp.parse_sbp(v) for k, v in pins.items()})
    replicate_updates(gm, mesh)
    decouple(gm, mesh, "forward")
    return gm, mesh, model, data, train(copy.deepcopy(model), F.mse_loss, "adamw", data)


def _peak(gm):
    return max(live_bytes(list(gm.graph.nodes)))


def test_memory_cap_keeps_issue_early_from_raising_the_peak(prefetching):
    from cost_models.program import program_timeline
    gm, mesh, model, data, want = prefetching

    def lowered(coord=(0,), **kw):
        return lower_rank(copy.deepcopy(gm), mesh, coord, axis_group_names(mesh), **{"fuse": False, **kw})
    cap = _peak(lowered(schedule=False))
    free, capped = lowered(), lowered(max_live_bytes=cap)
    assert _peak(free) > cap >= _peak(capped)
    assert program_timeline(free, mesh.profile).peak_memory > cap >= program_timeline(capped, mesh.profile).peak_memory
    check_waits(capped)
    assert max(_gaps(capped).values()) > 1  # still issued early where memory allows
    sequences = [collective_sequence(lowered((r,), max_live_bytes=cap)) for r in range(4)]
    assert all(s == sequences[0] for s in sequences)
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, {}, data, max_live_bytes=cap)
    assert_matches_reference({"losses": losses, "params": params}, want)


#: CPU-speed compute with a backend that runs reduce-scatter natively (as NCCL does; gloo
#: emulates it with an all-reduce, which makes decoupling not pay)
NATIVE_RS = ddlc.mesh.HardwareProfile.from_dict({
    "name": "cpu-native-rs", "devices_per_node": 64, "flops": {"float32": 2e10},
    "memory_bandwidth": 1e10, "memory_capacity": 8e9,
    "links": dict.fromkeys(["intra_node", "inter_node"], {"latency": 1e-7, "bandwidth": 1e10})})


@functools.lru_cache(maxsize=None)
def _decoupled(model_name, link_bandwidth):
    """A data-parallel AdamW step on (4,) over links of ``link_bandwidth`` bytes/s, updates on
    shards (reduce-scatter) with their all-gathers in the same step; the model, 3 batches and
    their single-device results."""
    if model_name == "mlp":
        (model, data), loss_fn = _wide_mlp(3), F.mse_loss
    else:  # "gpt" or "gpt_tied": the embedding is also the LM head, read in both places
        (model, loss_fn), data = model_and_loss(model_name), batches("gpt", 8)
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer("adamw", model)))
    names = {i.key: i.name for i in gm.meta["ddlc_step"].inputs}
    mesh = ddlc.Mesh((4,), profile=NATIVE_RS, links=[ddlc.LinkModel(1e-7, link_bandwidth)])
    pins = dict.fromkeys(["input0", "input1"], "(S0)") | {k: "(B)" for k, _ in model.named_parameters()}
    shard(gm, mesh, fixed={names[k]: ddlc.sbp.parse_sbp(v) for k, v in pins.items()})
    replicate_updates(gm, mesh)
    assert decouple(gm, mesh, "backward")
    return gm, mesh, model, data, train(copy.deepcopy(model), loss_fn, "adamw", data)


#: (model, link bandwidth) where gradients' reduce-scatters end during backward
INSIDE_BACKWARD = [("mlp", 1e10), ("gpt", 3e8)]


def _lower_rank(gm, mesh, coord, **kw):
    """Rank ``coord``'s program, unfused unless asked (these tests isolate the scheduler)."""
    return lower_rank(copy.deepcopy(gm), mesh, coord, axis_group_names(mesh), **{"fuse": False, **kw})


def _phase(node):
    origin = node.meta.get("ddlc_origin")
    return origin.phase if origin else None


def _inside_backward(gm):
    """(operators, all-gather issues) of the optimizer phase that read a reduce-scatter's
    result (transitively) and come before the last backward operator."""
    nodes = list(gm.graph.nodes)
    last = max(i for i, n in enumerate(nodes) if _phase(n) == "backward" and n.op == "call_function"
               and not (is_issue(n) or is_wait(n)))
    after_rs = set()
    for node in nodes:
        if any(a in after_rs or (is_wait(a) and COLLECTIVE(a.args[0]).kind == "reduce_scatter")
               for a in node.all_input_nodes):
            after_rs.add(node)
    early = [n for n in nodes[:last] if n in after_rs and _phase(n) == "optimizer"]
    return ([n for n in early if not (is_issue(n) or is_wait(n))],
            [n for n in early if is_issue(n) and COLLECTIVE(n).kind == "all_gather"])


@pytest.mark.parametrize("model_name,link", INSIDE_BACKWARD)
def test_early_updates_run_inside_backward(model_name, link):
    gm, mesh, *_ = _decoupled(model_name, link)
    updates, gathers = _inside_backward(_lower_rank(gm, mesh, (0,), updates="early"))
    assert updates and gathers
    assert _inside_backward(_lower_rank(gm, mesh, (0,), updates="end")) == ([], [])


@pytest.mark.parametrize("model_name,link", INSIDE_BACKWARD + [("gpt_tied", 3e8)])
def test_early_updates_match_single_device(model_name, link):
    gm, mesh, model, data, want = _decoupled(model_name, link)
    assert _inside_backward(_lower_rank(gm, mesh, (0,), updates="early"))[0]
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, opt_state, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data,
                                               updates="early")
    assert_matches_reference({"losses": losses, "params": params, "opt_state": opt_state}, want)


@pytest.mark.parametrize("model_name,link", INSIDE_BACKWARD)
def test_early_updates_give_every_rank_the_same_collective_sequence(model_name, link):
    gm, mesh, *_ = _decoupled(model_name, link)
    ranks = [_lower_rank(gm, mesh, (r,), updates="early") for r in range(4)]
    sequences = [collective_sequence(g) for g in ranks]
    assert sequences[0] and all(s == sequences[0] for s in sequences)
    assert all(_inside_backward(g)[1] for g in ranks)


@pytest.mark.parametrize("link,chosen", [(3e8, "early"), (3e10, "end")])
def test_timeline_model_places_updates(link, chosen):
    """On a slow link the all-gathers hide behind the rest of backward; on a fast one there
    is little to hide, and early updates delay the rest of backward and its reduce-scatters."""
    from cost_models.program import program_timeline
    gm, mesh, *_ = _decoupled("gpt", link)
    base = _lower_rank(gm, mesh, (0,), schedule=False)
    makespan = {}
    for updates in UPDATES + ("auto",):
        scheduled = schedule(copy.deepcopy(base), profile=mesh.profile, updates=updates)
        makespan[updates] = program_timeline(scheduled, mesh.profile).makespan
        assert scheduled.meta["ddlc_updates"] == (chosen if updates == "auto" else updates)
    other = "end" if chosen == "early" else "early"
    assert makespan["auto"] == makespan[chosen] < makespan[other]


def test_early_updates_respect_the_caps():
    """Updates run inside backward raise the peak above the program scheduled with them at
    the end; capped at that peak, they stay under it and still run inside backward. (The
    cap governs what runs early, not waits that go late: a collective's input lives until
    its wait, just before its result's first reader. Here the loss's all-reduce, read by
    the output alone, keeps its 8 bytes to the end, above the unscheduled program's peak.)"""
    gm, mesh, *_ = _decoupled("gpt", 1e11)
    cap = _peak(_lower_rank(gm, mesh, (0,), updates="end", fuse=True))
    assert _peak(_lower_rank(gm, mesh, (0,), updates="early", fuse=True)) > cap
    capped = _lower_rank(gm, mesh, (0,), updates="early", max_live_bytes=cap, fuse=True)
    assert _peak(capped) <= cap and _inside_backward(capped)[0]
    one = _lower_rank(gm, mesh, (0,), updates="early", max_inflight_bytes=1)
    assert most_in_flight(one) <= 1
    assert _inside_backward(one)[0]


@pytest.mark.parametrize("updates", UPDATES)
def test_the_schedulers_clock_times_its_order_like_the_program_timeline(planned, updates):
    """schedule does not time an order again that its scheduler timed while building it:
    the clock's makespan is the order's program timeline makespan, exactly."""
    from cost_models.program import NodeCosts, order_timeline
    from passes.schedule import _Program, _Scheduler
    mesh = planned[1]
    program = _Program(list(_lowered(planned, (0, 0), False, partition=512).graph.nodes))
    costs = NodeCosts(mesh.profile)
    run = _Scheduler(program, float("inf"), None, mesh.profile, costs, program.early(updates))
    order = run.run()
    assert run.makespan is not None  # the pieces of split collectives need the clock
    assert run.makespan == order_timeline(order, mesh.profile).makespan == \
        order_timeline(order, mesh.profile, costs).makespan


# -- per-group choice of early updates, on hand-built programs ------------------------------

#: every compute operator below reads 0-byte values and writes 4 bytes per float at 1 GB/s:
#: an output of 250 * t floats takes t microseconds; collectives take the seconds they carry
TOY = ddlc.mesh.HardwareProfile.from_dict({
    "name": "toy", "devices_per_node": 8, "flops": {"float32": 1e30}, "memory_bandwidth": 1e9,
    "memory_capacity": 8e9, "links": dict.fromkeys(["intra_node", "inter_node"],
                                                   {"latency": 1e-7, "bandwidth": 1e10})})


def _toy_program(layers):
    """A data-parallel step of ``layers`` = [(backward, reduce-scatter, update, all-gather)
    microseconds] in forward order: backward runs the last layer first, each layer's
    gradient (read by the next backward operator through a 0-byte view) goes to its
    reduce-scatter; then each layer's update reads its reduce-scatter and feeds its
    all-gather, whose result the step returns."""
    from torch import fx
    from ddlc.ir import ORIGIN, ROLE, CollectiveInfo, Origin
    c10d, aten, graph = torch.ops._c10d_functional, torch.ops.aten, fx.Graph()

    def add(target, args, us, phase, kind=None):
        node = graph.call_function(target, args)
        node.meta["val"] = torch.zeros(int(round(us * 250)) if kind is None else 0)
        ORIGIN.set(node, Origin(phase, "toy"))
        if kind is not None:
            sbp = ddlc.sbp.parse_sbp("(P)"), ddlc.sbp.parse_sbp("(S0)")
            COLLECTIVE.set(node, CollectiveInfo(kind, 0, "dp", 2, 4, us * 1e-6, *sbp))
        return node

    def placeholder(name, role):
        node = graph.placeholder(name)
        node.meta["val"] = torch.zeros(0)
        ROLE.set(node, role)
        return node
    params = [placeholder(f"p{i}", "param") for i in range(len(layers))]
    flowing, grads = placeholder("x", "input"), {}
    for i in reversed(range(len(layers))):
        grad = add(aten.neg.default, (flowing,), layers[i][0], "backward")
        issue = add(c10d.reduce_scatter_tensor.default, (grad, "sum", 2, "g0"), layers[i][1], "backward",
                    "reduce_scatter")
        grads[i] = add(c10d.wait_tensor.default, (issue,), 0, "backward")
        flowing = add(aten.alias.default, (grad,), 0, "backward")
    outputs = []
    for i, (_, _, update_us, gather_us) in enumerate(layers):
        update = add(aten.add.Tensor, (params[i], grads[i]), update_us, "optimizer")
        gather = add(c10d.all_gather_into_tensor.default, (update, 2, "g0"), gather_us, "optimizer",
                     "all_gather")
        outputs.append(add(c10d.wait_tensor.default, (gather,), 0, "optimizer"))
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _valid(gm):
    """The order is topological and every collective is read through its wait."""
    seen = set()
    for node in gm.graph.nodes:
        assert all(a in seen for a in node.all_input_nodes), node.name
        seen.add(node)
    check_waits(gm)


def _scheduled(layers, updates, search=False):
    from cost_models.program import program_timeline
    gm = schedule(_toy_program(layers), profile=TOY, updates=updates, search=search)
    _valid(gm)
    return round(program_timeline(gm, TOY).makespan * 1e6, 6), gm.meta["ddlc_updates"]


def test_per_group_updates_beat_both_whole_orders():
    """Layers 0, 1, 2 = (backward, RS, update, AG) us (4,1,3,1), (1,4,2,2), (2,2,4,3); one
    link. Backward (layer 2 first) runs bw2 0-2, bw1 2-3, bw0 3-7 and their RSs 2-4, 4-8,
    8-9 back to back (RS2 is ready at 2, RS1 at 3, RS0 at 7).
    - end: updates in forward order after backward: u0 9-12 (waits RS0), AG0 12-13, u1
      12-14, AG1 14-16, u2 14-18, AG2 18-21: 21 us.
    - early: RS2 lands at 4, while bw0 (3-7, emitted at 3) runs; u2 7-11, AG2 11-14; then u0
      and u1 are both ready and go in original order: u0 11-14, AG0 14-15, u1 14-16, AG1
      16-18: 18 us.
    - layers 1 and 2 early, layer 0 at the end: u2 7-11, AG2 11-14, u1 11-13 (ready since 8),
      AG1 14-16, u0 13-16, AG0 16-17: 17 us, better than both (the long AG1 before the short
      AG0)."""
    layers = [(4, 1, 3, 1), (1, 4, 2, 2), (2, 2, 4, 3)]
    assert _scheduled(layers, "end") == (21, "end")
    assert _scheduled(layers, "early") == (18, "early")
    assert _scheduled(layers, "auto") == (18, "early")
    assert _scheduled(layers, "auto", search=True) == (17, "mixed")


def test_per_group_search_takes_a_compound_move():
    """Layers (1,1,1,2), (2,2,4,3), (2,2,2,2): bw2 0-2, bw1 2-4, bw0 4-5, RS2 2-4, RS1 4-6,
    RS0 6-7. End: u0 7-8, AG0 8-10, u1 8-12, AG1 12-15, u2 12-14, AG2 15-17: 17 us; early
    gives the same 17 (the tie goes to "end"). Moving u0 or u1 alone inside backward gives
    17 again (u1 alone: u1 8-12 behind u0 as before; u0 alone: u1 6-10, AG1 10-13 ahead of
    AG0, AG2 15-17). Both together free the original order for u2: u2 5-7 (RS2 landed at
    4), AG2 7-9, u1 7-11, AG1 11-14, u0 11-12, AG0 14-16: 16 us, found by toggling the
    pair."""
    layers = [(1, 1, 1, 2), (2, 2, 4, 3), (2, 2, 2, 2)]
    assert _scheduled(layers, "end")[0] == _scheduled(layers, "early")[0] == 17
    assert _scheduled(layers, "auto") == (17, "end")
    assert _scheduled(layers, "auto", search=True) == (16, "mixed")


@pytest.mark.parametrize("model_name,link", [("gpt", 3e8), ("gpt_tied", 3e8), ("mlp", 1e9)])
def test_searched_updates_are_never_worse_and_the_same_on_every_rank(model_name, link):
    from cost_models.program import program_timeline
    gm, mesh, *_ = _decoupled(model_name, link)
    bases = [_lower_rank(gm, mesh, (r,), schedule=False, partition=False) for r in range(4)]
    whole = min(program_timeline(schedule(copy.deepcopy(bases[0]), profile=mesh.profile, updates=u),
                                 mesh.profile).makespan for u in UPDATES)
    ranks = [schedule(b, profile=mesh.profile, updates="auto", search=True) for b in bases]
    for g in ranks:
        _valid(g)
    assert program_timeline(ranks[0], mesh.profile).makespan <= whole + 1e-12
    sequences = [collective_sequence(g) for g in ranks]
    assert sequences[0] and all(s == sequences[0] for s in sequences)
    names = [[n.name for n in g.graph.nodes] for g in ranks]
    assert all(n == names[0] for n in names)


def test_searched_updates_match_single_device():
    """The pipeline's final order, searched per update group: the same losses, parameters
    and optimizer state as one device."""
    gm, mesh, model, data, want = _decoupled("gpt_tied", 3e9)
    program = _lower_rank(gm, mesh, (0,), partition=False)
    assert program.meta["ddlc_updates"] == "mixed" and _inside_backward(program)[0]
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, opt_state, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data,
                                                  fuse=False, partition=False)
    assert_matches_reference({"losses": losses, "params": params, "opt_state": opt_state}, want)


def _gloo_steps(rank):
    """Worker: the decoupled data-parallel tied GPT (as :func:`_decoupled`, on a 3e9 B/s link)
    compiled and trained on real gloo groups, its final order searched per update group and
    not scheduled at all; rank 0 returns what the parent compares, by ``scheduled``."""
    return {scheduled: _gloo_run(rank, scheduled) for scheduled in (True, False)}


def _gloo_run(rank, scheduled):
    from ddlc.runtime import compile
    (model, loss_fn), data = model_and_loss("gpt_tied"), batches("gpt", 8)
    mesh = ddlc.Mesh((4,), profile=NATIVE_RS, links=[ddlc.LinkModel(1e-7, 3e9)])
    pins = dict.fromkeys(["input0", "input1"], "(S0)") | {k: "(B)" for k, _ in model.named_parameters()}
    step = compile(model, mesh, data[0], loss_fn, optimizer("adamw", model), placements=pins,
                   decouple="always", ag_placement="backward", schedule=scheduled, fuse=False,
                   partition=False)
    out = {"losses": [step.step(*b) for b in data], "params": step.state_dict(),  # every rank gathers
           "opt_state": step.optimizer_state(), "updates": step.gm.meta.get("ddlc_updates"),
           "inside": bool(_inside_backward(step.gm)[0])}
    return out if rank == 0 else None


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_searched_updates_equal_the_unscheduled_program_on_gloo():
    from ddlc.launch import spawn
    runs = spawn(_gloo_steps, 4, timeout=120, deadline=300)[0]
    scheduled, plain = runs[True], runs[False]
    assert scheduled.pop("updates") == "mixed" and scheduled.pop("inside")
    plain.pop("updates"), plain.pop("inside")
    assert_matches_reference(scheduled, plain)
