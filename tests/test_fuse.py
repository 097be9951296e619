"""Tensor fusion and partitioning: bucketed collectives give the same numbers with fewer
start-ups, split ones the same numbers in pieces; the sizes come from the timeline model."""
import copy
import dataclasses
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import ddlc
from conftest import DP_BATCH, FAST_GLOO, assert_matches_reference, data_parallel_mlp, reference, replicate_updates
from cost_models.collectives import collective_time
from cost_models.program import program_timeline
from ddlc.ir import COLLECTIVE, SHARDING, NdSignature, collective_sequence, leaves
from ddlc.sbp import parse_sbp
from ddlc.simulate import axis_group_names, lower_rank, simulate_steps
from passes.canonicalize import canonicalize
from passes.decouple import decouple
from passes.fuse import pack, unpack
from passes.schedule import is_issue


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
    gm, mesh, model, data = data_parallel_mlp("adamw")
    replicate_updates(gm, mesh)
    decouple(gm, mesh, "forward")
    plain = collective_sequence(lower_rank(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh), fuse=False))
    fused = collective_sequence(lower_rank(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh),
                                      fuse=float("inf")))
    assert len(fused) < len(plain)
    assert sum(b for _, _, b in fused) == sum(b for _, _, b in plain)  # same bytes, fewer start-ups
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, {}, data, fuse=float("inf"))
    assert_matches_reference({"losses": losses, "params": params}, reference("mlp", "adamw", batch=DP_BATCH))


def test_the_loss_all_reduce_shares_the_gradients_bucket():
    """The loss's all-reduce (the MLP's mse: its sum; the count is static) is read only by
    ``sum / count`` and the output: that division moves to the end of the step, so the
    all-reduce joins a bucket of gradients instead of running alone."""
    gm, mesh, model, data = data_parallel_mlp("adamw")
    replicate_updates(gm, mesh)
    fused = lower_rank(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh), fuse=float("inf"))
    reduced = [nbytes for kind, _, nbytes in collective_sequence(fused) if kind == "all_reduce"]
    assert len(reduced) == 1 and reduced[0] > 4, reduced  # the loss (4 B) rode with gradients
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, {}, data, fuse=float("inf"))
    assert_matches_reference({"losses": losses, "params": params}, reference("mlp", "adamw", batch=DP_BATCH))


PIECE = 128  # bytes: splits the test MLP's collectives of weights and of a bias


def _pieces(gm):
    """Split collective name -> (kind, number of pieces) in ``gm``."""
    return {n.meta["ddlc_piece"][0]: (COLLECTIVE(n).kind, n.meta["ddlc_piece"][2])
            for n in gm.graph.nodes if "ddlc_piece" in n.meta}


@pytest.mark.parametrize("ag_placement, kinds", [(None, {"all_reduce", "reduce_scatter", "all_gather"}),
                                                  ("forward", {"reduce_scatter", "all_gather"})])
def test_split_collectives_train_like_single_device(ag_placement, kinds):
    gm, mesh, model, data = data_parallel_mlp("adamw")
    replicate_updates(gm, mesh)
    if ag_placement:
        decouple(gm, mesh, ag_placement)
    lowered = {size: lower_rank(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh), fuse=False, partition=size)
               for size in (False, PIECE)}
    whole, split = (collective_sequence(g) for g in lowered.values())
    pieces = _pieces(lowered[PIECE])
    assert {kind for kind, _ in pieces.values()} == kinds
    assert len(split) == len(whole) + sum(k - 1 for _, k in pieces.values())
    assert sum(b for _, _, b in split) == sum(b for _, _, b in whole)
    seconds = {}  # each piece pays its own start-up
    for node in lowered[PIECE].graph.nodes:
        if "ddlc_piece" in node.meta:
            seconds[node.meta["ddlc_piece"][0]] = seconds.get(node.meta["ddlc_piece"][0], 0) + COLLECTIVE(node).seconds
    for node in lowered[False].graph.nodes:
        if node.name in pieces:
            kind, k = pieces[node.name]
            startup = collective_time(mesh.profile.runs_as(kind), 0, 4, mesh.links[0], "ring")
            assert seconds[node.name] == pytest.approx(COLLECTIVE(node).seconds + (k - 1) * startup)
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, {}, data, fuse=False, partition=PIECE)
    assert_matches_reference({"losses": losses, "params": params}, reference("mlp", "adamw", batch=DP_BATCH))


