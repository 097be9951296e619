"""Factory operators: outputs made from shapes, not values.

``*_like`` ops read only the shape of their input, so it may have any SBP (``P``
included) and the output splits with it. Sized factories (``full``, ``zeros``,
``ones``, ``new_*``) may split any output dim: the ``size`` argument is localized.
Zero-filled outputs may also be ``P`` (zeros sum to zeros); ones and other fills
only ``B`` or ``S``. ``arange`` and ``scalar_tensor`` stay ``B`` (a split ``arange``
would need per-rank start values).
"""
from __future__ import annotations

import torch

from .core import UNSPLIT, Call, Labels, letters

aten = torch.ops.aten

# op: is the output all zeros
LIKE = {aten.zeros_like.default: True, aten.ones_like.default: False,
        aten.full_like.default: False, aten.empty_like.default: False}
SIZED = {aten.zeros.default: True, aten.ones.default: False, aten.full.default: False,
         aten.new_zeros.default: True, aten.new_ones.default: False,
         aten.new_full.default: False}
UNSPLIT_FACTORIES = [aten.arange.default, aten.arange.start, aten.arange.start_step,
                     aten.scalar_tensor.default]


def like(call: Call) -> Labels:
    labels = letters(call["self"].ndim)
    zero = LIKE[call.target] or (call.target is aten.full_like.default and call["fill_value"] == 0)
    return Labels({"self": labels}, [labels], shape_only=["self"], zero_output=zero)


def sized(call: Call) -> Labels:
    zero = SIZED[call.target] or (call.get("fill_value") == 0 and "fill_value" in call.args)
    return Labels({}, [letters(call.outputs[0].ndim)], shape_only=["self"], zero_output=zero)


def unsplit(call: Call) -> Labels:
    return Labels({}, [UNSPLIT * call.outputs[0].ndim])


RULES = {**dict.fromkeys(LIKE, like), **dict.fromkeys(SIZED, sized),
         **dict.fromkeys(UNSPLIT_FACTORIES, unsplit)}


def local_size(call: Call, in_shapes, out_shapes) -> dict:
    return {"size": list(out_shapes[0])}


LOCALIZERS = dict.fromkeys(SIZED, local_size)
