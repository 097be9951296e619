"""Trace a model's whole training step into one functional aten graph.

Recipe (see TORCH_NOTES.md): ``make_fx(functionalize(step), tracing_mode="fake")``
where ``step`` runs ``torch.func.grad_and_value`` over ``functional_call`` of the
model; each parameter's functional optimizer update (:mod:`ddlc.optim`) is then one
``ddlc::optimizer_update`` node (:mod:`ddlc.updates`, :mod:`ddlc.fused_update`). Parameters,
buffers, optimizer state and batch inputs are flat graph inputs with their role
recorded in a :class:`ddlc.ir.StepSignature` (``ir.STEP``); every node keeps
``meta["val"]``, its role (``ir.ROLE``, placeholders) and an :class:`ddlc.ir.Origin`
(``ir.ORIGIN``: phase, module path, user source line).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import sys
import threading
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
import torch.fx.proxy as fx_proxy
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch import fx, nn
from torch.func import functionalize, grad_and_value
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.nn.modules import module as module_mod, transformer as transformer_module
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten

from . import graph_checks, host_random, rng, sources, strided_views
from .errors import TraceError, UnsupportedInputError
from .forward_rewrites import ForwardRewrites
from .ir import (DRAW_STRIDES, ORIGIN, RECOMPUTE, ROLE, STEP, InputSpec, Origin, OutputSpec, OutputTree, StepSignature,
                 dataclasses_as_nodes, hyperparameter_tensors, micro_batch, micro_batch_key, uneven_micro_batches)
from .model_state import PLAIN, ModelWatch, describe, recomputed_attribute, same_plain as _same_plain
from .optim import hyperparameter_key, optimizer_spec
from .updates import Update, stamp_updates

__all__ = ["refuse_wrapped", "trace"]

def trace(model: nn.Module, example_inputs, loss_fn: Callable | None = None,
          optimizer: torch.optim.Optimizer | None = None, *, num_targets: int = 1,
          clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
          micro_batches: int = 1) -> fx.GraphModule:
    """Trace one training step of ``model`` into a flat functional aten GraphModule.

    ``example_inputs`` is a tensor, a tuple of tensors (the model is called
    ``model(*inputs)``) or a dict of tensors (``model(**inputs)``, a Hugging Face
    batch). With ``loss_fn`` the step computes ``loss_fn(model(...), *targets)``, where
    the last ``num_targets`` inputs (entries of a dict) are the targets and are not
    given to the model; with an ``optimizer`` and no ``loss_fn``, the model computes its
    own loss (a one-element tensor, or an output with ``.loss`` / ``["loss"]``, as a
    Hugging Face model does when given ``labels``). Then come the gradients, clipped to
    a global norm of ``clip_grad_norm`` (as ``torch.nn.utils.clip_grad_norm_``) or each
    clamped to ``[-clip_grad_value, clip_grad_value]`` (``clip_grad_value_``), and
    with ``optimizer`` (``torch.optim.SGD``, ``Adam`` or ``AdamW``) the updated
    parameters and state. Buffers the forward updates in place (BatchNorm running
    statistics) are step outputs. Outputs: ``(loss, [grad_norm], *new_params,
    *new_state, *new_buffers)``, or ``(loss, *grads, *new_buffers)`` without an
    optimizer. Without ``loss_fn`` and optimizer the graph is the forward pass alone.

    With ``micro_batches > 1`` (gradient accumulation) every batch tensor is cut along its
    first dim into that many equal micro-batches, the program's batch inputs ``key[i]``
    (:meth:`ddlc.ir.StepSignature.split_batch`), and the step runs as eager's loop
    ``for mb in micro-batches: (loss(mb) / micro_batches).backward()`` before one clipping
    and update: a forward and backward per micro-batch in turn (buffers such as BatchNorm's
    running statistics carried from one to the next), the gradients summed in that order;
    the loss output is the mean of the micro-batches' losses.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batch = _Batch.of(example_inputs)
    training = loss_fn is not None or optimizer is not None
    n_targets = num_targets if loss_fn is not None else 0
    if n_targets >= len(batch) + (not training):
        raise UnsupportedInputError(f"{len(batch)} example input(s) cannot hold {n_targets} "
                                    "target(s) and at least one model input")
    for option, value in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
        if value is not None and not training:
            raise UnsupportedInputError(f"{option} clips gradients: it needs a loss_fn or an optimizer")
    if micro_batches > 1 and not training:
        raise UnsupportedInputError("micro_batches accumulates gradients over micro-batches: it needs a "
                                    "loss_fn or an optimizer (an inference program takes its batch whole)")
    uneven = uneven_micro_batches(dict(zip(batch.keys, batch.tensors)), micro_batches)
    if uneven is not None:
        raise UnsupportedInputError(uneven)
    # the program's batch inputs: the batch's tensors, or each micro-batch's, laid out as the batch
    examples = dict(zip(batch.keys, batch.tensors)) if micro_batches == 1 else \
        {micro_batch_key(k, i, micro_batches): micro_batch(t, i, micro_batches).clone(memory_format=torch.preserve_format)
         for i in range(micro_batches) for k, t in zip(batch.keys, batch.tensors)}
    refuse_wrapped(model)
    _check_loss_signature(loss_fn, n_targets)
    _warn_of_targets_given_to_the_model(batch, n_targets)
    _check_initialised(model, batch)
    if training:
        _check_modules(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    trainable = [k for k, p in params.items() if p.requires_grad]
    if clip_grad_value is not None:
        _refuse_complex_value_clipping({k: params[k] for k in trainable})
    grouped = optimizer_spec(optimizer, params) if optimizer is not None else {}
    if optimizer is not None and not trainable:
        raise UnsupportedInputError(
            "every parameter of the model is frozen (requires_grad=False), so the step would train "
            "nothing: eager's loss.backward() raises on it (unfreeze what should train, or compile "
            "without an optimizer, --optimizer none on the command line, for the loss alone)")
    # a frozen parameter given to the optimizer gets no gradient, and torch.optim skips it
    group_of = {k: grouped[k][0] for k in trainable if k in grouped}
    specs = {k: grouped[k][1] for k in group_of}
    groups = {g: grouped[k][1] for k, g in sorted(group_of.items(), key=lambda kv: kv[1])}
    hyper = {hyperparameter_key(g, name): value for g, spec in groups.items()
             for name, value in spec.values().items()}
    opt_state = {f"{k}:{s}": t for k in specs for s, t in _initial_state(specs[k], params[k]).items()}

    inputs = ([InputSpec("", "param", k) for k in params]
              + [InputSpec("", "buffer", k) for k in buffers]
              + [InputSpec("", "opt_state", k) for k in opt_state]
              + [InputSpec("", "hparam", k) for k in hyper]
              + [InputSpec("", "input", k) for k in examples])
    clip = [OutputSpec("grad_norm", "grad_norm")] if clip_grad_norm is not None else []
    if not training:
        outputs = None  # known after tracing
    elif optimizer is None:
        outputs = [OutputSpec("loss", "loss"), *clip] + [OutputSpec("grad", k) for k in trainable]
    else:
        outputs = ([OutputSpec("loss", "loss"), *clip] + [OutputSpec("param", k) for k in specs]
                   + [OutputSpec("opt_state", k) for k in opt_state])
    outputs_tree = None
    loss_shape: tuple[int, ...] = ()  # a one-element loss of another shape is traced 0-d
    scalar_names: dict[int, tuple[str, ...]] = {}  # per param group, its update's scalars

    n_model_inputs = len(batch) - n_targets
    annotator = _ModuleAnnotator(model)
    rewrites = ForwardRewrites()  # one mode for every call of the forward (it keeps hook sites)

    def unpack(flat):
        it = iter(flat)
        tables = [{k: next(it) for k in params}, {k: next(it) for k in buffers},
                  {k: next(it) for k in opt_state}, {k: next(it) for k in hyper},
                  [next(it) for _ in range(len(examples))]]
        return tables

    def run_forward(weights, buffer_values, xs, then: Callable = lambda out: out):
        """``then`` of the model's output on ``xs`` (:meth:`_Batch.call`), with its buffers as
        fresh tensors it may update in place (created inside the transforms, so the update
        is functionalized into outputs)."""
        updated = {k: v.clone() for k, v in buffer_values.items()}
        annotator.phase("forward")
        with rewrites:
            result = batch.call(model, {**weights, **updated}, xs[:n_model_inputs],
                                lambda out: then(_checked_output(out)))
        _refuse_resized_buffers(buffer_values, updated)
        return result, updated

    def micro_batch_inputs(xs, i):
        """Micro-batch ``i``'s part of the program's batch inputs ``xs``."""
        return xs[i * len(batch):(i + 1) * len(batch)]

    def forward_eagerly():
        """The step's forward (and loss) on the real state and batch, micro-batch by micro-batch."""
        xs = list(examples.values())
        if not training:
            return run_forward(params, buffers, xs)
        buffer_values = buffers
        for i in range(micro_batches):
            mb = micro_batch_inputs(xs, i)
            _, buffer_values = run_forward(params, buffer_values, mb,
                                           lambda out: _loss_of(out, loss_fn, mb[n_model_inputs:]))

    def forward_only(*flat):
        nonlocal outputs_tree
        p, b, _, _, xs = unpack(flat)
        out, updated = run_forward(p, b, xs)
        tensors, outputs_tree = _flatten_output(out)
        return (*tensors, *(updated[k] for k in buffers))

    def train_step(*flat):
        p, b, state, hp, xs = unpack(flat)
        frozen = {k: v for k, v in p.items() if k not in trainable}

        def compute_loss(train_params, buffer_values, mb):
            """The loss on micro-batch ``mb``, divided by their number (as an eager loop
            scales it before ``backward()``), and, aside, the buffers the forward updated."""
            nonlocal loss_shape
            loss, updated = run_forward({**train_params, **frozen}, buffer_values, mb,
                                        lambda out: _loss_of(out, loss_fn, mb[n_model_inputs:]))
            if loss.ndim:  # step() returns it in its shape; torch.func takes 0-d losses only
                loss_shape, loss = tuple(loss.shape), loss.reshape(())
            scaled = loss / micro_batches if micro_batches > 1 else loss
            annotator.phase("backward")
            annotator.watch_backward(scaled)
            return scaled, updated

        grads, loss, updated = None, None, b
        for i in range(micro_batches):  # eager's order: forward, backward, the next micro-batch
            # the batch captured, not an argument: torch.func refuses its in-place update
            loss_of_micro_batch = functools.partial(compute_loss, mb=micro_batch_inputs(xs, i))
            mb_grads, (mb_loss, updated) = grad_and_value(loss_of_micro_batch, has_aux=True)(
                {k: p[k] for k in trainable}, updated)
            # summed in order, as backward() adds into .grad and a loop into its logged loss
            grads = mb_grads if grads is None else {k: grads[k] + mb_grads[k] for k in grads}
            loss = mb_loss if loss is None else loss + mb_loss
        annotator.phase("optimizer")
        norm = []
        if clip_grad_norm is not None:
            total, grads = _clip_by_global_norm(grads, clip_grad_norm)
            norm = [total]
        if clip_grad_value is not None:
            grads = {k: g.clamp(-clip_grad_value, clip_grad_value) for k, g in grads.items()}
        new_buffers = [updated[k] for k in buffers]
        if optimizer is None:
            return (loss, *norm, *(grads[k] for k in trainable), *new_buffers)
        # the updates themselves are stamped in after tracing (ddlc.updates): the step
        # returns what they read, the gradients and each group's scalars
        scalars = {g: spec.derived({name: hp[hyperparameter_key(g, name)] for name in spec.inputs})
                   for g, spec in groups.items()}
        scalar_names.update({g: tuple(s) for g, s in scalars.items()})
        return (loss, *norm, *(grads[k] for k in specs), *(v for s in scalars.values() for v in s.values()),
                *new_buffers)

    hyper_tensors = hyperparameter_tensors(hyper)
    tables = {"param": params, "buffer": buffers, "opt_state": opt_state, "hparam": hyper_tensors,
              "input": examples}
    flat = [tables[i.role][i.key].detach() for i in inputs]
    fn = train_step if training else forward_only
    def forward_again() -> None:
        """The model's forward once more, on fake copies of its state and batch."""
        mode = FakeTensorMode()
        state = {k: mode.from_tensor(v) for k, v in {**params, **buffers}.items()}
        xs = [mode.from_tensor(t) for t in batch.tensors[:n_model_inputs]]
        with mode, torch.no_grad(), _as_compiling(), _without_generation_cache(model), _single_device_world(), \
                _causal_masks_taken_as_given():
            batch.call(model, state, xs)

    with _no_state_kept_across_calls(model, forward_again):
        host_generators = host_random.HostGenerators()
        with _targets_named(batch, n_targets):
            gm = _make_fx(fn, flat, annotator, batch.tensors, model, loss_fn)
        host_generators.refuse_unless_seeded(gm, lambda: _make_fx(fn, flat, annotator, batch.tensors, model, loss_fn))
        with_views = None  # the step traced with its views as views, where a check needs it
        if strided_views.needs_repair(gm):  # an in-place update of a view: see ddlc.strided_views
            with_views = _make_fx(fn, flat, annotator, batch.tensors, model, loss_fn, remove="mutations")
            strided_views.repair(gm, with_views,
                                 lambda n: sources.source_from_stack(n.meta.get("stack_trace")) or None)
        if rng.may_draw_permuted(gm, strided_views.view_form):  # random fills: eager's memory order
            layouts = rng.eager_layouts(gm, lambda: _run_eagerly(forward_eagerly, annotator, model))
            if layouts is None:  # it does not run eagerly here: the layouts of the trace with views
                if with_views is None:
                    with_views = _make_fx(fn, flat, annotator, batch.tensors, model, loss_fn, remove="mutations")
                layouts = rng.traced_layouts(gm, with_views)
            for fill, strides in layouts.items():
                DRAW_STRIDES.set(fill, strides)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    untrained = ()
    if training and optimizer is None:  # the gradients are the step's outputs
        untrained = _without_gradient(gm, len(clip), list(trainable))
    if training and optimizer is not None:
        untrained = _stamp_updates(gm, placeholders, inputs, specs, group_of, scalar_names, len(clip))
        if specs and len(untrained) == len(specs):
            raise UnsupportedInputError(
                "the loss depends on no trainable parameter (computed under torch.no_grad(), from "
                "detached values, from frozen parameters only, or through ops with no gradient to "
                "their inputs, such as torch.normal's to its mean), so the step would train "
                "nothing: eager's loss.backward() raises on it, or gives every parameter a zero "
                "or no gradient")
    inputs = [InputSpec(_rename_placeholder(n, spec), spec.role, spec.key)
              for n, spec in zip(placeholders, inputs)]
    if outputs is None:
        outputs = [OutputSpec("output", f"output{i}") for i in range(outputs_tree.num_tensors)]
    outputs += [OutputSpec("buffer", k) for k in buffers]
    outputs = _drop_unchanged_buffers(gm, inputs, outputs)
    _functional_metadata_updates(gm)
    _bind_reads_in_backward(gm, model, inputs, outputs)
    graph_checks.no_input_mutation(gm, inputs)
    graph_checks.no_traced_constants(gm)
    updated_buffers = {o.key for o in outputs if o.role == "buffer"}
    graph_checks.no_captured_parameters(gm, model, updated_buffers=updated_buffers, hook_sites=rewrites.hook_sites)
    graph_checks.no_shared_memory(gm, model, trainable if training else (), updated_buffers)
    _annotate_origins(gm, inputs, annotator)
    graph_checks.random_ops(gm)
    graph_checks.checkpointed_draws(gm, annotator.fresh_draws)
    graph_checks.hidden_mutations(gm)
    graph_checks.no_collectives(gm)
    graph_checks.static_shapes(gm)
    graph_checks.operand_dtypes(gm, batch.tensors)
    strided_inputs = graph_checks.strided_inputs(gm, inputs)
    gm.recompile()
    STEP.set(gm, StepSignature(tuple(inputs), tuple(outputs), tuple((k, specs[k]) for k in specs),
                               n_targets, tuple(groups.items()), tuple(hyper.items()),
                               keyword_batch=batch.keyword, output_tree=outputs_tree, untrained=untrained,
                               loss_shape=loss_shape, strided_inputs=strided_inputs,
                               micro_batches=micro_batches))
    return gm


def _stamp_updates(gm: fx.GraphModule, placeholders: Sequence[fx.Node], inputs: Sequence[InputSpec],
                   specs: Mapping[str, Any], group_of: Mapping[str, int],
                   scalar_names: Mapping[int, tuple[str, ...]], n_norm: int) -> tuple[str, ...]:
    """Turn the traced ``(loss, *norm, *grads, *scalars, *buffers)`` outputs of the step
    into ``(loss, *norm, *new_params, *new_state, *buffers)`` by stamping in every
    parameter's update (:func:`ddlc.updates.stamp_updates`). A parameter the loss does not
    depend on (its gradient, zeros from torch.func, is not computed from the loss other than
    through the clipping norm, ``norm``) keeps its value and state, as torch.optim skips a
    parameter whose ``grad`` is None: no weight decay, no step count. Returns the names of
    those parameters."""
    node_of = {(i.role, i.key): n for i, n in zip(inputs, placeholders)}
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(output.args[0])
    head, grads = values[:1 + n_norm], values[1 + n_norm:1 + n_norm + len(specs)]
    rest = iter(values[1 + n_norm + len(specs):])
    scalars = {g: tuple(next(rest) for _ in names) for g, names in scalar_names.items()}
    buffers = list(rest)
    untrained = _without_gradient(gm, n_norm, list(specs))
    updates = [Update(spec, node_of["param", k], grad,
                      tuple(node_of["opt_state", f"{k}:{s}"] for s in spec.state_names),
                      scalar_names[group_of[k]], scalars[group_of[k]])
               for (k, spec), grad in zip(specs.items(), grads)]
    stamped = iter(stamp_updates(gm.graph, [u for k, u in zip(specs, updates) if k not in untrained],
                                 {"ddlc_phase": "optimizer", "ddlc_module": None}))
    new = [next(stamped) if k not in untrained else (u.param, *u.state) for k, u in zip(specs, updates)]
    output.args = ((*head, *(n[0] for n in new), *(s for n in new for s in n[1:]), *buffers),)
    for update in updates:  # the zeros of an unused parameter's gradient
        _erase_if_unused(gm.graph, update.grad)
    return untrained


def _without_gradient(gm: fx.GraphModule, n_norm: int, trainable: Sequence[str]) -> tuple[str, ...]:
    """The trainable parameters of a step traced as ``(loss, *norm, *grads, ...)`` whose
    gradient the loss does not give (torch.func's zeros, where eager's ``.grad`` stays
    None): with an optimizer, :func:`_stamp_updates` leaves them as they are; without,
    ``CompiledStep.gradients`` leaves them out."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(output.args[0])
    # each backward starts from the loss it differentiates: the step's loss output, or with
    # micro-batches each micro-batch's, which that output sums; so a gradient comes from the
    # loss if it is computed from what the loss output is computed from (torch.func's zeros
    # for an unused parameter are computed from the parameter alone). Not through the
    # clipping norm: every clipped gradient is computed from it, the zeros too.
    computing = [n for n in _ancestors(values[0]) if n.op != "placeholder"]
    from_loss = _descendants(*computing, stop=set(values[1:1 + n_norm]))
    grads = values[1 + n_norm:1 + n_norm + len(trainable)]
    return tuple(k for k, grad in zip(trainable, grads) if grad not in from_loss)


def _erase_if_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, and then its inputs that nothing else reads."""
    if node.op == "placeholder" or node.users:
        return
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for arg in inputs:
        _erase_if_unused(graph, arg)


def _descendants(*nodes: fx.Node, stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """``nodes`` and every node computed from them, other than through the nodes ``stop``."""
    found, stack = set(nodes), list(nodes)
    while stack:
        for user in stack.pop().users:
            if user not in found and user not in stop:
                found.add(user)
                stack.append(user)
    return found


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    found, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in found:
                found.add(arg)
                stack.append(arg)
    return found


def _initial_state(spec, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """``spec.init_state(param)`` as tensors of the same shapes, dtypes, strides and devices
    whose values are left unset: the trace reads only their metadata (it runs on fake
    tensors), and zero-filling the optimizer state of a large model costs seconds. The
    state is computed for a meta-device stand-in of ``param``; what comes back on the meta
    device is then allocated (uninitialised) on ``param``'s device."""
    stand_in = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device="meta")
    state = spec.init_state(stand_in)
    return {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=param.device)
            if t.device.type == "meta" else t for name, t in state.items()}


def _checked_output(out):
    """The model's output, or a clear error when it returned nothing to compute with."""
    if out is None or (isinstance(out, (tuple, list)) and not any(isinstance(o, torch.Tensor) for o in out)):
        raise UnsupportedInputError(f"the model's forward returned {out!r}; it must return a tensor "
                                    "(or a tuple of tensors) for the loss or the caller to read")
    return out


#: wrappers that distribute or compile a module themselves: (the module defining the class,
#: its name, the wrapper in words, what the user passes instead). ddlc distributes and
#: compiles the plain module; a class is looked up only where its module is loaded (no
#: instance exists otherwise).
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "DistributedDataParallel",
     "the module it wraps (model.module): ddlc distributes the model itself"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "DataParallel",
     "the module it wraps (model.module): ddlc distributes the model itself"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel", "FullyShardedDataParallel",
     "the model built without FSDP: ddlc shards the model itself"),
    ("torch.distributed.fsdp", "FSDPModule", "fully_shard (FSDP2)",
     "the model built without fully_shard: ddlc shards the model itself"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "torch.compile",
     "the module before torch.compile (model._orig_mod): ddlc compiles the whole step itself, "
     "and compile(..., backend='inductor') runs each rank's program through Inductor"),
    ("torch.jit._script", "ScriptModule", "TorchScript (torch.jit.script or torch.jit.trace)",
     "the eager module it was made from: ddlc traces Python modules (a scripted function called "
     "in the forward traces)"),
)


