"""Larger meshes than this machine hosts as processes: every rank's lowered program runs
in one process with exactly simulated collectives, and must match the single device."""
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddlc
from conftest import assert_matches_reference, batches, eager, model_and_loss, optimizer, reference, simulated
from ddlc.ir import COLLECTIVE, ROLE, SHARDING, STEP, collective_sequence
from ddlc.sbp import parse_sbp
from ddlc.simulate import axis_group_names, lower_rank, lower_ranks, simulate_steps
from passes import fuse
from passes.canonicalize import canonicalize
from passes.sharding import shard

CASES = [
    ((2, 4), "mlp", "adamw", {"input0": "(S0, B)", "layers.0.weight": "(B, S0)"}),
    ((2, 4), "gpt", "sgd", {"input0": "(S0, B)"}),
    ((2, 2, 2), "mlp", "sgd", {"input0": "(S0, S0, B)", "layers.1.weight": "(B, B, S1)"}),
    ((2, 4), "cnn", "adamw", {"input0": "(S0, B)"}),
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
    graph = lower_rank(copy.deepcopy(gm), mesh, (0,) * mesh.ndim, axis_group_names(mesh))
    assert collective_sequence(graph), "the plan should communicate"
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data)
    assert_matches_reference({"losses": losses, "params": params}, reference(model_name, opt_name))


def test_every_rank_lowers_to_the_same_collective_sequence():
    model, loss_fn = model_and_loss("mlp")
    data = batches("mlp")
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer("adamw", model)))
    mesh = ddlc.Mesh((2, 2, 2))
    shard(gm, mesh, fixed={"input0": parse_sbp("(S0, S0, B)"),
                           "p_layers_1_weight": parse_sbp("(B, B, S1)")})
    sequences = [collective_sequence(lower_rank(copy.deepcopy(gm), mesh, c, axis_group_names(mesh)))
                 for c in itertools.product(range(2), range(2), range(2))]
    assert all(s == sequences[0] for s in sequences)


def test_taking_coordinate_0s_choices_gives_the_searched_program_without_searching(monkeypatch):
    """ddlc.compile: rank 0 searches the bucket cap, piece size and order; the other ranks
    take them. Each rank's program is then the one it would have found by searching."""
    import ddlc.pipeline as pipeline
    from ddlc.options import CompileOptions
    model, loss_fn = model_and_loss("mlp")
    data = batches("mlp")
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer("adamw", model)))
    mesh = ddlc.Mesh((2, 2), links=[ddlc.LinkModel(1e-7, 1e10)] * 2)
    shard(gm, mesh, fixed={"input0": parse_sbp("(S0, B)"), "p_layers_0_weight": parse_sbp("(B, S0)")})
    options, groups = CompileOptions.from_kwargs(), axis_group_names(mesh)
    choices = pipeline.lower(copy.deepcopy(gm), mesh, (0, 0), groups, options)
    searched = lower_rank(copy.deepcopy(gm), mesh, (1, 1), groups)

    def no_search(*args):
        raise AssertionError("a rank given coordinate 0's choices searched again")
    for search in ("fuse_search", "partition_search", "schedule"):
        monkeypatch.setattr(pipeline, search, no_search)
    taken = lower_rank(copy.deepcopy(gm), mesh, (1, 1), groups, choices=choices)
    assert [n.name for n in taken.graph.nodes] == [n.name for n in searched.graph.nodes]
    assert collective_sequence(taken) == collective_sequence(searched)


