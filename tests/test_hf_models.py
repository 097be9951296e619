"""Hugging Face models as a user hands them over: built from a tiny config (nothing is
downloaded), a dict batch given to the model as keywords, the model's own ``outputs.loss``,
padding masks with zeros, the configs' dropout on and AdamW.

Two kinds of test per model:

* ``test_no_op_falls_back``: trace only. Every operator of the training step (forward,
  backward, AdamW) has a sharding rule, so nothing is forced to run replicated (all-B).
* ``test_training_matches_single_device``: three AdamW steps on simulated ranks (every
  rank's program in one process, see ``ddlc.simulate``) with the batch split over all
  ranks equal eager single-device training of the same weights on the same batches:
  losses step by step and every parameter afterwards. Eager runs after
  ``torch.manual_seed(0)``, the seed of the simulated program's generator (ddlc/rng.py),
  so both draw the same dropout masks.

The last two tests show that these comparisons can fail: the dropout masks and the
padding masks change the numbers.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ddlc  # noqa: E402
from conftest import assert_matches_reference, eager, simulated  # noqa: E402
from ddlc import rng  # noqa: E402

BATCH, SEQ, VOCAB, STEPS = 8, 16, 128, 3
#: the tiny size every model shares (hidden 32, 2 layers, 4 heads, MLP 64, vocab 128)
SIZE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=VOCAB, max_position_embeddings=32)


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_inner=64, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        **SIZE, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


def _llama(tied):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SIZE, num_key_value_heads=2, tie_word_embeddings=tied))  # grouped-query attention


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZE, num_key_value_heads=2))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=VOCAB,
        dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0))


def _deberta():
    return transformers.DebertaForMaskedLM(transformers.DebertaConfig(
        **SIZE, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, relative_attention=True,
        max_relative_positions=16, pos_att_type=["c2p", "p2c"], type_vocab_size=2))


def _vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.1, image_size=32, patch_size=8, num_labels=10))


def _swin():
    # shifted windows: a relative position bias looked up by index (its backward an
    # index_put that accumulates) and stochastic depth (drop_path_rate 0.1 by default)
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
        num_labels=10))


#: model name -> (builder, batch kind, whether its step draws random numbers (dropout)).
#: LLaMA and Qwen2 have no dropout by default (attention_dropout 0).
MODELS = {
    "gpt2": (_gpt2, "causal", True),
    "bert": (_bert, "masked", True),
    "llama_gqa": (lambda: _llama(tied=False), "causal", False),
    "llama_gqa_tied": (lambda: _llama(tied=True), "causal", False),
    "qwen2": (_qwen2, "causal", False),
    "t5": (_t5, "seq2seq", True),
    "vit": (_vit, "image", True),
    "deberta": (_deberta, "masked", True),  # divides a permuted view in place (ddlc.strided_views)
    "swin": (_swin, "image", True),
}
#: operators that fall back to running replicated: DeBERTa's in-place update of a view
#: traces to autograd's as_strided replays of it, which have no sharding rule
FALLBACKS = {"deberta": ["aten.as_strided_copy.default", "aten.as_strided_scatter.default",
                         "aten.new_empty_strided.default"]}
DROPOUT_MODELS = [name for name, (_, _, dropout) in MODELS.items() if dropout]
TEXT_MODELS = [name for name, (_, kind, _) in MODELS.items() if kind != "image"]


def build(name: str):
    """``name``'s model (training mode, dropout on) with the parameters of seed 0."""
    torch.manual_seed(0)
    model = MODELS[name][0]()
    assert model.training
    return model