class _HeadFirst(torch.nn.Module):
    """Linear -> GELU -> Linear whose large output layer is registered, so its parameters
    come, before the small first layer's."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(256, 256)
        self.body = torch.nn.Linear(32, 256)

    def forward(self, x):
        return self.head(F.gelu(self.body(x)))


#: The forward and backward of :class:`_HeadFirst` with the batch split: weights read whole
#: (B), activations split by rows, weight gradients partial sums.
_BATCH_SPLIT = {
    "t_copy": "(B) -> (B)", "addmm": "(B), (S0), (B) -> (S0)", "gelu": "(S0) -> (S0)",
    "t_copy_1": "(B) -> (B)", "addmm_1": "(B), (S0), (B) -> (S0)", "mse_loss": "(S0), (S0) -> (P)",
    "div_scalar": "(B) -> (B)", "ones_like": "(B) -> (B)", "div_scalar_1": "(B) -> (B)",
    "mse_loss_backward": "(B), (S0), (S0) -> (S0)", "t_copy_2": "(B) -> (B)", "mm": "(S0), (B) -> (S0)",
    "t_copy_3": "(S0) -> (S1)", "mm_1": "(S1), (S0) -> (P)", "sum_1": "(S0) -> (P)",
    "view_copy": "(P) -> (P)", "t_copy_4": "(P) -> (P)", "gelu_backward": "(S0), (S0) -> (S0)",
    "t_copy_5": "(S0) -> (S1)", "mm_2": "(S1), (S0) -> (P)", "sum_2": "(S0) -> (P)",
    "view_copy_1": "(P) -> (P)", "t_copy_6": "(P) -> (P)"}


def _fsdp_mlp():
    """:class:`_HeadFirst` planned by hand, FSDP-style: each weight and its optimizer state
    stay split by rows between steps (gathered for forward and backward, gradient
    reduce-scattered, updated on the shard), biases replicated, batch of 1024 split. The
    head's 256x256 weight is the one large all-gather, and it is issued first (parameter
    order), so the first layer's all-gather, needed earlier, becomes ready while it is in
    flight."""
    from passes.rules.core import tensor_inputs
    torch.manual_seed(0)
    model = _HeadFirst()
    batch = (torch.randn(1024, 32), torch.randn(1024, 256))
    gm = canonicalize(ddlc.trace(model, batch, F.mse_loss, torch.optim.AdamW(model.parameters())))

    def rows_if_matrix(val):  # weights and their state split by rows, the rest replicated
        return parse_sbp("(S0)" if val.dim() == 2 else "(B)")

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            sbp = parse_sbp("(S0)") if node.meta["ddlc_role"] == "input" else rows_if_matrix(node.meta["val"])
            SHARDING.set(node, NdSignature((), (sbp,)))
        elif node.op == "call_function" and node.meta["ddlc_origin"].phase == "optimizer":
            # an update's getitem reads the output it selects
            ins = [node.meta["val"]] if node.target is operator.getitem else \
                [a.meta["val"] for a in tensor_inputs(node)]
            SHARDING.set(node, NdSignature(tuple(map(rows_if_matrix, ins)),
                                           tuple(map(rows_if_matrix, leaves(node.meta["val"])))))
        elif node.op == "call_function":
            ins, out = _BATCH_SPLIT[node.name].split(" -> ")
            SHARDING.set(node, NdSignature(tuple(parse_sbp(s) for s in ins.split(", ")),
                                           (parse_sbp(out),)))
    return gm


@pytest.mark.parametrize("latency, splits", [(1e-6, True), (1e-3, False)])
def test_piece_size_is_chosen_by_the_timeline_model(latency, splits):
    """On a slow link, splitting the head's large all-gather lets the first layer's urgent
    all-gather go between its pieces, so the first layer runs while the rest of the head
    arrives; that pays for the extra start-ups and the merge unless each start-up costs a
    millisecond. Fusion is off: bucketing, chosen before the pieces, would put both
    all-gathers in one collective."""
    gm = _fsdp_mlp()
    mesh = ddlc.Mesh((4,), profile=FAST_GLOO, links=[ddlc.LinkModel(latency, 1e8)])
    chosen = lower_rank(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh), fuse=False)
    whole = lower_rank(copy.deepcopy(gm), mesh, (0,), axis_group_names(mesh), fuse=False, partition=False)
    made = program_timeline(chosen, mesh.profile).makespan
    assert (chosen.meta["ddlc_piece_bytes"] < math.inf) == splits == bool(_pieces(chosen))
    assert [(k, b) for k, _, b in collective_sequence(whole)][:2] == [("all_gather", 256 * 256 * 4),
                                                                       ("all_gather", 256 * 32 * 4)]
    if splits:
        assert made < program_timeline(whole, mesh.profile).makespan
        issues = [n for n in chosen.graph.nodes if is_issue(n)]
        head = issues[0].meta["ddlc_piece"][0]  # the head's all-gather, issued first
        at = [i for i, n in enumerate(issues) if n.meta.get("ddlc_piece", (None,))[0] == head]
        between = [COLLECTIVE(n) for n in issues[at[0]:at[-1]] if "ddlc_piece" not in n.meta]
        assert [(c.kind, c.nbytes) for c in between] == [("all_gather", 32768)]  # the first layer's


def _collective_graph(kinds_and_reads):
    """A graph of collectives on placeholders: for each (kind, early), an issue and its wait,
    read at once by a ``neg`` when ``early``, else by one ``add`` of every late result at
    the end."""
    from passes.fuse import issue_args
    graph = fx.Graph()
    late, c10d = [], torch.ops._c10d_functional
    target = {"all_reduce": c10d.all_reduce.default, "reduce_scatter": c10d.reduce_scatter_tensor.default}
    for i, (kind, early) in enumerate(kinds_and_reads):
        x = graph.placeholder(f"x{i}")
        x.meta["val"] = torch.zeros(8)
        issued = graph.call_function(target[kind], issue_args(kind, x, 4, "g"))
        wait = graph.call_function(c10d.wait_tensor.default, (issued,))
        if early:
            graph.call_function(torch.ops.aten.neg.default, (wait,))
        else:
            late.append(wait)
    graph.output(graph.call_function(torch.ops.aten.cat.default, (late,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_buckets_span_collectives_of_other_kinds():
    """An all-reduce between two late-read reduce-scatters does not keep them apart; a
    reduce-scatter whose result is read before the next one's input exists does."""
    from passes.fuse import _members
    gm = _collective_graph([("reduce_scatter", False), ("all_reduce", False), ("reduce_scatter", False)])
    assert [[n.args[0].name for n in b] for b in _members(gm, math.inf)] == [["x0", "x2"]]
    assert _members(gm, 31) == []  # two 32-byte inputs exceed a 31-byte cap
    gm = _collective_graph([("reduce_scatter", True), ("reduce_scatter", False), ("reduce_scatter", False)])
    assert [[n.args[0].name for n in b] for b in _members(gm, math.inf)] == [["x1", "x2"]]