def test_a_mesh_axis_of_one_device_issues_no_collective():
    """On an axis of one device, split, broadcast and partial sum hold the same values (the
    whole tensor; a sum of one), so redistributing along it is the identity: a plan that
    splits the batch over both axes of a 2x1 mesh communicates only on the first, and its
    numbers are the single device's."""
    model, loss_fn = model_and_loss("gpt")
    data = batches("gpt")
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer("sgd", model)))
    names = {i.key: i.name for i in gm.meta["ddlc_step"].inputs}
    mesh = ddlc.Mesh((2, 1))
    shard(gm, mesh, fixed={names[k]: parse_sbp("(S0, S0)") for k in ("input0", "input1")})
    for coord in ((0, 0), (1, 0)):
        program = lower_rank(copy.deepcopy(gm), mesh, coord, axis_group_names(mesh))
        steps = [info for n in program.graph.nodes if (info := COLLECTIVE.get(n)) is not None]
        assert collective_sequence(program) and {info.axis for info in steps} == {0}, steps
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data)
    assert_matches_reference({"losses": losses, "params": params}, reference("gpt", "sgd"))


def _program(local_clone: bool, then_gather: bool = True):
    """x -> [clone] -> all_reduce on axis0 -> wait -> [all_gather on axis0 -> wait] -> output."""
    from torch import fx
    c10d, graph = torch.ops._c10d_functional, fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.clone.default, (x,)) if local_clone else x
    y = graph.call_function(c10d.wait_tensor.default,
                            (graph.call_function(c10d.all_reduce.default, (y, "sum", "axis0")),))
    if then_gather:
        y = graph.call_function(c10d.wait_tensor.default,
                                (graph.call_function(c10d.all_gather_into_tensor.default, (y, 2, "axis0")),))
    graph.output((y,))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_ranks_whose_local_nodes_differ_run_their_collectives_together():
    """The ranks' programs may differ in local nodes (views.py gives only a rank whose
    piece is strided a contiguous copy): each runs up to its next collective, and the
    ranks' k-th collectives run together. Programs that issue different collectives are
    a clear error, not a hang or a wrong sum."""
    import torch
    from ddlc.errors import RuntimeMismatchError
    from ddlc.simulate import run_ranks
    mesh = ddlc.Mesh((2,))
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    out = run_ranks([_program(True), _program(False)], mesh, [[a], [b]])
    assert [o[0].tolist() for o in out] == [[11.0, 22.0, 11.0, 22.0]] * 2
    with pytest.raises(RuntimeMismatchError, match="different collectives"):
        run_ranks([_program(True), _program(False, then_gather=False)], mesh, [[a], [b]])


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4)], ids=lambda s: "x".join(map(str, s)))
def test_plans_made_for_gpus_match_single_device(mesh_shape):
    """What a GPU user gets: the zoo GPT planned for ``dgx-h100-ib`` with nothing pinned
    (fast links: parameters split for tensor parallelism) and lowered with that profile's
    searches (bucket cap, piece size, the order with updates placed by the timeline), as
    no gloo run plans it; three SGD steps on the simulated ranks equal the single device's.
    SGD, not AdamW: plans that reduce in another order differ from eager by float rounding,
    which Adam's division by the root of the second moment magnifies on gradients that are
    zero but for rounding (attention's key bias)."""
    from ddlc import pipeline
    from ddlc.options import CompileOptions
    from ddlc.sbp import NdSBP
    model, loss_fn = model_and_loss("gpt")
    data = batches("gpt")
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer("sgd", model)))
    mesh = ddlc.Mesh(mesh_shape, profile="dgx-h100-ib")
    pipeline.plan(gm, mesh, CompileOptions(profile="dgx-h100-ib"), {})
    whole = NdSBP.broadcast(mesh.ndim)
    split = [n.name for n in gm.graph.find_nodes(op="placeholder")
             if ROLE.get(n) == "param" and SHARDING(n).outputs[0] != whole]
    assert split, "the plan should split parameters (tensor parallelism), not only the batch"
    params = {k: v.detach() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data,
                                          profile="dgx-h100-ib")
    assert_matches_reference({"losses": losses, "params": params}, reference("gpt", "sgd"))


