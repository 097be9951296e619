"""The optimizer's update of one parameter (``ddlc::optimizer_update``, :mod:`ddlc.fused_update`).

Every operator of the update is elementwise on tensors shaped like the parameter (its
gradient and per-element state: Adam's moments, a momentum buffer) or arithmetic on 0-d
scalars (step counts, hyper-parameters). So the parameter-shaped inputs and outputs split
together along any dim, the scalars are ``B``, and nothing is linear: a partial gradient is
summed before the update reads it (``g * g`` in Adam's second moment). A 0-d output (a step
count) depends on the scalars alone, so it stays ``B`` where the parameter splits.
"""
from __future__ import annotations

from ddlc.fused_update import OP

from .core import UNSPLIT, Call, Labels, letters

__all__ = ["RULES"]


def optimizer_update(call: Call) -> Labels:
    param = call["param"]
    labels = letters(param.ndim)

    def like(meta) -> str:
        return labels if meta.shape == param.shape else UNSPLIT * meta.ndim

    scalar_only = {k: ("hp",) for k, m in enumerate(call.outputs) if m.shape != param.shape}
    return Labels({"param": labels, "grad": like(call["grad"]), "state": [like(m) for m in call["state"]],
                   "hp": [UNSPLIT * m.ndim for m in call["hp"]]},
                  [like(m) for m in call.outputs], deps=scalar_only)


RULES = {OP: optimizer_update}