def refuse_wrapped(model: nn.Module) -> None:
    """Refuse a model holding a module that a distributed wrapper or ``torch.compile``
    wraps, or a parameter or buffer that is already a DTensor: ddlc takes the plain
    single-device module, and a wrapper's own communication or compilation would be
    traced into the step or break it."""
    wrappers = [(getattr(sys.modules[mod], name), words, instead) for mod, name, words, instead in _WRAPPERS
                if mod in sys.modules and hasattr(sys.modules[mod], name)]
    for path, module in model.named_modules():
        for cls, words, instead in wrappers:
            if isinstance(module, cls):
                where = f"module {path}" if path else "the model"
                raise UnsupportedInputError(f"{where} is wrapped by {words}: pass {instead}",
                                            where=f"{where} ({type(module).__name__})")
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if isinstance(tensor, dtensor):
                raise UnsupportedInputError(
                    f"{name} is a DTensor (placements {tuple(tensor.placements)}): the model is "
                    "already distributed (parallelize_module, distribute_tensor, fully_shard); "
                    "ddlc takes the model with plain tensors on one device and distributes it itself",
                    where=f"parameter or buffer {name}")


def _check_loss_signature(loss_fn: Callable | None, n_targets: int) -> None:
    """Refuse a ``loss_fn`` that cannot be called as the step calls it: ``loss_fn(output,
    *targets)``, the targets the last ``num_targets`` example inputs."""
    if loss_fn is None:
        return
    if isinstance(loss_fn, type):
        raise UnsupportedInputError(f"loss_fn is the class {loss_fn.__name__}, not a loss: pass an instance "
                                    f"({loss_fn.__name__}()) or a function")
    try:  # the wrapper's own signature (functools.wraps of another arity calls it so)
        inspect.signature(loss_fn, follow_wrapped=False).bind(None, *[None] * n_targets)
    except TypeError as e:
        raise UnsupportedInputError(
            f"the step calls loss_fn(output, {', '.join(['target'] * n_targets)}), the model's output and "
            f"the last {n_targets} example input(s), and this loss_fn cannot take that ({e}): write it "
            f"so (ddlc.compile's num_targets= sets how many of the example inputs are targets)") from e
    except ValueError:  # no signature to read (a builtin): calling it tells
        pass


