"""Train a ResNet-18 with BatchNorm in training mode, data parallel over 4 ranks.

The batch is split across the ranks and every BatchNorm normalizes with the statistics
of the whole batch (as nn.SyncBatchNorm does), so the run equals single-device
training: the script checks losses, parameters and running statistics at the end. A
learning-rate schedule steps between compiled steps; afterwards the trained weights go
back into the model, which is compiled again in eval mode for inference.

Run:    python examples/train_resnet.py [--quick]       (4 local gloo processes)
or:     torchrun --nproc-per-node=4 examples/train_resnet.py [--quick]
"""
import argparse
import copy
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ddlc
from ddlc.launch import run
from ddlc.zoo import resnet18

MESH = (4,)


def setup(quick: bool):
    torch.manual_seed(0)
    model = resnet18(num_classes=10, width=4 if quick else 16)
    size, n = (16, 48) if quick else (32, 256)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g))
    # the same batches on every rank: each rank takes its part of the global batch
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(loader))
    return model, optimizer, schedule, loader


def train_distributed(rank: int, quick: bool):
    model, optimizer, schedule, loader = setup(quick)
    example = loader.dataset[:16]  # one batch's shapes (iterating the loader would shuffle)
    step = ddlc.compile(model, MESH, example, F.cross_entropy, optimizer)
    losses = []
    for images, labels in loader:
        losses.append(float(step.step(images, labels)))
        schedule.step()  # read by the next step from optimizer.param_groups
    state = step.state_dict()  # parameters and BatchNorm buffers, under the model's keys
    model.load_state_dict(state)
    model.eval()
    infer = ddlc.compile(model, MESH, images)  # eval mode: the running statistics
    logits = infer(images)
    return losses, state, logits


def train_single_device(quick: bool):
    model, optimizer, schedule, loader = setup(quick)
    losses = []
    for images, labels in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(images)
    return losses, copy.deepcopy(model.state_dict()), logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny ResNet and 3 steps")
    quick = parser.parse_args().quick
    result = run(train_distributed, 4, quick, timeout=300, deadline=1200)
    if result is None:  # a torchrun rank other than 0
        return 0
    losses, state, logits = result
    want_losses, want_state, want_logits = train_single_device(quick)
    print("step  single-device loss  ddlc loss (4 ranks)")
    for i, (a, b) in enumerate(zip(want_losses, losses)):
        print(f"{i:4d}  {a:18.6f}  {b:19.6f}")
    worst = max((state[k].double() - v.double()).abs().max().item() for k, v in want_state.items())
    print(f"largest difference of a parameter or BatchNorm buffer: {worst:.2e}; "
          f"of an eval-mode logit: {(logits - want_logits).abs().max().item():.2e}")
    ok = torch.allclose(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-5) \
        and worst < 1e-3 and torch.allclose(logits, want_logits, rtol=1e-3, atol=1e-4)
    print("MATCH: equal to single-device training" if ok else "MISMATCH with single-device training")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