class _SplitQKV(nn.Module):
    """A pre-LN decoder block whose attention splits one qkv projection and masks with
    ``masked_fill`` (not the zoo GPT's layout)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.ln1, self.qkv, self.proj = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=-1))
        att = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _SplitQKVModel(nn.Module):
    def __init__(self, vocab=64, d=32, seq=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_SplitQKV(d) for _ in range(2))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("mesh_shape", [(1, 4), (4, 1)], ids=["1x4", "4x1"])
def test_a_one_device_axis_needs_no_redistribution(mesh_shape):
    """On a mesh axis of one device every SBP is the whole value: the searched plan of this
    model on (1, 4) over fast links asks for (S1, S0) -> (P, S0), an S->P on the
    one-device axis alone, which lowering refused as S->P; it is nothing to do there, and
    the steps equal eager's."""
    from ddlc import pipeline
    from ddlc.options import CompileOptions
    from ddlc.zoo import lm_loss
    torch.manual_seed(0)
    model = _SplitQKVModel()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(2)]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    gm = canonicalize(ddlc.trace(model, data[0], lm_loss, torch.optim.SGD(model.parameters(), lr=0.1)))
    mesh = ddlc.Mesh(mesh_shape, links=[ddlc.LinkModel(1e-7, 1e10)] * 2)
    pipeline.plan(gm, mesh, CompileOptions.from_kwargs(), {})
    losses, params, _, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for (x, y), got in zip(data, losses):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


class _SolvedInPlaces(nn.Module):
    """Qwen3-Next's gated delta rule in small: a triangular solve (column-major on the
    CPU), ``zeros_like`` of it (the same layout) written slice by slice in place, so
    autograd replays views of a column-major tensor (``as_strided``)."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(16, 96), nn.Linear(8, 3)

    def forward(self, x):
        b = x.shape[0]
        h = self.inp(x)
        a = h[..., :32].reshape(b, 2, 8, 4, 8).permute(0, 3, 1, 2, 4).tril(-1) * 0.1
        v = h[..., 32:].reshape(b, 2, 8, 4, 16).permute(0, 3, 1, 2, 4)[..., :8]
        y = torch.linalg.solve_triangular(a, v, upper=False, unitriangular=True)
        out = torch.zeros_like(y)
        for i in range(2):
            out[:, :, i] = y[:, :, i] * 2
        return self.head(out).mean((1, 2, 3))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_view_replays_read_eagers_layout_after_a_collective(mesh_shape):
    """A plan of slow compute over fast links gathers the tensors autograd's view replays
    read through column-major strides; a gathered tensor is row-major, so the replays
    read other elements (losses 0.9077 for eager's 0.9096) until it is given eager's
    layout again (``comm.with_layout``). float64: the steps equal eager's."""
    from ddlc import pipeline
    from ddlc.mesh import HardwareProfile
    from ddlc.options import CompileOptions
    slow_compute = HardwareProfile.from_dict({
        "name": "slow-compute", "devices_per_node": 8, "flops": {"float32": 1e8, "float64": 1e8},
        "memory_bandwidth": 1e9, "memory_capacity": 8e10,
        "links": {"intra_node": {"latency": 1e-7, "bandwidth": 1e12},
                  "inter_node": {"latency": 1e-7, "bandwidth": 1e12}}})
    torch.manual_seed(0)
    model = _SolvedInPlaces().double()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
            for _ in range(3)]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    gm = canonicalize(ddlc.trace(model, data[0], F.cross_entropy,
                                 torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)))
    mesh = ddlc.Mesh(mesh_shape, profile=slow_compute)
    pipeline.plan(gm, mesh, CompileOptions.from_kwargs(profile=slow_compute), {})
    losses, params, _, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for (x, y), got in zip(data, losses):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        torch.testing.assert_close(got, loss.detach(), rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-9, atol=1e-12, msg=name)