@pytest.mark.parametrize("prepare, args", [("moved", (1, 0)), ("local_chunk", (0, 2, 1))])
def test_preparations_go_up_to_their_input(prepare, args):
    """The copy that moves a collective's dim to 0, and the slice that splits a tensor on
    another mesh axis before it is reduced on this one ((P, B) -> (P, S0) -> (B, S0)), are
    inserted right before the collective; fusion first moves them up to just after their
    input, where the input really exists."""
    from ddlc import comm
    from passes.fuse import _hoist_feeders
    graph = fx.Graph()
    x = graph.placeholder("x")
    later = graph.call_function(torch.ops.aten.neg.default, (x,))
    prepared = graph.call_function(getattr(comm, prepare), (x, *args))
    issued = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (prepared, "sum", "g"))
    graph.output((graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (issued,)), later))
    _hoist_feeders(graph)
    assert list(graph.nodes)[:3] == [x, prepared, later]


def test_sliced_gradients_share_a_bucket():
    """Two gradients, each sliced on another axis right before its all-reduce, which sits
    right before its reader (the optimizer, after every gradient exists): once the slices
    go up, the second gradient exists before the first is read, so they share a bucket
    (left in place, each collective's input would come after the other's reader)."""
    from ddlc import comm
    from passes.fuse import _hoist_feeders, _members
    c10d = torch.ops._c10d_functional
    graph = fx.Graph()
    grads = [graph.placeholder(f"g{i}") for i in range(2)]
    for g in grads:
        g.meta["val"] = torch.zeros(8)
    for g in grads:
        chunk = graph.call_function(comm.local_chunk, (g, 0, 2, 0))
        chunk.meta["val"] = torch.zeros(4)
        issued = graph.call_function(c10d.all_reduce.default, (chunk, "sum", "g"))
        wait = graph.call_function(c10d.wait_tensor.default, (issued,))
        graph.call_function(torch.ops.aten.neg.default, (wait,))
    graph.output(None)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert _members(gm, math.inf) == []
    _hoist_feeders(gm.graph)
    assert [len(b) for b in _members(gm, math.inf)] == [2]


