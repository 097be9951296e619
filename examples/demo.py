"""ddlc demo: compile a small GPT for a 2x2 mesh, train it on 4 local gloo processes,
and check every number against the single-device model.

Run:    python examples/demo.py          (starts 4 local worker processes)
or:     torchrun --nproc-per-node=4 examples/demo.py
"""
import os
import sys

import torch

import ddlc
from ddlc.ir import COLLECTIVE, COLLECTIVE_KINDS, collective_sequence
from ddlc.printing import format_graph
from ddlc.zoo import GPT, lm_loss

MESH = (2, 2)
COMMUNICATING = set(COLLECTIVE_KINDS.values())  # the other redistribution steps are local
STEPS = 3
# The plan is made for this hardware profile (see ddlc/profiles); it runs on local gloo
# processes either way, and the numbers must match the single-device run regardless.
PROFILE = os.environ.get("DDLC_PROFILE", "cpu-gloo")


def setup():
    torch.manual_seed(0)
    # large enough that distributing it pays on local gloo ranks (a smaller one is best
    # left replicated: every rank computes it whole, and ddlc's plan says so)
    model = GPT(vocab=512, d_model=192, n_heads=4, n_layers=3, seq_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 512, (16, 64), generator=g),
                torch.randint(0, 512, (16, 64), generator=g)) for _ in range(STEPS)]
    return model, optimizer, batches


def train_distributed(rank: int):
    model, optimizer, batches = setup()
    compiled = ddlc.compile(model, MESH, batches[0], lm_loss, optimizer, profile=PROFILE)
    if rank == 0:
        print(compiled.plan.summary())
        print("\nPlan (nodes that compute or communicate; first 40):")
        print(compiled.plan.table(limit=40, skip_free=True))
        print(f"\nTransformed graph of rank 0 (first 60 of {len(compiled.gm.graph.nodes)} nodes):")
        print(format_graph(compiled.gm, limit=60))
        sequence = collective_sequence(compiled.gm)
        steps = [node for node in compiled.gm.graph.nodes if COLLECTIVE.has(node)]
        print(f"\nRedistribution steps of rank 0: {len(sequence)} collectives per step, the same "
              f"sequence on every rank (fingerprint {compiled.fingerprint}):")
        for node in steps:
            if COLLECTIVE(node).kind in COMMUNICATING:
                print(f"  {node.name}: {COLLECTIVE(node)}")
        local = [node for node in steps if COLLECTIVE(node).kind not in COMMUNICATING]
        print(f"  and {len(local)} local steps (a rank taking its piece of a tensor it holds whole, "
              "or keeping one copy of a partial sum), e.g.:")
        for node in local[:3]:
            print(f"  {node.name}: {COLLECTIVE(node)}")
        timeline = compiled.timeline()
        timeline.write_chrome_trace("ddlc_demo.trace.json")
        print(f"\nModeled timeline of rank 0's scheduled program: {timeline.makespan * 1e3:.3f} ms, "
              f"{timeline.exposed_communication * 1e3:.3f} ms of it waiting on communication; "
              "Chrome trace: ddlc_demo.trace.json (open in Perfetto)")
    losses = [float(compiled.step(*batch)) for batch in batches]
    return losses, compiled.state_dict()


def train_single_device():
    model, optimizer, batches = setup()
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad()
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def main() -> int:
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        losses, state = train_distributed(rank)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        losses, state = ddlc.spawn(train_distributed, 4, timeout=120, deadline=600)[0]
    ref_losses, ref_params = train_single_device()
    print("\nstep  single-device loss  ddlc loss (4 ranks)  |difference|")
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        print(f"{i:4d}  {a:17.6f}  {b:19.6f}  {abs(a - b):.2e}")
    worst = max((state[k] - v).abs().max().item() for k, v in ref_params.items())
    print(f"largest parameter difference after {STEPS} AdamW steps: {worst:.2e}")
    ok = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(ref_losses, losses)) and worst < 1e-4
    print("MATCH: the distributed program reproduces the single-device run" if ok else
          "MISMATCH: the distributed program differs from the single-device run")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
