"""Gradient accumulation (``micro_batches=n``): the step's batch cut along its first dim into
``n`` equal micro-batches, a forward and backward each, their gradients summed before one
update, as eager's loop ``for mb in batch.chunk(n): (loss(mb) / n).backward()`` then
``optimizer.step()``. Numerics against that loop (losses, parameters, buffers, optimizer
state) on simulated ranks and on 4 gloo processes; one gradient reduction per step, not per
micro-batch; bad input refused by name."""
import copy
import weakref
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ddlc
from conftest import assert_matches_reference, eager, simulated
from ddlc.ir import STEP, collective_sequence
from ddlc.launch import spawn
from ddlc.simulate import axis_group_names, lower_rank
from ddlc.zoo import GPT, lm_loss
from passes.canonicalize import canonicalize
from passes.sharding import build_problem, shard
from ddlc.sbp import parse_sbp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MESHES = [(4,), (2, 2)]


class _BatchNormNet(nn.Module):
    """Batch statistics per micro-batch, running statistics carried from one micro-batch to
    the next, and a layer the loss never reads (no gradient, no update)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def _rows(n, *shapes, steps=3):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(n, *shape, generator=g) for shape in shapes) for _ in range(steps)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["4", "2x2"])
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_accumulated_steps_match_an_eager_loop_over_micro_batches(micro_batches, mesh_shape):
    torch.manual_seed(0)
    model = _BatchNormNet()
    reference = copy.deepcopy(model)
    data = _rows(16, (6,), (3,))
    losses, params, buffers, gm = simulated(model, F.mse_loss, _sgd, data, mesh_shape,
                                            micro_batches=micro_batches, clip_grad_norm=0.5)
    want, _ = eager(reference, F.mse_loss, _sgd, data, clip=0.5, micro_batches=micro_batches)
    assert_matches_reference({"losses": losses, "params": params, "opt_state": buffers},
                             {"losses": want, "params": dict(reference.named_parameters()),
                              "opt_state": dict(reference.named_buffers())})
    assert int(buffers["bn.num_batches_tracked"]) == len(data) * micro_batches
    torch.testing.assert_close(params["unused.weight"], reference.unused.weight)  # never updated
    # and not the whole batch at once: another loss, other running statistics
    whole = copy.deepcopy(model)
    whole_losses, _ = eager(whole, F.mse_loss, _sgd, data, clip=0.5)
    assert not torch.allclose(torch.stack(whole_losses), torch.stack(want))


def test_dropout_draws_each_micro_batch_in_eager_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    data = _rows(8, (8,), (4,))
    losses, params, _, _ = simulated(model, F.mse_loss, _sgd, data, (2, 2), micro_batches=2)
    want, _ = eager(reference, F.mse_loss, _sgd, data, seed=0, micro_batches=2)  # the program's seed
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


def test_a_hugging_face_model_with_its_own_loss_accumulates_over_a_dict_batch():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_inner=64, vocab_size=96, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 96, (8, 12), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # noqa: E731
    losses, params, _, gm = simulated(model, None, adamw, data, (4,), micro_batches=2)
    assert STEP(gm).batch_keys() == ["input_ids", "labels"]
    assert STEP(gm).keys("input") == ["input_ids[0]", "labels[0]", "input_ids[1]", "labels[1]"]
    want, _ = eager(reference, None, adamw, data, micro_batches=2)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


def _gradient_collectives(micro_batches):
    """The collectives of rank 0's data-parallel program of the zoo GPT on (4,), by kind."""
    model = GPT()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 64, (16, 16), generator=g), torch.randint(0, 64, (16, 16), generator=g))
    gm = canonicalize(ddlc.trace(model, batch, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                                 micro_batches=micro_batches))
    sig = STEP(gm)
    mesh = ddlc.Mesh((4,))
    pins = {sig.input_name("input", k): parse_sbp("(S0)") for k in sig.keys("input")}
    pins.update({sig.input_name("param", k): parse_sbp("(B)") for k in sig.keys("param")})
    shard(gm, mesh, fixed=pins, move_activations=False)
    program = lower_rank(gm, mesh, (0,), axis_group_names(mesh), fuse=False, partition=False, schedule=False)
    return Counter(kind for kind, _, _ in collective_sequence(program))