def _check_initialised(model: nn.Module, batch: _Batch) -> None:
    """Refuse a lazy module whose parameters or buffers have no shape yet (they take it on
    the first call, which compile does not make for the user), and a model or example
    input on the meta device (no values; traced beside the others, its device clashes
    with theirs deep inside torch)."""
    tensors = [*model.named_parameters(), *model.named_buffers(),
               *((f"example input {key}", t) for key, t in zip(batch.keys, batch.tensors))]
    meta = next((name for name, t in tensors if t.device.type == "meta"), None)
    if meta is not None:
        raise UnsupportedInputError(
            f"{meta} is on the meta device (a shape with no values): build the model and the example "
            "inputs on the device they train on (model.to_empty(device=...) and initialise its "
            "weights, or load them, for a model built on meta)")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, nn.parameter.UninitializedTensorMixin):
            module = name.rpartition(".")[0]
            raise UnsupportedInputError(
                f"{name} is not initialised yet ({type(model.get_submodule(module)).__name__} "
                f"{module or '<root>'} is a lazy module): call the model once on the example batch "
                "before compile (under torch.no_grad()), and create the optimizer after that call",
                where=f"module {module or '<root>'}")


def _check_modules(model: nn.Module) -> None:
    """Refuse embeddings with sparse gradients (no sparse tensor runs through the traced
    update), and hooks on gradients: a parameter's (``register_hook``, ``register_post_accumulate_grad_hook``,
    which autograd runs as it fills ``.grad``: ddlc computes gradients in the traced step
    and no ``.grad`` is filled) and a module's backward hooks (torch runs them through an
    old-style autograd.Function, which the torch.func transforms cannot run)."""
    for name, param in model.named_parameters():
        if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
            raise UnsupportedInputError(
                f"parameter {name!r} has a hook on its gradient (Tensor.register_hook or "
                "register_post_accumulate_grad_hook); the compiled step computes gradients inside "
                "its traced program, where such a hook would not run: remove it and express what "
                "it does in the loss or the model (a scaled gradient: scale that parameter's use), "
                "or use clip_grad_norm= for clipping", where=f"parameter {name}")
    if module_mod._global_backward_hooks or module_mod._global_backward_pre_hooks:
        raise UnsupportedInputError(
            "a global module backward hook is registered (register_module_full_backward_hook); "
            "ddlc cannot trace module backward hooks: remove it before compile")
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            raise UnsupportedInputError(
                f"module {name or '<root>'} ({type(module).__name__}) has a backward hook "
                "(register_full_backward_hook or register_full_backward_pre_hook); ddlc traces "
                "the backward pass with torch.func, which cannot run module backward hooks: "
                "remove it (a hook on an activation's gradient, h.register_hook(...) inside "
                "forward, is traced)", where=f"module {name or '<root>'} ({type(module).__name__})")
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise UnsupportedInputError(
                f"{type(module).__name__} {name!r} has sparse=True: ddlc trains with dense "
                "gradients only; give it sparse=False", where=f"module {name} ({type(module).__name__})")


@dataclass(frozen=True)
class _Batch:
    """The example batch: its tensors in order, their input keys, and how the model takes
    them (``model(*tensors)``, or ``model(**dict)`` for a keyword batch)."""

    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    keyword: bool

    @staticmethod
    def of(example_inputs) -> "_Batch":
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if isinstance(example_inputs, Mapping):
            keys, values, keyword = tuple(example_inputs), tuple(example_inputs.values()), True
        elif isinstance(example_inputs, (tuple, list)):
            values, keyword = tuple(example_inputs), False
            keys = tuple(f"input{i}" for i in range(len(values)))
        else:
            raise UnsupportedInputError("example_inputs must be a tensor, a tuple of tensors or a "
                                        f"dict of tensors, got {type(example_inputs).__name__}")
        if not values:
            raise UnsupportedInputError("example_inputs is empty: give the model's inputs")
        for key, t in zip(keys, values):
            if not isinstance(t, torch.Tensor):
                raise UnsupportedInputError(f"example input {key!r} is of type {type(t).__name__}; ddlc "
                                            "traces tensor inputs only (set other values on the "
                                            "model, e.g. its config, or bind them with "
                                            "functools.partial in a wrapper)")
        return _Batch(keys, values, keyword)

    def __len__(self) -> int:
        return len(self.keys)

    def call(self, model: nn.Module, state: Mapping[str, torch.Tensor], xs: Sequence[torch.Tensor],
             then: Callable = lambda out: out):
        """``then(model(...))``: the model on the first ``len(xs)`` inputs, and ``then`` (the
        loss) on its output, both with ``state`` as the model's parameters and buffers (as
        ``torch.func.functional_call`` puts them, tied weights tied): a loss that reads the
        model's parameters (an L2 penalty over ``model.parameters()``) reads the step's, as
        eager does, not constants of their values at compile. A buffer the forward assigns
        a new tensor is refused (:func:`_refuse_reassigned_buffers`)."""
        check = model.register_forward_hook(functools.partial(_refuse_reassigned_buffers, state=state))
        try:
            with _reparametrize_module(model, state, tie_weights=True):
                return then(model(**dict(zip(self.keys, xs))) if self.keyword else model(*xs))
        finally:
            check.remove()


