"""Run every rank's lowered program in one process, collectives simulated exactly.

For tests of meshes larger than the local machine can host as processes. The
per-rank graphs come from :func:`ddlc.runtime.lower` with process-group names
``"axis0"``, ``"axis1"``, ...; they have the same nodes in the same order (only
rank-specific constants differ, e.g. chunk bounds and padding sizes; local shapes
differ where a split is uneven), so they run in lockstep: node ``i`` of every
rank, then node ``i + 1``. A collective node combines the values of its axis
group (ranks that share every other mesh coordinate, in axis order).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

from . import comm
from .mesh import Mesh

__all__ = ["axis_group_names", "run_ranks", "simulate_steps"]

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
        if target is _c10d.all_reduce.default:
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
    return out


SIMULATED = {_c10d.wait_tensor.default, _c10d.all_reduce.default, _c10d.all_gather_into_tensor.default,
             _c10d.reduce_scatter_tensor.default, comm.all_to_all_dims}


def run_ranks(graphs: Sequence[fx.GraphModule], mesh: Mesh, inputs: Sequence[Sequence]) -> list:
    """Run ``graphs[r]`` on ``inputs[r]`` for every rank ``r``; returns each rank's outputs."""
    node_lists = [list(g.graph.nodes) for g in graphs]
    envs = [dict() for _ in graphs]
    feeds = [iter(x) for x in inputs]
    results = [None] * len(graphs)
    for i, node in enumerate(node_lists[0]):
        if node.op == "call_function" and node.target in SIMULATED:
            args = {r: fx.node.map_arg(nodes[i].args, lambda a: envs[r][a])
                    for r, nodes in enumerate(node_lists)}
            for r, value in _collective(node.target, args, mesh).items():
                envs[r][node_lists[r][i]] = value
            continue
        for r, nodes in enumerate(node_lists):
            n = nodes[i]
            if n.op == "placeholder":
                envs[r][n] = next(feeds[r])
            elif n.op == "output":
                results[r] = fx.node.map_arg(n.args[0], lambda a: envs[r][a])
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: envs[r][a])
                envs[r][n] = n.target(*args, **kwargs)
    return results


def simulate_steps(gm: fx.GraphModule, mesh: Mesh, params: dict, buffers: dict, batches,
                   **lower_options) -> tuple:
    """Train with a sharded (plan-annotated) step graph on every rank of ``mesh`` in one
    process: lower it per rank, cut the global state and each batch into the ranks'
    pieces, run all ranks, and reassemble the new full state. Returns
    ``(losses, params, optimizer_state)``, all full tensors. ``lower_options`` go to
    :func:`ddlc.runtime.lower`."""
    import copy
    import itertools

    from .runtime import lower
    from .sbp import local_slices

    sig = gm.meta["ddlc_step"]
    coords = list(itertools.product(*(range(p) for p in mesh.shape)))
    graphs = [lower(copy.deepcopy(gm), mesh, c, axis_group_names(mesh), **lower_options)
              for c in coords]
    sbp = {n.name: n.meta["ddlc"].outputs[0] for n in gm.graph.nodes if n.op == "placeholder"}
    state = {"param": dict(params), "opt_state": sig.init_opt_state(params)}
    input_index = {(i.role, i.key): j for j, i in enumerate(sig.inputs)}
    losses = []
    for batch in batches:
        full = sig.flatten(state["param"], buffers, state["opt_state"], batch)
        pieces = [[t[local_slices(tuple(t.shape), sbp[i.name], mesh.shape, c)].contiguous()
                   for t, i in zip(full, sig.inputs)] for c in coords]
        outs = run_ranks(graphs, mesh, pieces)
        if any(float(o[0]) != float(outs[0][0]) for o in outs):
            raise AssertionError(f"ranks disagree on the loss: {[float(o[0]) for o in outs]}")
        losses.append(outs[0][0])
        for k, spec in enumerate(sig.outputs):
            if spec.role in ("param", "opt_state"):
                j = input_index[(spec.role, spec.key)]
                whole = torch.empty_like(full[j])
                for c, o in zip(coords, outs):
                    whole[local_slices(tuple(whole.shape), sbp[sig.inputs[j].name], mesh.shape, c)] = o[k]
                state[spec.role][spec.key] = whole
    return losses, state["param"], state["opt_state"]
