"""Elementwise operators: matching splits on the broadcast output, P where linear.

Every tensor operand is aligned with the output by trailing dims; a dim where the
operand has size 1 (or no dim at all) is ``B`` when the output splits there. Every
output (``frexp`` has two) splits like the broadcast output.

Which ops: every functional overload tagged ``torch.Tag.pointwise`` (by tag, through
``TAG_RULES``: ``sin``, ``abs``, ``minimum``, ``ge``, ``bitwise_and``, ``erf``,
``silu_backward``, ...; in-place and ``out=`` overloads get no rule), plus the untagged
ones ``LINEAR_IN`` names (``_to_copy``, ``hardtanh_backward``, ``masked_fill.Tensor``...).

``LINEAR_IN`` lists the argument sets an op is jointly linear in: those may be ``P``
together, the rest ``B``. A number in a set is a broadcast value, so ``add(P, 1)`` is
not claimed; ``LINEAR_IF_ZERO`` ops are linear only when a number argument is 0
(``masked_fill(x, m, 0)``). Any other op (tagged, not listed) is nonlinear: no ``P``.
Comparison and logical ops give bool outputs, never ``P`` anyway. The unary backward
ops (``tanh_backward(grad_output, output)``...) are linear in the incoming gradient.

Random ops (``bernoulli``, ``native_dropout``) split like deterministic ones: a rule
only says how shapes split; that every rank draws the values of its own piece (and the
same values where the SBP is ``B`` or ``P``) is the RNG handling's business, not the
rule's. ``native_dropout``'s mask splits like its output and is ``B`` when the output is
``P`` (the output is linear in the input for a given mask).
"""
from __future__ import annotations

import torch

from .core import Call, Labels, aligned, letters

aten = torch.ops.aten

SELF = ({"self"},)
JOINT = ({"self", "other"},)
GRAD = ({"grad_output"},)

LINEAR_IN: dict = {
    aten.add.Tensor: JOINT, aten.add.Scalar: JOINT,          # self + alpha * other
    aten.sub.Tensor: JOINT, aten.sub.Scalar: JOINT,
    aten.rsub.Tensor: JOINT, aten.rsub.Scalar: JOINT,        # other - alpha * self
    aten.mul.Tensor: ({"self"}, {"other"}), aten.mul.Scalar: SELF,
    aten.div.Tensor: SELF, aten.div.Scalar: SELF,            # linear in the numerator only
    aten.true_divide.Tensor: SELF,
    aten.neg.default: SELF, aten.positive.default: SELF,
    aten.deg2rad.default: SELF, aten.rad2deg.default: SELF,
    aten.ldexp.Tensor: SELF,                                 # self * 2 ** other
    aten.clone.default: SELF, aten.alias.default: SELF, aten.detach.default: SELF,
    aten.alias_copy.default: SELF, aten.detach_copy.default: SELF,
    aten.lift_fresh_copy.default: SELF,
    aten._to_copy.default: SELF,
    aten.copy.default: ({"src"},),                           # self's shape, src's values
    aten.lerp.Scalar: ({"self", "end"},),                    # self + weight * (end - self)
    aten.lerp.Tensor: ({"self", "end"},),
    aten.addcmul.default: ({"self", "tensor1"}, {"self", "tensor2"}),  # self + v * t1 * t2
    aten.addcdiv.default: ({"self", "tensor1"},),                      # self + v * t1 / t2
    aten.where.self: ({"self", "other"},),
    aten.masked_fill.Tensor: ({"self", "value"},),           # where(mask, value, self)
    # unary backward ops: the incoming gradient times a function of the forward values
    aten.gelu_backward.default: GRAD, aten.threshold_backward.default: GRAD,
    aten.tanh_backward.default: GRAD, aten.sigmoid_backward.default: GRAD,
    aten.silu_backward.default: GRAD, aten.hardtanh_backward.default: GRAD,
    aten.logit_backward.default: GRAD, aten.leaky_relu_backward.default: GRAD,
    aten.elu_backward.default: GRAD, aten.softplus_backward.default: GRAD,
    aten.softshrink_backward.default: GRAD, aten.hardshrink_backward.default: ({"grad_out"},),
    aten.hardswish_backward.default: GRAD, aten.hardsigmoid_backward.default: GRAD,
    aten.mish_backward.default: GRAD, aten.native_dropout_backward.default: GRAD,
    # nonlinear (most are pointwise-tagged too; listed for readers and untagged builds)
    aten.sqrt.default: (), aten.rsqrt.default: (), aten.reciprocal.default: (),
    aten.exp.default: (), aten.log.default: (), aten.tanh.default: (),
    aten.gelu.default: (), aten.relu.default: (), aten.sigmoid.default: (),
    aten.silu.default: (), aten.hardtanh.default: (), aten.hardswish.default: (),
    aten.pow.Tensor_Scalar: (), aten.pow.Tensor_Tensor: (), aten.pow.Scalar: (),
    aten.bernoulli.default: (),                              # self: the probabilities
    aten.floor_divide.default: (),                           # untagged (a GNN's node // size)
}

#: op: (number argument, linear sets when it is 0, else none). ``masked_fill(x, m, 0)`` is
#: ``x * ~m``; with another fill value the result is affine, not linear.
LINEAR_IF_ZERO: dict = {
    aten.masked_fill.Scalar: ("value", SELF),
    aten.where.ScalarOther: ("other", SELF),
    aten.where.ScalarSelf: ("self", ({"other"},)),
}


def linear_sets(call: Call) -> tuple:
    """The argument sets ``call`` is jointly linear in (none for an unlisted op)."""
    if call.target in LINEAR_IF_ZERO:
        name, sets = LINEAR_IF_ZERO[call.target]
        return sets if call.args.get(name) == 0 else ()
    return LINEAR_IN.get(call.target, ())


def elementwise(call: Call) -> Labels:
    """Every operand broadcast against the output (trailing alignment); every output
    splits like it; ``P`` only for the linear sets of :func:`linear_sets`."""
    out = call.outputs[0]
    out_labels = letters(out.ndim)
    inputs = {name: aligned(meta, out.shape, out_labels)
              for (name, _), meta in zip(call.slots, call.inputs)}
    return Labels(inputs, [out_labels] * len(call.outputs), linear=linear_sets(call))


def bernoulli(call: Call) -> Labels:
    """``bernoulli.p`` / ``.Tensor``: ``self`` gives only the shape (any SBP, ``P`` too);
    the output splits with it (and with a broadcast tensor ``p``). Never ``P``."""
    out_labels = letters(call.outputs[0].ndim)
    inputs = {"self": out_labels}
    if "p" in dict(call.slots):
        inputs["p"] = aligned(call["p"], call.outputs[0].shape, out_labels)
    return Labels(inputs, [out_labels], shape_only=["self"])


def native_dropout(call: Call) -> Labels:
    """``(output, mask)`` split like the input; linear in the input (the mask stays ``B``)."""
    labels = letters(call["input"].ndim)
    return Labels({"input": labels}, [labels, labels], linear=[{"input"}], deps={1: ()})


RULES = {op: elementwise for op in (*LINEAR_IN, *LINEAR_IF_ZERO)}
RULES.update({aten.bernoulli.p: bernoulli, aten.bernoulli.Tensor: bernoulli,
              aten.native_dropout.default: native_dropout})
TAG_RULES = {torch.Tag.pointwise: elementwise}