def test_gradients_are_reduced_once_a_step_not_once_a_micro_batch():
    one, four = _gradient_collectives(1), _gradient_collectives(4)
    params = len(list(GPT().parameters()))
    assert set(one) == set(four) == {"all_reduce"} and one["all_reduce"] > params  # data parallel
    # the micro-batches' partial gradients are summed on each rank first and reduced once:
    # only each micro-batch's token count (its mean's divisor) is summed over ranks on its own
    assert four["all_reduce"] == one["all_reduce"] + 3, (one, four)


def test_micro_batches_that_do_not_divide_the_batch_or_an_inference_program_are_refused():
    model = nn.Linear(4, 2)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ddlc.errors.UnsupportedInputError,
                       match=r"batch entry 'input0' has shape \(6, 4\), whose first dim cannot be cut "
                             r"into micro_batches=4 equal micro-batches"):
        ddlc.trace(model, (x, y), F.mse_loss, sgd, micro_batches=4)
    with pytest.raises(ddlc.errors.UnsupportedInputError, match="needs a loss_fn or an optimizer"):
        ddlc.trace(model, (x,), micro_batches=2)
    with pytest.raises(ddlc.errors.OptionError, match="micro_batches=0 must be >= 1"):
        ddlc.options.CompileOptions.from_kwargs(micro_batches=0)


def _compiled_steps(rank, mesh_shape, placements, batch_mode):
    torch.manual_seed(0)
    model = GPT()
    opt = _sgd(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(3)]
    step = ddlc.compile(model, mesh_shape, data[0], lm_loss, opt, micro_batches=2, placements=placements,
                        batch=batch_mode)
    if batch_mode == "local":
        assert step.local_input_shapes == [(2, 16), (2, 16)], step.local_input_shapes
    losses = []
    for x, y in data:
        if batch_mode == "local":  # each rank its own quarter, as a DistributedSampler gives
            x, y = x.chunk(4)[rank], y.chunk(4)[rank]
        losses.append(float(step.step(x, y)))
    try:  # 7 rows (1 on each rank) cannot be cut into two micro-batches
        step.step(*(t[:7] if batch_mode == "global" else t[:1] for t in data[0]))
        refusal = None
    except ddlc.errors.UnsupportedInputError as error:
        refusal = str(error)
    return losses, step.state_dict(), step.optimizer_state(), refusal


def _eager_steps(batch_mode):
    torch.manual_seed(0)
    model = GPT()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(3)]
    if batch_mode == "local":
        # micro-batch i: each rank's i-th half of its own quarter, as the ranks' steps cut them
        data = [tuple(torch.cat([part.chunk(2)[i] for i in range(2) for part in t.chunk(4)]) for t in batch)
                for batch in data]
    opt = _sgd(model)
    losses, _ = eager(model, lm_loss, lambda m: opt, data, micro_batches=2)
    moments = {f"{name}:momentum_buffer": opt.state[p]["momentum_buffer"] for name, p in model.named_parameters()}
    return [float(x) for x in losses], model.state_dict(), moments


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh_shape, placements, batch_mode", [
    ((2, 2), {"input0": "(S0, S0)", "input1": "(S0, S0)"}, "global"),
    ((4,), {"input0": "(S0)", "input1": "(S0)"}, "local"),
], ids=["2x2-batch-split", "4-local-batch"])
def test_compiled_accumulation_on_gloo_ranks_matches_the_eager_loop(mesh_shape, placements, batch_mode):
    results = spawn(_compiled_steps, 4, mesh_shape, placements, batch_mode, timeout=240, deadline=280)
    want_losses, want_state, want_moments = _eager_steps(batch_mode)
    for losses, state, opt_state, refusal in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)
        for key, value in want_moments.items():
            torch.testing.assert_close(opt_state[key], value, rtol=1e-4, atol=1e-5, msg=key)
        assert "cannot be cut into micro_batches=2 equal micro-batches" in refusal, refusal


