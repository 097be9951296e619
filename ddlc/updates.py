"""The optimizer's per-parameter updates in the step graph, traced once per kind.

make_fx runs every operator of every parameter's update through its proxy and fake
tensor modes, about a millisecond an operator: AdamW's 15-operator update is half of
the nodes of a GPT step and half of its tracing time. A parameter's update depends
only on its :class:`ddlc.optim.OptimizerSpec` and on the metadata of its inputs (the
parameter, its gradient, its state and its group's scalars). So the step is traced up
to the gradients and the scalars, and :func:`stamp_updates` then traces the update
once per such key (make_fx on the step's own fake values) and copies the nodes of that
trace for every parameter of the key, in parameter order, right before the output:
each copy named as make_fx names it, with a fresh fake value of the same metadata and
the optimizer phase's annotation, so the graph is the one a per-parameter trace gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from .errors import TraceError
from .fake import strided_fake
from .optim import OptimizerSpec

__all__ = ["Update", "stamp_updates"]


@dataclass(frozen=True)
class Update:
    """One parameter's update: its spec and the graph nodes it reads, the parameter,
    its gradient, its state (in ``spec.state_names`` order) and its group's scalars
    (``spec.derived``'s names, in ``scalars`` order)."""

    spec: OptimizerSpec
    param: fx.Node
    grad: fx.Node
    state: tuple[fx.Node, ...]
    scalar_names: tuple[str, ...]
    scalars: tuple[fx.Node, ...]

    @property
    def inputs(self) -> tuple[fx.Node, ...]:
        return (self.param, self.grad, *self.state, *self.scalars)

    def key(self) -> tuple:
        """What the traced update depends on: the spec, the scalars' names and every
        input's metadata."""
        return (self.spec, self.scalar_names, tuple(_metadata(n.meta["val"]) for n in self.inputs))


def _metadata(val: torch.Tensor) -> tuple:
    return (tuple(val.shape), val.stride(), val.storage_offset(), val.dtype, val.device, val.layout,
            val.requires_grad)


def _trace_update(update: Update) -> fx.Graph:
    """``update.spec.update`` traced on the fake values of ``update``'s inputs; outputs
    ``(new_param, *new_state)``."""
    spec, n_state = update.spec, len(update.state)

    def step(param, grad, *rest):
        state = dict(zip(spec.state_names, rest[:n_state]))
        new_param, new_state = spec.apply(param, grad, state, dict(zip(update.scalar_names, rest[n_state:])))
        outputs = (new_param, *(new_state[s] for s in spec.state_names))
        for name, before, after in zip(("parameter", *spec.state_names), (param, *rest), outputs):
            if after.dtype != before.dtype or after.shape != before.shape:
                raise TraceError(f"ddlc's {type(spec).__name__} update of {update.param.name} "
                                 f"({tuple(param.shape)}, {param.dtype}) turns its {name} from "
                                 f"{tuple(before.shape)} {before.dtype} into {tuple(after.shape)} "
                                 f"{after.dtype}, which torch.optim does not: a bug in ddlc, "
                                 "please report it")
        return outputs

    graph = make_fx(functionalize(step, remove="mutations_and_views"))(
        *(n.meta["val"] for n in update.inputs)).graph
    odd = [n for n in graph.nodes if n.op not in ("placeholder", "call_function", "output")]
    if odd:  # a constant or submodule would need copying too: ddlc's specs make none
        raise TraceError(f"the {type(spec).__name__} update traces to {odd[0].op} nodes, which "
                         "ddlc.updates cannot copy per parameter")
    return graph


def _fresh(val):
    """A fake tensor of ``val``'s metadata, in its fake mode (a node of its own)."""
    if not isinstance(val, torch.Tensor):
        return val
    return strided_fake(val.fake_mode, val.shape, val.stride(), val.dtype, val.device, val.storage_offset(),
                        val.requires_grad)


def stamp_updates(graph: fx.Graph, updates: Sequence[Update], annotation: dict) -> list[list[fx.Node]]:
    """Insert every update's nodes before ``graph``'s output, in order (see the module
    docstring); ``annotation``: the ``meta["custom"]`` of the optimizer phase. Returns
    per update its outputs ``[new_param, *new_state]``."""
    templates: dict[tuple, fx.Graph] = {}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = []
    with graph.inserting_before(output):
        for update in updates:
            key = update.key()
            if key not in templates:
                try:
                    templates[key] = _trace_update(update)
                except TraceError:
                    raise
                except Exception as e:
                    raise TraceError(f"tracing the {type(update.spec).__name__} update of "
                                     f"{update.param.name} failed ({type(e).__name__}: {e})") from e
            results.append(_copy(graph, templates[key], update.inputs, annotation))
    return results


def _copy(graph: fx.Graph, template: fx.Graph, inputs: Sequence[fx.Node], annotation: dict) -> list[fx.Node]:
    env = dict(zip((n for n in template.nodes if n.op == "placeholder"), inputs))
    for t in template.nodes:
        if t.op == "output":
            return list(fx.map_arg(t.args[0], env.__getitem__))
        if t.op == "placeholder":
            continue
        name = graph._target_to_str(t.target.overloadpacket.__name__) \
            if isinstance(t.target, torch._ops.OpOverload) else None
        node = graph.create_node(t.op, t.target, fx.map_arg(t.args, env.__getitem__),
                                 fx.map_arg(t.kwargs, env.__getitem__), name=name)
        node.meta.update(t.meta)
        node.meta["val"] = fx.node.map_aggregate(t.meta["val"], _fresh)
        node.meta["custom"] = dict(annotation)
        env[t] = node
    raise AssertionError("a traced graph ends with its output")
