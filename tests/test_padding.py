"""Parameters whose dims do not divide the group size decouple too: uneven torch.chunk
pieces of the update and its optimizer state, zero-padded collectives; the numbers are
the single device's."""
import copy
import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

import ddlc
from conftest import FAST_GLOO, assert_matches_reference, eager, optimizer, replicate_updates, train
from ddlc import comm
from ddlc.errors import SBPError
from ddlc.ir import GLOBAL_VAL, SHARDING, STEP, NdSignature, collective_sequence
from ddlc.launch import spawn
from ddlc.sbp import B, NdSBP, S, local_shape, local_slices, padded_shape, parse_sbp
from ddlc.simulate import axis_group_names, lower_rank, simulate_steps
from ddlc.zoo import MLP
from passes.canonicalize import canonicalize
from passes.decouple import _uneven_candidates, decouple, update_chain
from passes.rules import tensor_inputs
from passes.rules.checker import make_node
from passes.sharding import shard

STEPS = 3
BATCH = 240  # divides by every mesh size below, and makes the plan data parallel
PARAMS = ("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")
WIDE = (6, 10, 6)  # weights (10, 6), (6, 10), biases (10,), (6,): no dim divides by 4
ODD = (5, 7, 3)    # no dim divides by 2
#: A backend with a native reduce-scatter (NCCL's pricing): a padded reduce-scatter then
#: beats an all-reduce of the unpadded gradient, so the updates are decoupled. Under gloo's
#: emulation (reduce-scatter runs as an all-reduce) the padding makes it dearer, and the
#: search rightly all-reduces instead.
NATIVE_RS = dataclasses.replace(FAST_GLOO, emulated=())


def _model(widths=WIDE):
    torch.manual_seed(0)
    return MLP(*widths)


def _batches(widths=WIDE):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, widths[0], generator=g), torch.randn(BATCH, widths[-1], generator=g))
            for _ in range(STEPS)]


def _reference(opt_name, widths=WIDE):
    return train(_model(widths), F.mse_loss, opt_name, _batches(widths))


def _planned(opt_name, mesh_shape):
    """The data-parallel step: parameters B, updates all-B, fed by all-reduces."""
    model = _model()
    gm = canonicalize(ddlc.trace(model, _batches()[0], F.mse_loss, optimizer(opt_name, model)))
    names = {i.key: i.name for i in gm.meta["ddlc_step"].inputs}
    mesh = ddlc.Mesh(mesh_shape, links=[ddlc.LinkModel(1e-7, 1e10)] * len(mesh_shape), profile=NATIVE_RS)
    batch = NdSBP((S(0),) * mesh.ndim)
    fixed = {names["input0"]: batch, names["input1"]: batch}
    fixed.update({names[k]: NdSBP.broadcast(mesh.ndim) for k in PARAMS})
    shard(gm, mesh, fixed=fixed)
    replicate_updates(gm, mesh)
    return gm, mesh, model


def _decoupled(opt_name, mesh_shape, placement="forward"):
    gm, mesh, model = _planned(opt_name, mesh_shape)
    return gm, mesh, model, decouple(gm, mesh, placement, always=True)


def _coords(mesh):
    return list(itertools.product(*(range(p) for p in mesh.shape)))


def test_padded_shape_makes_the_axis_split_even():
    assert padded_shape((10, 3), parse_sbp("(S0)"), 0, (4,)) == (12, 3)
    assert padded_shape((12, 3), parse_sbp("(S0)"), 0, (4,)) == (12, 3)
    # the outer axis cuts 6 into 3 + 3; axis 1 cuts each 3 into 2 + 1: pad each to 4
    assert padded_shape((6,), parse_sbp("(S0, S0)"), 1, (2, 2)) == (8,)
    with pytest.raises(SBPError, match="unevenly on a mesh axis other than 1"):
        padded_shape((5,), parse_sbp("(S0, S0)"), 1, (2, 2))


def test_local_chunk_and_padding_follow_torch_chunk():
    x = torch.arange(12.0).reshape(6, 2)
    for index in range(4):  # pieces of 2, 2, 2 and 0 rows
        want = x[local_slices((6, 2), NdSBP((S(0),)), (4,), (index,))]
        got = comm.local_chunk(x, 0, 4, index)
        assert torch.equal(got, want)
        padded = comm.padded(got, 2)
        assert padded.shape == (2, 2) and torch.equal(comm.narrowed(padded, len(want)), want)
        assert not padded[len(want):].any()