class _OverlappingFrames(nn.Module):
    """Overlapping windows of an activation by ``as_strided`` (how ``torch.stft`` and
    hand-written framing cut frames): its backward adds each window's gradient into the
    activation's storage (``index_add``), a partial sum over a split batch whose all-reduce
    the replay ``as_strided(grad, ..., offset 0)`` reads. ``frames``: "tanh" (of the linear
    layer's output), "linear" (of the output itself) or "stft" (``torch.stft`` of it)."""

    def __init__(self, frames: str = "tanh"):
        super().__init__()
        self.frames = frames
        self.lin, self.out = nn.Linear(32, 32), nn.Linear(9 if frames == "stft" else 16, 2)
        self.register_buffer("window", torch.hann_window(16))

    def forward(self, x):
        h = self.lin(x)
        if self.frames == "stft":
            spectrum = torch.stft(h, 16, hop_length=4, window=self.window, center=False, return_complex=True)
            return self.out(spectrum.abs().mean(-1))
        h = torch.tanh(h) if self.frames == "tanh" else h
        frames = h.as_strided((h.shape[0], 5, 16), (h.stride(0), 4, 1))
        return self.out(frames.pow(2).mean(1))


@pytest.mark.parametrize("frames", ["tanh", "linear", "stft"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_a_storage_reader_after_a_fused_collective_reads_its_own_tensor(mesh_shape, frames):
    """Data parallel, collectives fused: the all-reduce that the replay reads shared a
    bucket with the gradients', and the replay read the bucket's storage from its start
    (the loss and other gradients): ``lin``'s gradient 65 off (largest true entry 0.08).
    The replay's input is now a tensor of its own (``comm.with_layout``). Frames of the
    linear layer's own output were refused: the two traces of ``ddlc.strided_views``
    repeat the replays a linear layer's backward reads in other numbers."""
    torch.manual_seed(0)
    model = _OverlappingFrames(frames)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 32, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    gm = canonicalize(ddlc.trace(model, data[0], F.mse_loss, sgd(model)))
    sig, mesh = STEP(gm), ddlc.Mesh(mesh_shape)
    split = parse_sbp("(S0)" if len(mesh_shape) == 1 else "(S0, S0)")
    shard(gm, mesh, fixed={sig.input_name("input", k): split for k in sig.keys("input")})
    losses, params, _, _ = simulate_steps(gm, mesh, {k: v.detach() for k, v in model.named_parameters()},
                                          dict(model.named_buffers()), data, fuse=2**20)
    assert any(n.target is fuse.unpack for n in lower_ranks(gm, mesh, fuse=2**20)[0].graph.nodes)
    want, _ = eager(reference, F.mse_loss, sgd, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


class _ConvolvedSelfAttention(nn.Module):
    """Attention of one tensor with itself whose query is a convolution's channels
    permuted, reshaped into heads and transposed: its last dimension is strided."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv1d(4, 16, 3, padding=1), nn.Linear(16, 4)

    def forward(self, x):
        q = self.conv(x).permute(0, 2, 1).reshape(8, 6, 4, 4).transpose(1, 2)
        return self.head(F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(8, 6, 16))


@pytest.mark.parametrize("profile", ["default", "slow-compute"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_attention_of_a_strided_tensor_with_itself_matches_single_device(mesh_shape, profile):
    """Once NaN losses on every rank: the per-rank program ran the CPU flash kernel on
    the strided query as a view (passes/views.py gives it dense rows now); and the plan
    search, pricing the one tensor read as query, key and value by tensor rather than by
    argument, failed inside torch's flop counter. On a batch-split plan and on one that
    slow compute over fast links makes split other dimensions."""
    from ddlc import pipeline
    from ddlc.mesh import HardwareProfile
    from ddlc.options import CompileOptions
    torch.manual_seed(0)
    model = _ConvolvedSelfAttention()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, 6, generator=g), torch.randn(8, 6, 4, generator=g)) for _ in range(3)]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    gm = canonicalize(ddlc.trace(model, data[0], F.mse_loss, make_opt(model)))
    options = {} if profile == "default" else {"profile": HardwareProfile.from_dict({
        "name": "slow-compute", "devices_per_node": 8, "flops": {"float32": 1e8},
        "memory_bandwidth": 1e9, "memory_capacity": 8e10,
        "links": {"intra_node": {"latency": 1e-7, "bandwidth": 1e12},
                  "inter_node": {"latency": 1e-7, "bandwidth": 1e12}}})}
    mesh = ddlc.Mesh(mesh_shape, **options)
    pipeline.plan(gm, mesh, CompileOptions.from_kwargs(**options), {})
    losses, params, _, _ = simulate_steps(gm, mesh, params, {}, data)
    opt = make_opt(model)
    for (x, y), got in zip(data, losses):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        torch.testing.assert_close(got, loss.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), msg=name)


def _assert_simulated_matches_eager(model, make_opt, data, mesh_shape):
    """Three steps of ``model`` (mean squared error) on simulated ranks of ``mesh_shape``,
    its batches split, give eager's losses and parameters."""
    reference_model = copy.deepcopy(model)
    losses, params, _, _ = simulated(model, F.mse_loss, make_opt, data, mesh_shape)
    want, _ = eager(reference_model, F.mse_loss, make_opt, data)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want))
    for name, p in reference_model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), msg=name)


