"""Trace a model's whole training step into one functional aten graph.

Recipe (see TORCH_NOTES.md): ``make_fx(functionalize(step), tracing_mode="fake")``
where ``step`` runs ``torch.func.grad_and_value`` over ``functional_call`` of the
model and then the functional optimizer update of :mod:`ddlc.optim`. Parameters,
buffers, optimizer state and batch inputs are flat graph inputs with their role
recorded in a :class:`ddlc.ir.StepSignature` (``ir.STEP``); every node keeps
``meta["val"]``, its role (``ir.ROLE``, placeholders) and an :class:`ddlc.ir.Origin`
(``ir.ORIGIN``: phase, module path, user source line).
"""
from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch.func import functional_call, functionalize, grad_and_value
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.modules import module as module_mod

from .errors import TraceError, UnsupportedInputError
from .ir import ORIGIN, ROLE, STEP, InputSpec, Origin, OutputSpec, StepSignature, hyperparameter_tensors
from .optim import hyperparameter_key, optimizer_spec

__all__ = ["trace"]

def trace(model: nn.Module, example_inputs, loss_fn: Callable | None = None,
          optimizer: torch.optim.Optimizer | None = None, *, num_targets: int = 1) -> fx.GraphModule:
    """Trace one training step of ``model`` into a flat functional aten GraphModule.

    With ``loss_fn`` the step computes ``loss_fn(model(*inputs), *targets)`` where the
    last ``num_targets`` example inputs are the targets, then the gradients, then (with
    ``optimizer``: ``torch.optim.SGD`` or ``AdamW``) the updated parameters and state.
    Outputs: ``(loss, *new_params, *new_state)``, or ``(loss, *grads)`` without an
    optimizer. Without ``loss_fn`` the graph is the forward pass alone.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batch = _check_batch(example_inputs)
    if optimizer is not None and loss_fn is None:
        raise UnsupportedInputError("an optimizer needs a loss_fn to produce gradients")
    n_targets = num_targets if loss_fn is not None else 0
    if n_targets >= len(batch) + (loss_fn is None):
        raise UnsupportedInputError(f"{len(batch)} example input(s) cannot hold {n_targets} "
                                    "target(s) and at least one model input")
    if loss_fn is not None:
        _check_no_running_statistics(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    trainable = [k for k, p in params.items() if p.requires_grad]
    grouped = optimizer_spec(optimizer, params) if optimizer is not None else {}
    # a frozen parameter given to the optimizer gets no gradient, and torch.optim skips it
    group_of = {k: grouped[k][0] for k in trainable if k in grouped}
    specs = {k: grouped[k][1] for k in group_of}
    groups = {g: grouped[k][1] for k, g in sorted(group_of.items(), key=lambda kv: kv[1])}
    hyper = {hyperparameter_key(g, name): value for g, spec in groups.items()
             for name, value in spec.values().items()}
    opt_state = {f"{k}:{s}": t for k in specs for s, t in specs[k].init_state(params[k].detach()).items()}

    inputs = ([InputSpec("", "param", k) for k in params]
              + [InputSpec("", "buffer", k) for k in buffers]
              + [InputSpec("", "opt_state", k) for k in opt_state]
              + [InputSpec("", "hparam", k) for k in hyper]
              + [InputSpec("", "input", f"input{i}") for i in range(len(batch))])
    if loss_fn is None:
        outputs = None  # known after tracing
    elif optimizer is None:
        outputs = [OutputSpec("loss", "loss")] + [OutputSpec("grad", k) for k in trainable]
    else:
        outputs = ([OutputSpec("loss", "loss")] + [OutputSpec("param", k) for k in specs]
                   + [OutputSpec("opt_state", k) for k in opt_state])

    n_model_inputs = len(batch) - n_targets
    annotator = _ModuleAnnotator(model)

    def unpack(flat):
        it = iter(flat)
        tables = [{k: next(it) for k in params}, {k: next(it) for k in buffers},
                  {k: next(it) for k in opt_state}, {k: next(it) for k in hyper},
                  [next(it) for _ in batch]]
        return tables

    def forward_only(*flat):
        p, b, _, _, xs = unpack(flat)
        annotator.phase("forward")
        out = _checked_output(functional_call(model, {**p, **b}, tuple(xs)))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def train_step(*flat):
        p, b, state, hp, xs = unpack(flat)
        frozen = {k: v for k, v in p.items() if k not in trainable}

        def compute_loss(train_params):
            annotator.phase("forward")
            out = _checked_output(functional_call(model, {**train_params, **frozen, **b},
                                                  tuple(xs[:n_model_inputs])))
            loss = loss_fn(out, *xs[n_model_inputs:])
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise UnsupportedInputError("loss_fn must return a one-element tensor, got "
                                            f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
            annotator.phase("backward")
            return loss

        grads, loss = grad_and_value(compute_loss)({k: p[k] for k in trainable})
        annotator.phase("optimizer")
        if optimizer is None:
            return (loss, *(grads[k] for k in trainable))
        scalars = {g: spec.derived({name: hp[hyperparameter_key(g, name)] for name in spec.inputs})
                   for g, spec in groups.items()}
        new_params, new_state = [], []
        for k in specs:
            names = specs[k].state_names
            new_p, st = specs[k].update(p[k], grads[k], {s: state[f"{k}:{s}"] for s in names},
                                        scalars[group_of[k]])
            new_params.append(new_p)
            new_state.extend(st[s] for s in names)
        return (loss, *new_params, *new_state)

    hyper_tensors = hyperparameter_tensors(hyper)
    tables = {"param": params, "buffer": buffers, "opt_state": opt_state, "hparam": hyper_tensors,
              "input": {f"input{i}": t for i, t in enumerate(batch)}}
    flat = [tables[i.role][i.key].detach() for i in inputs]
    fn = train_step if loss_fn is not None else forward_only
    gm = _make_fx(fn, flat, annotator, batch)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [InputSpec(_rename_placeholder(n, spec), spec.role, spec.key)
              for n, spec in zip(placeholders, inputs)]
    if outputs is None:
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        outputs = [OutputSpec("output", f"output{i}") for i in range(n_out)]
    _check_no_input_mutation(gm)
    _annotate_origins(gm, inputs, annotator)
    _check_no_random_ops(gm)
    gm.recompile()
    STEP.set(gm, StepSignature(tuple(inputs), tuple(outputs), tuple((k, specs[k]) for k in specs),
                               n_targets, tuple(groups.items()), tuple(hyper.items())))
    return gm


def _checked_output(out):
    """The model's output, or a clear error when it returned nothing to compute with."""
    if out is None or (isinstance(out, (tuple, list)) and not any(isinstance(o, torch.Tensor) for o in out)):
        raise UnsupportedInputError(f"the model's forward returned {out!r}; it must return a tensor "
                                    "(or a tuple of tensors) for the loss or the caller to read")
    return out


