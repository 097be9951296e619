"""Elementwise operators: matching splits on the broadcast output, P where linear.

Every tensor operand is aligned with the output by trailing dims; a dim where the
operand has size 1 (or no dim at all) is ``B`` when the output splits there. The
table lists the argument sets each op is jointly linear in: those may be ``P``
together, the rest ``B``. A number in a set is a broadcast value, so ``add(P, 1)``
is not claimed; nonlinear ops list none.
"""
from __future__ import annotations

import torch

from .core import Call, Labels, aligned, letters

aten = torch.ops.aten

SELF = ({"self"},)
JOINT = ({"self", "other"},)

LINEAR_IN: dict = {
    aten.add.Tensor: JOINT, aten.add.Scalar: JOINT,          # self + alpha * other
    aten.sub.Tensor: JOINT, aten.sub.Scalar: JOINT,
    aten.rsub.Tensor: JOINT, aten.rsub.Scalar: JOINT,        # other - alpha * self
    aten.mul.Tensor: ({"self"}, {"other"}), aten.mul.Scalar: SELF,
    aten.div.Tensor: SELF, aten.div.Scalar: SELF,            # linear in the numerator only
    aten.neg.default: SELF,
    aten.clone.default: SELF, aten.alias.default: SELF, aten.detach.default: SELF,
    aten.alias_copy.default: SELF, aten.detach_copy.default: SELF,
    aten.lift_fresh_copy.default: SELF,
    aten._to_copy.default: SELF,
    aten.lerp.Scalar: ({"self", "end"},),                    # self + weight * (end - self)
    aten.lerp.Tensor: ({"self", "end"},),
    aten.addcmul.default: ({"self", "tensor1"}, {"self", "tensor2"}),  # self + v * t1 * t2
    aten.addcdiv.default: ({"self", "tensor1"},),                      # self + v * t1 / t2
    aten.gelu_backward.default: ({"grad_output"},),
    aten.threshold_backward.default: ({"grad_output"},),
    aten.where.self: ({"self", "other"},),
    aten.sqrt.default: (), aten.rsqrt.default: (), aten.reciprocal.default: (),
    aten.exp.default: (), aten.log.default: (), aten.tanh.default: (),
    aten.gelu.default: (), aten.relu.default: (), aten.sigmoid.default: (),
    aten.pow.Tensor_Scalar: (), aten.pow.Tensor_Tensor: (), aten.pow.Scalar: (),
}


def elementwise(call: Call) -> Labels:
    """Labels from broadcasting every tensor operand against the output."""
    out = call.outputs[0]
    out_labels = letters(out.ndim)
    inputs = {name: aligned(meta, out.shape, out_labels)
              for (name, _), meta in zip(call.slots, call.inputs)}
    return Labels(inputs, [out_labels], linear=LINEAR_IN[call.target])


RULES = {op: elementwise for op in LINEAR_IN}
