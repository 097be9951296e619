"""Rewrite a global-shape graph into the per-rank program on local shards.

Every node's local output shape follows from its global value, its SBP
(``ir.SHARDING``) and the rank's mesh coordinate (``torch.chunk`` pieces:
where a split is uneven, e.g. a padded decoupled parameter, shapes differ by
rank). Placeholders become local-shaped; each operator gets its shape arguments
rewritten by the rules' :func:`passes.rules.localize_args` (view sizes, expand
sizes, factory sizes, ...), then is re-run on fake local inputs (once per distinct
call: repeated layers share the run, :class:`_Runs`; the fake mode, not the meta
kernels alone, as some of those answer by device: CPU's eval-mode ``native_batch_norm``
saves no statistics, its meta kernel does); the result must
have exactly the local shape its SBP predicts, so a rule or localization error
stops compilation instead of producing wrong numbers.
Afterwards ``meta["val"]`` holds local values and ``ir.GLOBAL_VAL`` the global ones.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ddlc import comm
from ddlc.errors import LoweringError
from ddlc.fake import empty_fake
from ddlc.ir import COLLECTIVE, GLOBAL_VAL, SHARDING, frozen, is_getitem, leaves, map_leaves, where
from ddlc.mesh import Mesh
from ddlc.printing import format_sharding
from ddlc.sbp import local_shape
from passes.rules import localize_args, tensor_inputs

__all__ = ["localize"]


def _expected(val, sbps, mesh: Mesh, coord: Sequence[int]) -> list:
    values = leaves(val)
    sbps = list(sbps) + [None] * (len(values) - len(sbps))
    return [local_shape(tuple(v.shape), x, mesh.shape, coord)
            if isinstance(v, torch.Tensor) and x is not None else None for v, x in zip(values, sbps)]


#: The boxing pieces the collectives pass inserts (:mod:`ddlc.comm`): Python functions whose
#: result's metadata follows from their arguments' metadata and other arguments alone,
#: like an operator's (:class:`_Runs` runs them once per distinct call; a piece that
#: happens to be a view of its input, a contiguous slice, carries no values either).
_BOXING_PIECES = frozenset({comm.moved, comm.local_chunk, comm.padded, comm.keep_on_first, comm.with_layout})


class _Runs:
    """Fake runs of operators, one per distinct call: an operator that returns fresh
    tensors (no mutation, no aliasing in its schema), or a boxing piece
    (:data:`_BOXING_PIECES`), computes the same output metadata for inputs of the same
    metadata and the same other arguments, so repeated layers and the per-parameter
    optimizer chains reuse one run's output (fake tensors hold no values; a multi-output
    node's getitems already share its tensors)."""

    def __init__(self):
        self.outputs: dict = {}
        self.pure: dict = {}

    def run(self, target, args, kwargs, mode):
        key = self._key(target, args, kwargs)
        if key is not None and key in self.outputs:
            return self.outputs[key]
        with mode:
            out = target(*args, **kwargs)
        if key is not None:
            given = {id(t) for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if not any(id(t) in given for t in leaves(out) if isinstance(t, torch.Tensor)):
                self.outputs[key] = out
        return out

    def _key(self, target, args, kwargs):
        if target not in self.pure:
            schema = getattr(target, "_schema", None)
            self.pure[target] = target in _BOXING_PIECES or (
                isinstance(target, torch._ops.OpOverload) and schema is not None
                and not schema.is_mutable and not any(r.alias_info for r in schema.returns))
        if not self.pure[target]:
            return None
        try:
            key = (target, frozen(args, _layout), frozen(kwargs, _layout))
            hash(key)
        except TypeError:
            return None
        return key


def _layout(t: torch.Tensor) -> tuple:
    """What a fake run's output metadata can depend on of an input tensor."""
    return ("tensor", tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.layout, t.requires_grad)


def localize(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int]) -> fx.GraphModule:
    """Turn every shape in ``gm`` (annotated by sharding and collectives) into the local
    shapes of the rank at mesh coordinate ``coord``."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    runs = _Runs()
    for node in gm.graph.nodes:
        if node.op == "output" or node.meta.get("val") is None:
            continue  # the output, or a getitem of a None (an unrequested gradient)
        info = SHARDING.get(node)
        if info is None:
            raise LoweringError(f"{node.name} has no sharding decision", where=where(node))
        GLOBAL_VAL.set(node, node.meta["val"])
        expected = _expected(node.meta["val"], info.outputs, mesh, coord)
        if node.op in ("placeholder", "get_attr"):
            (val,) = leaves(node.meta["val"])
            node.meta["val"] = empty_fake(mode, expected[0], val.dtype, val.device)
            continue
        if not (COLLECTIVE.has(node) or is_getitem(node)):
            in_shapes = [tuple(a.meta["val"].shape) for a in tensor_inputs(node)]
            node.args, node.kwargs = localize_args(node, in_shapes, expected)
        args, kwargs = map_leaves(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a,
                                (node.args, node.kwargs))
        try:
            out = runs.run(node.target, args, kwargs, mode)
        except Exception as e:
            raise LoweringError(f"{node.name} ({node.target}) does not run on its local shards: "
                                f"{type(e).__name__}: {e}", where=where(node)) from None
        got = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in leaves(out)]
        if any(e is not None and e != g for e, g in zip(expected, got)):
            raise LoweringError(f"{node.name} ({node.target}) computes local shapes {got} but its "
                                f"SBP {format_sharding(info)} needs {expected}", where=where(node))
        node.meta["val"] = out
    gm.recompile()
    return gm
