"""Run every rank's lowered program in one process, collectives simulated exactly.

For tests of meshes larger than the local machine can host as processes. The
per-rank graphs come from :func:`ddlc.pipeline.lower` with process-group names
``"axis0"``, ``"axis1"``, ...; they issue the same collectives in the same order (their
local nodes may differ: rank-specific constants such as chunk bounds and padding sizes,
local shapes where a split is uneven, a contiguous copy only one rank's piece needs).
Each rank runs up to its next collective, then the ranks' collectives run together: a
collective combines the values of its axis group (ranks that share every other mesh
coordinate, in axis order).
"""
from __future__ import annotations

import copy
import itertools
from typing import Sequence

import torch
from torch import fx

from . import comm
from .errors import RuntimeMismatchError
from .ir import SHARDING, STEP, is_collective, is_wait
from .mesh import Mesh
from .options import CompileOptions
from .pipeline import LoweringChoices, lower, retarget, splits_evenly
from .sbp import local_slices

__all__ = ["axis_group_names", "lower_rank", "lower_ranks", "run_ranks", "simulate_steps"]

_c10d = torch.ops._c10d_functional


def axis_group_names(mesh: Mesh) -> list[str]:
    return [f"axis{k}" for k in range(mesh.ndim)]


def _group(mesh: Mesh, rank: int, group_name: str) -> list[int]:
    axis = int(group_name.removeprefix("axis"))
    return next(g for g in mesh.axis_groups(axis) if rank in g)


def _collective(target, args_by_rank: dict[int, tuple], mesh: Mesh) -> dict[int, torch.Tensor]:
    out = {}
    for rank, args in args_by_rank.items():
        if target is _c10d.wait_tensor.default:
            out[rank] = args[0]
            continue
        group = _group(mesh, rank, args[-1])
        values = [args_by_rank[r][0] for r in group]
        me = group.index(rank)
        if target in (_c10d.all_reduce.default, _c10d.all_reduce_.default):
            out[rank] = torch.stack(values).sum(0)
        elif target is _c10d.all_gather_into_tensor.default:
            out[rank] = torch.cat(values, 0)
        elif target is _c10d.reduce_scatter_tensor.default:
            out[rank] = torch.stack(values).sum(0).chunk(len(group), 0)[me].clone()
        elif target is comm.all_to_all_dims:
            _, split_dim, cat_dim, parts, _ = args
            out[rank] = torch.cat([v.chunk(parts, split_dim)[me] for v in values], cat_dim)
        else:
            raise NotImplementedError(f"no simulation of {target}")
    if target is _c10d.all_reduce_.default:  # in place: every rank's sum in its input
        for rank, args in args_by_rank.items():
            out[rank] = args[0].copy_(out[rank])
    return out


def _simulated(node: fx.Node) -> bool:
    """Whether ``node`` communicates (a collective, its wait, or the all-to-all kernel)."""
    return is_collective(node) or is_wait(node) or (node.op == "call_function"
                                                    and node.target is comm.all_to_all_dims)


def run_ranks(graphs: Sequence[fx.GraphModule], mesh: Mesh, inputs: Sequence[Sequence]) -> list:
    """Run ``graphs[r]`` on ``inputs[r]`` for every rank ``r``; returns each rank's outputs.
    Each rank runs its own nodes up to its next collective; the ranks' k-th collectives
    run together (the programs may differ in local nodes, e.g. a contiguous copy only a
    rank with a strided piece needs, never in their collectives). A program may overwrite
    its parameter, buffer and optimizer-state inputs (:mod:`passes.inplace`): give every
    rank, and every run, tensors of its own."""
    node_lists = [list(g.graph.nodes) for g in graphs]
    envs = [dict() for _ in graphs]
    feeds = [iter(x) for x in inputs]
    results = [None] * len(graphs)
    cursors = [0] * len(graphs)

    def run_to_collective(r: int) -> fx.Node | None:
        """Run rank ``r``'s nodes up to its next collective (returned; None at the end)."""
        nodes, env = node_lists[r], envs[r]
        while cursors[r] < len(nodes):
            n = nodes[cursors[r]]
            if _simulated(n):
                return n
            cursors[r] += 1
            if n.op == "placeholder":
                env[n] = next(feeds[r])
            elif n.op == "get_attr":
                env[n] = getattr(graphs[r], n.target)
            elif n.op == "output":
                results[r] = fx.node.map_arg(n.args[0], env.__getitem__)
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = n.target(*args, **kwargs)
        return None

    while True:
        issued = [run_to_collective(r) for r in range(len(graphs))]
        if all(n is None for n in issued):
            return results
        if any(n is None or n.target is not issued[0].target for n in issued):
            raise RuntimeMismatchError("the ranks' programs issue different collectives: "
                                       + ", ".join(f"rank {r}: {n.target if n is not None else 'none'}"
                                                   for r, n in enumerate(issued)))
        args = {r: fx.node.map_arg(n.args, envs[r].__getitem__) for r, n in enumerate(issued)}
        for r, value in _collective(issued[0].target, args, mesh).items():
            envs[r][issued[r]] = value
        cursors = [c + 1 for c in cursors]


