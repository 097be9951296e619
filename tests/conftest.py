"""Shared test helpers: the small models, batches and optimizers the tests train, the
single-device eager reference run, and the comparison of a compiled or simulated run
against it.

Plain functions: test modules (and the multi-process workers, through
``distributed_cases``) import them with ``from conftest import ...``; pytest's default
(prepend) import mode puts tests/ on ``sys.path`` and registers this file as ``conftest``.
Only core modules are imported at the top, so that every test module, whatever it tests,
still loads while a pass is being rewritten.
"""
from __future__ import annotations

import dataclasses

import pytest

import torch
import torch.nn.functional as F

import ddlc
from ddlc.ir import STEP, SHARDING, NdSignature
from ddlc.sbp import NdSBP, parse_sbp
from ddlc.zoo import CNN, GPT, MLP, lm_loss

STEPS = 3
MODELS = ("mlp", "gpt", "gpt_tied", "gpt_checkpointed", "cnn")

#: A fast local network beside CPU compute: the former guess of the ``cpu-gloo`` profile
#: (50 us start-ups, 2 GB/s, 2e10 FLOP/s, no cache level), for tests of mechanisms that
#: pay only where communication is cheap against compute. The shipped ``cpu-gloo`` holds
#: what 4 gloo ranks measure on a 2-core machine (1.2 ms start-ups), where a small test
#: model is best left replicated.
FAST_GLOO_DICT = {
    "name": "fast-gloo", "devices_per_node": 64,
    "flops": {"float32": 2.0e10, "bfloat16": 1.0e10, "float16": 1.0e10},
    "memory_bandwidth": 1.0e10, "memory_capacity": 8.0e9,
    "emulated_collectives": {"reduce_scatter": "all_reduce"},
    "links": dict.fromkeys(["intra_node", "inter_node"], {"latency": 5.0e-5, "bandwidth": 2.0e9})}
FAST_GLOO = ddlc.mesh.HardwareProfile.from_dict(FAST_GLOO_DICT)

#: ``cpu-gloo`` without its measured contention: its collectives priced on the links alone
#: and overlapping compute, as if on cores of their own (tests of the collective fits and
#: of hiding communication; ranks that share cores are tested in test_measured).
GLOO_ALONE = dataclasses.replace(ddlc.mesh.load_profile("cpu-gloo"), contention=None)

#: Optimizers by name. The attention key bias has a gradient that is zero up to rounding
#: noise, and Adam with a tiny eps turns that noise into a full-size step; eps=1e-4 keeps
#: comparisons about the update rule, not about float summation order. RMSprop divides the
#: gradient by sqrt(its average) + eps, so a noise-sized gradient's rounding comes out
#: multiplied by 1 / eps (1e-3 here); its momentum buffer keeps that ratio unscaled by the
#: learning rate, so momentum and the centered variant are compared on an MLP on their own
#: (tests/test_training_loops.py), where no gradient is noise-sized.
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-4),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, weight_decay=1e-3, eps=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=5e-2, lr_decay=1e-2, weight_decay=1e-3,
                                              initial_accumulator_value=0.1),
}


def model_and_loss(model_name: str):
    """One of :data:`MODELS` with the parameters of seed 0, and its loss function."""
    torch.manual_seed(0)
    model = {"mlp": MLP, "mlp_deep": lambda: MLP(depth=3), "mlp_wide": lambda: MLP(d_hidden=1024, depth=3),
             "gpt": GPT, "gpt_tied": lambda: GPT(tied=True),
             "gpt_checkpointed": lambda: GPT(checkpoint=True), "cnn": CNN}[model_name]()
    loss = {"mlp": F.mse_loss, "mlp_deep": F.mse_loss, "mlp_wide": F.mse_loss,
            "cnn": F.cross_entropy}.get(model_name, lm_loss)
    return model, loss


