"""The optimizer's per-parameter updates in the step graph: one node each.

The step is traced up to the gradients and the scalars; :func:`stamp_updates` then adds,
for every parameter, one ``ddlc::optimizer_update`` node (:mod:`ddlc.fused_update`: the
update's aten operators run as one, until ``passes/expand_updates.py`` puts them back) and
a getitem per output, right before the output. Output values are the template's run on
the step's own fake values, once per input metadata (:func:`ddlc.fused_update.fake_values`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

from torch import fx

from .errors import TraceError
from .fake import fresh_fake
from .fused_update import OP, fake_values, results, spec_text
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


def _outputs(update: Update, runs: dict) -> list:
    """The fake values of ``update``'s ``[new_param, *new_state]`` (``runs``: see
    :func:`ddlc.fused_update.fake_values`), refused where the update would change a dtype or
    a shape (torch.optim keeps both)."""
    spec, names = spec_text(update.spec), ",".join(update.scalar_names)
    inputs = [n.meta["val"] for n in update.inputs]
    wanted = results(spec, names, inputs)
    values = fake_values(spec, names, inputs, runs, wanted)
    outputs = [values[t] for t in wanted]
    kept = [inputs[0], *inputs[2:2 + len(update.spec.state_names)]]  # the parameter and its state
    for name, before, after in zip(("parameter", *update.spec.state_names), kept, outputs):
        if after.dtype != before.dtype or after.shape != before.shape:
            raise TraceError(f"ddlc's {type(update.spec).__name__} update of {update.param.name} "
                             f"({tuple(inputs[0].shape)}, {inputs[0].dtype}) turns its {name} from "
                             f"{tuple(before.shape)} {before.dtype} into {tuple(after.shape)} "
                             f"{after.dtype}, which torch.optim does not: a bug in ddlc, "
                             "please report it")
    return [fresh_fake(v) if any(v is i for i in inputs) else v for v in outputs]


def stamp_updates(graph: fx.Graph, updates: Sequence[Update], annotation: dict) -> list[list[fx.Node]]:
    """Insert every update's node and its getitems before ``graph``'s output, in order (see
    the module docstring); ``annotation``: the ``meta["custom"]`` of the optimizer phase.
    Returns per update its outputs ``[new_param, *new_state]``."""
    runs: dict = {}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = []
    with graph.inserting_before(output):
        for update in updates:
            try:
                vals = _outputs(update, runs)
            except TraceError:
                raise
            except Exception as e:
                raise TraceError(f"tracing the {type(update.spec).__name__} update of "
                                 f"{update.param.name} failed ({type(e).__name__}: {e})") from e
            node = graph.call_function(OP, (spec_text(update.spec), ",".join(update.scalar_names), update.param,
                                            update.grad, list(update.state), list(update.scalars)))
            node.meta["val"] = vals
            node.meta["custom"] = dict(annotation)
            items = []
            for i, val in enumerate(vals):
                item = graph.call_function(operator.getitem, (node, i))
                item.meta["val"] = val
                item.meta["custom"] = dict(annotation)
                items.append(item)
            results.append(items)
    return results