def _program(gm):
    """What a lowered program is made of, node by node (the decisions fusion takes)."""
    return [(n.name, str(n.target), str(n.args), str(n.kwargs), repr(COLLECTIVE.get(n)))
            for n in gm.graph.nodes]


@pytest.fixture(scope="module")
def unfused():
    """Rank 0's program of the data-parallel MLP (decoupled) before fusion and partition."""
    gm, mesh, _, _ = data_parallel_mlp("adamw")
    replicate_updates(gm, mesh)
    decouple(gm, mesh, "forward")
    return lower_rank(gm, mesh, (0,), axis_group_names(mesh), fuse=False, partition=False,
                      schedule=False), mesh


def test_caps_between_the_largest_formed_and_smallest_refused_bucket_fuse_alike(unfused):
    """:func:`passes.fuse._fuse` returns the largest bucket it formed and the smallest one
    the cap ruled out (:class:`passes.fuse.CapsAlike`); every cap from the one up to below
    the other fuses to the same program, a cap that admits the refused bucket or cuts the
    formed one fuses differently."""
    from passes.fuse import Trial, _fuse
    gm, mesh = unfused
    cap = next(c for c in (2**k for k in range(6, 20)) if 0 < _fuse(Trial(gm), mesh, c).formed
               and _fuse(Trial(gm), mesh, c).refused < math.inf)
    alike = _fuse(Trial(gm), mesh, cap)
    formed, refused = int(alike.formed), int(alike.refused)
    assert formed <= cap < refused
    programs = {}
    for c in (formed - 1, formed, cap, (cap + refused) // 2, refused - 1, refused):
        trial = Trial(gm)
        _fuse(trial, mesh, c)
        programs[c] = _program(trial)
        assert alike.covers(c) == (formed <= c < refused)
    assert programs[formed] == programs[cap] == programs[(cap + refused) // 2] == programs[refused - 1]
    assert programs[formed - 1] != programs[cap] != programs[refused]
    assert not alike.covers(0)


def test_skipping_caps_that_fuse_alike_keeps_the_choice(unfused):
    """fuse_best skips the caps that fuse like one tried already; trying every cap (in the
    same order), as choose_by_timeline does without ``tried_alike``,
    chooses the same cap and program."""
    from passes.fuse import CAPS, Trial, _descending, choose_by_timeline, fuse, fuse_best
    from passes.schedule import schedule
    gm, mesh = unfused
    order = lambda g, costs=None: schedule(g, profile=mesh.profile, updates="auto", costs=costs)  # noqa: E731
    every, skipping = Trial(gm), Trial(gm)
    assert choose_by_timeline(every, mesh, _descending(CAPS), lambda g, cap: fuse(g, mesh, cap),
                              order) == fuse_best(skipping, mesh, order)
    assert _program(every) == _program(skipping)


@pytest.mark.parametrize("latency, stops_early", [(1e-7, True), (1e-5, False), (1e-3, False)],
                         ids=["fast start-ups", "10 us", "1 ms"])
def test_the_cap_search_stops_at_the_first_slower_cap(monkeypatch, latency, stops_early):
    """fuse_search times no fusion, then the caps from the largest down up to the first
    one slower than the best of them so far; it chooses the cap (and program) of least
    makespan over every cap, and times exactly the caps of that descent that fuse
    differently. (With sub-microsecond start-ups the makespan is not unimodal from the
    largest cap down to 0: a cap of 8192 bytes models faster than 32768 and 2048, and no
    fusion fastest; trying no fusion apart chooses it. The caps are the MLP's sizes as
    buckets count them: a collective's bytes on its group, an all-gather's whole output.)"""
    import passes.fuse as fuse_module
    from cost_models.program import order_makespan
    from passes.fuse import Trial, _fuse, fuse, fuse_search
    from passes.schedule import schedule
    planned, _, _, _ = data_parallel_mlp("adamw")
    replicate_updates(planned, mesh := ddlc.Mesh((4,), links=[ddlc.LinkModel(latency, 1e9)], profile=FAST_GLOO))
    decouple(planned, mesh, "forward")
    gm = lower_rank(planned, mesh, (0,), axis_group_names(mesh), fuse=False, partition=False, schedule=False)
    monkeypatch.setattr(fuse_module, "CAPS", CAPS := (0, 128, 512, 2048, 8192, 32768, math.inf))  # the MLP's sizes
    order = lambda g, costs=None: schedule(g, profile=mesh.profile, updates="auto", costs=costs)  # noqa: E731
    makespans, programs = {}, {}
    for cap in CAPS:
        trial = order(fuse(Trial(gm), mesh, cap))
        makespans[cap] = order_makespan(list(trial.graph.nodes), mesh.profile)
        programs[cap] = _program(fuse(Trial(gm), mesh, cap))
    descent, best = [0], None  # the caps timed: each new program, up to the first slower one
    for cap in sorted(CAPS[1:], reverse=True):
        if any(programs[cap] == programs[c] for c in descent):
            continue
        descent.append(cap)
        if best is not None and makespans[cap] > best + 1e-12:
            break
        best = makespans[cap] if best is None else min(best, makespans[cap])
    tried = []
    monkeypatch.setattr(fuse_module, "_fuse", lambda g, m, cap, values=None: tried.append(cap) or
                        _fuse(g, m, cap, values))
    searched = Trial(gm)
    chosen = fuse_search(searched, mesh, order).option
    trials = [0] + tried  # no fusion is timed on ``searched`` itself; the chosen trial becomes it
    assert makespans[chosen] == min(makespans.values())
    assert _program(searched) == programs[chosen]
    distinct = [p for i, p in enumerate(programs.values()) if p not in list(programs.values())[:i]]
    assert (len(set(trials)) < len(distinct)) == stops_early
    assert [c for c in trials if c in descent] == descent
    assert all(any(programs[c] == programs[d] for d in descent) for c in trials)


def test_trial_copies_the_graph_without_code(unfused):
    """A Trial has the graph's nodes under the same names, its own graph and meta, and
    never generates code; the module it copies is left as it was."""
    from passes.fuse import Trial, fuse
    gm, mesh = unfused
    before, code = _program(gm), gm.code
    trial = Trial(gm)
    assert _program(trial) == before == _program(copy.deepcopy(gm))
    fuse(trial, mesh, math.inf)
    trial.meta["ddlc_updates"] = "end"
    assert _program(trial) != before
    assert _program(gm) == before and gm.code == code and "ddlc_updates" not in gm.meta
    assert not hasattr(trial, "_code")  # recompile did nothing


def test_the_chosen_trial_becomes_the_program_that_fusing_again_gives():
    """fuse_search makes the chosen trial's graph the program: node for node, name for name
    (new nodes too: a trial names them as the program would) and in the same order as
    fusing the program itself with the chosen cap, and its namespace goes on naming new
    nodes alike; the order it records is the one scheduling that program gives."""
    from ddlc.pipeline import named_alike_copy
    from passes.fuse import adopt, fuse, fuse_search
    from passes.schedule import follow, schedule
    planned, _, _, _ = data_parallel_mlp("adamw")
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(1e-3, 1e9)], profile=FAST_GLOO)  # slow start-ups: fuse
    replicate_updates(planned, mesh)
    decouple(planned, mesh, "forward")
    gm = lower_rank(planned, mesh, (0,), axis_group_names(mesh), fuse=False, partition=False, schedule=False)
    order = lambda g, costs=None: schedule(g, profile=mesh.profile, updates="auto", costs=costs)  # noqa: E731
    searched, again = named_alike_copy(gm), named_alike_copy(gm)
    timed = fuse_search(searched, mesh, order)
    assert timed.option > 0  # a trial was chosen, not the program as it stood
    fuse(again, mesh, timed.option)
    assert _program(searched) == _program(again)
    assert searched.meta == again.meta
    names = [g.graph._graph_namespace.create_name("getitem", None) for g in (searched, again)]
    assert names[0] == names[1]
    assert _program(adopt(searched, timed, follow)) == _program(order(again))