def _refuse_reassigned_buffers(model: nn.Module, args, output, state: Mapping[str, torch.Tensor]) -> None:
    """After the model's forward (inside ``functional_call``, which puts the original
    buffers back after it): a buffer that now holds another tensor than the step gave it was
    assigned in forward (``self.last = h.mean(0)``). The step carries buffers updated in
    place, not reassigned ones, so every step would start from the value it had at compile."""
    for name, buffer in model.named_buffers():
        if name in state and buffer is not state[name]:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            raise UnsupportedInputError(
                f"the forward assigns buffer {name!r} a new tensor (self.{attr} = ...); the "
                "compiled step carries buffers the forward updates in place, and would start every "
                f"step from its value at compile: write it in place instead (self.{attr}.copy_(...)); "
                "where the forward sizes it on its first call only (timm's ConViT, a cache of "
                "positions), call the model once on the example batch before compile (under "
                "torch.no_grad())", where=_assignment_line(module, attr))


def _assignment_line(module: nn.Module, attr: str) -> str | None:
    """``file:line`` of the first line of ``module``'s forward that assigns ``self.attr``
    (``=`` or an augmented assignment), if its source can be read."""
    try:
        lines, start = inspect.getsourcelines(type(module).forward)
        filename = inspect.getsourcefile(type(module).forward)
    except (OSError, TypeError):
        return None
    assigns = re.compile(rf"\bself\.{re.escape(attr)}\s*(?:[-+*/@%&|^]|//|\*\*|<<|>>)?=(?!=)")
    for offset, line in enumerate(lines):
        if assigns.search(line):
            return f"{filename}:{start + offset}: {line.strip()}"
    return None


def _reparametrized(module: nn.Module, attr: str) -> bool:
    """Whether ``module.<attr>`` is what a forward pre-hook of torch's hook-based
    ``nn.utils.weight_norm`` or ``nn.utils.spectral_norm``, or of ``nn.utils.prune``,
    computes from the module's parameters and buffers before every call."""
    return any(recomputed_attribute(hook) == attr for hook in module._forward_pre_hooks.values())


def _may_be_state(value) -> bool:
    return isinstance(value, (*PLAIN, torch.Tensor))


def _aliased_modules(model: nn.Module) -> frozenset[int]:
    """The ``id`` of every submodule of ``model`` registered under more than one name."""
    seen = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    return frozenset(i for i, n in seen.items() if n > 1)


@contextlib.contextmanager
def _no_state_kept_across_calls(model: nn.Module, forward_again: Callable[[], None]):
    """Within, ``model``'s step is traced. Afterwards every module gets back the tensor
    attributes it had (tracing leaves traced values in what the forward assigns), and an
    attribute the forward changed that would move on at every call is refused: the step
    is traced once, so every step would run with its value at compile. Which those are:

    - a tensor attribute that does not require grad (``self.scale = self.scale * 1.5``);
      one that requires grad is the forward's own scratch, recomputed from parameters
      before it is read (``torch.nn.utils.spectral_norm``'s ``weight``): a step cannot
      carry autograd history to the next;
      In an inference program nothing requires grad: an attribute that torch's own
      hook-based ``nn.utils.weight_norm`` or ``spectral_norm`` computes from parameters
      before every call (:func:`_reparametrized`) is scratch too;
    - a number, string or flag that ``forward_again`` (the forward once more, on fake
      tensors) moves again (a counter, ``self.n += 1``). One that a second call leaves
      as the first did is a setting the forward makes before it reads it (BigBird
      switching to full attention on short sequences, Funnel's pooling bookkeeping): it
      keeps the value the forward gave it, as in eager. If the second call fails, the
      setting is taken as such.

    Other objects are not taken for state: torch's own modules reset their lists when
    their parameters are set (``nn.LSTM``'s weights, set again by ``functional_call``).
    A forward that replaces or adds a submodule, parameter or buffer changes the model on
    its first call (BigBird rebuilding its attention layer, whose construction draws random
    numbers eager draws once; a lazy module): refused, with the model given back what it
    had."""
    watch = ModelWatch(model)
    try:
        yield
    except BaseException:
        watch.restore_members()
        watch.restore_attributes()
        raise
    # torch's functional_call gives a module registered under two names (``self.b =
    # self.a``) back another tensor than it had: what it holds then is torch's doing, not
    # the forward's (the trace itself read the right ones), and is put back below
    structure = watch.member_change(skip=_aliased_modules(model))
    if structure is not None:
        watch.restore_members()
        watch.restore_attributes()
        raise UnsupportedInputError(
            f"the forward changes the model itself on this call: {structure} (a model that "
            "rebuilds a layer on its first call, as BigBird switching to full attention on short "
            "sequences, or a lazy module taking its shape). ddlc traces one call and would repeat "
            "that first call's work at every step: call the model once on the example batch "
            "before compile (under torch.no_grad()), so that compile traces the calls that follow")
    watch.restore_members()
    changed = [(name, attr, old, new) for name, attr, old, new in watch.attributes_changed()
               if _may_be_state(old) and _may_be_state(new)
               and not (isinstance(new, torch.Tensor) and new.requires_grad)
               and not _reparametrized(model.get_submodule(name), attr)]
    kept = [c for c in changed if isinstance(c[3], torch.Tensor)]
    settings = [c for c in changed if not isinstance(c[3], torch.Tensor)]
    if settings and not kept:
        try:
            forward_again()
            kept = [(name, attr, old, new) for name, attr, old, new in settings
                    if not _same_plain(vars(model.get_submodule(name)).get(attr), new)]
        except Exception:  # the forward does not run again on fake tensors: cannot tell
            kept = []
    watch.restore_attributes()
    if not kept:  # settings the forward makes before reading them stay as it made them
        for name, attr, _, new in settings:
            vars(model.get_submodule(name))[attr] = new
        return
    name, attr, old, new = kept[0]
    raise UnsupportedInputError(
        f"the forward changes {name + '.' if name else ''}{attr} ({describe(old)} -> {describe(new)}) "
        "at every call: ddlc traces the step once, so every step would run with its value at "
        "compile. Keep such state in a buffer updated in place "
        f"(self.register_buffer('{attr}', ...) in __init__, then self.{attr}.add_(1) or "
        f"self.{attr}.copy_(...)), which the compiled step carries",
        where=_assignment_line(model.get_submodule(name), attr))