class _LiveBytes(TorchDispatchMode):
    """The most bytes held at once by the tensors the operators run under it make (each
    storage counted once, until its tensor is freed)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def _free(self, pointer: int) -> None:
        self.live -= self.sizes.pop(pointer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.sizes:
                pointer, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                self.sizes[pointer] = size
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, pointer)
        return out


def _peak_bytes_of_a_step(rank):
    """Per number of micro-batches, 1 and 8, the peak bytes of the second step."""
    peaks = {}
    for micro_batches in (1, 8):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)], nn.Linear(64, 10))
        x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
        step = ddlc.compile(model, (2,), (x, y), F.cross_entropy, _sgd(model), micro_batches=micro_batches,
                            placements={"input0": "(S0)", "input1": "(S0)"})
        step.step(x, y)
        with _LiveBytes() as live:
            step.step(x, y)
        peaks[micro_batches] = live.peak
    return peaks


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_one_micro_batchs_activations_are_live_at_a_time():
    """The program runs each micro-batch's forward and then its backward, so its peak holds
    one micro-batch's activations, not all of them (the scheduler once ran the next
    micro-batch's forward, which every gradient's bucket reads through, before the backward
    of the one before)."""
    peaks = spawn(_peak_bytes_of_a_step, 2, timeout=150, deadline=190)[0]
    whole, eighths = peaks[1], peaks[8]
    # 17 activations of 512 x 64 floats on each rank in one batch; of 64 x 64 in an eighth
    assert whole > 17 * 512 * 64 * 4
    assert eighths < 0.3 * whole, (eighths, whole)


def _least_footprint(micro_batches):
    """The least bytes per device any plan of an 8-layer MLP on (2,) keeps resident, by
    the search's memory model, and the bytes of its parameters, gradients and momentum."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)], nn.Linear(64, 10))
    gm = canonicalize(ddlc.trace(model, (torch.randn(1024, 64), torch.randint(0, 10, (1024,))), F.cross_entropy,
                                 _sgd(model), micro_batches=micro_batches))
    need, _ = build_problem(gm, ddlc.Mesh((2,))).min_memory()
    return need


def test_the_search_counts_one_micro_batchs_saved_activations():
    """One micro-batch's activations are live at a time (the test above), so the least
    budget the search accepts falls with more micro-batches (it rose before: every
    micro-batch's saved activations were counted, and a budget met by accumulating
    gradients was refused)."""
    one, four, eight = (_least_footprint(k) for k in (1, 4, 8))
    assert eight < four < one
    # 17 saved activations of 1024 x 64 floats, split over the 2 ranks at best: the four
    # micro-batches save a quarter of them, the eight an eighth
    activations = 17 * 512 * 64 * 4
    assert one - four > 0.7 * activations * 3 / 4, (one, four)


def test_a_micro_batch_the_mesh_cannot_split_is_named_as_one():
    """Eight rows in four micro-batches leave two rows a micro-batch, which (S0) over four
    ranks cannot cut: the refusal names the micro-batch of which batch input it is."""
    model = nn.Linear(4, 2)
    gm = canonicalize(ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 2)), F.mse_loss,
                                 torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=4))
    sig = STEP(gm)
    with pytest.raises(ddlc.errors.ShardingError,
                       match=r"batch input 'input0\[0\]' \(micro-batch 0 of input0, cut into micro_batches=4\) "
                             r"cannot cut its shape \(2, 4\)"):
        shard(gm, ddlc.Mesh((4,)), fixed={sig.input_name("input", k): parse_sbp("(S0)") for k in sig.keys("input")})


def _own_part_of_a_whole_input(rank):
    model = nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    step = ddlc.compile(model, (2,), (x, y), F.mse_loss, _sgd(model), micro_batches=2, batch="local",
                        placements={"input0": "(B)", "input1": "(B)"})
    try:
        step.step(x.chunk(2)[rank], y.chunk(2)[rank])
    except ddlc.errors.UnsupportedInputError as error:
        return str(error)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_ranks_own_part_of_a_whole_input_names_the_batch_entry_to_pin():
    """With batch="local", a rank's own rows of an input the plan keeps whole are refused
    with the pin that fixes it: the batch entry's, which pins every micro-batch (round V: it
    named one micro-batch's key, and pinning that one named the next)."""
    message = spawn(_own_part_of_a_whole_input, 2, timeout=100, deadline=110)[0]
    assert "pin it split, placements={'input0': \"(S0)\"} for every batch input" in message, message
    assert "input0[0] is a micro-batch" in message