@pytest.mark.parametrize("src,dst,size,splits", [
    ((1, 10), (10,), 10, ["(S1)->(S0)"]),  # unit dims only: the pieces hold the same elements
    ((6, 4), (24,), 6, []),  # on 4 ranks 6 = 2+2+2+0 rows are 8+8+8+0 elements, not 6+6+6+6
    ((24,), (6, 4), 6, [])])
def test_uneven_splits_of_a_reshape_only_where_the_pieces_match(src, dst, size, splits):
    node, _ = make_node(torch.ops.aten.view_copy.default, torch.zeros(src), list(dst))
    SHARDING.set(node, NdSignature((NdSBP((B,)),), (NdSBP((B,)),)))
    candidates = [str(c) for c in _uneven_candidates(node, 0, size)]
    assert [c for c in candidates if "S" in c] == splits


def test_indivisible_parameters_are_decoupled_with_sharded_state():
    gm, mesh, _, done = _decoupled("adamw", (4,))
    assert sorted(done) == sorted(PARAMS)
    states = [n for n in gm.graph.nodes if n.meta.get("ddlc_role") == "opt_state"
              and n.meta["val"].dim() > 0]
    assert len(states) == 2 * len(PARAMS)  # exp_avg, exp_avg_sq
    assert all(SHARDING(n).outputs[0][0].is_split for n in states)
    sequences = []
    for coord in _coords(mesh):
        graph = lower_rank(copy.deepcopy(gm), mesh, coord, axis_group_names(mesh))
        kinds = [kind for kind, _, _ in collective_sequence(graph)]
        reduced = [n.args[0].meta["val"].numel() for n in graph.graph.nodes
                   if n.target is torch.ops._c10d_functional.all_reduce.default]
        assert reduced == [1], reduced  # only the loss is all-reduced
        assert "reduce_scatter" in kinds and "all_gather" in kinds
        assert any(n.target is comm.padded for n in graph.graph.nodes)
        for n in graph.graph.nodes:  # each rank holds its torch.chunk piece of the state
            if n.op == "placeholder" and n.meta.get("ddlc_role") == "opt_state":
                want = local_shape(tuple(GLOBAL_VAL(n).shape), SHARDING(n).outputs[0],
                                   mesh.shape, coord)
                assert tuple(n.meta["val"].shape) == want, n.name
        sequences.append(collective_sequence(graph))
    assert all(s == sequences[0] for s in sequences)
    bias_states = [n for n in graph.graph.nodes if n.name == "st_layers_1_bias_exp_avg"]
    assert tuple(bias_states[0].meta["val"].shape) == (0,)  # 6 = 2 + 2 + 2 + 0 on the last rank


def test_a_reader_wanting_a_split_keeps_an_uneven_parameter_whole():
    gm, mesh, _ = _planned("sgd", (4,))
    bias = next(n for n in gm.graph.nodes if n.name == "p_layers_1_bias")
    chain, _ = update_chain(gm, "layers.1.bias")
    reader = next(u for u in bias.users if u not in chain)
    # pretend the forward reads the bias split (as a tensor-parallel plan could): an
    # uneven piece has no all-to-all to that split, so the bias is gathered in the step
    # that updates it and stays whole between steps; its update is still sharded
    info = SHARDING(reader)
    SHARDING.set(reader, NdSignature(
        tuple(NdSBP((S(0),)) if a is bias else x for x, a in zip(info.inputs, tensor_inputs(reader))),
        info.outputs))
    assert "layers.1.bias" in decouple(gm, mesh, "forward", always=True)
    placed = {n.name: str(SHARDING(n).outputs[0]) for n in gm.graph.nodes if n.op == "placeholder"}
    assert placed["p_layers_1_bias"] == "(B)" and placed["st_layers_1_bias_momentum_buffer"] == "(S0)"
    assert placed["p_layers_0_bias"] == "(S0)"


@pytest.mark.parametrize("mesh_shape,opt_name,placement", [
    ((4,), "adamw", "forward"), ((4,), "sgd", "backward"), ((2, 2), "sgd", "auto"),
    ((2, 2), "adamw", "forward"), ((3,), "adamw", "forward")],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else None)