@contextlib.contextmanager
def _as_compiling():
    """``torch.compiler.is_compiling()`` answers True while ddlc traces, as it does under
    non-strict ``torch.export`` (also a make_fx trace): libraries that branch on it take
    their traceable path. Hugging Face's mask code otherwise reads the attention mask's
    values (to skip an all-ones mask), which one static graph cannot do."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


@contextlib.contextmanager
def _without_generation_cache(model: nn.Module):
    """``use_cache=False`` on every config of ``model`` (a Hugging Face model and its
    sub-stacks, which keep their own copies) while tracing: a training step or a forward
    pass has no use for a generation cache, whose objects are not tensors."""
    configs = {id(c): c for m in model.modules()
               if hasattr(c := getattr(m, "config", None), "use_cache")}
    saved = {k: c.use_cache for k, c in configs.items()}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for k, c in configs.items():
            c.use_cache = saved[k]


@contextlib.contextmanager
def _inference_mode_as_no_grad():
    """``torch.inference_mode()`` inside the step (a block of the forward, a decorated
    helper: an EMA teacher's targets) runs as ``torch.no_grad()`` while ddlc traces: the
    same values, none tracked for the gradient, where real inference mode would make the
    trace's fake tensors inference tensors, which the transforms cannot carry (the trace
    failed: "Cannot set version_counter for inference tensor"). ``inference_mode(False)``
    changes nothing there. (Eager raises where an inference tensor is saved for backward,
    ``linear(inference_out)``; the trace does not.)"""
    cls = torch.autograd.grad_mode.inference_mode
    enter = cls.__enter__

    def as_no_grad(self):  # its __exit__ leaves whatever this entered
        self._inference_mode_context = torch.no_grad() if self.mode else contextlib.nullcontext()
        self._inference_mode_context.__enter__()

    cls.__enter__ = as_no_grad
    try:
        yield
    finally:
        cls.__enter__ = enter


class _WorldHiddenFromOneThread(c10d._World):
    """c10d's registry of process groups (``c10d._world``, its class swapped for this one
    while a step is traced) without its default group in the thread that traces:
    everything torch.distributed answers there is what a process without a process group
    gets, however the call is reached (``dist.is_initialized()``, a name imported from
    ``torch.distributed``, ``distributed_c10d``, ``dist.group.WORLD``). Other threads of
    the process (a user's logging thread) see the group as it is."""

    @property
    def default_pg(self):
        return None if threading.get_ident() == self._ddlc_tracing_thread else self._default_pg

    @default_pg.setter
    def default_pg(self, value):
        self._default_pg = value


#: what a process group or device mesh the model or loss holds answers about the world
#: (``(class, methods)``), refused while traced (:func:`_single_device_world`), as is every
#: torch.distributed call given such a group (each asks ``_rank_not_in_group`` first)
_HELD_GROUP_QUERIES = ((c10d, ("_rank_not_in_group",)), (c10d.ProcessGroup, ("size", "rank")),
                       (DeviceMesh, ("size", "get_group", "get_rank", "get_local_rank", "get_coordinate")))


@contextlib.contextmanager
def _single_device_world():
    """The step is traced as the single-device model runs: in a process without a process
    group (:class:`_WorldHiddenFromOneThread`). ``torch.distributed.is_initialized()``
    answers False meanwhile, so code written for both worlds takes its one-device path
    (Hugging Face's FLAVA contrastive head and DETR-style losses gather or reduce across
    ranks where a group exists, which would count the batch again on a global batch, and
    ddlc places the step's communication itself), and a call that needs the group (the
    rank, the world size, a collective) fails as it would there, refused at the user's
    line (:func:`_process_group_call`). A group or device mesh made before (held by the
    model or loss, or global) still exists: its queries and collectives
    (:data:`_HELD_GROUP_QUERIES`) are refused at the user's line in the tracing thread
    (a size read from it scaled the loss by the world size; a collective on it waited for
    ranks that do not trace). Environment variables (torchrun's ``WORLD_SIZE``) are the
    process's: a forward reading them reads the compiled world's."""
    world = c10d._world
    if type(world) is not c10d._World:  # another trace in this process holds it (or torch changed)
        yield
        return
    tracing = threading.get_ident()

    def refused_here(owner, name, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            if threading.get_ident() != tracing:
                return original(*args, **kwargs)
            # a module's guard names the torch.distributed function that asks it
            what = f"{owner.__name__}.{name}()" if isinstance(owner, type) else \
                f"torch.distributed.{sys._getframe(1).f_code.co_name}()"
            raise graph_checks.process_group_call(what, sources.caller())
        return call

    # as the owner holds them (a class's descriptors unbound, which setattr puts back as they were)
    saved = [(owner, name, vars(owner)[name]) for owner, names in _HELD_GROUP_QUERIES for name in names]
    world._ddlc_tracing_thread = tracing
    world.__class__ = _WorldHiddenFromOneThread
    for owner, name, original in saved:
        setattr(owner, name, refused_here(owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        world.__class__ = c10d._World
        del world._ddlc_tracing_thread


def _process_group_call(e: BaseException) -> str | None:
    """The torch.distributed function a failed trace called without the process group
    that :func:`_single_device_world` hides (``"torch.distributed.get_world_size()"``),
    or None where ``e`` is no such failure."""
    if not (isinstance(e, (ValueError, RuntimeError)) and re.search(
            r"process group has not been initialized|is not supported under torch\.compile", str(e))):
        return None  # (torch.distributed.nn's autograd collectives refuse what compiles, as ddlc's trace does)
    for frame in traceback.extract_tb(e.__traceback__):
        path = frame.filename.replace("\\", "/")
        if "/torch/distributed/" in path and not path.endswith("/c10d_logger.py"):  # its decorator
            module = path.rsplit("/torch/distributed/", 1)[1].removesuffix(".py").replace("/", ".")
            module = "" if module in ("distributed_c10d", "__init__") else f".{module}"
            return f"torch.distributed{module}.{frame.name}()"
    return "torch.distributed" if "initialized" in str(e) else None


@contextlib.contextmanager
def _causal_masks_taken_as_given():
    """``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` given a mask and no
    ``is_causal`` compare the mask's values with a causal mask to choose a kernel
    (``_detect_is_causal_mask``: ``bool((mask == causal).all())``), which one static graph
    cannot do. Within, the mask is taken as given (not detected causal): the attention
    applies it, which computes what the causal kernel computes for a causal mask, and the
    mask itself for any other."""
    detect = transformer_module._detect_is_causal_mask
    transformer_module._detect_is_causal_mask = lambda mask, is_causal=None, size=None: is_causal is True
    try:
        yield
    finally:
        transformer_module._detect_is_causal_mask = detect


@contextlib.contextmanager
def _batch_norms_traceable():
    """Batch norm layers run as torch's ``_BatchNorm.forward`` does, in two forms one
    static graph can hold:

    - ``nn.SyncBatchNorm`` as the batch norm it is. Under DDP it reduces the statistics of
      every rank's part of the batch; ddlc traces the step on the global batch, and a plan
      that splits it sums the statistics across ranks itself, so its BatchNorm already
      normalizes as SyncBatchNorm does (SyncBatchNorm's own forward refuses a CPU tensor
      and calls collectives of its own).
    - ``momentum=None`` in training (a cumulative average of the statistics): torch's factor
      ``1.0 / float(num_batches_tracked)`` reads the count's value into Python. It is
      computed as a 0-d float64 tensor of the count instead, which ``F.batch_norm``'s
      rewrite (:mod:`ddlc.forward_rewrites`) takes as its momentum, so every step reads the
      count it has reached."""
    forward, sync = nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward

    def traceable(self, input):
        if not (self.momentum is None and self.training and self.track_running_stats
                and self.num_batches_tracked is not None):
            return forward(self, input)
        self._check_input_dim(input)
        self.num_batches_tracked.add_(1)
        factor = 1.0 / self.num_batches_tracked.to(torch.float64)
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            True, factor, self.eps)

    nn.modules.batchnorm._BatchNorm.forward = nn.SyncBatchNorm.forward = traceable
    try:
        yield
    finally:
        nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward = forward, sync


def _loss_of(out, loss_fn: Callable | None, targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """The step's loss: ``loss_fn(out, *targets)``, or the model's own (``out`` itself, its
    ``.loss`` or ``["loss"]``, or a scalar first element of a tuple); any one-element
    tensor, as eager's ``backward()`` takes (``(1,)``, as code written for
    ``nn.DataParallel`` returns)."""
    if loss_fn is not None:
        loss, what = loss_fn(out, *targets), "loss_fn"
    else:
        what = "the model (compiled without loss_fn, so its output must hold the loss)"
        loss = out
        if isinstance(out, Mapping) and "loss" in out:
            loss = out["loss"]
        elif not isinstance(out, torch.Tensor) and getattr(out, "loss", None) is not None:
            loss = out.loss
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].ndim == 0:
            loss = out[0]
        if loss is None or (not isinstance(loss, torch.Tensor) and hasattr(out, "loss")):
            raise UnsupportedInputError(
                f"{what} returned {type(out).__name__} with loss=None: give the model the "
                "batch entry it computes the loss from (e.g. labels=...), or pass a loss_fn")
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else \
            f"a {type(loss).__name__}" + (f" of {len(loss)}" if isinstance(loss, (tuple, list)) else "")
        raise UnsupportedInputError(f"{what} must return a one-element loss tensor, got {got}")
    if not loss.is_floating_point():
        raise UnsupportedInputError(
            f"{what} returned a {loss.dtype} loss, which has no gradient (a count or an accuracy: "
            "eager's loss.backward() raises on it); return a floating-point loss")
    return loss


def _flatten_output(out) -> tuple[list[torch.Tensor], OutputTree]:
    """The tensors of a forward's output (a tensor, tuple, dict, dataclass or
    ``ModelOutput``) and the tree that rebuilds it; a leaf that is neither a tensor nor a
    plain constant (a generation cache object) is refused by name."""
    leaves, spec = tree_flatten(dataclasses_as_nodes(out))
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *PLAIN)):
            raise UnsupportedInputError(
                f"the model's output holds a {type(leaf).__name__}, which is not a tensor; a "
                "compiled program returns tensors only (for a generation cache, pass "
                "use_cache=False)")
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    constants = tuple(None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    is_tensor = tuple(isinstance(leaf, torch.Tensor) for leaf in leaves)
    return tensors, OutputTree(spec, constants, is_tensor)


def _clip_by_global_norm(grads: Mapping[str, torch.Tensor], max_norm: float):
    """``torch.nn.utils.clip_grad_norm_`` as pure ops: the 2-norm over all gradients
    (one sum of squares: on a sharded gradient a partial sum, reduced across the mesh; a
    complex gradient's real and imaginary parts, float64 gradients' in float64, the others'
    in float32), and every gradient scaled by ``min(1, max_norm / (norm + 1e-6))``."""
    def squares(g: torch.Tensor) -> torch.Tensor:
        parts = torch.view_as_real(g) if g.is_complex() else g
        parts = parts.to(torch.float64 if parts.dtype == torch.float64 else torch.float32)
        return (parts * parts).sum()
    total = torch.stack([squares(g) for g in grads.values()]).sum().sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    return total, {k: g * scale.to(g.dtype) for k, g in grads.items()}


_TARGET_NAMES = ("labels", "label", "targets", "target")


def _warn_of_targets_given_to_the_model(batch: "_Batch", n_targets: int) -> None:
    """A dict batch with a ``loss_fn`` gives the loss its last ``n_targets`` entries and the
    model the rest, by order: warn where an entry named like a target (``labels``) goes to
    the model, as a collator or ``datasets.map`` that puts it first does (the loss then takes
    ``attention_mask``, whose 0s and 1s are valid classes: it trains, on the wrong target)."""
    if not (batch.keyword and n_targets):
        return
    given = [k for k in batch.keys[:len(batch) - n_targets] if k in _TARGET_NAMES]
    if given:
        targets = list(batch.keys[len(batch) - n_targets:])
        warnings.warn(f"the dict batch's entry {given[0]!r} goes to the model, and loss_fn's target(s) are "
                      f"the last {n_targets} entr{'y' if n_targets == 1 else 'ies'}, {targets}, of "
                      f"{list(batch.keys)}: if {given[0]!r} is the target, order the dict so that it comes "
                      "last", UserWarning, stacklevel=4)


@contextlib.contextmanager
def _targets_named(batch: "_Batch", n_targets: int):
    """Within, a trace error of a step on a dict batch with targets also names the entries
    taken as the targets: the last ``n_targets`` of the dict, by order (a collator that puts
    ``labels`` first makes ``attention_mask`` the target, and ``labels`` a model input)."""
    try:
        yield
    except TraceError as error:
        if not (batch.keyword and n_targets):
            raise
        message = str(error)
        if error.where:
            message = message.removesuffix(f"\n  at {error.where}")
        targets = list(batch.keys[len(batch) - n_targets:])
        raise type(error)(f"{message} [the loss_fn's target(s): the dict batch's last {n_targets} "
                          f"entr{'y' if n_targets == 1 else 'ies'} {targets}, of {list(batch.keys)}; "
                          "order the dict so that the targets come last]", where=error.where) from error


def _refuse_resized_buffers(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> None:
    """A buffer the forward resizes in place (``resize_``: torch.ao's fake-quantize modules
    size their per-channel statistics on their first call) would be resized, and refilled,
    at every step of the traced program, where eager does it once: refused."""
    for key, value in before.items():
        if tuple(after[key].shape) != tuple(value.shape):
            raise UnsupportedInputError(
                f"the forward resizes buffer {key} from {tuple(value.shape)} to {tuple(after[key].shape)} "
                "(torch.ao's fake-quantize and observer modules size their statistics on their first "
                "call): the step would do it at every step, where eager does it once. Call the model "
                "once on the example batch before ddlc.compile", where=f"buffer {key}")


def _refuse_complex_value_clipping(trainable: Mapping[str, torch.Tensor]) -> None:
    """``clip_grad_value_`` clamps each gradient, which torch does not define for complex
    numbers (its clamp raises): refused, naming the parameters."""
    complex_ = [k for k, p in trainable.items() if p.is_complex()]
    if complex_:
        raise UnsupportedInputError(
            f"clip_grad_value clamps gradients, which torch does not do for complex parameters "
            f"({', '.join(complex_)}): clip them by norm (clip_grad_norm=) or freeze them")


#: in-place operators that change only a tensor's metadata, which functionalization leaves in
#: an inference trace (``torch.stft``'s ``transpose_`` of its result) -> their functional forms
_METADATA_UPDATES = {torch.ops.aten.transpose_.default: torch.ops.aten.transpose_copy.int,
                     torch.ops.aten.t_.default: torch.ops.aten.t_copy.default,
                     torch.ops.aten.unsqueeze_.default: torch.ops.aten.unsqueeze_copy.default,
                     torch.ops.aten.squeeze_.dim: torch.ops.aten.squeeze_copy.dim}


def _functional_metadata_updates(gm: fx.GraphModule) -> None:
    """Replace each in-place metadata update ``y = transpose_(x, ...)`` by its functional
    form, read instead of ``x`` from there on (the update's result is ``x`` itself, with the
    new metadata): the passes run every node on fake or meta tensors, where the in-place
    form would change the value recorded for ``x``."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        functional = _METADATA_UPDATES.get(node.target) if node.op == "call_function" else None
        if functional is None:
            continue
        source = node.args[0]
        with gm.graph.inserting_before(node):
            made = gm.graph.call_function(functional, node.args, node.kwargs)
        made.meta = dict(node.meta)
        node.replace_all_uses_with(made)
        source.replace_all_uses_with(made, delete_user_cb=lambda user: order.get(user, -1) > order[node])
        gm.graph.erase_node(node)
    gm.graph.lint()


def _drop_unchanged_buffers(gm: fx.GraphModule, inputs: Sequence[InputSpec],
                            outputs: Sequence[OutputSpec]) -> list[OutputSpec]:
    """Remove the buffer outputs that are only a copy of their input (buffers the step does
    not update) from the graph's outputs; return the remaining output specs."""
    placeholder = {i.key: i.name for i in inputs if i.role == "buffer"}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    keep = []
    for spec, value in zip(outputs, values):
        copy_of = value
        while isinstance(copy_of, fx.Node) and copy_of.target in _COPIES:
            copy_of = copy_of.args[0]
        unchanged = spec.role == "buffer" and isinstance(copy_of, fx.Node) \
            and copy_of.name == placeholder[spec.key]
        keep.append(not unchanged)
    output.args = (tuple(v for v, k in zip(values, keep) if k),)
    gm.graph.eliminate_dead_code()
    return [s for s, k in zip(outputs, keep) if k]


_COPIES = (torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.alias_copy.default)


def _bind_reads_in_backward(gm: fx.GraphModule, model: nn.Module, inputs: Sequence[InputSpec],
                            outputs: Sequence[OutputSpec]) -> None:
    """A hook on an activation's gradient that reads a parameter or buffer through the
    module (``h.register_hook(lambda g: g * self.scale)``) runs while the backward is
    traced, after the forward's reparametrization ended: it reads the real tensor, which
    make_fx keeps as a constant of its value at compile. Eager reads the tensor's value at
    that moment, and no gradient flows through what a hook computes: the step's parameter
    (its update comes after the backward), or the buffer's value after the forward's
    in-place updates. So a constant that is one of the model's tensors and that only
    backward nodes read becomes that value: the parameter's or buffer's placeholder, or the
    buffer's value the step returns. Read anywhere else (a reference kept before compile,
    read by the forward or the loss), it stays, and
    :func:`graph_checks.no_captured_parameters` refuses it."""
    if not gm.graph.find_nodes(op="get_attr"):
        return
    key_of = {id(t): k for k, t in [*model.named_parameters(), *model.named_buffers()]}
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    value_of = {i.key: placeholders[i.name] for i in inputs if i.role in ("param", "buffer")}
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value_of.update((o.key, v) for o, v in zip(outputs, output.args[0]) if o.role == "buffer")
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.find_nodes(op="get_attr")):
        value = value_of.get(key_of.get(id(getattr(gm, node.target, None))))
        in_backward = node.users and all((u.meta.get("custom") or {}).get("ddlc_phase") == "backward"
                                         for u in node.users)
        if value is not None and in_backward and all(position[value] < position[u] for u in node.users):
            node.replace_all_uses_with(value)
            gm.graph.erase_node(node)
            if not any(n.target == node.target for n in gm.graph.find_nodes(op="get_attr")):
                delattr(gm, node.target)  # the real tensor, no longer read


class _ModuleAnnotator:
    """Forward hooks that stamp the current module path and phase on new nodes, and the
    activation-checkpointed call they run in (:meth:`checkpointed`)."""

    def __init__(self, model: nn.Module):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.current_phase = "forward"
        self.regions = 0        # checkpointed calls entered so far
        self.region: int | None = None  # the outermost one running now
        self.fresh_draws: set[int] = set()  # regions whose recomputation draws afresh in eager
        self.grad_fn: int | None = None  # the autograd node whose backward runs now
        self.graph: fx.Graph | None = None  # the graph being traced, once backward starts

    def phase(self, name: str) -> None:
        self.current_phase = name
        self._publish()

    def _publish(self):
        forward = self.current_phase == "forward"
        module = self.stack[-1] if self.stack and forward else None
        fx_traceback.current_meta["custom"] = {"ddlc_phase": self.current_phase, "ddlc_module": module,
                                               "ddlc_recompute": self.region if forward else None,
                                               "ddlc_grad_fn": None if forward else self.grad_fn}

    def watch_backward(self, loss: torch.Tensor) -> None:
        """Stamp each backward node with the sequence number of the autograd node whose
        backward made it: a forward node's ``meta["seq_nr"]`` is the sequence number of the
        autograd node its op created, so the two meet in :func:`_annotate_origins` (as
        aot_autograd pairs them). Hooks on every node of ``loss``'s autograd graph set the
        number before the node's backward runs and clear it after; what the autograd engine
        runs between nodes (summing a tensor's gradients from several readers) gets none."""
        mode = proxy_tensor.get_proxy_mode()
        self.graph = mode.tracer.graph if mode is not None else None
        root = loss.grad_fn if isinstance(loss, torch.Tensor) else None
        seen, todo = set(), [root] if root is not None else []
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            node.register_prehook(functools.partial(self._entered, node._sequence_nr()))
            node.register_hook(self._left)
            todo.extend(fn for fn, _ in node.next_functions if fn is not None)

    def backward_source(self) -> str | None:
        """The user's line of the forward op whose backward runs now (where tracing fails
        inside backward, whose frames are torch's alone), else None."""
        if self.grad_fn is None or self.graph is None:
            return None
        forward = next((n for n in self.graph.nodes if n.meta.get("seq_nr") == self.grad_fn
                        and (n.meta.get("custom") or {}).get("ddlc_phase") == "forward"), None)
        if forward is None:
            return None
        return sources.source_from_stack(forward.meta.get("stack_trace")) or None

    def _entered(self, sequence_nr: int, grad_outputs) -> None:
        self.grad_fn = sequence_nr
        self._publish()

    def _left(self, grad_inputs, grad_outputs) -> None:
        self.grad_fn = None
        self._publish()

    @contextlib.contextmanager
    def checkpointed(self, preserve_rng_state: bool = True):
        """Within, new forward nodes belong to a new checkpointed region (a call nested in
        another stays in the outer one, whose recomputation covers it). Without
        ``preserve_rng_state``, eager's recomputation of the region draws new random
        numbers (see :func:`graph_checks.checkpointed_draws`)."""
        outer = self.region
        if outer is None:
            self.region, self.regions = self.regions, self.regions + 1
            self._publish()
        if not preserve_rng_state:
            self.fresh_draws.add(self.region)
        try:
            yield
        finally:
            self.region = outer
            self._publish()

    def pre(self, module, args):
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])
            self._publish()

    def post(self, module, args, out):
        if id(module) in self.names:
            self.stack.pop()
            self._publish()


