"""Time of one operator at its local shapes: a roofline over the hardware profile.

``time = max(flops / profile.flops_for(dtype), bytes / bandwidth)``, where the
bandwidth is the profile's cache bandwidth when the op's bytes fit its cache
(profiles that model one, e.g. those measured by ``python -m ddlc calibrate``),
else its memory bandwidth,
with FLOPs from PyTorch's own formula registry (``torch.utils.flop_counter``:
mm, addmm, bmm, baddbmm, convolution and its backward, SDPA and its backward,
...; 0 for operators it has no formula for, which are memory-bound; CPU variants
it lacks borrow the formula of their generic form, :data:`FLOP_ALIASES`) and bytes
the sum over the tensor inputs and outputs. A parameter's optimizer update
(``ddlc::optimizer_update``) costs what the operators it runs cost, each priced so
(:func:`ddlc.fused_update.parts`). Free (0 s): anything that is not a
torch operator (``operator.getitem``, Python arithmetic on sizes), views
(aliases of an input) and operators without a tensor output.
"""
from __future__ import annotations

import torch
from torch._ops import HigherOrderOperator, OpOverload
from torch.utils.flop_counter import flop_registry

from ddlc import fused_update
from ddlc.ir import leaves
from ddlc.mesh import HardwareProfile

from .measured import measured_time

__all__ = ["FLOP_ALIASES", "op_flops", "op_bytes", "op_time", "memory_seconds", "tensors"]

_aten = torch.ops.aten

#: Operators missing from the registry -> the registered one with the same leading arguments.
FLOP_ALIASES = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        _aten._scaled_dot_product_flash_attention_backward,
}

def tensors(tree) -> list[torch.Tensor]:
    """The tensors among ``tree``'s pytree leaves, in ``tree_leaves`` order
    (:func:`ddlc.ir.leaves`)."""
    return [x for x in leaves(tree) if isinstance(x, torch.Tensor)]


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
    if target is fused_update.OP:
        return _update_time(args, profile)
    if profile.compute == "measured":  # cost_models/measured.py
        return measured_time(target, args, kwargs, out, profile, op_time)
    if not isinstance(target, (OpOverload, HigherOrderOperator)) or getattr(target, "is_view", False):
        return 0.0
    outs = tensors(out)
    if not outs:
        return 0.0
    ins = tensors((args, kwargs))
    dtype = (ins or outs)[0].dtype
    flop_time = op_flops(target, args, kwargs, out) / profile.flops_for(str(dtype))
    return max(flop_time, memory_seconds(_nbytes(ins) + _nbytes(outs), profile))


_UPDATE_TIMES: dict[tuple, float] = {}


def _update_time(args, profile: HardwareProfile) -> float:
    """The summed :func:`op_time` of the operators an optimizer update runs, once per
    profile and input metadata."""
    inputs = fused_update.update_inputs(args)
    key = (profile, args[0], args[1],
           tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in inputs))
    if key not in _UPDATE_TIMES:
        _UPDATE_TIMES[key] = sum(op_time(t, a, k, out, profile) for t, a, k, out in fused_update.parts(args))
    return _UPDATE_TIMES[key]


def memory_seconds(nbytes: float, profile: HardwareProfile) -> float:
    """Seconds to move ``nbytes`` through memory: the first ``profile.cache_bytes`` at the
    cache level's bandwidth, the rest at memory's. A working set a little larger than the
    cache streams only its excess from further out: on the 2-core Xeon, one process alone,
    an add runs at 130 GB/s with its three tensors in 1 MiB and at 25 GB/s in 4-16 MiB;
    in 1.5 MiB it takes 22 µs, which this prices at 29 µs, where pricing all of it at
    memory's bandwidth gave 63 µs; far beyond the cache the two agree."""
    if profile.cache_bandwidth <= 0:
        return nbytes / profile.memory_bandwidth
    cached = min(nbytes, profile.cache_bytes)
    return cached / profile.cache_bandwidth + (nbytes - cached) / profile.memory_bandwidth