class _BagsOfColumns(nn.Module):
    """A DLRM's sparse features: one EmbeddingBag per column of the index batch, a
    GroupNorm of a transposed projection beside them."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(10, 4, mode="sum") for _ in range(2))
        self.proj, self.norm, self.out = nn.Linear(3, 8), nn.GroupNorm(2, 8), nn.Linear(8 + 4 * 2, 3)

    def forward(self, idx, dense):
        offsets = torch.arange(idx.shape[0])
        sparse = [bag(idx[:, k], offsets) for k, bag in enumerate(self.bags)]
        normed = self.norm(self.proj(dense).transpose(1, 2)).mean(-1)
        return self.out(torch.cat(sparse + [normed], -1))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_embedding_bags_of_index_columns_match_single_device(mesh_shape):
    """``idx[:, k]`` is a strided view in the per-rank program, which ``_embedding_bag``
    read as dense indices (losses 0.2 off) and whose backward refused; GroupNorm's
    kernel refused its transposed input. Both get contiguous inputs now (passes/views.py)."""
    torch.manual_seed(0)
    model = _BagsOfColumns()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 10, (8, 2), generator=g), torch.randn(8, 6, 3, generator=g),
             torch.randn(8, 3, generator=g)) for _ in range(3)]
    _assert_simulated_matches_eager(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                                    data, mesh_shape)


class _SqueezedScore(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(8, 1)

    def forward(self, x):
        return self.score(x).squeeze()


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_a_squeezed_batch_of_one_per_rank_matches_single_device(mesh_shape):
    """``model(x).squeeze()`` with one sample per rank: the rank's ``(1, 1)`` piece lost its
    batch dim too (LoweringError); squeeze names its dims now (passes/canonicalize.py)."""
    torch.manual_seed(0)
    model = _SqueezedScore()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g)) for _ in range(3)]
    _assert_simulated_matches_eager(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                    data, mesh_shape)


def test_a_collective_that_brought_only_a_random_draw_its_input_is_dropped():
    """Dropout's ``bernoulli`` reads its template (``expand(empty)``) for the shape alone, so
    the draw that replaces it (passes/random.py) leaves the template's redistribution
    unread; fx keeps a wait, so the collective ran every step for nothing and fusion,
    which takes every wait to have a reader, stopped with a ValueError (a random plan of
    an HF GPT-2 with the template a partial sum)."""
    from ddlc.ir import NdSignature, is_wait
    from ddlc.sbp import NdSBP, P
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    gm = canonicalize(ddlc.trace(model, batch, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1)))
    mesh = ddlc.Mesh((2,))
    shard(gm, mesh, fixed={STEP(gm).input_name("input", k): parse_sbp("(S0)") for k in STEP(gm).keys("input")})
    template = next(n for n in gm.graph.nodes if "bernoulli" in str(n.target)).args[0]
    SHARDING.set(template, NdSignature((NdSBP((P,)),), (NdSBP((P,)),)))  # reduce-scattered for the draw
    program = lower_rank(gm, mesh, (0,), fuse=True)
    assert not [n for n in program.graph.nodes if is_wait(n) and not n.users]
    assert [str(n.target) for n in program.graph.nodes if "reduce_scatter" in str(n.target)] == []
