"""One node per parameter's optimizer update: the operator ``ddlc::optimizer_update``.

AdamW's update is about fifteen operators a parameter, more than half of the nodes of a
GPT step, and every pass from the search to the end of lowering walked them one by one
(priced, placed, copied, scheduled). They are elementwise on tensors shaped like the
parameter, or arithmetic on 0-d scalars, and they always run on the same piece of the
parameter. So from tracing to the end of lowering's schedule a parameter's update is one
node:

    optimizer_update(spec, scalars, param, grad, state, hp) -> [new_param, *new_state]

``spec`` is the :class:`ddlc.optim.OptimizerSpec` as JSON (:func:`spec_text`), ``scalars``
the names of the group's scalars ``hp`` (``spec.derived``'s), comma-separated; ``state`` in
``spec.state_names`` order.

Its *template* is the spec's update (``spec.apply``) traced by make_fx into aten operators,
once per spec, scalar names and kind of inputs (dtype, and whether 0-d, which takes the
one-element path): the operators take no shape, so the template serves every shape.
:func:`evaluate` runs its operators one by one on the tensors it is given: fake ones
(lowering's values), or meta ones for the cost model, which prices each operator at the
local shapes as the program runs them (:func:`parts`) and counts the memory its
intermediate values hold (:func:`temporary_bytes`: the lowered program's timeline and the
scheduler's memory cap count them). The operator's own kernels (real
and fake) run ``spec.apply``, which the template is a trace of. ``passes/expand_updates.py``
puts the template's operators in the node's place before the views pass, so the per-rank
program runs the aten operators a per-parameter trace gives.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import torch
from torch import fx
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes

from . import optim
from .fake import fresh_fake
from .optim import OptimizerSpec

__all__ = ["OP", "spec_text", "spec_of", "evaluate", "fake_values", "parts", "results", "temporary_bytes", "template",
           "update_inputs"]


def spec_text(spec: OptimizerSpec) -> str:
    """``spec`` as the operator's ``spec`` argument: its class and fields as JSON (floats
    round-trip exactly)."""
    return json.dumps({"kind": type(spec).__name__, **dataclasses.asdict(spec)}, sort_keys=True)


@functools.lru_cache(maxsize=None)
def spec_of(text: str) -> OptimizerSpec:
    """The spec :func:`spec_text` wrote."""
    fields = json.loads(text)
    return getattr(optim, fields.pop("kind"))(**fields)


def _kind(t: torch.Tensor) -> tuple:
    return t.dtype, t.dim() == 0


@functools.lru_cache(maxsize=None)
def _template(spec: str, scalars: str, kinds: tuple) -> fx.Graph:
    spec_obj, names = spec_of(spec), tuple(scalars.split(",")) if scalars else ()
    n_state = len(spec_obj.state_names)

    def step(param, grad, *rest):
        state = dict(zip(spec_obj.state_names, rest[:n_state]))
        new_param, new_state = spec_obj.apply(param, grad, state, dict(zip(names, rest[n_state:])))
        return (new_param, *(new_state[s] for s in spec_obj.state_names))

    with _disable_current_modes():  # traced on first use, which may be inside a fake mode's kernel
        stand_ins = [torch.empty(() if zero_d else (2,), dtype=dtype, device="meta") for dtype, zero_d in kinds]
        graph = make_fx(functionalize(step, remove="mutations_and_views"))(*stand_ins).graph
    for node in graph.nodes:
        odd = node.op not in ("placeholder", "call_function", "output")
        sized = any(isinstance(a, (list, tuple, torch.Size)) and a and all(isinstance(x, int) for x in a)
                    for a in (*node.args, *node.kwargs.values()))
        if odd or (sized and not kinds[0][1]):
            raise AssertionError(f"the {type(spec_obj).__name__} update traces to {node.format_node()}, "
                                 "which depends on more than its inputs' dtypes: a bug in ddlc")
    return graph


def template(spec: str, scalars: str, inputs: Sequence[torch.Tensor]) -> fx.Graph:
    """The traced update for these arguments of the operator (see the module docstring);
    ``inputs``: ``[param, grad, *state, *hp]``."""
    return _template(spec, scalars, tuple(_kind(t) for t in inputs))


def results(spec: str, scalars: str, inputs: Sequence[torch.Tensor]) -> list[fx.Node]:
    """The template's nodes that give ``[new_param, *new_state]``."""
    return list(next(n for n in template(spec, scalars, inputs).nodes if n.op == "output").args[0])


