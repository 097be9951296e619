"""Inference only: compile a Hugging Face model's forward pass for 2 ranks.

Compiled without ``loss_fn`` and optimizer, the program is the forward pass of the
model as it stands (here ``BertForMaskedLM`` in eval mode, from a config). It is
called with the same keywords as the model and returns the model's own output type
(a ``MaskedLMOutput``), full on every rank; the script checks its logits against the
single-device model.

Run:    python examples/inference.py [--quick]        (2 local gloo processes)
or:     torchrun --nproc-per-node=2 examples/inference.py [--quick]
"""
import argparse
import sys

import torch
from transformers import BertConfig, BertForMaskedLM

import ddlc
from ddlc.launch import run


def setup(quick: bool):
    torch.manual_seed(0)
    width = 32 if quick else 256
    model = BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=width, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=2 * width,
                                       max_position_embeddings=32)).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[:3, 12:] = 0  # three padded rows
    return model, {"input_ids": ids, "attention_mask": mask}


def infer(rank: int, quick: bool):
    model, batch = setup(quick)
    forward = ddlc.compile(model, (2,), batch)
    out = forward(**batch)
    return type(out).__name__, out.logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model")
    quick = parser.parse_args().quick
    result = run(infer, 2, quick, timeout=300, deadline=900)
    if result is None:  # a torchrun rank other than 0
        return 0
    kind, logits = result
    model, batch = setup(quick)
    with torch.no_grad():
        want = model(**batch).logits
    worst = (logits - want).abs().max().item()
    print(f"compiled forward returned a {kind}; largest logit difference to the model: {worst:.2e}")
    ok = torch.allclose(logits, want, rtol=1e-4, atol=1e-5)
    print("MATCH: equal to the single-device model" if ok else "MISMATCH with the single-device model")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