def test_padded_updates_match_single_device(mesh_shape, opt_name, placement):
    gm, mesh, model, done = _decoupled(opt_name, mesh_shape, placement)
    assert set(done) == set(PARAMS)
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, state, _ = simulate_steps(gm, mesh, params, {}, _batches())
    assert_matches_reference({"losses": losses, "params": params, "opt_state": state}, _reference(opt_name))


def _compiled_adamw(rank):
    from ddlc.runtime import compile
    model, data = _model(ODD), _batches(ODD)
    placements = {"input0": "(S0)", "input1": "(S0)", **{k: "(B)" for k in PARAMS}}
    mesh = ddlc.Mesh((2,), links=[ddlc.LinkModel(1e-7, 1e10)], profile=NATIVE_RS)
    step = compile(model, mesh, data[0], F.mse_loss, optimizer("adamw", model),
                   placements=placements)
    losses = [step.step(*b) for b in data]
    return {"losses": losses, "params": step.state_dict(), "opt_state": step.optimizer_state(),
            "local_state": {k: (tuple(v.shape), step._sbp(k)) for k, v in step.opt_state.items()},
            "collectives": collective_sequence(step.gm)}


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_padded_updates_on_gloo_processes():
    per_rank = spawn(_compiled_adamw, 2, timeout=60, deadline=80)
    want = _reference("adamw", ODD)
    for rank, got in enumerate(per_rank):
        assert_matches_reference({k: got[k] for k in ("losses", "params", "opt_state")}, want, f"rank {rank}")
        for key, (shape, sbp) in got["local_state"].items():  # each rank keeps only its piece
            if key.endswith(("exp_avg", "exp_avg_sq")):
                assert sbp[0].is_split, key
                assert shape == local_shape(tuple(want["opt_state"][key].shape), sbp, (2,), (rank,)), key
        assert [c for c in got["collectives"] if c[0] == "all_reduce"] == [("all_reduce", 0, 4)]
        assert got["collectives"] == per_rank[0]["collectives"]


class _TwoLayers(torch.nn.Sequential):
    def __init__(self):
        super().__init__()
        self.add_module("fc1", torch.nn.Linear(13, 33))
        self.add_module("act", torch.nn.GELU())
        self.add_module("fc2", torch.nn.Linear(33, 7))


def _two_layer_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 13, generator=g), torch.randint(0, 7, (8,), generator=g)


def _partitioned_uneven_steps(rank):
    torch.manual_seed(0)
    model, (x, y) = _TwoLayers(), _two_layer_data()
    step = ddlc.compile(model, (2, 2), (x, y), F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-2),
                        placements={"fc1.weight": "(S0, S1)"}, partition=64)
    return [step.step(x, y) for _ in range(3)], step.state_dict(), collective_sequence(step.gm)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_collectives_cut_into_pieces_of_an_uneven_split_match_single_device():
    """``fc1.weight`` (13, 33) split over both axes of (2,2): the rows are cut 7/6 on axis
    0, so the two groups of axis 1 gather 7 and 6 rows, and ``partition=64`` cuts their
    all-gathers into pieces of other sizes (56/64 and 59/67 bytes). Those groups never
    exchange a piece, but the check of the programs compared every collective's bytes
    across all ranks and refused them as a deadlock; it compares bytes within a group now."""
    per_rank = spawn(_partitioned_uneven_steps, 4, timeout=120, deadline=140)
    torch.manual_seed(0)
    model, (x, y) = _TwoLayers(), _two_layer_data()
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for _ in range(3):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    assert_matches_reference({"losses": per_rank[0][0], "params": per_rank[0][1]},
                             {"losses": losses, "params": dict(model.named_parameters())})
    assert per_rank[0][2] != per_rank[2][2]  # the groups of axis 1 move other bytes