def batches(name: str, steps: int = STEPS, padded: bool = True) -> list[dict]:
    """``steps`` dict batches for ``name``. Text batches have an attention mask with zeros
    in 3 of the 8 rows (``padded``): on the left for the causal LMs, where it changes
    the loss (right padding with -100 labels would not: no scored position attends to
    a later one), on the right for BERT and T5. Padded positions are not scored."""
    kind = MODELS[name][1]
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if kind == "image":
            out.append({"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
                        "labels": torch.randint(0, 10, (BATCH,), generator=g)})
            continue
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        if padded:
            mask[:3, :4] = 0 if kind == "causal" else 1
            mask[:3, -4:] = 1 if kind == "causal" else 0
        batch = {"input_ids": ids, "attention_mask": mask}
        if kind == "causal":
            labels = ids.masked_fill(mask == 0, -100)
        elif kind == "masked":
            batch["token_type_ids"] = torch.randint(0, 2, (BATCH, SEQ), generator=g)
            chosen = torch.rand(BATCH, SEQ, generator=g) < 0.3  # the masked-LM positions
            labels = torch.where(chosen & (mask == 1), ids, torch.full_like(ids, -100))
        else:  # seq2seq: decoder targets, some ignored (-100, shifted in as the pad token)
            labels = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
            labels[5:, -3:] = -100
        batch["labels"] = labels
        out.append(batch)
    return out


def adamw(model):
    # eps=1e-4: see conftest.OPTIMIZERS (a tiny eps turns rounding noise into full steps)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_no_op_falls_back(name):
    """Trace only: every operator of the model's training step (forward with its padding
    mask and dropout, backward, AdamW) has a sharding rule, so none falls back to
    running replicated on every rank (but :data:`FALLBACKS`)."""
    from passes.rules import fallback_ops  # imported on use, as in conftest
    model = build(name)
    gm = ddlc.trace(model, batches(name, 1)[0], None, adamw(model))
    assert [str(op) for op in fallback_ops(gm)] == FALLBACKS.get(name, [])


#: (model, mesh) of the numerics test: every model on (2, 2), GPT-2 and BERT on (4,) too
CASES = [(name, (2, 2)) for name in MODELS] + [("gpt2", (4,)), ("bert", (4,))]


@pytest.mark.parametrize("name, mesh_shape", CASES,
                         ids=[f"{n}-{'x'.join(map(str, m))}" for n, m in CASES])
def test_training_matches_single_device(name, mesh_shape):
    """Three AdamW steps on simulated ranks, the batch split over all of them, with the
    padding mask and the configs' dropout: the losses of every step and all parameters
    afterwards equal eager single-device training with the same seed (same dropout
    masks). The traced step draws random numbers exactly when the model has dropout."""
    model = build(name)
    reference = copy.deepcopy(model)
    data = batches(name)
    losses, params, _, gm = simulated(model, None, adamw, data, mesh_shape)
    assert any(rng.draws_random_numbers(n) for n in gm.graph.nodes) == MODELS[name][2]
    want, _ = eager(reference, None, adamw, data, seed=0)  # the simulated program's seed
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())},
                             label=f"{name} on {mesh_shape}")


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_dropout_masks_matter(name):
    """Eager only: with the same seed the run repeats exactly, with another seed (other
    dropout masks) the losses differ, so the comparison above checks the masks."""
    model, data = build(name), batches(name)
    seed0, _ = eager(copy.deepcopy(model), None, adamw, data, seed=0)
    again, _ = eager(copy.deepcopy(model), None, adamw, data, seed=0)
    seed1, _ = eager(copy.deepcopy(model), None, adamw, data, seed=1)
    assert torch.equal(torch.stack(seed0), torch.stack(again))
    assert not torch.allclose(torch.stack(seed0), torch.stack(seed1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_padding_mask_matters(name):
    """Eager only: training with the padding mask ends with other parameters than
    training on the same tokens with an all-ones mask, so the comparison above checks
    how the masked attention is computed (and the mask is not ignored)."""
    model = build(name)
    masked, unmasked = copy.deepcopy(model), copy.deepcopy(model)
    data = batches(name)
    ones = [{**b, "attention_mask": torch.ones_like(b["attention_mask"])} for b in data]
    eager(masked, None, adamw, data, seed=0)
    eager(unmasked, None, adamw, ones, seed=0)
    params = dict(unmasked.named_parameters())
    assert any(not torch.allclose(p, params[k], rtol=1e-4, atol=1e-5)
               for k, p in masked.named_parameters())


@pytest.mark.parametrize("mesh", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("name", ["llama_gqa", "bert", "t5", "swin"])
def test_data_parallel_needs_no_activation_moved(name, mesh):
    """Data parallelism as a user writes it (the batch split, parameters whole, no
    activation redistributed: ``move_activations=False``, the candidate ``choose_plan``
    compares with) plans for a model with a padding mask, and three AdamW steps on
    simulated (4,) ranks equal eager's. transformers builds the mask by indexing it with
    ranges (``mask[batch_idx, kv_idx]``), which needed the mask whole on every rank
    until canonicalize made it a view; no data-parallel plan could be made before."""
    from ddlc.pipeline import data_parallel_placements  # imported on use, as in conftest
    model, data = build(name), batches(name)
    reference = copy.deepcopy(model)
    losses, params, _, _ = simulated(model, None, adamw, data, mesh, pins=data_parallel_placements,
                                     move_activations=False)
    want, _ = eager(reference, None, adamw, data, seed=0)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())},
                             label=f"{name} data parallel on {mesh}")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_data_parallel_plan_repaired_by_propagation_trains_on_gloo():
    """LLaMA pinned data parallel with no activation moved on (2, 2): coordinate descent
    alone ends with a forbidden move, the plan comes from its restart at a start that
    constraint propagation found (``passes/sharding/descent.py::feasible_start``), and
    on 4 gloo processes three AdamW steps equal eager's."""
    from ddlc.launch import spawn
    from distributed_cases import hf_data_parallel_in_place
    per_rank = spawn(hf_data_parallel_in_place, 4, "llama_gqa", (2, 2), timeout=120, deadline=240)
    got = per_rank[0]
    assert got.pop("repaired_by") == "propagation"
    model, data = build("llama_gqa"), batches("llama_gqa")
    want, _ = eager(model, None, adamw, data, seed=0)
    assert_matches_reference(got, {"losses": want, "params": dict(model.named_parameters())},
                             label="llama_gqa data parallel on (2, 2) gloo")
    for other in per_rank[1:]:
        torch.testing.assert_close(other["losses"], got["losses"])


