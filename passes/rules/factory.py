"""Factory operators: outputs made from shapes, not values.

``*_like`` ops and ``fill.Scalar`` read only the shape of their input, so it may have
any SBP (``P`` included) and the output splits with it. Sized factories (``full``,
``zeros``, ``ones``, ``empty``, ``new_*``) may split any output dim: the ``size``
argument is localized; ``new_*``'s ``self`` (its dtype and device only) may have any
SBP. Zero-filled outputs may also be ``P`` (zeros sum to zeros); ones and other fills
only ``B`` or ``S``, and so do ``empty`` outputs (their values are undefined, and a plan
must not read them). ``fill.Tensor`` broadcasts its 0-d value over
``self``'s shape: linear in the value (``P`` value, ``P`` output). ``arange``,
``scalar_tensor`` and ``eye`` stay ``B`` (a split ``arange`` would need per-rank start
values, a split ``eye`` the offset of its diagonal).

Random factories (``rand``, ``randn``, ``randint``, ``normal``, ``rand_like``,
``randn_like``, ``randint_like``, and the in-place fills ``t.uniform_()``, ``t.normal_()``,
``t.exponential_()``, ``cauchy_``, ``geometric_``, ``log_normal_``, ``random_``) split the
same way, never ``P`` (``randperm`` stays ``B``, as ``arange``): a rule says only how shapes
split; that each rank's piece holds its part of the numbers drawn for the global shape
(and equal copies where ``B``) is :mod:`ddlc.rng`'s business.
"""
from __future__ import annotations

import torch

from .core import UNSPLIT, Call, Labels, letters

aten = torch.ops.aten

# op: is the output all zeros
LIKE = {aten.zeros_like.default: True, aten.ones_like.default: False,
        aten.full_like.default: False, aten.empty_like.default: False,
        aten.fill.Scalar: False, aten.rand_like.default: False, aten.randn_like.default: False,
        aten.uniform.default: False, aten.normal_functional.default: False, aten.exponential.default: False,
        aten.cauchy.default: False, aten.geometric.default: False, aten.log_normal.default: False,
        aten.random.default: False, aten.random.to: False, aten.randint_like.default: False,
        aten.randint_like.low_dtype: False}
SIZED = {aten.zeros.default: True, aten.ones.default: False, aten.full.default: False,
         aten.new_zeros.default: True, aten.new_ones.default: False,
         aten.new_full.default: False, aten.empty.memory_format: False,
         aten.new_empty.default: False, aten.rand.default: False, aten.randn.default: False,
         aten.randint.low: False, aten.randint.default: False, aten.normal.float_float: False}
#: op: the argument holding the fill value (a 0 fill gives zeros)
FILL_ARG = {aten.full_like.default: "fill_value", aten.fill.Scalar: "value",
            aten.full.default: "fill_value", aten.new_full.default: "fill_value"}
UNSPLIT_FACTORIES = [aten.arange.default, aten.arange.start, aten.arange.start_step,
                     aten.scalar_tensor.default, aten.eye.default, aten.eye.m, aten.randperm.default]


def _zero(call: Call, table: dict) -> bool:
    return table[call.target] or (call.target in FILL_ARG and call[FILL_ARG[call.target]] == 0)


def like(call: Call) -> Labels:
    """The output splits with ``self`` (shape only: any SBP); ``P`` output if all zeros."""
    labels = letters(call["self"].ndim)
    return Labels({"self": labels}, [labels], shape_only=["self"], zero_output=_zero(call, LIKE))


def sized(call: Call) -> Labels:
    """Any output dim may split (``size`` localized); ``P`` output if all zeros. ``new_*``
    read only their ``self``'s dtype and device, so it may have any SBP (a batch split
    input's ``new_zeros(labels.shape)``, as BART shifts its labels, splits with it)."""
    return Labels({}, [letters(call.outputs[0].ndim)], metadata_only=["self"],
                  zero_output=_zero(call, SIZED))


def fill_tensor(call: Call) -> Labels:
    """The 0-d ``value`` broadcast over ``self``'s shape (``self``: shape only)."""
    labels = letters(call["self"].ndim)
    return Labels({"self": labels, "value": ""}, [labels], shape_only=["self"],
                  linear=[{"value"}])


def unsplit(call: Call) -> Labels:
    return Labels({}, [UNSPLIT * call.outputs[0].ndim])


RULES = {**dict.fromkeys(LIKE, like), **dict.fromkeys(SIZED, sized),
         **dict.fromkeys(UNSPLIT_FACTORIES, unsplit), aten.fill.Tensor: fill_tensor}


def local_size(call: Call, in_shapes, out_shapes) -> dict:
    return {"size": list(out_shapes[0])}


LOCALIZERS = dict.fromkeys(SIZED, local_size)