def batches(model_name: str, batch: int = 4):
    """:data:`STEPS` (input, target) batches for ``model_name`` (2 * ``batch`` rows for the MLP)."""
    g = torch.Generator().manual_seed(1)
    if model_name.startswith("mlp"):
        return [(torch.randn(2 * batch, 32, generator=g), torch.randn(2 * batch, 16, generator=g))
                for _ in range(STEPS)]
    if model_name.startswith("gpt"):
        return [(torch.randint(0, 64, (batch, 16), generator=g),
                 torch.randint(0, 64, (batch, 16), generator=g)) for _ in range(STEPS)]
    return [(torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(STEPS)]


def optimizer(name: str | None, model):
    """:data:`OPTIMIZERS` ``name`` over ``model``'s parameters; None for None."""
    return OPTIMIZERS[name](model.parameters()) if name else None


def train(model, loss_fn, opt_name: str, data, clip_grad_norm: float | None = None,
          clip_grad_value: float | None = None):
    """Eager single-device steps of ``model`` (trained in place) with optimizer ``opt_name``
    on ``data`` (batches whose last entry is the target), gradients clipped to a global norm
    of ``clip_grad_norm`` by ``torch.nn.utils.clip_grad_norm_`` or to ``clip_grad_value``
    by ``clip_grad_value_`` if given: losses, final parameters and optimizer state
    ("<param>:<state>", float32)."""
    opt, losses = optimizer(opt_name, model), []
    for b in data:
        opt.zero_grad()
        loss = loss_fn(model(*b[:-1]), b[-1])
        loss.backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_grad_value)
        opt.step()
        losses.append(loss.detach())
    state = {f"{k}:{s}": v.to(torch.float32) for k, p in model.named_parameters()
             for s, v in opt.state[p].items()}
    return {"losses": losses, "params": {k: p.detach() for k, p in model.named_parameters()},
            "opt_state": state}


def reference(model_name: str, opt_name: str | None, mode: str = "train", batch: int = 4,
              clip_grad_value: float | None = None):
    """Single-device losses, final parameters and optimizer state (or outputs / gradients)
    of ``model_name`` on its :func:`batches`, gradients clamped to ``clip_grad_value``."""
    model, loss_fn = model_and_loss(model_name)
    data = batches(model_name, batch)
    if mode == "forward":
        return {"outputs": [model(*b[:-1]).detach() for b in data[:1]]}
    if mode == "gradients":
        loss = loss_fn(model(*data[0][:-1]), data[0][-1])
        loss.backward()
        return {"losses": [loss.detach()],
                "gradients": {k: p.grad for k, p in model.named_parameters()}}
    return train(model, loss_fn, opt_name, data, clip_grad_value=clip_grad_value)


#: (rtol, atol) of each quantity a run is compared on: a few steps' losses (and outputs,
#: gradients) agree more closely than the parameters and state several updates produce
TOLERANCES = {"losses": (1e-5, 1e-6), "outputs": (1e-5, 1e-6), "gradients": (1e-5, 1e-6),
              "params": (1e-4, 1e-5), "opt_state": (1e-4, 1e-5)}


def assert_matches_reference(got: dict, want: dict, label: str = "", **tolerances):
    """Every quantity in ``got`` (keys of :data:`TOLERANCES`) equals the reference run's:
    ``losses`` and ``outputs`` step by step, ``params``, ``opt_state`` and ``gradients``
    for every name in ``want``. ``tolerances`` maps a quantity to its (rtol, atol)."""
    for key, values in got.items():
        rtol, atol = tolerances.get(key, TOLERANCES[key])
        expected = want[key]
        if isinstance(expected, dict):
            pairs = [(f"{key}[{name}]", values[name], value) for name, value in expected.items()]
        else:
            pairs = [(f"{key}[{i}]", a, b) for i, (a, b) in enumerate(zip(values, expected))]
        for what, actual, value in pairs:
            torch.testing.assert_close(actual, value, rtol=rtol, atol=atol,
                                       msg=lambda m, what=what: f"{label} {what}: {m}".lstrip())


# -- any model, eager and on simulated ranks ------------------------------------------------

MESHES = {(4,): "(S0)", (2, 2): "(S0, S0)"}
#: lowering options of the simulated runs of whole models: bucketing, splitting and the
#: collective order change no numbers (tests/test_fuse.py and tests/test_schedule.py
#: check that on their own), and their timeline searches are most of the lowering time
LOWER = {"fuse": False, "partition": False, "schedule": False}


def eager(model, loss_fn, make_optimizer, data, clip=None, seed=None, clip_value=None, micro_batches=1):
    """Single-device training of ``model`` in place: losses, and the last gradient norm.
    A batch is a tuple ``(*inputs, target)`` for ``loss_fn``, or a dict the model takes
    as keywords and computes its own loss from (``loss_fn`` None: ``out["loss"]``). With
    ``micro_batches``, gradient accumulation as a training loop writes it: each tensor of
    the batch chunked along dim 0, ``(loss / micro_batches).backward()`` per chunk, the
    loss reported the sum of the scaled ones."""
    opt = make_optimizer(model)
    if seed is not None:
        torch.manual_seed(seed)
    losses, norm = [], None
    for batch in data:
        opt.zero_grad()
        keys = list(batch) if isinstance(batch, dict) else range(len(batch))
        chunks = zip(*(batch[k].chunk(micro_batches) for k in keys))
        loss = 0
        for chunk in (dict(zip(keys, c)) if isinstance(batch, dict) else c for c in chunks):
            if isinstance(chunk, dict):
                part = model(**chunk)["loss"]
            else:
                *inputs, target = chunk
                part = loss_fn(model(*inputs), target)
            if micro_batches > 1:
                part = part / micro_batches
            part.backward()
            loss = loss + part.detach()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
        losses.append(loss.detach())
    return losses, norm


