"""Time of one operator at its local shapes: a roofline over the hardware profile.

``time = max(flops / profile.flops_for(dtype), bytes / bandwidth)``, where the
bandwidth is the profile's cache bandwidth when the op's bytes fit its cache
(profiles that model one, e.g. those measured by ``python -m ddlc calibrate``),
else its memory bandwidth,
with FLOPs from PyTorch's own formula registry (``torch.utils.flop_counter``:
mm, addmm, bmm, baddbmm, convolution and its backward, SDPA and its backward,
...; 0 for operators it has no formula for, which are memory-bound; CPU variants
it lacks borrow the formula of their generic form, :data:`FLOP_ALIASES`) and bytes
the sum over the tensor inputs and outputs. Free (0 s): anything that is not a
torch operator (``operator.getitem``, Python arithmetic on sizes), views
(aliases of an input) and operators without a tensor output.
"""
from __future__ import annotations

import torch
from torch._ops import HigherOrderOperator, OpOverload
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ddlc.mesh import HardwareProfile

from .measured import measured_time

__all__ = ["FLOP_ALIASES", "op_flops", "op_bytes", "op_time", "tensors"]

_aten = torch.ops.aten

#: Operators missing from the registry -> the registered one with the same leading arguments.
FLOP_ALIASES = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        _aten._scaled_dot_product_flash_attention_backward,
}

#: Leaf types that hold no tensor (what an operator's arguments mostly are besides tensors).
_PLAIN = frozenset({int, float, bool, str, type(None), slice, torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
#: Containers whose pytree children are their items (fx keeps arguments in the immutable ones).
_SEQUENCES = frozenset({tuple, list, immutable_list})
_MAPPINGS = frozenset({dict, immutable_dict})


def tensors(tree) -> list[torch.Tensor]:
    """The tensors among ``tree``'s pytree leaves, in ``tree_leaves`` order. Tuples, lists
    and dicts (:data:`_SEQUENCES`, :data:`_MAPPINGS`: what fx arguments and values are made
    of) are walked here; other containers go to ``torch.utils._pytree.tree_leaves``."""
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


def _collect(tree, out: list) -> None:
    kind = type(tree)
    if kind in _SEQUENCES:
        for x in tree:
            _collect(x, out)
    elif kind in _MAPPINGS:
        for x in tree.values():
            _collect(x, out)
    elif isinstance(tree, torch.Tensor):
        out.append(tree)
    elif kind not in _PLAIN:
        out.extend(x for x in tree_leaves(tree) if isinstance(x, torch.Tensor))


def op_flops(target, args, kwargs, out) -> int:
    """FLOPs of ``target(*args, **kwargs) -> out`` by ``torch.utils.flop_counter``'s registry."""
    packet = getattr(target, "overloadpacket", target)
    formula = flop_registry.get(FLOP_ALIASES.get(packet, packet))
    return 0 if formula is None else int(formula(*args, **(kwargs or {}), out_val=out))


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def op_bytes(args, kwargs, out) -> int:
    """Bytes read and written: every tensor input and output once."""
    return _nbytes(tensors((args, kwargs, out)))


def op_time(target, args, kwargs, out, profile: HardwareProfile) -> float:
    """Seconds for one call at the shapes of ``args``/``kwargs``/``out`` (tensors or fakes)."""
    if profile.compute == "measured":  # cost_models/measured.py
        return measured_time(target, args, kwargs, out, profile, op_time)
    outs = tensors(out)
    if (not outs or not isinstance(target, (OpOverload, HigherOrderOperator))
            or getattr(target, "is_view", False)):
        return 0.0
    ins = tensors((args, kwargs))
    dtype = (ins or outs)[0].dtype
    flop_time = op_flops(target, args, kwargs, out) / profile.flops_for(str(dtype))
    nbytes = _nbytes(ins) + _nbytes(outs)
    cached = profile.cache_bandwidth > 0 and nbytes <= profile.cache_bytes
    return max(flop_time, nbytes / (profile.cache_bandwidth if cached else profile.memory_bandwidth))
