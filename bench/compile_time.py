"""Compile time per model: trace, plan (shard + decouple on rank 0) and lower (one rank's
program), in seconds, for the models of the README's "Supported models" table at the
sizes the tests use (Hugging Face models from small configs: hidden 32, 2 layers,
sequence 16, batch 8; the CNNs at width 4-8 on 32x32 images), on a (4,) mesh with the
batch split. All in one process; a real ``compile`` adds the rank-0 broadcast and the
fingerprint check. Each figure is the best of ``--repeat`` rounds.

``--ranks 1 4``: ``ddlc.compile`` itself on that many local gloo processes (ranks 0 and 1
trace; rank 0 plans and lowers while rank 1 makes the data-parallel candidate, and the
chosen program is sent to the others where the plan splits evenly), for the zoo GPT the issue measured (3 layers, d 192) and the models given; the
figure is the slowest rank's wall time of the ``compile`` call, and the ratio to the first
rank count and the CPU-seconds of all ranks together are printed.
``--mesh 2x4`` compiles for that mesh shape instead of a flat one of each rank count
(``gpt2_small``: the GPT-2-small-shaped model of ``ddlc plan``'s benchmark, 12 layers,
hidden 768, vocabulary 50304, sequence 1024, batch 8, AdamW; its weights are initialised
on every rank before the timed call).

    python bench/compile_time.py [--repeat 1] [--models gpt2 resnet18 ...]
    python bench/compile_time.py --ranks 1 4 [--models zoo_gpt gpt2]
    python bench/compile_time.py --ranks 8 --mesh 2x4 --models gpt2_small
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

import ddlc
from ddlc import pipeline, zoo
from ddlc.options import CompileOptions
from ddlc.sbp import parse_sbp
from ddlc.ir import STEP

MESH = (4,)
SEQ, BATCH, VOCAB = 16, 8, 128


def _text(**extra):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[:3, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask, **extra, "labels": ids.masked_fill(mask == 0, -100)}


def _hf(name):
    import transformers as tf
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                                n_head=4)), _text()
    if name == "bert":
        return (tf.BertForMaskedLM(tf.BertConfig(vocab_size=VOCAB, max_position_embeddings=32, **small)),
                _text(token_type_ids=torch.zeros(BATCH, SEQ, dtype=torch.long)))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=32,
                                                  num_key_value_heads=2, **small)), _text()
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=VOCAB, max_position_embeddings=32,
                                                  num_key_value_heads=2, **small)), _text()
    if name == "t5":
        return (tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                                                          num_layers=2, num_heads=4, decoder_start_token_id=0,
                                                          pad_token_id=0)), _text())
    if name == "vit":
        g = torch.Generator().manual_seed(1)
        return (tf.ViTForImageClassification(tf.ViTConfig(image_size=32, patch_size=8, num_labels=10, **small)),
                {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
                 "labels": torch.randint(0, 10, (BATCH,), generator=g)})
    raise KeyError(name)


CNNS = {"resnet18": lambda: zoo.resnet18(width=8), "resnet50": lambda: zoo.resnet50(width=4),
        "vgg16_bn": lambda: zoo.vgg16_bn(width=4), "mobilenet_v2": lambda: zoo.mobilenet_v2(width_mult=0.25)}
MODELS = ["gpt2", "bert", "llama", "qwen2", "t5", "vit", *CNNS]
ZOO_GPT = dict(vocab=512, d_model=192, n_heads=4, n_layers=3, seq_len=64)
GPT2_SMALL = dict(vocab=50304, d_model=768, n_heads=12, n_layers=12, seq_len=1024)


def build(name):
    torch.manual_seed(0)
    if name == "zoo_gpt":
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, ZOO_GPT["vocab"], (16, ZOO_GPT["seq_len"] + 1), generator=g)
        return zoo.GPT(**ZOO_GPT), (tokens[:, :-1], tokens[:, 1:]), zoo.lm_loss
    if name == "gpt2_small":
        tokens = torch.zeros(8, GPT2_SMALL["seq_len"], dtype=torch.long)
        return zoo.GPT(**GPT2_SMALL), (tokens, tokens), zoo.lm_loss
    if name in CNNS:
        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        return CNNS[name](), batch, F.cross_entropy
    model, batch = _hf(name)
    return model, batch, None


def measure(name: str) -> dict[str, float]:
    """Seconds to trace, plan and lower ``name``, with the garbage collector deferred as
    ``ddlc plan`` defers it (``ddlc.compile`` does not: see the README)."""
    with pipeline.collections_deferred():
        return _measure(name)


def _measure(name: str) -> dict[str, float]:
    model, batch, loss_fn = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = CompileOptions()
    mesh = ddlc.Mesh(MESH)
    times = {}
    start = time.perf_counter()
    gm = pipeline.trace_step(model, batch, loss_fn, optimizer, options)
    times["trace"] = time.perf_counter() - start
    sig = STEP(gm)
    fixed = {sig.input_name("input", k): parse_sbp("(S0)") for k in sig.keys("input")}
    start = time.perf_counter()
    pipeline.plan(gm, mesh, options, fixed)
    times["plan"] = time.perf_counter() - start
    start = time.perf_counter()
    pipeline.lower(copy.deepcopy(gm), mesh, (1,), ["axis0"], options)
    times["lower"] = time.perf_counter() - start
    times["nodes"] = len(gm.graph.nodes)
    return times


def _compile_rank(rank: int, name: str, mesh: str | None) -> tuple[float, float]:
    """One rank of a local gloo job: seconds of its ``ddlc.compile`` call (on ``mesh``, or
    a flat mesh of every rank), wall and CPU (this process's)."""
    import torch.distributed as dist
    model, batch, loss_fn = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    ddlc.compile(model, mesh or (dist.get_world_size(),), batch, loss_fn, optimizer)
    return time.perf_counter() - start, time.process_time() - cpu


def compile_on_ranks(names, rank_counts, repeat: int, mesh: str | None = None) -> None:
    """Per model: the slowest rank's wall seconds of ``compile`` for each rank count (best
    of ``repeat`` runs), the ratio to the first count, and the CPU-seconds of all ranks
    together in that run."""
    print(f"{'model':14s}" + "".join(f"{f'{n} ranks s':>12s}" for n in rank_counts)
          + "".join(f"{f'{n}/{rank_counts[0]}':>8s}" for n in rank_counts[1:])
          + "".join(f"{f'{n} ranks CPU-s':>16s}" for n in rank_counts)
          + (f"  (mesh {mesh})" if mesh else ""))
    for name in names:
        best = []
        for n in rank_counts:
            runs = [ddlc.spawn(_compile_rank, n, name, mesh, timeout=600, deadline=1200)
                    for _ in range(repeat)]
            best.append(min(((max(w for w, _ in run), sum(c for _, c in run)) for run in runs)))
        print(f"{name:14s}" + "".join(f"{w:12.2f}" for w, _ in best)
              + "".join(f"{w / best[0][0]:8.2f}" for w, _ in best[1:])
              + "".join(f"{c:16.2f}" for _, c in best), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--ranks", nargs="*", type=int, help="compile on this many local gloo "
                    "processes each (e.g. 1 4) instead of the one-process pass timings")
    ap.add_argument("--mesh", help="with --ranks: compile for this mesh shape (e.g. 2x4), "
                    "not a flat one")
    args = ap.parse_args()
    if args.ranks:
        compile_on_ranks(args.models or ["zoo_gpt"], args.ranks, args.repeat, args.mesh)
        return
    args.models = args.models or MODELS
    print(f"{'model':14s} {'nodes':>6s} {'trace s':>8s} {'plan s':>7s} {'lower s':>8s} {'total s':>8s}")
    for name in args.models:
        rounds = [measure(name) for _ in range(args.repeat)]
        best = {k: min(r[k] for r in rounds) for k in ("trace", "plan", "lower")}
        print(f"{name:14s} {rounds[0]['nodes']:6d} {best['trace']:8.2f} {best['plan']:7.2f} "
              f"{best['lower']:8.2f} {sum(best.values()):8.2f}", flush=True)


if __name__ == "__main__":
    main()