#: torch's error for a custom autograd Function (or a custom op's autograd formula) under torch.func
_CUSTOM_FUNCTION = re.compile(r"autograd\.Function .*setup_context|custom_function_call", re.I)

#: torch's errors for a read of a tensor's value while tracing
_DATA_DEPENDENT = re.compile(r"data.dependent|GuardOnDataDependent|DataDependentOutput|Could not guard on|"
                             r"item\(\)|tolist\(\)|unallocated storage|aten\._local_scalar_dense", re.I)

#: What torch's errors while tracing mean, first match wins: (pattern, error type, cause).
#: "The example inputs may not match the model" is said only for shape errors.
_CAUSES = (
    (re.compile(r"SymIntArrayRef expected to contain only concrete integers|"
                r"data-dependent expression u\d+ .*\(Size-like symbols: u\d", re.I | re.S), TraceError,
     "the step computes a tensor whose size depends on tensor values (a boolean-mask index "
     "`x[mask]`, `nonzero`, `masked_select`: made at or before this line), and an operator, or its "
     "gradient, needs that size as a number (a mean over it, a layer's shape check), which one "
     "static graph cannot plan; write it with a fixed size, e.g. "
     "`torch.where(mask, loss, 0).sum() / mask.sum()` for `loss[mask].mean()`"),
    (_DATA_DEPENDENT, TraceError,
     "the model has data-dependent Python control flow or reads a tensor's value (e.g. "
     "`if x.sum() > 0`, `.item()`, `.tolist()`; or an operator it calls checks its input's "
     "values, as torch.istft checks its window's overlap-add and scatter_reduce's 'prod' its "
     "counts), which one static graph cannot express"),
    (_CUSTOM_FUNCTION, UnsupportedInputError,
     "the model calls a custom torch.autograd.Function, which ddlc cannot trace in either "
     "style (an old-style forward(ctx, ...) cannot run under torch.func; with setup_context, "
     "torch's functionalization has no rule for it): write that function with plain tensor "
     "operations (a straight-through estimator: x + (torch.round(x) - x).detach())"),
    (re.compile(r"mutating directly with `\.data`", re.I), UnsupportedInputError,
     "the forward sets a tensor's .data (nn.Module.to(), .float() or .half() called inside "
     "forward do, even when nothing changes: SwitchTransformers' router converts its "
     "classifier so), which the torch.func transforms ddlc traces with refuse: convert the "
     "module once before ddlc.compile and leave the call out of forward"),
    (re.compile(r"saved tensor hooks", re.I), UnsupportedInputError,
     "the model uses a saved-tensor hook (torch.autograd.graph.saved_tensors_hooks, "
     "save_on_cpu: activation offloading), which the torch.func transforms ddlc traces with "
     "cannot run: leave it out (ddlc keeps activations within memory_budget= by its plan; "
     "activation checkpointing, torch.utils.checkpoint with use_reentrant=False, is "
     "recomputed in the graph)"),
    (re.compile(r"attempting to call Tensor\.requires_grad_\(\) \(or perhaps using torch\.autograd\.functional", re.I),
     UnsupportedInputError,
     "the step calls torch.autograd.functional (vjp, jvp, hvp, vhp, jacobian, hessian) or "
     "requires_grad_() inside a torch.func transform of its own: those mark their inputs with "
     "requires_grad_(), which the torch.func transforms ddlc traces with refuse; use "
     "torch.func's own (torch.func.vjp, jvp, jacrev, jacfwd, hessian), which trace"),
    (re.compile(r"differentiated Tensors does not require grad|does not require grad and does not have a "
                r"grad_fn", re.I), UnsupportedInputError,
     "the model calls torch.autograd.grad with respect to a tensor that carries no gradient in "
     "ddlc's trace: one it marks with requires_grad_() inside the step (a gradient penalty on "
     "the input batch; forces as the gradient of an energy), or any tensor in an inference "
     "program (no loss_fn and no optimizer: nothing requires a gradient). Under the torch.func "
     "transforms ddlc traces with, only a training step's parameters carry gradients and "
     "requires_grad_() does nothing: take the gradient with torch.func.grad "
     "(g = torch.func.grad(lambda x: energy(x).sum())(x)), or, in a training step, with "
     "respect to an activation the parameters produce, which ddlc traces"),
    (re.compile(r"mutate a captured Tensor", re.I), UnsupportedInputError,
     "the model updates in place a tensor that is not one of its buffers: an input of the "
     "step (`x.mul_(2)` on the batch: write `x = x * 2`), a frozen parameter "
     "(requires_grad=False, e.g. the weights of an EMA or momentum teacher), a tensor "
     "attribute or a global; ddlc carries in-place updates of buffers only: keep such state "
     "in buffers (register_buffer), which the step updates as eager does (running "
     "statistics, EMA teachers, queues)"),
    (re.compile(r"tuple of ints, ?but (?:got|found element of type) Tensor", re.I), TraceError,
     "the step passes a tensor where torch takes a size as numbers, a size computed from tensor "
     "values (pack_padded_sequence's batch sizes from the lengths, torch.zeros(lengths.max())), "
     "which one static graph cannot express: pad to a fixed length and mask the padding instead "
     "(nn.LSTM over the padded batch, its outputs masked)"),
    (re.compile(r"dtype|scalar type|type \(.*\) and .* type \(.*\) should be the same", re.I), TraceError,
     "the example inputs' dtypes do not fit the model (an integer tensor fed into a float "
     "layer, or a float64 or bfloat16 one into a float32 layer?)"),
    (re.compile(r"shape|size|dim|mat1 and mat2", re.I), TraceError,
     "the example inputs may not match the model (or, where eager runs the model on them, its "
     "code fails on the path libraries take while compiling: torch.compiler.is_compiling() is "
     "True while ddlc traces, as under torch.compile and torch.export)"),
)


