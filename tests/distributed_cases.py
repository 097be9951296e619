"""The multi-process workers' side: each worker builds the same model, batches and
optimizer (``conftest``) as the parent's single-device reference, compiles and runs them."""
from __future__ import annotations

from conftest import batches, model_and_loss, most_in_flight, optimizer


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
        out["most_in_flight"] = most_in_flight(compiled.gm)
        results.append(out if rank == 0 else {"losses": out.get("losses")})
    return results


def compiled_run_preferring_data_parallel(rank: int, mesh, cases):
    """:func:`compiled_run_recording_the_kept_plan` where rank 0's ``choose_plan`` models
    the data-parallel program faster than the searched one."""
    from ddlc import pipeline
    from ddlc.ir import SHARDING, STEP

    def modeled_step(planned, *args, **kwargs):
        by_name = {n.name: n for n in planned.graph.find_nodes(op="placeholder")}
        replicated = all(all(x.is_broadcast for x in SHARDING(by_name[i.name]).outputs[0])
                         for i in STEP(planned).inputs if i.role == "param")
        return (1.0 if replicated else 2.0), *lowered_step(planned, *args, **kwargs)[1:]

    lowered_step = pipeline._lowered_step
    pipeline._lowered_step = modeled_step
    return compiled_run_recording_the_kept_plan(rank, mesh, cases)


def compiled_run_recording_the_kept_plan(rank: int, mesh, cases):
    """:func:`compiled_run`; rank 0's first result also holds which plan its first
    ``choose_plan`` kept (``kept``: "data parallel", "replicated", "start-ups priced" or
    "searched")."""
    from ddlc import pipeline
    kept = []
    choose_plan = pipeline.choose_plan

    def recording(*args, **kwargs):
        result = choose_plan(*args, **kwargs)
        stats = result.plan.stats
        kept.append("replicated" if stats.get("replicated_chosen") else
                    "data parallel" if stats.get("chosen_over_search") else
                    "start-ups priced" if stats.get("startups_priced_chosen") else "searched")
        return result

    pipeline.choose_plan = recording
    results = compiled_run(rank, mesh, cases)
    if rank == 0:
        results[0]["kept"] = kept[0]
    return results


def compiled_on_a_device_mesh(rank: int, layout, cases):
    """:func:`compiled_run` on a ``DeviceMesh`` of ``layout`` (nested lists of ranks); each
    rank's first result also holds how often this rank called ``pipeline.lower``
    (``lowered``) and the passes it ran (``passes``, by name, as ``pipeline.run_pass``
    logs them)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from ddlc import pipeline
    calls, passes = [], []
    lower, run_pass = pipeline.lower, pipeline.run_pass

    def counted(*args, **kwargs):
        calls.append(args[2])
        return lower(*args, **kwargs)

    def recorded(name, *args, **kwargs):
        passes.append(name)
        return run_pass(name, *args, **kwargs)

    pipeline.lower, pipeline.run_pass = counted, recorded
    results = compiled_run(rank, DeviceMesh("cpu", torch.tensor(layout)), cases)
    results[0]["lowered"], results[0]["passes"] = len(calls), sorted(set(passes))
    return results


def cumulative_every_other_batch_norm(model):
    """``model`` with every other batch norm layer a cumulative average (``momentum=None``)."""
    import torch
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for norm in norms[::2]:
        norm.momentum = None
    return model


def sync_batchnorm_steps(rank, steps: int):
    """A tiny ResNet, every other batch norm a cumulative average, converted to
    ``nn.SyncBatchNorm`` (as for DDP), compiled on (4,) with the batch split, SGD steps:
    the losses, and the parameters and buffers."""
    import torch
    import torch.nn.functional as F
    import ddlc
    from ddlc import zoo
    torch.manual_seed(0)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        cumulative_every_other_batch_norm(zoo.resnet18(num_classes=10, width=4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    step = ddlc.compile(model, (4,), batch, F.cross_entropy, opt, placements={"input0": "(S0)"})
    losses = [step.step(*batch) for _ in range(steps)]
    return losses, step.state_dict()


def hf_data_parallel_in_place(rank: int, name: str, mesh):
    """Worker: the Hugging Face model ``name`` of ``test_hf_models`` compiled data parallel
    with no activation moved (every batch key split along dim 0 over every mesh axis,
    every parameter whole, ``move_activations=False``), three AdamW steps; rank 0 returns
    the losses, the trained parameters and how the search found its plan."""
    import ddlc
    from test_hf_models import adamw, batches, build
    model, data = build(name), batches(name)
    split, whole = (f"({', '.join([x] * len(mesh))})" for x in ("S0", "B"))
    placements = {k: split for k in data[0]} | {k: whole for k, _ in model.named_parameters()}
    step = ddlc.compile(model, mesh, data[0], optimizer=adamw(model), placements=placements,
                        move_activations=False)
    losses = [step.step(b) for b in data]
    params = step.state_dict()  # a collective: every rank gathers
    if rank:
        return {"losses": losses}
    return {"losses": losses, "params": params, "repaired_by": step.plan.stats.get("repaired_by")}