def test_fake_values_are_worked_out_once():
    """FakeValues returns the very result of the first call with the same function, the
    same tensors (by identity) and the same other arguments, and works out the others."""
    from passes.fuse import FakeValues
    calls = []

    def stack(ts, dim):
        calls.append(dim)
        return torch.stack(ts, int(dim))

    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    values = FakeValues()
    first = values.call(stack, [a, b], 1)
    assert values.call(stack, [a, b], 1) is first and calls == [1]
    assert values.call(stack, [a, b], 0) is not first
    assert values.call(stack, [a, torch.ones(2, 3)], 1) is not first
    assert values.call(stack, [a, b], dim=1) is not first  # as a keyword: another call
    assert values.call(stack, [a, b], True) is not first  # True is not 1
    assert calls == [1, 0, 1, 1, True]


def test_sizes_that_split_alike_are_tried_once(unfused, monkeypatch):
    """partition_best tries a size only if it splits some collective differently from every
    larger size (tiny sizes all split into the most pieces there can be); trying them all
    chooses the same size and program."""
    import passes.partition as partition_module
    from passes.fuse import Trial, choose_by_timeline, fuse
    from passes.partition import _splits, partition, partition_best
    from passes.schedule import schedule
    gm, mesh = unfused
    fused = fuse(Trial(gm), mesh, 2**16)
    sizes = (math.inf, 2**16, 4096, 1024, 512, 256, 128)
    assert _splits(fused, 256) == _splits(fused, 128) != _splits(fused, 512)
    monkeypatch.setattr(partition_module, "SIZES", sizes)
    order = lambda g, costs=None: schedule(g, profile=mesh.profile, updates="auto", costs=costs)  # noqa: E731
    tried = [s for s in sizes if s == math.inf or _splits(fused, s)]
    every, skipping = Trial(fused), Trial(fused)
    assert choose_by_timeline(every, mesh, tried, lambda g, s: partition(g, mesh, s), order) == \
        partition_best(skipping, mesh, order)
    assert _program(every) == _program(skipping)