def simulated(model, loss_fn, make_optimizer, data, mesh_shape, batch_sbp=None, pins=None,
              move_activations=True, **trace_options):
    """The same training on simulated ranks of ``mesh_shape`` with every batch input split
    as ``batch_sbp`` (default :data:`MESHES`), or with the pins ``pins(gm, mesh)`` gives:
    (losses, params, buffers, step graph)."""
    from passes.canonicalize import canonicalize  # imported on use: see the module docstring
    from passes.recompute import recompute_checkpointed
    from passes.sharding import shard
    from ddlc.simulate import simulate_steps
    gm = recompute_checkpointed(canonicalize(ddlc.trace(model, data[0], loss_fn, make_optimizer(model),
                                                        **trace_options)))
    sig = STEP(gm)
    mesh = ddlc.Mesh(mesh_shape)
    if pins is None:
        sbp = parse_sbp(batch_sbp or MESHES[mesh_shape])
        fixed = {sig.input_name("input", k): sbp for k in sig.keys("input")}
    else:
        fixed = pins(gm, mesh)
    shard(gm, mesh, fixed=fixed, move_activations=move_activations)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    losses, params, _, buffers = simulate_steps(gm, mesh, params, buffers, data, **LOWER)
    return losses, params, buffers, gm



# -- planned graphs -------------------------------------------------------------------------

#: a batch large enough that data parallelism (gradient all-reduce) is the MLP's plan
DP_BATCH = 256
DATA_PARALLEL_MLP = {"input0": "(S0)", "input1": "(S0)", "layers.0.weight": "(B)",
                     "layers.0.bias": "(B)", "layers.1.weight": "(B)", "layers.1.bias": "(B)"}


def data_parallel_mlp(opt_name: str):
    """The MLP's canonical step on (4,), planned data parallel: (gm, mesh, model, batches)."""
    from passes.canonicalize import canonicalize  # imported on use: see the module docstring
    from passes.sharding import shard
    model, loss_fn = model_and_loss("mlp")
    data = batches("mlp", DP_BATCH)
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer(opt_name, model)))
    names = {i.key: i.name for i in gm.meta["ddlc_step"].inputs}
    # a low-latency link: per-parameter gradient all-reduces are then cheaper than
    # gathering the batch, so the plan is data parallel
    mesh = ddlc.Mesh((4,), links=[ddlc.LinkModel(1e-7, 1e10)], profile=FAST_GLOO)
    shard(gm, mesh, fixed={names[k]: parse_sbp(v) for k, v in DATA_PARALLEL_MLP.items()})
    return gm, mesh, model, data


def replicate_updates(gm, mesh):
    """Make every optimizer update run on the full tensor on every rank (all-B), so each
    gradient reaches it through an all-reduce: the plan a DDP-style system runs."""
    b = NdSBP.broadcast(mesh.ndim)
    for n in gm.graph.nodes:
        origin = n.meta.get("ddlc_origin")
        if (origin and origin.phase == "optimizer" and n.op == "call_function") or \
                n.meta.get("ddlc_role") in ("param", "opt_state"):
            old = SHARDING(n)
            SHARDING.set(n, NdSignature(tuple(None if x is None else b for x in old.inputs),
                                        tuple(None if x is None else b for x in old.outputs)))


def most_in_flight(gm) -> int:
    """The most collectives ``gm``'s program has issued and not yet waited for at any point."""
    from ddlc.ir import is_collective, is_wait
    pending = most = 0
    for node in gm.graph.nodes:
        pending += is_collective(node) - is_wait(node)
        most = max(most, pending)
    return most


def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's ``--dist loadgroup`` (the README's test command): the
    multi-process tests run one after another on one worker (their gloo ranks already fill
    the cores), and each test module's other tests together on one worker, which builds
    the module's fixtures (traced example graphs, the command line's runs) once."""
    for item in items:
        group = "gloo" if item.get_closest_marker("multiprocess") else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))
