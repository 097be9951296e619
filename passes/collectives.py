"""Insert the boxing collectives that a plan's SBP changes need.

For every edge whose producer's output SBP differs from the SBP the consumer's
signature requires, the redistribution of :func:`cost_models.boxing.boxing_cost`
is emitted step by step on the global graph (shapes stay global; each new node
carries its SBP, so :mod:`passes.localize` can size it like any other node):

- ``S(d)->B`` all-gather, ``P->S(d)`` reduce-scatter, ``P->B`` all-reduce: a
  ``torch.ops._c10d_functional`` collective and its ``wait_tensor``, on the
  process group of the step's mesh axis; a split dim other than 0 is moved to
  dim 0 around the collective (:func:`ddlc.comm.moved`). Splits follow
  ``torch.chunk`` (:mod:`ddlc.sbp`); when the axis cuts the dim unevenly, the
  collective runs on a zero-padded copy, DTensor's way: each rank pads its
  piece to the even size (:func:`ddlc.sbp.padded_shape`, :func:`ddlc.comm.padded`),
  and keeps its own rows of the result (:func:`ddlc.comm.narrowed`) -- after a
  reduce-scatter its chunk, after an all-gather the first ``n`` rows, which are
  the whole tensor because only trailing chunks are short. The padded sizes are
  the same on every rank of the group;
- ``S(i)->S(j)`` all-to-all: :func:`ddlc.comm.all_to_all_dims`;
- ``B->S(d)`` and ``B->P``: local (:func:`ddlc.comm.local_chunk`,
  :func:`ddlc.comm.keep_on_first`) with this rank's mesh coordinate.

A redistribution is emitted once per (tensor, target SBP) and shared by its
consumers. Graph outputs get the SBP the next step expects: updated
parameters and optimizer state their placeholder's, the loss and other
outputs ``B``. Every new node records its SBP (``ir.SHARDING``); each collective and
local boxing step also its :class:`ddlc.ir.CollectiveInfo` (``ir.COLLECTIVE``).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_flatten, tree_unflatten

from cost_models.boxing import BoxingStep, boxing_cost
from cost_models.collectives import axis_time
from ddlc import comm
from ddlc.errors import LoweringError
from ddlc.ir import (COLLECTIVE, ORIGIN, RANK_ARG, SHARDING, STEP, STRIDED_READERS, CollectiveInfo,
                     NdSignature, RankArg, is_getitem, where)
from ddlc.mesh import Mesh
from ddlc.sbp import B, NdSBP, S, local_shape, padded_shape
from passes.rules import selected_leaf

__all__ = ["insert_collectives", "output_targets"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _out_sbp(node: fx.Node) -> NdSBP:
    try:
        return SHARDING(node).output
    except ValueError:
        raise LoweringError(f"{node.name} has several tensor outputs; read it via getitem") from None


def _moved(sbp: NdSBP, src: int, dst: int) -> NdSBP:
    """The SBP of ``movedim(x, src, dst)`` for ``x`` placed ``sbp``."""
    order = list(range(max([src, dst] + [x.dim for x in sbp if x.is_split]) + 1))
    order.insert(dst, order.pop(src))  # order[new] = old
    return NdSBP(tuple(S(order.index(x.dim)) if x.is_split else x for x in sbp))


def _is_tensor_input(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


#: the argument of a local boxing step that is the rank's coordinate on its axis
_BY_COORDINATE = {"slice": lambda axis: RankArg(3, "index", axis),
                  "zero": lambda axis: RankArg(1, "first", axis)}


class _Emitter:
    """Emits redistributions before the node currently being rewired (``self.graph``'s
    insertion point), caching one per (tensor, target SBP)."""

    def __init__(self, graph: fx.Graph, mesh: Mesh, groups: Sequence[str], coord: Sequence[int]):
        self.graph, self.mesh, self.groups, self.coord = graph, mesh, list(groups), tuple(coord)
        self.cache: dict[tuple[fx.Node, NdSBP], fx.Node] = {}

    def node(self, target, args, val, sbp: NdSBP, origin, info=None) -> fx.Node:
        n = self.graph.call_function(target, args)
        n.meta["val"] = val
        if info is None:
            SHARDING.set(n, NdSignature((), (sbp,)))
        else:
            SHARDING.set(n, NdSignature((info.before,), (info.after,)))
            COLLECTIVE.set(n, info)
        if origin is not None:
            ORIGIN.set(n, origin)
        return n

    def redistribute(self, x: fx.Node, dst: NdSBP) -> fx.Node:
        src = _out_sbp(x)
        if src == dst:
            return x
        if (x, dst) not in self.cache:
            val = x.meta["val"]
            plan = boxing_cost(tuple(val.shape), val.element_size(), src, dst, self.mesh)
            if not plan.feasible:
                raise LoweringError(f"no redistribution of {x.name} from {src} to {dst} "
                                    "(S->P is refused)")
            cur = x
            for step in plan.steps:
                if self.mesh.shape[step.axis] > 1:  # on a one-device axis every step is the identity
                    cur = self.step(cur, step)
            self.cache[(x, dst)] = cur
        return self.cache[(x, dst)]

    def laid_out_as(self, x: fx.Node, boxed: fx.Node, reader: fx.Node) -> fx.Node:
        """``boxed`` (``x`` redistributed for ``reader``, which reads its storage through
        strides and an offset recorded from eager's layout: ``as_strided``) copied into a
        tensor of its own in ``x``'s layout. A collective's result is row-major, where the
        reader would read other elements of a layout that is not; and it need not own its
        storage: :mod:`passes.fuse` hands out views of its bucket, whose storage the reader
        would read from the bucket's start. A ``LoweringError`` where the reader reads a
        piece of a tensor that is not row-major (its recorded strides are the whole
        tensor's)."""
        val = x.meta["val"]
        if boxed is x:
            return boxed
        if not all(sbp.is_broadcast for sbp in _out_sbp(boxed)):
            if val.is_contiguous():
                return boxed
            raise LoweringError(f"{reader.name} ({reader.target}) reads {x.name} through the strides of "
                                f"its layout in eager ({tuple(val.stride())}), but the plan gives it a "
                                f"piece ({_out_sbp(boxed)}); pin {x.name}'s producer whole or make the "
                                "tensor contiguous (.contiguous()) in the model", where=where(reader))
        return self.node(comm.with_layout, (boxed, tuple(val.stride())), val, _out_sbp(boxed), ORIGIN.get(x))

    def step(self, x: fx.Node, step: BoxingStep) -> fx.Node:
        axis, p = step.axis, self.mesh.shape[step.axis]
        group, index = self.groups[axis], self.coord[axis]
        val, origin = x.meta["val"], ORIGIN.get(x)
        info = CollectiveInfo(step.kind, axis, self.mesh.axis_names[axis], p, step.nbytes,
                              step.seconds, step.before, step.after)
        local = {"slice": (comm.local_chunk, (x, step.dst_sbp.dim, p, index)),
                 "zero": (comm.keep_on_first, (x, index == 0)),
                 "all_to_all": (comm.all_to_all_dims,
                                (x, step.dst_sbp.dim, step.src_sbp.dim, p, group))}
        if step.kind in local:
            made = self.node(*local[step.kind], val, step.after, origin, info)
            if step.kind in _BY_COORDINATE:
                RANK_ARG.set(made, _BY_COORDINATE[step.kind](axis))
            return made
        if step.kind == "all_reduce":
            issued = self.node(c10d.all_reduce.default, (x, "sum", group), val, step.after,
                               origin, info)
            return self.node(c10d.wait_tensor.default, (issued,), val, step.after, origin)
        dim = (step.src_sbp if step.kind == "all_gather" else step.dst_sbp).dim
        return self._on_dim0(x, step, dim, origin)

    def _on_dim0(self, x, step, dim, origin) -> fx.Node:
        """All-gather or reduce-scatter along ``dim`` through dim 0 of a moved copy, padded
        to an even split when the axis cuts ``dim`` unevenly."""
        p, group = self.mesh.shape[step.axis], self.groups[step.axis]
        before, after, cur = step.before, step.after, x
        if dim:
            with detect_fake_mode([x.meta["val"]]):
                moved_val = x.meta["val"].movedim(dim, 0)
            before, after = _moved(before, dim, 0), _moved(after, dim, 0)
            cur = self.node(comm.moved, (x, dim, 0), moved_val, before, origin)
        unpadded = cur.meta["val"]
        shape = padded_shape(tuple(unpadded.shape), after if step.kind == "reduce_scatter" else before,
                             step.axis, self.mesh.shape)
        pad = shape != tuple(unpadded.shape)
        if pad:
            cur = self._padded(cur, shape, before, origin)
        info = self._info(step, shape, unpadded.element_size(), before, after)
        target, args = ((c10d.all_gather_into_tensor.default, (cur, p, group))
                        if step.kind == "all_gather"
                        else (c10d.reduce_scatter_tensor.default, (cur, "sum", p, group)))
        issued = self.node(target, args, cur.meta["val"], after, origin, info)
        done = self.node(c10d.wait_tensor.default, (issued,), cur.meta["val"], after, origin)
        if pad:
            rows = local_shape(tuple(unpadded.shape), after, self.mesh.shape, self.coord)[0]
            done = self.node(comm.narrowed, (done, rows), unpadded, after, origin)
        if not dim:
            return done
        return self.node(comm.moved, (done, 0, dim), x.meta["val"], step.after, origin)

    def _padded(self, x: fx.Node, shape: tuple[int, ...], sbp: NdSBP, origin) -> fx.Node:
        """``x`` zero-padded on dim 0 to the global ``shape`` (this rank's rows of it)."""
        with detect_fake_mode([x.meta["val"]]):
            val = x.meta["val"].new_zeros(shape)
        rows = local_shape(shape, sbp, self.mesh.shape, self.coord)[0]
        return self.node(comm.padded, (x, rows), val, sbp, origin)

    def _info(self, step: BoxingStep, shape, itemsize: int, before: NdSBP,
              after: NdSBP) -> CollectiveInfo:
        """The record of ``step`` run on the (moved, maybe padded) global ``shape``, placed
        ``before`` -> ``after``: padding adds to its bytes and seconds."""
        p = self.mesh.shape[step.axis]
        nbytes = itemsize * math.prod(local_shape(shape, before.replace(step.axis, B), self.mesh.shape))
        seconds = step.seconds if nbytes == step.nbytes else \
            axis_time(step.kind, nbytes, self.mesh, step.axis, step.algorithm)
        return CollectiveInfo(step.kind, step.axis, self.mesh.axis_names[step.axis], p, nbytes,
                              seconds, before, after)


def output_targets(gm: fx.GraphModule, ndim: int) -> list[NdSBP | None]:
    """The SBP each graph output must have: its placeholder's for loop-carried state, else B."""
    sig = STEP.get(gm)
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    loop = sig.loop_inputs() if sig else {}
    n_out = len(tree_flatten(next(n for n in gm.graph.nodes if n.op == "output").args[0])[0])
    return [_out_sbp(placeholders[loop[k]]) if k in loop else NdSBP.broadcast(ndim)
            for k in range(n_out)]


def _box_getitem(node: fx.Node, emit: _Emitter) -> None:
    """A getitem yields its source's leaf as placed; when the plan wants it elsewhere,
    redistribute right after it and let every user read the redistributed value."""
    source, _ = node.args
    actual = SHARDING(source).outputs[selected_leaf(node)]
    planned = SHARDING(node).outputs[0]
    if actual == planned:
        return
    users = list(node.users)
    SHARDING.set(node, NdSignature((actual,), (actual,)))
    with emit.graph.inserting_before(node.next):
        boxed = emit.redistribute(node, planned)
    for user in users:
        user.replace_input_with(node, boxed)


def insert_collectives(gm: fx.GraphModule, mesh: Mesh, groups: Sequence[str],
                       coord: Sequence[int]) -> fx.GraphModule:
    """Emit every redistribution the plan (``ir.SHARDING``) needs, for the rank at
    mesh coordinate ``coord`` whose per-axis process groups are named ``groups``."""
    emit = _Emitter(gm.graph, mesh, groups, coord)
    for node in list(gm.graph.nodes):
        if is_getitem(node) and isinstance(node.meta.get("val"), torch.Tensor):
            _box_getitem(node, emit)
            continue
        if node.op == "output":
            targets = iter(output_targets(gm, mesh.ndim))
        elif node.op == "call_function" and SHARDING.has(node):
            targets = iter(SHARDING(node).inputs)
        else:
            continue
        given, spec = tree_flatten((node.args, node.kwargs))
        with gm.graph.inserting_before(node):
            leaves = [emit.redistribute(a, next(targets)) if _is_tensor_input(a) else a
                      for a in given]
            if node.target in STRIDED_READERS:
                leaves = [emit.laid_out_as(a, boxed, node) if _is_tensor_input(a) else boxed
                          for a, boxed in zip(given, leaves)]
        if any(a is not b for a, b in zip(leaves, given)):  # else its inputs stay as they are
            node.args, node.kwargs = tree_unflatten(leaves, spec)
    gm.graph.lint()
    gm.recompile()
    return gm