@pytest.mark.parametrize("latency, shared, pruned", [(1e-7, False, False), (1e-3, False, True),
                                                     (1e-7, True, True)],
                         ids=["fast link", "slow start-ups", "ranks sharing cores"])
def test_sizes_that_cannot_beat_the_best_are_not_tried(unfused, monkeypatch, latency, shared, pruned):
    """partition_search skips a size whose busiest stream (its pieces' seconds in place of
    the collectives they split) already exceeds the best makespan: that bound never
    exceeds the size's scheduled makespan, and trying every size chooses the same. Sizes
    are tried from the largest down, up to the first one slower than the best. Where
    ranks share cores, collectives run on the compute stream, so no split can pay: none
    is tried; nor where a start-up costs a millisecond."""
    import passes.partition as partition_module
    from cost_models.program import NodeCosts, order_makespan
    from passes.fuse import Trial, choose_by_timeline, fuse
    from passes.partition import _busiest_stream, _splits, partition, partition_search
    from passes.schedule import schedule
    gm, mesh = unfused
    profile = FAST_GLOO if not shared else dataclasses.replace(
        FAST_GLOO, contention=ddlc.mesh.Contention(4, 2.0, 1e-6, 1.0, 1.0))
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(latency, 1e9)], profile=profile)
    fused = fuse(Trial(gm), mesh, 2**16)
    monkeypatch.setattr(partition_module, "SIZES", (math.inf, 2**16, 4096, 1024))
    order = lambda g, costs=None: schedule(g, profile=mesh.profile, updates="auto", costs=costs)  # noqa: E731
    sizes = [s for s in partition_module.SIZES if s == math.inf or _splits(fused, s)]
    assert len(sizes) > 1
    makespans = {}
    for size in sizes:
        trial = order(partition(Trial(fused), mesh, size))
        makespans[size] = order_makespan(list(trial.graph.nodes), mesh.profile)
        bound = _busiest_stream(NodeCosts(mesh.profile), list(fused.graph.nodes), _splits(fused, size), mesh)
        assert bound <= makespans[size] * (1 + 1e-12)
    tried = []
    monkeypatch.setattr(partition_module, "partition",
                        lambda g, m, size, values=None: tried.append(size) or partition(g, m, size, values))
    every, skipping = Trial(fused), Trial(fused)
    chosen = partition_search(skipping, mesh, order).option
    assert choose_by_timeline(every, mesh, sizes, lambda g, s: partition(g, mesh, s), order) == chosen
    assert _program(every) == _program(skipping)
    assert chosen == min(sizes, key=lambda s: (makespans[s], -s))
    splits_tried = [s for s in tried if s < math.inf]
    until_slower, best = [], makespans[math.inf]  # the search stops at the first slower size
    for size in sizes[1:]:
        until_slower.append(size)
        if makespans[size] > best + 1e-12:
            break
        best = min(best, makespans[size])
    assert splits_tried == ([] if pruned else until_slower)