def test_git_plans_of_uneven_reader_pieces_lower_on_every_rank():
    """GitForCausalLM planned for slow compute over fast links on (2, 2): every tensor's
    placement divides it, but a reader asks for an uneven piece of one (``local_chunk``), so
    ranks' programs differ and each must lower its own (``pipeline.splits_evenly`` reads
    the inputs' placements too; the program shipped from one rank had made the others fail
    to retarget it, and the job hang). Two SGD steps on the simulated ranks equal eager's."""
    import copy

    import torch
    import transformers as T

    import ddlc
    from ddlc import pipeline
    from ddlc.mesh import HardwareProfile
    from ddlc.options import CompileOptions
    from ddlc.simulate import simulate_steps
    from passes.canonicalize import canonicalize
    slow_compute = HardwareProfile.from_dict({
        "name": "slow-compute", "devices_per_node": 8, "flops": {"float32": 1e8},
        "memory_bandwidth": 1e9, "memory_capacity": 8e10,
        "links": {"intra_node": {"latency": 1e-7, "bandwidth": 1e12},
                  "inter_node": {"latency": 1e-7, "bandwidth": 1e12}}})
    torch.manual_seed(0)
    cfg = T.GitConfig(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, image_size=32, patch_size=8),
                      vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=64, pad_token_id=0,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = T.GitForCausalLM(cfg)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(2):
        ids = torch.randint(1, 128, (8, 16), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone(),
                     "pixel_values": torch.randn(8, 3, 32, 32, generator=g)})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gm = canonicalize(ddlc.trace(model, data[0], None, sgd))
    mesh = ddlc.Mesh((2, 2), profile=slow_compute)
    pipeline.choose_plan(gm, mesh, CompileOptions.from_kwargs(profile=slow_compute), {})
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    losses, params, _, _ = simulate_steps(gm, mesh, params, dict(model.named_buffers()), data)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch, got in zip(data, losses):
        opt.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        torch.testing.assert_close(got, loss.detach(), rtol=1e-4, atol=1e-5)
