"""Another rank's program from one rank's lowered program, without lowering again.

Where a plan splits every tensor evenly, every rank's local shapes are the same, and
lowering makes the same graph for every mesh coordinate (the same nodes, names and
order, given the same choices), but for a few arguments: the piece a local slice keeps
(:func:`ddlc.comm.local_chunk`'s index), whether the rank keeps a value that becomes a
partial sum (:func:`ddlc.comm.keep_on_first`), and the piece of a random draw
(:func:`ddlc.rng.draw`). The passes that make those nodes mark that argument
(``ir.RANK_ARG``); :func:`for_coordinate` recomputes each for the coordinate wanted. Process
groups are named alike on every rank (``ddlc.runtime`` names each mesh axis's group the
same everywhere), so collectives need no change. ``tests/test_retarget.py`` checks that the
result is the program lowering makes for that coordinate itself.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

from ddlc.errors import LoweringError
from ddlc.ir import GLOBAL_VAL, RANK_ARG, SHARDING, RankArg, leaves
from ddlc.mesh import Mesh
from ddlc.sbp import local_shape, local_slices

__all__ = ["for_coordinate"]


def for_coordinate(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int]) -> fx.GraphModule:
    """``gm``, a program lowered for some mesh coordinate of a plan that splits every
    tensor evenly, made the program of mesh coordinate ``coord`` (in place): every
    ``ir.RANK_ARG`` argument recomputed. A ``LoweringError`` where a node's local shape is
    not the one ``coord`` holds (an uneven plan: lower each coordinate instead)."""
    coord = tuple(coord)
    for node in gm.graph.nodes:
        _check_local_shapes(node, mesh, coord)
        arg = RANK_ARG.get(node)
        if arg is not None:
            node.update_arg(arg.position, _value(arg, mesh, coord))
    gm.recompile()
    return gm


def _value(arg: RankArg, mesh: Mesh, coord: tuple[int, ...]):
    if arg.kind == "index":
        return coord[arg.axis]
    if arg.kind == "first":
        return coord[arg.axis] == 0
    if arg.kind == "piece":
        return local_slices(arg.shape, arg.sbp, mesh.shape, coord)
    raise ValueError(f"unknown rank-dependent argument {arg.kind!r}")


def _check_local_shapes(node: fx.Node, mesh: Mesh, coord: tuple[int, ...]) -> None:
    sharding = SHARDING.get(node)
    if sharding is None or not GLOBAL_VAL.has(node):
        return
    for whole, local, sbp in zip(leaves(GLOBAL_VAL(node)), leaves(node.meta.get("val")), sharding.outputs):
        if isinstance(whole, torch.Tensor) and isinstance(local, torch.Tensor) and sbp is not None \
                and tuple(local.shape) != local_shape(tuple(whole.shape), sbp, mesh.shape, coord):
            raise LoweringError(f"{node.name}'s piece at mesh coordinate {coord} has another shape "
                                f"than the program's ({tuple(local.shape)}): only the program of a "
                                "plan that splits every tensor evenly serves every rank")