def _check_no_running_statistics(model: nn.Module) -> None:
    """Refuse BatchNorm layers that would update running statistics in a training step
    (an in-place update of a buffer, which the step cannot carry yet)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training \
                and module.track_running_stats:
            raise UnsupportedInputError(
                f"{type(module).__name__} {name!r} is in training mode and updates its running "
                "statistics in place, which ddlc does not support yet: call .eval() on it (use "
                "the running statistics) or build it with track_running_stats=False",
                where=f"module {name} ({type(module).__name__})")


def _check_batch(example_inputs) -> list[torch.Tensor]:
    batch = [example_inputs] if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(batch, (tuple, list)) or not batch:
        raise UnsupportedInputError("example_inputs must be a tensor or a non-empty tuple of "
                                    f"tensors, got {type(example_inputs).__name__}")
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedInputError(f"example input {i} is a {type(t).__name__}; ddlc "
                                        "traces tensor inputs only (pass other values as "
                                        "module attributes)")
    return list(batch)


class _ModuleAnnotator:
    """Forward hooks that stamp the current module path and phase on new nodes."""

    def __init__(self, model: nn.Module):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.current_phase = "forward"

    def phase(self, name: str) -> None:
        self.current_phase = name
        self._publish()

    def _publish(self):
        module = self.stack[-1] if self.stack and self.current_phase == "forward" else None
        fx_traceback.current_meta["custom"] = {"ddlc_phase": self.current_phase,
                                               "ddlc_module": module}

    def pre(self, module, args):
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])
            self._publish()

    def post(self, module, args, out):
        if id(module) in self.names:
            self.stack.pop()
            self._publish()


#: What torch's errors while tracing mean, first match wins: (pattern, error type, cause).
#: "The example inputs may not match the model" is said only for shape errors.
_CAUSES = (
    (re.compile(r"data.dependent|GuardOnDataDependent|DataDependentOutput|Could not guard on|"
                r"item\(\)|tolist\(\)|unallocated storage|aten\._local_scalar_dense", re.I), TraceError,
     "the model has data-dependent Python control flow or reads a tensor's value (e.g. "
     "`if x.sum() > 0`, `.item()`, `.tolist()`), which one static graph cannot express"),
    (re.compile(r"mutate a captured Tensor", re.I), UnsupportedInputError,
     "the model updates a tensor captured from outside the step in place (a buffer such as "
     "running statistics, or a tensor attribute); ddlc does not support in-place updates of "
     "model state"),
    (re.compile(r"dtype|scalar type", re.I), TraceError,
     "the example inputs' dtypes do not fit the model (an integer tensor fed into a float "
     "layer?)"),
    (re.compile(r"shape|size|dim|mat1 and mat2", re.I), TraceError,
     "the example inputs may not match the model"),
)


def _make_fx(fn, flat, annotator: _ModuleAnnotator, batch: Sequence[torch.Tensor]) -> fx.GraphModule:
    hooks = [module_mod.register_module_forward_pre_hook(annotator.pre),
             module_mod.register_module_forward_hook(annotator.post)]
    try:
        with fx_traceback.preserve_node_meta():
            return make_fx(functionalize(fn, remove="mutations_and_views"), tracing_mode="fake",
                           record_stack_traces=True)(*flat)
    except (UnsupportedInputError, TraceError):
        raise
    except Exception as e:  # torch raises many types; name the cause and the user's line
        where = _user_frame(e)
        text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        for pattern, error, cause in _CAUSES:
            if pattern.search(f"{type(e).__name__} {e}"):
                raise error(f"{cause}; the example inputs are {_describe(batch)} ({text})",
                            where=where) from None
        raise TraceError(f"tracing the training step failed ({text})", where=where) from None
    finally:
        for h in hooks:
            h.remove()


def _describe(flat) -> str:
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in flat)


_INTERNAL_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)),
                  os.path.dirname(os.__file__))


def _is_user_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.endswith(os.path.join("ddlc", "zoo.py")):
        return True
    return not path.startswith(_INTERNAL_DIRS) and "site-packages" not in path \
        and not filename.startswith("<")


def _user_frame(exc: BaseException) -> str | None:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    return f'{f.filename}:{f.lineno} in {f.name}: {(f.line or "").strip()}'


def _source_from_stack(stack_trace: str | None) -> str:
    if not stack_trace:
        return ""
    found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', stack_trace)
    user = [f for f in found if _is_user_file(f[0])]
    if not user:
        return ""
    file, line, func, code = user[-1]
    return f"{file}:{line} in {func}: {code.strip()}"


def _rename_placeholder(node: fx.Node, spec: InputSpec) -> str:
    prefix = {"param": "p", "buffer": "buf", "opt_state": "st", "hparam": "hp", "input": ""}[spec.role]
    name = re.sub(r"\W", "_", f"{prefix}_{spec.key}" if prefix else spec.key)
    node._rename(name)
    node.target = node.name
    return node.name


def _check_no_input_mutation(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and node.args[0].op == "placeholder":
            raise UnsupportedInputError(
                f"the step mutates its input {node.args[0].name!r} in place (for example "
                "BatchNorm running statistics in training mode); ddlc does not support "
                "in-place updates of buffers or inputs yet")


def _draws_random_numbers(node: fx.Node) -> bool:
    """Whether ``node`` is an op torch tags as seeded-random, other than one whose dropout
    is switched off by its arguments (attention with ``dropout_p=0``, ``train=False``)."""
    target = node.target
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    names = [a.name for a in target._schema.arguments]
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    defaults = {a.name: a.default_value for a in target._schema.arguments if a.has_default_value()}
    value = lambda name: bound.get(name, defaults.get(name))  # noqa: E731
    return not (("dropout_p" in names and value("dropout_p") == 0) or ("train" in names and value("train") is False))


def _check_no_random_ops(gm: fx.GraphModule) -> None:
    """Refuse a step that draws random numbers (dropout in training mode, ``torch.rand``):
    every rank's generator would draw its own values, so replicated tensors would differ
    between ranks and parameters drift apart -- a silent wrong result."""
    for node in gm.graph.nodes:
        if _draws_random_numbers(node):
            origin = ORIGIN.get(node)
            raise UnsupportedInputError(
                f"the step draws random numbers ({node.target}, e.g. dropout in training mode); "
                "ddlc cannot yet keep ranks' random streams consistent, so each rank would use "
                "its own mask: set the dropout probability to 0 or put those modules in eval() "
                "mode", where=origin.where(node.name) if origin else node.name)


def _annotate_origins(gm: fx.GraphModule, inputs: Sequence[InputSpec],
                      annotator: _ModuleAnnotator) -> None:
    """Record an Origin per node. Backward nodes borrow the module of their first
    forward-phase input (a saved activation or parameter), else of any input; then,
    walking backwards, a backward node whose users all sit in one submodule of its
    module moves into that submodule."""
    by_name = {i.name: i for i in inputs}
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
        source = _source_from_stack(node.meta.get("stack_trace"))
        if module is None:
            origins = [ORIGIN.get(a) for a in node.all_input_nodes if ORIGIN.get(a)]
            preferred = [o for o in origins if o.phase in ("forward", "input")] or origins
            module = preferred[0].module if preferred else ""
            if phase == "backward":
                source = source or next((o.source for o in preferred if o.source), "")
        ORIGIN.set(node, Origin(phase, module, source))
    # Weight-gradient chains read only activations of the module *before*; refine a
    # backward node to the one module all its users belong to when that is a submodule.
    for node in reversed(gm.graph.nodes):
        origin = ORIGIN.get(node)
        if origin is None or origin.phase != "backward":
            continue
        users = {ORIGIN.get(u).module for u in node.users if u.op != "output" and ORIGIN.get(u)}
        if len(users) == 1:
            (module,) = users
            if module != origin.module and (not origin.module or module.startswith(origin.module + ".")):
                ORIGIN.set(node, Origin(origin.phase, module, origin.source))
