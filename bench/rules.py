"""SBP signature enumeration speed: every operator of a 12-layer GPT's traced AdamW step
(vocab 128, width 64, 4 heads, sequence 32, batch 8; over 3000 nodes) enumerated for a
(2, 4) mesh with ``passes.rules.signatures_nd``, cold (caches cleared first) and warm
(every call cached by the cold pass).

Targets: cold under 1.0 s, warm under 0.5 s (the bounds a unit test held until wall-clock
limits left the unit tests, which share machines). Each figure is the best of
``--repeat`` rounds.

    python bench/rules.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import time

import torch

import ddlc
from ddlc.zoo import GPT, lm_loss
from passes.rules import clear_caches, signatures_nd

MESH = (2, 4)
TARGETS = {"cold": 1.0, "warm": 0.5}  # seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the best of them is reported")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab=128, d_model=64, n_heads=4, n_layers=12, seq_len=32)
    batch = (torch.randint(0, 128, (8, 32)),) * 2
    gm = ddlc.trace(model, batch, lm_loss, torch.optim.AdamW(model.parameters()))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    best = dict.fromkeys(TARGETS, float("inf"))
    for _ in range(args.repeat):
        clear_caches()
        for phase in TARGETS:  # cold, then warm from the caches the cold pass filled
            start = time.perf_counter()
            for node in nodes:
                signatures_nd(node, MESH)
            best[phase] = min(best[phase], time.perf_counter() - start)
    print(f"signature enumeration, 12-layer GPT step: {len(nodes)} nodes, mesh {MESH}, "
          f"best of {args.repeat}")
    for phase, target in TARGETS.items():
        verdict = "ok" if best[phase] < target else "OVER TARGET"
        print(f"  {phase:5s} {best[phase]:7.3f} s   target < {target:.1f} s   {verdict}")


if __name__ == "__main__":
    main()