def test_where_ranks_share_cores_the_order_does_not_change_the_makespan(unfused):
    """Where the ranks share cores every task runs on the compute stream: a program's
    order with its updates at the end and with them inside backward differ, but have one
    modeled makespan. So "auto" keeps the updates at the end, and the searches time their
    trials without scheduling them."""
    from cost_models.program import order_makespan
    from passes.fuse import Trial, fuse, fuse_search
    from passes.schedule import schedule
    gm, _ = unfused
    profile = dataclasses.replace(FAST_GLOO, contention=ddlc.mesh.Contention(4, 2.0, 1e-6, 1.0, 1.0))
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(1e-5, 1e9)], profile=profile)
    fused = fuse(Trial(gm), mesh, 2**16)
    end, early = (schedule(Trial(fused), profile=profile, updates=u) for u in ("end", "early"))
    assert [n.name for n in end.graph.nodes] != [n.name for n in early.graph.nodes]
    assert order_makespan(list(end.graph.nodes), profile) == \
        pytest.approx(order_makespan(list(early.graph.nodes), profile), rel=1e-12)
    assert schedule(Trial(fused), profile=profile, updates="auto", search=True).meta["ddlc_updates"] == "end"
    scheduled = []
    timed = fuse_search(Trial(gm), mesh, lambda g, costs=None: scheduled.append(g))
    assert scheduled == [] and timed.order is None and timed.makespan > 0


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
def test_fake_values_are_those_the_fake_mode_gives(kind):
    """FakeValues works values out on meta tensors, not under the fake mode: the buckets'
    and the pieces' values have the shapes, strides, dtypes, device, type and fake mode that
    running under the fake mode gives (non-contiguous inputs included)."""
    import torch.distributed._functional_collectives  # noqa: F401  (the collectives' meta kernels)
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from passes.fuse import FakeValues, issue_args
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    target = {"all_reduce": c10d.all_reduce.default, "reduce_scatter": c10d.reduce_scatter_tensor.default,
              "all_gather": c10d.all_gather_into_tensor.default}[kind]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        xs = [torch.empty(6, 8).t(), torch.empty(12), torch.empty(4, 2, 2)]
    values = FakeValues()
    calls = []

    def both(fn, *args, **kwargs):
        mine = values.call(fn, *args, **kwargs)
        with mode:
            calls.append((mine, fn(*args, **kwargs)))
        return mine
    packed = both(pack, kind, xs, 4)
    done = both(target, *issue_args(kind, packed, 4, "g"))
    shapes = [tuple(both(target, *issue_args(kind, x.contiguous(), 4, "g")).shape) for x in xs]
    parts = both(unpack, kind, done, shapes, 4)
    grid = both(aten.view.default, packed, [4, -1])
    column = both(aten.slice.Tensor, grid, 1, 0, 1)
    both(aten.view.default, both(aten.clone.default, column, memory_format=torch.contiguous_format), [-1])
    both(aten.cat.default, [both(aten.view.default, p, [-1]) for p in parts])
    for mine, theirs in calls:
        for a, b in zip(*(m if isinstance(m, tuple) else (m,) for m in (mine, theirs))):
            assert type(a) is type(b) is FakeTensor and a.fake_mode is b.fake_mode is mode
            assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


