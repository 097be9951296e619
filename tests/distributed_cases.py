"""Cases for the multi-process tests: each builds the same model, batches and optimizer
in the parent (single-device reference) and in every worker (compiled run)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ddlc.zoo import CNN, GPT, MLP, lm_loss

STEPS = 3


def batches(model_name: str, batch: int = 4):
    g = torch.Generator().manual_seed(1)
    if model_name == "mlp":
        return [(torch.randn(2 * batch, 32, generator=g), torch.randn(2 * batch, 16, generator=g))
                for _ in range(STEPS)]
    if model_name == "gpt":
        return [(torch.randint(0, 64, (batch, 16), generator=g),
                 torch.randint(0, 64, (batch, 16), generator=g)) for _ in range(STEPS)]
    return [(torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(STEPS)]


def model_and_loss(model_name: str):
    torch.manual_seed(0)
    model = {"mlp": MLP, "gpt": GPT, "cnn": CNN}[model_name]()
    loss = {"mlp": F.mse_loss, "gpt": lm_loss, "cnn": F.cross_entropy}[model_name]
    return model, loss


def optimizer(name: str | None, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    return None


def reference(model_name: str, opt_name: str | None, mode: str = "train", batch: int = 4):
    """Single-device losses, final parameters and optimizer state (or outputs / gradients)."""
    model, loss_fn = model_and_loss(model_name)
    data = batches(model_name, batch)
    if mode == "forward":
        return {"outputs": [model(*b[:-1]).detach() for b in data[:1]]}
    if mode == "gradients":
        loss = loss_fn(model(*data[0][:-1]), data[0][-1])
        loss.backward()
        return {"losses": [loss.detach()],
                "gradients": {k: p.grad for k, p in model.named_parameters()}}
    return train(model, loss_fn, optimizer(opt_name, model), data)


def train(model, loss_fn, opt, data):
    """Eager single-device steps of ``model`` with ``opt`` on ``data`` (batches whose last
    entry is the target): losses, final parameters, optimizer state ("<param>:<state>")."""
    losses = []
    for b in data:
        opt.zero_grad()
        loss = loss_fn(model(*b[:-1]), b[-1])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    state = {f"{k}:{s}": v.to(torch.float32) for k, p in model.named_parameters()
             for s, v in opt.state[p].items()}
    return {"losses": losses, "params": {k: p.detach() for k, p in model.named_parameters()},
            "opt_state": state}


def compiled_run(rank: int, mesh, cases):
    """Worker: compile and run each case; rank 0 returns what the parent compares."""
    from ddlc.ir import collective_sequence
    from ddlc.runtime import compile
    results = []
    import ddlc
    for model_name, opt_name, mode, placements, *options in cases:
        options = dict(options[0]) if options else {}
        # a fast link makes communication cheap, so the search shards instead of replicating
        link = options.pop("link", None)
        mesh_here = ddlc.Mesh(mesh, links=[ddlc.LinkModel(*link)] * len(mesh)) if link else mesh
        model, loss_fn = model_and_loss(model_name)
        data = batches(model_name)
        if mode == "forward":
            compiled = compile(model, mesh_here, data[0][:-1], placements=placements, **options)
            out = {"outputs": [compiled(*b[:-1]) for b in data[:1]]}
        elif mode == "gradients":
            compiled = compile(model, mesh_here, data[0], loss_fn, placements=placements, **options)
            out = {"losses": [compiled.step(*data[0])], "gradients": compiled.gradients()}
        else:
            compiled = compile(model, mesh_here, data[0], loss_fn, optimizer(opt_name, model),
                               placements=placements, **options)
            out = {"losses": [compiled.step(*b) for b in data]}
            out["params"] = compiled.state_dict()
            out["opt_state"] = compiled.optimizer_state()
        out["collectives"] = sorted({kind for kind, _, _ in collective_sequence(compiled.gm)})
        results.append(out if rank == 0 else {"losses": out.get("losses")})
    return results
