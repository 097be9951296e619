"""The timeline simulator against hand-computed schedules."""
import json

import pytest

from cost_models.timeline import COMPUTE, Timeline


def test_fifo_streams_and_dependencies():
    tl = Timeline()
    f = tl.add("f", COMPUTE, 2.0)                    # compute 0 -> 2
    c1 = tl.add("c1", "dp", 3.0, [f])                # waits for f: 2 -> 5
    c2 = tl.add("c2", "dp", 1.0)                     # FIFO behind c1: 5 -> 6
    g = tl.add("g", COMPUTE, 1.0)                    # no deps: 2 -> 3
    h = tl.add("h", COMPUTE, 1.0, [c2])              # waits for c2: 6 -> 7
    other = tl.add("o", "tp", 4.0, [f])              # another channel, in parallel: 2 -> 6
    r = tl.run()
    assert [r.start[i] for i in (f, c1, c2, g, h, other)] == [0, 2, 5, 2, 6, 2]
    assert r.makespan == 7
    assert r.exposed_communication == 7 - 4          # compute idles 3 -> 6
    assert r.lower_bound == 4                        # dp 4, tp 4, compute 4


def test_dear_recurrences_on_a_three_layer_chain():
    """Build DeAR's timeline by hand: t_f = (1, 2, 1), t_b = (2, 4, 2), t_rs = t_ag = (2, 1.5, 3)."""
    t_f, t_b, t_c = (1, 2, 1), (2, 4, 2), (2, 1.5, 3)
    tl, bwd, rs, ag = Timeline(), {}, {}, {}
    for l in (2, 1, 0):
        bwd[l] = tl.add(f"bwd{l}", COMPUTE, t_b[l])
    for l in (2, 1, 0):
        rs[l] = tl.add(f"rs{l}", "dp", t_c[l], [bwd[l]])
    for l in (0, 1, 2):
        ag[l] = tl.add(f"ag{l}", "dp", t_c[l])
    fwd = [tl.add(f"fwd{l}", COMPUTE, t_f[l], [ag[l]]) for l in (0, 1, 2)]
    r = tl.run()
    # tau_b[2] = 0, tau_b[1] = 0 + 2 = 2, tau_b[0] = 2 + 4 = 6
    assert [r.start[bwd[l]] for l in (0, 1, 2)] == [6, 2, 0]
    # tau_c[2] = t_b[2] = 2; tau_c[1] = max(2 + 4, 2 + 3) = 6; tau_c[0] = max(6 + 2, 6 + 1.5) = 8
    assert [r.start[rs[l]] for l in (0, 1, 2)] == [8, 6, 2]
    # AGs back to back after RS(0) ends at 8 + 2 = 10: ends 10 + 2 = 12, 12 + 1.5 = 13.5, 13.5 + 3 = 16.5
    assert [r.end[ag[l]] for l in (0, 1, 2)] == [12, 13.5, 16.5]
    # tau_f[0] = max(8, 12) = 12; tau_f[1] = max(12 + 1, 13.5) = 13.5; tau_f[2] = max(13.5 + 2, 16.5)
    assert [r.start[i] for i in fwd] == [12, 13.5, 16.5]
    assert r.makespan == 16.5 + 1
    assert r.exposed_communication == 17.5 - 12      # compute totals 12


def test_peak_memory_frees_before_allocating_at_equal_times():
    tl = Timeline()
    a = tl.add("a", COMPUTE, 1.0, alloc=100)          # 100 live from 0
    tl.add("free a", "dp", 1.0, [a], free=100)        # released at 2
    tl.add("b", COMPUTE, 1.0, alloc=50)               # 150 live at 1
    tl.add("c", COMPUTE, 1.0, [1], alloc=70)          # starts at 2, after the release: 50 + 70
    assert tl.run().peak_memory == 150


def test_chrome_trace_has_one_thread_per_stream(tmp_path):
    tl = Timeline()
    f = tl.add("fwd", COMPUTE, 0.002, category="forward")
    tl.add("RS", "dp", 0.001, [f])
    path = tmp_path / "trace.json"
    tl.run().write_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    threads = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X"]
    assert threads == {"compute": 0, "dp": 1}
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in spans] == [
        ("fwd", 0, 0.0, 2000.0), ("RS", 1, 2000.0, 1000.0)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(duration=-1.0), "duration"),
    (dict(duration=float("nan")), "duration"),
    (dict(duration=1.0, deps=[5]), "dependency 5"),
    (dict(duration=1.0, alloc=-1), "alloc"),
])
def test_bad_tasks_are_rejected(kwargs, message):
    tl = Timeline()
    tl.add("first", COMPUTE, 1.0)
    with pytest.raises(ValueError, match=message):
        tl.add("bad", COMPUTE, **kwargs)