def _run_eagerly(forward: Callable[[], object], annotator: _ModuleAnnotator, model: nn.Module) -> None:
    """``forward`` (the step's forward and loss on the real state and batch) without
    gradients (the memory of one forward's activations at most), in the setting
    :func:`_make_fx` traces the step in (what it asks of torch.distributed, batch norm and
    checkpoints answered alike), and outside torch.func's transforms, which draw dropout's
    mask otherwise than eager: :func:`ddlc.rng.eager_layouts` records which tensors
    eager's random fills fill (a forward that draws otherwise without gradients pairs
    with none of the trace's draws, and the trace's layouts are taken)."""
    with torch.no_grad(), _as_the_step_runs(annotator, model):
        forward()


@contextlib.contextmanager
def _as_the_step_runs(annotator: _ModuleAnnotator, model: nn.Module):
    """The setting the step runs in, traced (:func:`_make_fx`) or eagerly
    (:func:`_run_eagerly`): compiling (``torch.compiler.is_compiling()``), no generation
    cache, checkpoints as regions, batch norms traceable, inference mode as
    ``no_grad``, a world of one process, failed kernels unlogged, transformer masks taken
    as given, distributions unchecked unless asked."""
    with _as_compiling(), _without_generation_cache(model), _checkpoints_as_regions(annotator), \
            _batch_norms_traceable(), _inference_mode_as_no_grad(), _single_device_world(), \
            _failed_kernels_unlogged(), _causal_masks_taken_as_given(), _distributions_unchecked():
        yield


@contextlib.contextmanager
def _distributions_unchecked():
    """``torch.distributions`` distributions made without ``validate_args`` do not check
    their arguments, nor the values given to ``log_prob``: each check reads the values into
    Python (``constraint.check(value).all()``), which one static graph cannot hold, and a
    check that passes changes no number (RL's ``Categorical(logits=...).log_prob(actions)``,
    a VAE's ``Normal(mu, std).rsample()``). As under ``torch.compile``, whose first use
    turns the default off for the rest of the process; here only while the step is traced.
    Values eager would refuse (a negative scale) then go through unchecked. A distribution
    given ``validate_args=True`` still checks, and is refused naming the fix."""
    default = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(default)


