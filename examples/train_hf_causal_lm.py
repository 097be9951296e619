"""Train a Hugging Face causal LM as a user hands it over, on a 2x2 mesh of 4 ranks.

The model is ``GPT2LMHeadModel`` built from a config (nothing downloaded), with its
default dropout on. A ``DataLoader`` yields dict batches (``input_ids``,
``attention_mask`` with padding, ``labels``); the model computes its own loss; a
warm-up + linear-decay learning-rate schedule steps between compiled steps, and
gradients are clipped to a global norm of 1.0. Dropout draws from the compiled
program's generator, seeded like the single-device run, so the script can check the
distributed losses and parameters against single-device training at the end.

Run:    python examples/train_hf_causal_lm.py [--quick]     (4 local gloo processes)
or:     torchrun --nproc-per-node=4 examples/train_hf_causal_lm.py [--quick]
"""
import argparse
import copy
import sys

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import ddlc
from ddlc.launch import run

MESH = (2, 2)
SEQ, BATCH, VOCAB = 16, 8, 128
DROPOUT_SEED = 1234


def collate(samples: list[dict]) -> dict:
    """Right-pad token lists to SEQ: ids, the attention mask, and labels (-100 on padding)."""
    ids = torch.zeros(len(samples), SEQ, dtype=torch.long)
    mask = torch.zeros(len(samples), SEQ, dtype=torch.long)
    for row, sample in enumerate(samples):
        tokens = sample["tokens"][:SEQ]
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def setup(quick: bool):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32 if quick else 128,
                        n_layer=2 if quick else 4, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (3 * BATCH if quick else 32 * BATCH,), generator=g)
    samples = [{"tokens": torch.randint(0, VOCAB, (int(n),), generator=g).tolist()} for n in lengths]
    # the loader's own generator: iterating it must not draw from the default one, whose
    # state after the seed below is where dropout's numbers come from
    loader = DataLoader(samples, batch_size=BATCH, collate_fn=collate,
                        generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1,
                                               num_training_steps=len(loader))
    return model, optimizer, schedule, loader


def train_distributed(rank: int, quick: bool):
    model, optimizer, schedule, loader = setup(quick)
    torch.manual_seed(DROPOUT_SEED)  # rank 0's state seeds the program's dropout generator
    step = ddlc.compile(model, MESH, collate(loader.dataset[:BATCH]), optimizer=optimizer,
                        clip_grad_norm=1.0)
    if rank == 0:
        print(step.plan.summary())
    losses = []
    for batch in loader:
        losses.append(float(step.step(batch)))  # the global batch; each rank takes its part
        schedule.step()
    return losses, step.state_dict()


def train_single_device(quick: bool):
    model, optimizer, schedule, loader = setup(quick)
    torch.manual_seed(DROPOUT_SEED)
    losses = []
    for batch in loader:
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses, copy.deepcopy(model.state_dict())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and 3 steps")
    quick = parser.parse_args().quick
    result = run(train_distributed, 4, quick, timeout=300, deadline=1200)
    if result is None:  # a torchrun rank other than 0
        return 0
    losses, state = result
    want_losses, want_state = train_single_device(quick)
    print("step  single-device loss  ddlc loss (2x2 mesh)")
    for i, (a, b) in enumerate(zip(want_losses, losses)):
        print(f"{i:4d}  {a:18.6f}  {b:20.6f}")
    worst = max((state[k] - v).abs().max().item() for k, v in want_state.items()
                if v.is_floating_point())
    print(f"largest parameter difference: {worst:.2e}")
    ok = torch.allclose(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-5) \
        and worst < 1e-3
    print("MATCH: equal to single-device training" if ok else "MISMATCH with single-device training")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
