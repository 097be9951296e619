"""Rewrite a global-shape graph into the per-rank program on local shards.

Every node's local output shape follows from its global value, its SBP
(``ir.SHARDING``) and the rank's mesh coordinate (``torch.chunk`` pieces:
where a split is uneven, e.g. a padded decoupled parameter, shapes differ by
rank). Placeholders become local-shaped; each operator gets its shape arguments
rewritten by the rules' :func:`passes.rules.localize_args` (view sizes, expand
sizes, factory sizes, ...), then is re-run on fake local inputs; the result must
have exactly the local shape its SBP predicts, so a rule or localization error
stops compilation instead of producing wrong numbers.
Afterwards ``meta["val"]`` holds local values and ``ir.GLOBAL_VAL`` the global ones.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from ddlc.errors import LoweringError
from ddlc.ir import COLLECTIVE, GLOBAL_VAL, SHARDING, is_getitem, where
from ddlc.mesh import Mesh
from ddlc.printing import format_sharding
from ddlc.sbp import local_shape
from passes.rules import localize_args, tensor_inputs

__all__ = ["localize"]


def _expected(val, sbps, mesh: Mesh, coord: Sequence[int]) -> list:
    leaves = tree_leaves(val)
    sbps = list(sbps) + [None] * (len(leaves) - len(sbps))
    return [local_shape(tuple(v.shape), x, mesh.shape, coord)
            if isinstance(v, torch.Tensor) and x is not None else None for v, x in zip(leaves, sbps)]


def localize(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int]) -> fx.GraphModule:
    """Turn every shape in ``gm`` (annotated by sharding and collectives) into the local
    shapes of the rank at mesh coordinate ``coord``."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for node in gm.graph.nodes:
        if node.op == "output" or node.meta.get("val") is None:
            continue  # the output, or a getitem of a None (an unrequested gradient)
        info = SHARDING.get(node)
        if info is None:
            raise LoweringError(f"{node.name} has no sharding decision", where=where(node))
        GLOBAL_VAL.set(node, node.meta["val"])
        expected = _expected(node.meta["val"], info.outputs, mesh, coord)
        if node.op in ("placeholder", "get_attr"):
            (val,) = tree_leaves(node.meta["val"])
            with mode:
                node.meta["val"] = torch.empty(expected[0], dtype=val.dtype)
            continue
        if not (COLLECTIVE.has(node) or is_getitem(node)):
            in_shapes = [tuple(a.meta["val"].shape) for a in tensor_inputs(node)]
            node.args, node.kwargs = localize_args(node, in_shapes, expected)
        args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a,
                                (node.args, node.kwargs))
        try:
            with mode:
                out = node.target(*args, **kwargs)
        except Exception as e:
            raise LoweringError(f"{node.name} ({node.target}) does not run on its local shards: "
                                f"{type(e).__name__}: {e}", where=where(node)) from None
        got = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in tree_leaves(out)]
        if any(e is not None and e != g for e, g in zip(expected, got)):
            raise LoweringError(f"{node.name} ({node.target}) computes local shapes {got} but its "
                                f"SBP {format_sharding(info)} needs {expected}", where=where(node))
        node.meta["val"] = out
    gm.recompile()
    return gm