def lower_rank(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int], groups: Sequence[str] | None = None,
               choices: LoweringChoices | None = None, **options) -> fx.GraphModule:
    """:func:`ddlc.pipeline.lower` of a planned graph (in place) for the rank at ``coord``,
    with :class:`CompileOptions` fields as keywords; groups default to
    :func:`axis_group_names`; ``choices`` as for :func:`ddlc.pipeline.lower`."""
    groups = axis_group_names(mesh) if groups is None else groups
    lower(gm, mesh, coord, groups, CompileOptions.from_kwargs(**options), choices)
    return gm


def lower_ranks(gm: fx.GraphModule, mesh: Mesh, **options) -> list[fx.GraphModule]:
    """Every rank's program of a planned graph, in mesh-coordinate order (``gm`` is not
    changed); ``options`` as for :func:`lower_rank`. As in ``ddlc.compile``, coordinate 0
    is lowered first; where the plan splits every tensor evenly the others are its
    program made theirs (:func:`ddlc.pipeline.retarget`), else they take its choices."""
    coords = list(itertools.product(*(range(p) for p in mesh.shape)))
    first = copy.deepcopy(gm)
    choices = lower(first, mesh, coords[0], axis_group_names(mesh), CompileOptions.from_kwargs(**options))
    if splits_evenly(gm, mesh):
        return [first] + [retarget(copy.deepcopy(first), mesh, c) for c in coords[1:]]
    return [first] + [lower_rank(copy.deepcopy(gm), mesh, c, choices=choices, **options)
                      for c in coords[1:]]


def simulate_steps(gm: fx.GraphModule, mesh: Mesh, params: dict, buffers: dict, batches,
                   **lower_options) -> tuple:
    """Train with a sharded (plan-annotated) step graph on every rank of ``mesh`` in one
    process: lower it per rank, cut the global state and each batch (a tuple of tensors,
    or a dict for a keyword batch) into the ranks' pieces, run all ranks, and reassemble
    the new full state. Returns ``(losses, params, optimizer_state, buffers)``, all full
    tensors. ``lower_options`` are :class:`ddlc.options.CompileOptions` fields for
    :func:`ddlc.pipeline.lower`."""
    sig = STEP(gm)
    coords = list(itertools.product(*(range(p) for p in mesh.shape)))
    graphs = lower_ranks(gm, mesh, **lower_options)
    sbp = {n.name: SHARDING(n).outputs[0] for n in gm.graph.nodes if n.op == "placeholder"}
    state = {"param": dict(params), "opt_state": sig.init_opt_state(params), "buffer": dict(buffers)}
    input_index = {(i.role, i.key): j for j, i in enumerate(sig.inputs)}
    losses = []
    for batch in batches:
        full = sig.flatten(state["param"], state["buffer"], state["opt_state"], batch)
        # every rank its own copies: a program may overwrite its state inputs (passes/inplace.py)
        pieces = [[t[local_slices(tuple(t.shape), sbp[i.name], mesh.shape, c)].clone(
                       memory_format=torch.contiguous_format) for t, i in zip(full, sig.inputs)]
                  for c in coords]
        outs = run_ranks(graphs, mesh, pieces)
        if any(float(o[0]) != float(outs[0][0]) for o in outs):
            what = "every rank's loss is NaN" if all(o[0].isnan() for o in outs) else "ranks disagree on the loss"
            raise AssertionError(f"{what}: {[float(o[0]) for o in outs]}")
        losses.append(outs[0][0])
        for k, spec in enumerate(sig.outputs):
            if spec.role in ("param", "opt_state", "buffer"):
                j = input_index[(spec.role, spec.key)]
                whole = torch.empty_like(full[j])
                for c, o in zip(coords, outs):
                    whole[local_slices(tuple(whole.shape), sbp[sig.inputs[j].name], mesh.shape, c)] = o[k]
                state[spec.role][spec.key] = whole
    return losses, state["param"], state["opt_state"], state["buffer"]