def _make_fx(fn, flat, annotator: _ModuleAnnotator, batch: Sequence[torch.Tensor],
             model: nn.Module, loss_fn: Callable | None, remove: str = "mutations_and_views") -> fx.GraphModule:
    hooks = [module_mod.register_module_forward_pre_hook(annotator.pre),
             module_mod.register_module_forward_hook(annotator.post)]
    try:
        # a lazy graph module generates its Python code when first run or printed: the
        # passes rewrite the graph many times before anything runs it (0.25 s a time on a
        # GPT-2-small step)
        with fx_traceback.preserve_node_meta(), _forward_frames_only(), _loss_frames_kept(loss_fn), \
                _use_lazy_graph_module(True), _as_the_step_runs(annotator, model), rng.reseeds_refused():
            # a tensor the forward or loss captures from outside the model (class weights
            # in a global) becomes a constant of the graph
            return make_fx(functionalize(fn, remove=remove), tracing_mode="fake",
                           record_stack_traces=True, _allow_non_fake_inputs=True)(*flat)
    except (UnsupportedInputError, TraceError):
        raise
    except Exception as e:  # torch raises many types; name the cause and the user's line
        line = sources.user_frame(e) or annotator.backward_source()
        text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        custom = sources.custom_operator(e)
        if custom is not None and _CUSTOM_FUNCTION.search(f"{type(e).__name__} {e}"):
            raise UnsupportedInputError(
                f"the model calls the custom operator {custom} (a torch.library op with its own "
                "autograd formula), which the torch.func transforms ddlc traces with cannot "
                "differentiate: write it with plain tensor operations, or, where a library picks "
                "it, configure another implementation (transformers' mixture-of-experts layers "
                "pick transformers::grouped_mm_fallback while compiling: "
                "model.set_experts_implementation('batched_mm'), or experts_implementation="
                f"'batched_mm' given to the config's constructor or from_pretrained, traces) ({text})",
                where=line) from e
        if sources.torch_compiled_call(e):
            raise UnsupportedInputError(
                "the step calls a function compiled with torch.compile, which cannot run inside the "
                "trace ddlc makes of the whole step: call the function itself (torch.compile(f) "
                "keeps it as ._torchdynamo_orig_callable); ddlc compiles the whole step, and "
                f"compile(..., backend='inductor') runs each rank's program through Inductor ({text})",
                where=line) from e
        called = _process_group_call(e)
        if called is not None:
            raise graph_checks.process_group_call(called, line) from e
        function = sources.autograd_function(e)
        if function is not None and "c10d" in function.__qualname__:  # a functional collective's
            raise graph_checks.process_group_call(f"a functional collective ({function.__qualname__})", line) from e
        if function is torch.nn.modules._functions.BackwardHookFunction:
            raise UnsupportedInputError(
                "the forward registers a backward hook on a module (register_full_backward_hook "
                "or register_full_backward_pre_hook), which torch runs through an autograd.Function "
                "the torch.func transforms ddlc traces with cannot run: register a hook on the "
                f"activation's gradient instead (h.register_hook(...) inside forward is traced) ({text})",
                where=line) from e
        if function is not None and function.__module__.startswith("torch.") \
                and _CUSTOM_FUNCTION.search(f"{type(e).__name__} {e}"):
            raise UnsupportedInputError(
                f"the step calls torch's own autograd.Function {function.__module__}.{function.__qualname__} "
                "(torch.distributions samples Beta, Dirichlet and Gamma distributions through one), which "
                "the torch.func transforms ddlc traces with cannot run: draw the number with torch.rand, "
                f"torch.randn or torch.randint, or pass it in as an example input ({text})", where=line) from e
        if sources.validating_distribution(e) and _DATA_DEPENDENT.search(f"{type(e).__name__} {e}"):
            raise TraceError(
                "a torch.distributions distribution given validate_args=True checks the values of "
                "its arguments (or of a value given to log_prob), which one static graph cannot "
                "express: leave validate_args out, or pass validate_args=False "
                f"({text})", where=line) from e
        if isinstance(e, DynamicOutputShapeException):
            raise UnsupportedInputError(
                f"the step calls {e.func}, an operator whose output size torch cannot tell without "
                "running it (it has no shape rule for tracing, as aten._ctc_loss of F.ctc_loss has "
                "none), so ddlc cannot trace it into one static graph", where=line) from e
        for pattern, error, cause in _CAUSES:
            if pattern.search(f"{type(e).__name__} {e}"):
                inputs = graph_checks.describe_tensors(batch)
                inside = sources.torch_module_frame(e) if pattern is _DATA_DEPENDENT else None
                if inside is not None:  # a torch layer reading a value (FakeQuantize's observer flag)
                    cause = f"{cause}; the value is read in torch's {inside}"
                raise error(f"{cause}; the example inputs are {inputs} ({text})", where=line) from e
        raise TraceError(f"tracing the step failed ({text})", where=line) from e
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def _failed_kernels_unlogged():
    """Within, torch's fake tensor mode does not log a kernel that fails (its traceback, at
    ERROR, before it raises the error): the trace raises that error as a ddlc error naming
    its cause and the user's line, and the log would bury it."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


@contextlib.contextmanager
def _checkpoints_as_regions(annotator: _ModuleAnnotator):
    """Within, ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``, as Hugging
    Face's ``gradient_checkpointing_enable`` calls it) runs its function directly, its
    nodes marked as one region (:meth:`_ModuleAnnotator.checkpointed`), whose values
    ``passes.recompute`` then recomputes for the backward pass as eager does. Eager's
    saved-tensor hooks cannot run under the torch.func transforms ddlc traces with; the
    reentrant variant (an old-style autograd Function, which gives no gradient to the
    parameters inside when no input of the call requires one) is refused."""
    import torch.utils.checkpoint as checkpoint_module

    def without_reentrant(fn, preserve_rng_state=True, context_fn=checkpoint_module.noop_context_fn,
                          *args, **kwargs):
        with annotator.checkpointed(preserve_rng_state):  # checkpoint runs fn between two next() calls
            yield

    class Reentrant:
        @staticmethod
        def apply(*args):
            raise UnsupportedInputError(
                "the model calls torch.utils.checkpoint with use_reentrant=True, which runs "
                "the block in an old-style autograd Function that ddlc cannot trace; pass "
                "use_reentrant=False (Hugging Face's gradient_checkpointing_enable does by "
                "default): ddlc then recomputes the block's activations in backward",
                where=sources.caller())

    saved = checkpoint_module._checkpoint_without_reentrant_generator, checkpoint_module.CheckpointFunction
    checkpoint_module._checkpoint_without_reentrant_generator = without_reentrant
    checkpoint_module.CheckpointFunction = Reentrant
    try:
        yield
    finally:
        checkpoint_module._checkpoint_without_reentrant_generator, checkpoint_module.CheckpointFunction = saved


class _ForwardFrames:
    """A cheap stand-in for ``torch.utils._traceback.CapturedTraceback`` while ddlc traces.

    With ``record_stack_traces=True`` make_fx captures and symbolizes the whole Python
    stack for every node (a millisecond each), then keeps only the frames of functions
    named ``forward`` (and ``torch/__init__.py``'s and registered anchors'), minus
    torch's internal files (``_filter_traceback_frames``). This walks the live frames
    and builds the summary of just the frames that filter can keep, so the node's
    ``stack_trace`` text is the same and the rest of the stack costs nothing."""

    __slots__ = ("frames",)

    def __init__(self, frames):
        self.frames = frames

    @staticmethod
    def extract(*, script=False, cpp=False, skip=0):
        anchors = getattr(fx_proxy, "_STACK_TRACE_ANCHORS", ())
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "forward" or code.co_filename.endswith("torch/__init__.py") \
                    or (code.co_filename, code.co_name) in anchors:
                frames.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        return _ForwardFrames(frames)

    def summary(self) -> traceback.StackSummary:
        stack = traceback.StackSummary()
        for filename, lineno, name in reversed(self.frames):  # outermost first
            stack.append(traceback.FrameSummary(filename, lineno, name))
        return stack


@contextlib.contextmanager
def _forward_frames_only():
    """make_fx records node stack traces through :class:`_ForwardFrames` (when this torch
    records them the way it was written against: ``torch.fx.proxy.CapturedTraceback``
    with forward-only filtering; otherwise torch's own capture runs)."""
    original = getattr(fx_proxy, "CapturedTraceback", None)
    if original is None or not hasattr(fx_proxy.TracerBase, "_record_forward_stack_traces_only"):
        yield
        return
    fx_proxy.CapturedTraceback = _ForwardFrames
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = original


@contextlib.contextmanager
def _loss_frames_kept(loss_fn: Callable | None):
    """Within, node stack traces keep the frames of the function ``loss_fn`` besides those
    of ``forward``s (it is a stack-trace anchor of torch.fx), so that an error in the loss
    names the user's line."""
    anchors = getattr(fx_proxy, "_STACK_TRACE_ANCHORS", None)
    code = getattr(loss_fn, "__code__", None)
    anchor = (code.co_filename, code.co_name) if code is not None else None
    added = anchors is not None and anchor is not None and anchor not in anchors
    if added:
        anchors.add(anchor)
    try:
        yield
    finally:
        if added:
            anchors.discard(anchor)


def _rename_placeholder(node: fx.Node, spec: InputSpec) -> str:
    prefix = {"param": "p", "buffer": "buf", "opt_state": "st", "hparam": "hp", "input": ""}[spec.role]
    name = re.sub(r"\W", "_", f"{prefix}_{spec.key}" if prefix else spec.key)
    node._rename(name)
    node.target = node.name
    return node.name


def _annotate_origins(gm: fx.GraphModule, inputs: Sequence[InputSpec],
                      annotator: _ModuleAnnotator) -> None:
    """Record an Origin per node, and the checkpointed region of a forward node traced in
    one (``ir.RECOMPUTE``). A backward node made by an autograd node's backward takes the
    module and source line of the forward op that created that autograd node (the two
    share its sequence number: :meth:`_ModuleAnnotator.watch_backward`). Other nodes
    borrow an input's origin: a backward node (the engine summing a tensor's gradients)
    that of its latest-computed input, where the sum completes; an optimizer node (or
    a forward op outside any module) that of its first forward-phase input (a parameter
    or an activation), else of its first input."""
    by_name = {i.name: i for i in inputs}
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    forward_origin: dict[int, Origin] = {}  # autograd sequence number -> its forward op's origin
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = by_name[node.name]
            module = spec.key.split(":")[0].rpartition(".")[0] if spec.role != "input" else ""
            ROLE.set(node, spec.role)
            ORIGIN.set(node, Origin("input", module))
            continue
        custom = node.meta.get("custom") or {}
        phase = custom.get("ddlc_phase", "optimizer" if node.op == "output" else "forward")
        module = custom.get("ddlc_module")
        source = sources.source_from_stack(node.meta.get("stack_trace"))
        made_by = forward_origin.get(custom.get("ddlc_grad_fn")) if phase == "backward" else None
        if made_by is not None:
            module, source = made_by.module, source or made_by.source
        elif module is None:
            if phase == "backward":
                latest = max(node.all_input_nodes, key=position.__getitem__, default=None)
                preferred = [ORIGIN.get(latest)] if latest is not None else []
            else:
                origins = [ORIGIN.get(a) for a in node.all_input_nodes if ORIGIN.get(a)]
                preferred = [o for o in origins if o.phase in ("forward", "input")] or origins
            module = preferred[0].module if preferred else ""
            if phase == "backward":
                source = source or next((o.source for o in preferred if o.source), "")
        origin = Origin(phase, module, source)
        ORIGIN.set(node, origin)
        if phase == "forward":
            forward_origin.setdefault(node.meta.get("seq_nr"), origin)
            if custom.get("ddlc_recompute") is not None:
                RECOMPUTE.set(node, custom["ddlc_recompute"])
