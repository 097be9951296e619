"""The optimizer's per-parameter updates in the step graph: one node each.

The step is traced up to the gradients and the scalars; :func:`stamp_updates` then adds,
for every parameter, one ``ddlc::optimizer_update`` node (:mod:`ddlc.fused_update`: the
update's aten operators run as one, until ``passes/expand_updates.py`` puts them back) and
a getitem per output, right before the output. Output metadata are computed once per
:meth:`Update.key` (the template run on the step's own fake values) and given to every
parameter of that key as fresh fake values of the same metadata.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

from torch import fx

from .errors import TraceError
from .fake import fresh_fake, metadata
from .fused_update import OP, evaluate, spec_text
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
        return (self.spec, self.scalar_names, tuple(metadata(n.meta["val"]) for n in self.inputs))


def _outputs(update: Update) -> list:
    """The fake values of ``update``'s ``[new_param, *new_state]``, refused where the update
    would change a dtype or a shape (torch.optim keeps both)."""
    spec = update.spec
    inputs = [n.meta["val"] for n in update.inputs]
    with inputs[0].fake_mode:
        outputs = evaluate(spec_text(spec), ",".join(update.scalar_names), inputs)
    kept = [inputs[0], *inputs[2:2 + len(spec.state_names)]]  # the parameter and its state
    for name, before, after in zip(("parameter", *spec.state_names), kept, outputs):
        if after.dtype != before.dtype or after.shape != before.shape:
            raise TraceError(f"ddlc's {type(spec).__name__} update of {update.param.name} "
                             f"({tuple(inputs[0].shape)}, {inputs[0].dtype}) turns its {name} from "
                             f"{tuple(before.shape)} {before.dtype} into {tuple(after.shape)} "
                             f"{after.dtype}, which torch.optim does not: a bug in ddlc, "
                             "please report it")
    return outputs


def stamp_updates(graph: fx.Graph, updates: Sequence[Update], annotation: dict) -> list[list[fx.Node]]:
    """Insert every update's node and its getitems before ``graph``'s output, in order (see
    the module docstring); ``annotation``: the ``meta["custom"]`` of the optimizer phase.
    Returns per update its outputs ``[new_param, *new_state]``."""
    outputs: dict[tuple, list] = {}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = []
    with graph.inserting_before(output):
        for update in updates:
            key = update.key()
            if key not in outputs:
                try:
                    outputs[key] = _outputs(update)
                except TraceError:
                    raise
                except Exception as e:
                    raise TraceError(f"tracing the {type(update.spec).__name__} update of "
                                     f"{update.param.name} failed ({type(e).__name__}: {e})") from e
            vals = [fresh_fake(v) for v in outputs[key]]
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