def _searched_and_scheduled_again(gm, mesh):
    """``gm`` fused and partitioned by the searches and given the order they kept, and
    fused and partitioned by fuse_best and partition_best and scheduled again; the
    partition search's record."""
    from passes.fuse import adopt, fuse_best, fuse_search
    from passes.partition import partition_best, partition_search
    from passes.schedule import follow, schedule
    order = lambda g, costs=None: schedule(g, profile=mesh.profile, updates="auto", costs=costs)  # noqa: E731
    searched, again = copy.deepcopy(gm), copy.deepcopy(gm)
    fused = fuse_search(searched, mesh, order)
    timed = partition_search(searched, mesh, order, fused)
    assert timed.order is not None
    adopt(searched, timed, follow)
    assert fused.option == fuse_best(again, mesh, order)
    assert timed.option == partition_best(again, mesh, order)
    order(again)
    return searched, again, timed


def _assert_same_programs(searched, again, timed, mesh):
    assert _program(searched) == _program(again) and searched.code == again.code
    assert searched.meta["ddlc_updates"] == again.meta["ddlc_updates"]
    assert timed.makespan == program_timeline(again, mesh.profile).makespan


@pytest.mark.parametrize("sizes", [(math.inf, 4096, 256), (math.inf,)])
def test_searches_keep_the_program_scheduling_again_gives(unfused, monkeypatch, sizes):
    """fuse_search keeps its chosen trial's scheduled order, partition_search takes that
    timing for the size that splits nothing (not trying it again); adopting the order
    gives the very program (names, order, annotations) and makespan that choosing with
    fuse_best and partition_best and scheduling the result again gives."""
    import passes.partition as partition_module
    gm, mesh = unfused
    monkeypatch.setattr(partition_module, "SIZES", sizes)
    searched, again, timed = _searched_and_scheduled_again(gm, mesh)
    _assert_same_programs(searched, again, timed, mesh)


def test_a_chosen_split_keeps_the_program_scheduling_again_gives():
    """Where partition_search chooses to split (the FSDP MLP on a fast link), the order
    kept from its trial is the order scheduling the split program again gives."""
    gm = _fsdp_mlp()
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(1e-6, 1e8)], profile=FAST_GLOO)
    local = lower_rank(gm, mesh, (0,), axis_group_names(mesh), fuse=False, partition=False, schedule=False)
    searched, again, timed = _searched_and_scheduled_again(local, mesh)
    assert timed.option < math.inf and _pieces(searched)
    _assert_same_programs(searched, again, timed, mesh)
