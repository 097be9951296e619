"""ddlc demo: trace a small GPT's whole training step and print its graph.

Run: python examples/demo.py
"""
import torch

import ddlc
from ddlc.printing import format_graph, op_summary
from ddlc.zoo import GPT, lm_loss


def main():
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (8, 16))
    targets = torch.randint(0, 64, (8, 16))
    gm = ddlc.trace(model, (tokens, targets), lm_loss, optimizer)
    sig = gm.meta["ddlc_step"]
    print(f"Traced training step: {len(gm.graph.nodes)} nodes, "
          f"{len(sig.keys('param'))} parameters, {len(sig.keys('opt_state'))} optimizer-state tensors")
    print("Operators:", ", ".join(f"{k} x{v}" for k, v in sorted(op_summary(gm).items())))
    print()
    print(format_graph(gm, limit=80))


if __name__ == "__main__":
    main()