def test_collective_sequences_agree_in_kind_and_axis_and_in_bytes_within_each_group():
    from ddlc.runtime import mismatched_sequences
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    pieces = {0: [("all_gather", 1, 56), ("all_gather", 0, 152)], 2: [("all_gather", 1, 59), ("all_gather", 0, 152)]}
    agreeing = [(c, pieces[2 * c[0]]) for c in coords]
    assert mismatched_sequences(agreeing) is None
    within = list(agreeing)
    within[1] = ((0, 1), [("all_gather", 1, 64), ("all_gather", 0, 152)])
    assert "moves 56 bytes on rank 0 and 64 on rank 1, of one group" in mismatched_sequences(within)
    across = list(agreeing)
    across[3] = ((1, 1), [("all_gather", 1, 59), ("all_gather", 0, 160)])
    assert "of one group" in mismatched_sequences(across)  # ranks 1 and 3 gather on axis 0 together
    other_order = list(agreeing)
    other_order[2] = ((1, 0), [("all_gather", 0, 152), ("all_gather", 1, 59)])
    assert "first difference is collective 0" in mismatched_sequences(other_order)


class _TwoBranches(torch.nn.Module):
    """A linear branch and a channels-last convolution of a second input."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(13, 27), torch.nn.Linear(27, 7)
        self.conv = torch.nn.Conv2d(3, 5, 3, padding=1).to(memory_format=torch.channels_last)

    def forward(self, x, img):
        return self.fc2(torch.relu(self.fc1(x))) + self.conv(img).mean((1, 2, 3))[:, None]


def _two_branch_data():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(6, 13, generator=g),
            torch.randn(6, 3, 5, 5, generator=g).contiguous(memory_format=torch.channels_last),
            torch.randn(6, 7, generator=g))


def _two_branch_steps(rank):
    torch.manual_seed(0)
    model, batch = _TwoBranches(), _two_branch_data()
    step = ddlc.compile(model, (2, 2), batch, F.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-2),
                        placements={"input0": "(S0, B)"}, partition=64, fuse=200)
    return [step.step(*batch) for _ in range(3)]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_piece_contiguous_on_coordinate_0_only_is_cut_on_every_rank():
    """The pieces of a collective are decided on mesh coordinate 0's program, where its
    input is contiguous; on another coordinate it need not be, and the cut flattened it with
    ``view``: ``step()`` failed there ("view size is not compatible"). A ``reshape`` now."""
    got = spawn(_two_branch_steps, 4, timeout=120, deadline=140)[0]
    torch.manual_seed(0)
    model, (x, img, y) = _TwoBranches(), _two_branch_data()
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for _ in range(3):
        loss = F.mse_loss(model(x, img), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(got), torch.stack(losses), rtol=1e-5, atol=1e-6)


class _OddWidths(torch.nn.Module):
    """A token model of widths 33 and 130 and 97 words, which a (2, 2) mesh splits
    unevenly (33 into 17 and 16)."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm = torch.nn.Embedding(97, 33), torch.nn.LayerNorm(33)
        self.a, self.b, self.head = torch.nn.Linear(33, 130), torch.nn.Linear(130, 33), torch.nn.Linear(33, 97)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.b(F.gelu(self.a(self.norm(h)))))


def _token_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def test_a_bucket_cap_buckets_unevenly_split_collectives_alike_on_every_rank():
    """Bucketing filled buckets on each rank's own bytes, which differ where a tensor is split
    unevenly (68 and 64 bytes for 17 and 16 floats): with a cap of 68 bytes, one mesh column
    bucketed the loss's scalar all-reduce with its piece's and the other did not, and
    lowering stopped on ranks whose programs differed (or the step ran other collectives
    than its peers'). Buckets are filled on the bytes the plan prices, the same on every rank."""
    torch.manual_seed(0)
    model = _OddWidths()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 97, (4, 6), generator=g), torch.randint(0, 97, (4, 6), generator=g)) for _ in range(2)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    gm = canonicalize(ddlc.trace(model, data[0], _token_loss, sgd(model)))
    sig, mesh = STEP(gm), ddlc.Mesh((2, 2), profile="dgx-h100-ib")
    fixed = {sig.input_name("param", "a.weight"): parse_sbp("(S0, S1)"),
             sig.input_name("param", "b.weight"): parse_sbp("(S1, S0)"),
             **{sig.input_name("input", k): parse_sbp("(S0, B)") for k in sig.keys("input")}}
    shard(gm, mesh, fixed=fixed)
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, {}, data, fuse=68.0, partition=False, schedule=True)
    want, _ = eager(reference, _token_loss, sgd, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})