def update_inputs(args: Sequence[Any]) -> list:
    """The operator's ``(spec, scalars, param, grad, state, hp)`` as ``[param, grad, *state, *hp]``."""
    _, _, param, grad, state, hp = args
    return [param, grad, *state, *hp]


def evaluate(spec: str, scalars: str, inputs: Sequence[torch.Tensor], record: list | None = None) -> list:
    """Run the template on ``inputs`` (``[param, grad, *state, *hp]``), operator by
    operator; return ``[new_param, *new_state]``. With ``record``, append each operator's
    ``(template node, args, kwargs, out)``."""
    graph = template(spec, scalars, inputs)
    env: dict[fx.Node, Any] = {}
    it = iter(inputs)
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "call_function":
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = node.target(*args, **kwargs)
            if record is not None:
                record.append((node, args, kwargs, env[node]))
        else:
            return list(fx.map_arg(node.args[0], env.__getitem__))
    raise AssertionError("a traced graph ends with its output")


def fake_values(spec: str, scalars: str, inputs: Sequence[torch.Tensor], runs: dict,
                wanted: Sequence[fx.Node] | None = None) -> dict[fx.Node, Any]:
    """The fake value of every node of the template run on the fake ``inputs`` (its
    placeholders' are ``inputs``), or of its nodes ``wanted`` and the placeholders. The
    template runs once per input metadata, kept in ``runs``; a later call with inputs of
    that metadata gets fresh fake values of the same metadata (fake tensors hold no
    values; the template makes no views, so an input's storage offset reaches no value)."""
    key = (spec, scalars, tuple((tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad) for v in inputs))
    if key in runs:
        known = runs[key]
        made = {t: fresh_fake(known[t]) for t in (known if wanted is None else wanted) if t in known}
    else:
        record: list = []
        with next(v.fake_mode for v in inputs if hasattr(v, "fake_mode")):
            evaluate(spec, scalars, inputs, record)
        made = runs[key] = {t: v for t, _, _, v in record}
    placeholders = (t for t in template(spec, scalars, inputs).nodes if t.op == "placeholder")
    return {**dict(zip(placeholders, inputs)), **made}


def parts(args: Sequence[Any]) -> list[tuple]:
    """The ``(target, args, kwargs, out)`` of every operator the update runs on the
    operator's arguments ``args`` (meta or fake tensors): what the cost model prices.
    Each value the operators make is a meta tensor of its shape and dtype (contiguous).
    Running the template on meta tensors costs about 0.4 ms an operator (their meta
    kernels are Python); its values are shaped like the parameter, or 0-d, so their
    shapes are found once per template (:func:`_shapes`) and made here directly."""
    return [(node.target, a, k, out) for node, a, k, out in _records(args)]


def _records(args: Sequence[Any]) -> list[tuple]:
    """:func:`parts` with each operator's template node: ``(node, args, kwargs, out)``."""
    spec, scalars = args[0], args[1]
    inputs = update_inputs(args)
    shapes = _shapes(spec, scalars, tuple(_kind(t) for t in inputs))
    record: list = []
    if shapes is None:  # a 0-d parameter (reshaped to one element) or an unforeseen shape
        evaluate(spec, scalars, inputs, record)
        return record
    param = tuple(inputs[0].shape)
    env: dict[fx.Node, Any] = dict(zip((n for n in template(spec, scalars, inputs).nodes
                                        if n.op == "placeholder"), inputs))
    for node, (like, dtype) in shapes.items():
        a, k = fx.map_arg((node.args, node.kwargs), env.__getitem__)
        env[node] = torch.empty(param + like if like is not None else (), dtype=dtype, device="meta")
        record.append((node, a, k, env[node]))
    return record


