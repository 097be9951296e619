"""Matmul family from one einsum description per op.

``"bmk,bkn->bmn"``: a label in an operand and the output (batch ``b``, free ``m``,
``n``) splits both; a contracting label (``k``) splits both operands and makes the
output ``P`` (and the added ``bias``/``self`` term ``P`` with it). The product is
linear in each operand alone (with the added term): ``P,B->P`` and ``B,P->P``.
For ``Y = X @ W`` this gives S0,B->S0; B,S1->S1; S1,S0->P; P,B->P; B,P->P; B,B->B.
``...`` stands for the leading batch dims of ``linear``'s input.
"""
from __future__ import annotations

import torch

from .core import Call, Labels, aligned

aten = torch.ops.aten

# op: (einsum of the product, operand argument names, argument added to the product or None)
EINSUM = {
    aten.mm.default: ("mk,kn->mn", ("self", "mat2"), None),
    aten.addmm.default: ("mk,kn->mn", ("mat1", "mat2"), "self"),
    aten.bmm.default: ("bmk,bkn->bmn", ("self", "mat2"), None),
    aten.baddbmm.default: ("bmk,bkn->bmn", ("batch1", "batch2"), "self"),
    aten.linear.default: ("...k,nk->...n", ("input", "weight"), "bias"),
}


def matmul(call: Call) -> Labels:
    """Labels from the op's einsum; the added term is broadcast against the output."""
    equation, operands, addend = EINSUM[call.target]
    lhs, out = equation.split("->")
    specs = lhs.split(",")
    batch = "".join(chr(ord("A") + i) for i in range(call[operands[0]].ndim - len(specs[0]) + 3))
    specs = [s.replace("...", batch) for s in specs]
    out = out.replace("...", batch)
    inputs = dict(zip(operands, specs))
    linear = [{name} for name in operands]
    if addend is not None and call.get(addend) is not None:
        inputs[addend] = aligned(call[addend], call.outputs[0].shape, out)
        linear = [{name, addend} for name in operands]
    return Labels(inputs, [out], linear=linear, addends=[addend] if addend else [])


RULES = {op: matmul for op in EINSUM}
