"""Activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``): the
checkpointed calls' activations are recomputed in backward (``passes.recompute``), the
run matches eager training with checkpointing on simulated ranks, and the plan keeps
fewer activations."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ddlc
from conftest import MESHES, assert_matches_reference, eager, simulated
from ddlc import pipeline
from ddlc.errors import UnsupportedInputError
from ddlc.ir import ORIGIN, RECOMPUTE
from ddlc.options import CompileOptions
from ddlc.zoo import GPT, lm_loss
from passes.canonicalize import canonicalize
from passes.recompute import recompute_checkpointed


class _Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.fc2(self.drop(F.gelu(self.fc1(self.norm(x)))))


class _Checkpointed(nn.Module):
    def __init__(self, layers: int = 3, use_checkpoint: bool = True, **checkpoint_options):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(layers))
        self.head = nn.Linear(16, 8)
        self.use_checkpoint, self.checkpoint_options = use_checkpoint, checkpoint_options

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, **self.checkpoint_options) if self.use_checkpoint else block(x)
        return self.head(x)


def _data(n_steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n_steps)]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model):
    data = _data(1)
    return recompute_checkpointed(canonicalize(ddlc.trace(model, data[0], F.mse_loss, _adamw(model))))


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_checkpointed_blocks_train_as_eager(mesh_shape):
    """Three checkpointed blocks with dropout (recomputed in eager from the saved generator
    state; kept in ddlc's program) and AdamW: losses and parameters equal eager training
    with checkpointing, the same seed."""
    torch.manual_seed(0)
    model = _Checkpointed(use_reentrant=False)
    reference = copy.deepcopy(model)
    data = _data()
    losses, params, _, _ = simulated(model, F.mse_loss, _adamw, data, mesh_shape)
    want, _ = eager(reference, F.mse_loss, _adamw, data, seed=0)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


def test_backward_reads_recomputed_copies_and_fewer_activations_stay():
    """No value computed inside a checkpointed call is read by backward but its outputs and
    its random draws; the copies are backward nodes; the activations the backward pass reads
    from forward (what the plan keeps resident) shrink to the blocks' boundaries."""
    torch.manual_seed(0)
    model = _Checkpointed(use_reentrant=False)
    gm = _step(model)
    regions = {RECOMPUTE(n) for n in gm.graph.nodes if RECOMPUTE.has(n)}
    assert regions == {0, 1, 2}
    copies = 0
    for node in gm.graph.nodes:
        if not RECOMPUTE.has(node):
            continue
        backward = [u for u in node.users if ORIGIN(u).phase == "backward"]
        if backward:  # kept: a block's output, read by the next block, or a dropout draw
            assert ddlc.rng.draws_random_numbers(node) or any(
                RECOMPUTE.get(u) != RECOMPUTE(node) and ORIGIN(u).phase == "forward"
                for u in node.users), node.name
    for node in gm.graph.nodes:
        copies += ORIGIN(node).phase == "backward" and node.target is torch.ops.aten.native_layer_norm.default
    assert copies == 3  # each block's layer norm runs again in backward

    def saved_bytes(graph_module):
        return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in graph_module.graph.nodes
                   if ORIGIN(n).phase == "forward" and isinstance(n.meta.get("val"), torch.Tensor)
                   and any(ORIGIN(u).phase == "backward" for u in n.users))
    plain = _step(_Checkpointed(use_checkpoint=False))
    assert saved_bytes(gm) < 0.6 * saved_bytes(plain)


def _zoo_gpt_step(checkpointed: bool, batch: int = 8):
    torch.manual_seed(0)
    model = GPT(d_model=64, n_layers=4, checkpoint=checkpointed)
    tokens = torch.randint(0, 64, (batch, 16))
    return pipeline.trace_step(model, (tokens, tokens), lm_loss, _adamw(model), CompileOptions())


def test_the_zoo_gpt_checkpointed_plans_fewer_resident_bytes():
    """The planner's memory of the zoo GPT with checkpointed blocks (saved activations are
    resident bytes) is below that of the same GPT without, on the same mesh."""
    from passes.sharding import build_problem

    def smallest_memory(checkpointed):
        return build_problem(_zoo_gpt_step(checkpointed), ddlc.Mesh((4,))).min_memory()[0]
    assert smallest_memory(True) < 0.8 * smallest_memory(False)


def test_the_scheduled_program_keeps_the_lower_peak():
    """Rank 0's lowered program (data parallel on (4,), collectives scheduled) peaks lower
    with checkpointed blocks: the scheduler issues a gradient's collective early with the
    operators that only feed it, but leaves the recomputed activations among those where
    they are (hoisted, they had run in forward and the peak was the same as without)."""
    from cost_models.program import live_bytes
    from ddlc.simulate import axis_group_names

    def peak(checkpointed):
        gm = _zoo_gpt_step(checkpointed, batch=64)  # activations outweigh the weights
        mesh = ddlc.Mesh((4,))
        options = CompileOptions(fuse=False, partition=False)
        pins = pipeline.data_parallel_placements(gm, mesh)
        pipeline.plan(gm, mesh, options, pins)
        pipeline.lower(gm, mesh, (0,), axis_group_names(mesh), options)
        return max(live_bytes(list(gm.graph.nodes)))
    assert peak(True) < 0.8 * peak(False)


def test_reentrant_checkpoint_is_refused_with_the_fix():
    model = _Checkpointed(use_reentrant=True)
    with pytest.raises(UnsupportedInputError, match="use_reentrant=False") as info:
        _step(model)
    assert "test_recompute.py" in str(info.value)


def test_hugging_face_gradient_checkpointing_trains_as_eager():
    """GPT-2 with ``gradient_checkpointing_enable()`` (its default: use_reentrant=False),
    dropout 0.1, on simulated (2,2) ranks: equal to eager training with checkpointing."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    model.train()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 16), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    # eps well above the size of gradients that are zero up to rounding, as in test_hf_models
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-4)  # noqa: E731
    losses, params, _, gm = simulated(model, None, adamw, data, (2, 2))
    assert {RECOMPUTE(n) for n in gm.graph.nodes if RECOMPUTE.has(n)} == {0, 1}
    want, _ = eager(reference, None, adamw, data, seed=0)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


def test_a_buffer_updated_inside_a_checkpointed_call_is_refused():
    """Eager's recomputation updates BatchNorm's running statistics a second time (and
    counts num_batches_tracked twice); ddlc refuses rather than update them once."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.BatchNorm1d(16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc(checkpoint(self.norm, x, use_reentrant=False))

    model = Model()
    with pytest.raises(UnsupportedInputError, match="a second time") as info:
        _step(model)
    assert "norm.running_mean" in str(info.value) or "norm.num_batches_tracked" in str(info.value)
    model.norm.eval()  # running statistics read, not updated: traced
    assert any(RECOMPUTE.has(n) for n in _step(model).graph.nodes)


def test_fresh_draws_in_recomputation_are_refused():
    """With ``preserve_rng_state=False`` eager's recomputation draws new dropout masks (the
    backward pass sees other masks than the forward); ddlc would reuse the forward's, so
    a call that draws random numbers is refused; one that draws none is traced."""
    torch.manual_seed(0)
    with pytest.raises(UnsupportedInputError, match="preserve_rng_state=False") as info:
        _step(_Checkpointed(use_reentrant=False, preserve_rng_state=False))
    assert "test_recompute.py" in str(info.value)
    model = _Checkpointed(use_reentrant=False, preserve_rng_state=False)
    model.eval()  # no dropout, but the blocks still run checkpointed under a training step
    assert any(RECOMPUTE.has(n) for n in _step(model).graph.nodes)