@functools.lru_cache(maxsize=None)
def _shapes(spec: str, scalars: str, kinds: tuple) -> dict | None:
    """Per operator of the template, in order: ``(suffix, dtype)``, its value's shape being
    the parameter's shape plus ``suffix`` (``()``; ``(2,)`` under ``view_as_real``), or 0-d
    where ``suffix`` is None; None where some value is neither (then :func:`parts` runs
    the template)."""
    if kinds[0][1]:
        return None
    reference = (3, 5)
    with _disable_current_modes():
        inputs = [torch.empty(() if zero_d else reference, dtype=dtype, device="meta") for dtype, zero_d in kinds]
        record: list = []
        evaluate(spec, scalars, inputs, record)
    shapes = {}
    for node, _, _, out in record:
        if not isinstance(out, torch.Tensor):
            return None
        shape = tuple(out.shape)
        if shape == ():
            shapes[node] = (None, out.dtype)
        elif shape[:2] == reference and len(shape) <= 3:
            shapes[node] = (shape[2:], out.dtype)
        else:
            return None
    return shapes


def temporary_bytes(args: Sequence[Any]) -> int:
    """The most bytes the update's intermediate values (neither inputs nor outputs) hold at
    once while its operators run on the operator's arguments ``args`` (meta or fake
    tensors): what the program's memory holds beyond the node's inputs and outputs."""
    record = _records(args)
    outputs = set(results(args[0], args[1], update_inputs(args)))
    last = {a: i for i, (node, _, _, _) in enumerate(record) for a in node.all_input_nodes}
    out = {node: val for node, _, _, val in record}
    live = peak = 0
    for i, (node, _, _, val) in enumerate(record):
        if node not in outputs:
            live += val.numel() * val.element_size()
        peak = max(peak, live)
        live -= sum(out[a].numel() * out[a].element_size() for a, j in last.items()
                    if j == i and a in out and a not in outputs)
    return peak


def _run(spec: str, scalars: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The update computed by ``spec.apply`` itself (what the template is a trace of), with
    an output that is an input, or a view of one, copied: an operator's outputs are its own."""
    spec_obj, names = spec_of(spec), scalars.split(",") if scalars else []
    n_state = len(spec_obj.state_names)
    param, grad, rest = inputs[0], inputs[1], inputs[2:]
    new_param, new_state = spec_obj.apply(param, grad, dict(zip(spec_obj.state_names, rest[:n_state])),
                                          dict(zip(names, rest[n_state:])))
    given = {id(t) for t in inputs}
    return [t.clone() if id(t) in given or id(t._base) in given else t
            for t in (new_param, *(new_state[s] for s in spec_obj.state_names))]


# The kernels run ``spec.apply`` rather than the template: they may run where a trace cannot
# start (inside another operator's dispatch, with its dispatch keys excluded).
@torch.library.custom_op("ddlc::optimizer_update", mutates_args=())
def _optimizer_update(spec: str, scalars: str, param: torch.Tensor, grad: torch.Tensor,
                      state: list[torch.Tensor], hp: list[torch.Tensor]) -> list[torch.Tensor]:
    return _run(spec, scalars, [param, grad, *state, *hp])


@_optimizer_update.register_fake
def _(spec, scalars, param, grad, state, hp):
    return _run(spec, scalars, [param, grad, *state, *hp])


#: The operator (an OpOverload, as the rules and the cost model key operators).
OP = torch.ops.ddlc.optimizer_update.default