def _lowered_mlp():
    """(mesh, rank 0's lowered program) of the zoo MLP with AdamW on (4,), batch split."""
    import torch
    import torch.nn.functional as F

    import ddlc
    from ddlc.simulate import axis_group_names, lower_rank
    from ddlc.zoo import MLP
    from passes.canonicalize import canonicalize
    from passes.sharding import shard

    torch.manual_seed(0)
    model = MLP()
    batch = (torch.randn(8, 32), torch.randn(8, 16))
    gm = canonicalize(ddlc.trace(model, batch, F.mse_loss, torch.optim.AdamW(model.parameters())))
    mesh = ddlc.Mesh((4,))
    names = {i.key: i.name for i in gm.meta["ddlc_step"].inputs}
    shard(gm, mesh, fixed={names["input0"]: ddlc.sbp.parse_sbp("(S0)")})
    return mesh, lower_rank(gm, mesh, (0,), axis_group_names(mesh))


def test_shared_node_costs_time_like_fresh_ones():
    """Clocks over the same nodes may share one NodeCosts: each node's time, stream and
    bytes are worked out once, and every order times as with costs of its own."""
    from cost_models.program import NodeCosts, order_timeline

    mesh, program = _lowered_mlp()
    nodes = list(program.graph.nodes)
    fresh, costs = order_timeline(nodes, mesh.profile), NodeCosts(mesh.profile)
    for _ in range(2):  # working the costs out, then reusing them
        shared = order_timeline(nodes, mesh.profile, costs)
        assert (shared.tasks, shared.start, shared.end) == (fresh.tasks, fresh.start, fresh.end)
        assert shared.peak_memory == fresh.peak_memory


def test_the_clock_times_an_order_as_the_timeline_does():
    """order_makespan (a ProgramClock) gives an order exactly the makespan of its full
    timeline, and so does a scheduler's clock that timed the order as it built it (early
    updates): what it remembers in NodeCosts.makespans, which order_makespan then returns."""
    from cost_models.program import NodeCosts, order_makespan, order_timeline, task_order
    from passes.fuse import Trial
    from passes.schedule import schedule

    mesh, program = _lowered_mlp()
    nodes = list(program.graph.nodes)
    assert order_makespan(nodes, mesh.profile) == order_timeline(nodes, mesh.profile).makespan
    trial, costs = Trial(program), NodeCosts(mesh.profile)
    schedule(trial, profile=mesh.profile, updates="early", costs=costs)
    order = list(trial.graph.nodes)  # placeholders first: the tasks in the scheduler's order
    assert list(costs.makespans) == [task_order(order)]  # the scheduler timed it; nothing else was
    assert costs.makespans[task_order(order)] == order_makespan(order, mesh.profile) == \
        order_timeline(order, mesh.profile).makespan
    assert order_makespan(order, mesh.profile, costs) == costs.makespans[task_order(order)]


@pytest.mark.parametrize("tree", [
    ([1, (2.0, None)], {"b": 3, "a": [4]}),
    (slice(0, 2), "s", True),
])
def test_tensors_are_the_tensor_leaves_in_pytree_order(tree):
    """cost_models.compute.tensors walks fx arguments faster than tree_leaves, alike."""
    import torch
    from torch.fx.immutable_collections import immutable_dict, immutable_list
    from torch.utils._pytree import tree_leaves

    from cost_models.compute import tensors

    t = [torch.zeros(i + 1) for i in range(6)]
    tree = (tree, t[0], [t[1], (t[2],)], immutable_list([t[3], immutable_dict(b=t[4], a=t[5])]),
            torch.return_types.max((t[5], t[0])), torch.Size([2, 3]))
    expected = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]
    assert [id(x) for x in tensors(tree)] == [id(x) for x in expected]


def test_node_costs_reuse_an_earlier_graphs_prices_only_for_the_same_call(monkeypatch):
    """NodeCosts(earlier=...) over a copied graph (a search's trial) prices every node as a
    fresh table does: an operator reuses the earlier price only where its name, target,
    value and argument values are the same; one given a new value (a pass rewrote it) is
    priced again."""
    import torch

    from cost_models.program import NodeCosts
    from passes.fuse import Trial

    mesh, program = _lowered_mlp()
    first = NodeCosts(mesh.profile)
    before = {n.name: first.seconds(n) for n in program.graph.nodes if n.op == "call_function"}
    trial = Trial(program)
    product = next(n for n in trial.graph.nodes if n.target is torch.ops.aten.mm.default)
    val = product.meta["val"]
    with val.fake_mode:
        product.meta["val"] = torch.empty(val.shape[0] * 4, val.shape[1], dtype=val.dtype)
    import cost_models.program as program_costs
    from cost_models.compute import op_time
    priced = []
    monkeypatch.setattr(program_costs, "op_time", lambda target, *a: priced.append(target)
                        or op_time(target, *a))
    reused = NodeCosts(mesh.profile, earlier=first)
    prices = {n: reused.seconds(n) for n in trial.graph.nodes if n.op == "call_function"}
    # only the rewritten operator and those reading it were priced anew
    assert priced[0] is product.target and len(priced) <= 1 + len(product.users)
    assert set(priced[1:]) <= {u.target for u in product.users}
    monkeypatch.undo()
    fresh = NodeCosts(mesh.profile)
    assert prices == {n: fresh.seconds(n) for n in prices}
    assert prices[product] != before[product.name]
