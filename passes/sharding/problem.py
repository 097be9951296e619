"""The sharding problem of one traced step: candidates, unary and pairwise costs.

Variables are groups of nodes that share one n-D signature index: a parameter
placeholder together with its same-shaped optimizer-state placeholders (they
share a placement); every other node is its own variable. For variable ``v``
with candidate ``k``:

- ``unary[v][k]``: compute seconds of its nodes at local shapes (roofline of
  :mod:`cost_models.compute`) plus the boxing of graph outputs that must be
  ``B`` (the loss, forward outputs);
- ``memory[v][k]``: resident bytes per device: parameters twice (the gradient
  shares the placement), optimizer state, batch inputs, and forward activations
  that the backward pass reads (saved activations);
- for each edge (producer output -> consumer input) ``cost[k_src, k_dst]``:
  boxing seconds from the producer's output SBP to the SBP the consumer's
  signature requires (:mod:`cost_models.boxing`). Updated parameters and
  optimizer state feed the next step, so each has a *loop edge* to its
  placeholder: the step must end in the placement it started from.
  Parameter traffic (reads of parameters and optimizer state from their
  placeholders, gradients entering the update, loop edges) is priced without
  start-up latency: :mod:`passes.fuse` buckets those collectives, so a start-up
  is shared by many tensors instead of paid per tensor.

The objective of an assignment is the sum of unary and edge costs: the modeled
step time without overlap (the scheduling pass hides what it can later). An activation
that several operators read reaches them through an alias (:mod:`passes.shared_reads`),
a variable like any node: one redistribution to the alias's placement serves them all.

The solvers' shared pieces live here too: :func:`fold_block` (the sub-problem of a
block of variables with the rest fixed; also :meth:`ShardingProblem.local_cost`) and
:func:`reduce_costs` / :func:`reduce_problem` (the exact reduction of degree <= 2
variables that runs before every solver).
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

import numpy as np
import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from cost_models.boxing import boxing_table
from cost_models.compute import op_time
from ddlc.errors import ShardingError
from ddlc.ir import ORIGIN, ROLE, SHARDING, SHARED_READ, STEP, is_scalar_valued, leaves, map_leaves, output_scalars, phase_of, where
from ddlc.mesh import Mesh
from ddlc.sbp import B, NdSBP, S, local_shape, plannable, why_not_plannable
from passes.rules import NdSignature, call_key, is_tensor_node, selected_leaf, signatures_nd, tensor_inputs

__all__ = ["Edge", "ShardingProblem", "build_problem", "lone_scalar_axes", "gradient_only_rides", "compute_seconds", "fold_block", "reduce_problem",
           "reduce_costs", "FORBIDDEN"]

#: Finite stand-in for an impossible redistribution (keeps the MILP numeric).
FORBIDDEN = 1e6


@dataclass
class Edge:
    """``cost[k_src, k_dst]`` between two variables; ``what`` says why it exists (empty for
    the edges of a block's or a reduction's own sub-problem, when no one reads it)."""

    src: int
    dst: int
    cost: np.ndarray
    what: str = ""


@dataclass
class ShardingProblem:
    gm: fx.GraphModule
    mesh: Mesh
    nodes: list[fx.Node]                       # decision nodes in graph order
    var_of: dict[fx.Node, int]                 # node -> variable
    members: list[list[fx.Node]]               # variable -> its nodes (first = representative)
    candidates: list[list[NdSignature]]        # per variable (shared by its members)
    compute: list[np.ndarray]                  # per variable, seconds
    sink: list[np.ndarray]                     # per variable, seconds of output boxing
    memory: list[np.ndarray]                   # per variable, bytes
    edges: list[Edge]
    incident: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self.incident = [[] for _ in self.members]
        for i, e in enumerate(self.edges):
            self.incident[e.src].append(i)
            if e.dst != e.src:
                self.incident[e.dst].append(i)
        self.unary = [c + s for c, s in zip(self.compute, self.sink)]

    @property
    def num_vars(self) -> int:
        return len(self.members)

    def objective(self, choice: Sequence[int]) -> float:
        total = sum(float(u[k]) for u, k in zip(self.unary, choice))
        return total + sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in self.edges)

    def memory_of(self, choice: Sequence[int]) -> float:
        return float(sum(m[k] for m, k in zip(self.memory, choice)))

    def local_cost(self, v: int, choice: Sequence[int]) -> np.ndarray:
        """Cost of every candidate of ``v`` with all other variables fixed: the fold of the
        one-variable block ``[v]`` (:func:`fold_block`)."""
        (total,), _ = fold_block(self, [v], choice)
        return total

    def min_memory(self) -> tuple[float, list[tuple[str, float]]]:
        """The smallest resident bytes any assignment needs (memory is separable),
        and the variables that dominate it, largest first."""
        per_var = [(self.members[v][0].name, float(self.memory[v].min())) for v in range(self.num_vars)]
        return sum(b for _, b in per_var), sorted(per_var, key=lambda x: -x[1])


def fold_block(problem: ShardingProblem, block: Sequence[int],
               choice: Sequence[int]) -> tuple[list[np.ndarray], list[Edge]]:
    """The sub-problem of the variables in ``block`` with every other variable fixed at
    ``choice``: per block variable (in ``block`` order) its unary cost with every edge
    that has exactly one end in the block folded in (``cost[:, choice[dst]]`` for an
    edge leaving it, ``cost[choice[src], :]`` for one entering it) and every self-loop
    (``src == dst``) on its diagonal; and the edges with both ends in the block, with
    block-local indices, each once (from its source). Terms are added in the order of
    ``problem.incident``, so every caller sums alike."""
    local = {v: i for i, v in enumerate(block)}
    unary = [problem.unary[v].copy() for v in block]
    edges = []
    for i, v in enumerate(block):
        for ei in problem.incident[v]:
            e = problem.edges[ei]
            if e.src == e.dst:
                unary[i] += np.diag(e.cost)
            elif e.src in local and e.dst in local:
                if e.src == v:
                    edges.append(Edge(local[e.src], local[e.dst], e.cost, e.what))
            elif e.src == v:
                unary[i] += e.cost[:, choice[e.dst]]
            else:
                unary[i] += e.cost[choice[e.src], :]
    return unary, edges


# -- candidates -----------------------------------------------------------------

def _tensor_vals(node: fx.Node) -> list:
    return [v for v in leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]


def _placement_candidates(shape: tuple[int, ...], mesh: Mesh) -> list[NdSBP]:
    """Every B / S(d) combination over the mesh axes that may place ``shape``
    (:func:`ddlc.sbp.plannable`: even splits, and uneven ones on one axis); B alone on an
    axis of one device, where a split is the whole tensor too (the same costs: the
    candidates would only repeat each other)."""
    splits = [S(d) for d in range(len(shape))]
    sbps = [NdSBP(c) for c in itertools.product(*([B] + (splits if p > 1 else []) for p in mesh.shape))]
    return [x for x in sbps if plannable(shape, x, mesh.shape)]


def _placeholder_signatures(node: fx.Node, mesh: Mesh,
                            fixed: Mapping[str, NdSBP]) -> list[NdSignature]:
    (val,) = _tensor_vals(node)
    if node.name in fixed:
        sbps = [fixed[node.name]]
        if not plannable(tuple(val.shape), sbps[0], mesh.shape):
            gm = node.graph.owning_module
            step = STEP.get(gm) if gm is not None else None
            what = step.describe_input(node.name) if step is not None else f"input {node.name!r}"
            why = why_not_plannable(tuple(val.shape), sbps[0], mesh.shape)
            raise ShardingError(f"the requested placement {sbps[0]} of {what} "
                                f"cannot cut its shape {tuple(val.shape)} on mesh {mesh}: {why}")
    elif node.op == "get_attr":
        sbps = [NdSBP.broadcast(mesh.ndim)]
    else:
        sbps = _placement_candidates(tuple(val.shape), mesh)
    return [NdSignature((), (x,)) for x in sbps]


# -- costs ----------------------------------------------------------------------

def _local(val: torch.Tensor, sbp: NdSBP | None, mesh: Mesh) -> torch.Tensor:
    shape = tuple(val.shape) if sbp is None else local_shape(tuple(val.shape), sbp, mesh.shape)
    return torch.empty(shape, dtype=val.dtype, device="meta")


def compute_seconds(node: fx.Node, sig: NdSignature, mesh: Mesh) -> float:
    """Roofline time of ``node`` at the local shapes ``sig`` gives it."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    out_leaves, out_spec = tree_flatten(node.meta.get("val"))
    local_out = [_local(v, x, mesh) if isinstance(v, torch.Tensor) else v
                 for v, x in zip(out_leaves, sig.outputs)]
    in_sbps = iter(sig.inputs)  # by position: one tensor may be read as several arguments

    def to_local(a):
        if not isinstance(a, fx.Node):
            return a
        return _local(a.meta["val"], next(in_sbps), mesh) if is_tensor_node(a) else a.meta.get("val")

    args, kwargs = map_leaves(to_local, (node.args, node.kwargs))
    return op_time(node.target, args, kwargs, out_spec.unflatten(local_out), mesh.profile)


class _NodeSeconds:
    """:func:`compute_seconds` of one node, priced once per distinct local shapes: its
    candidates that give every tensor input and output the same local shape (``P`` and
    ``B``, or splits of equal pieces) cost the same, since the time depends on nothing
    else. ``shapes`` caches local shapes (shared by the nodes of one build)."""

    def __init__(self, node: fx.Node, mesh: Mesh, shapes: dict):
        self.node, self.mesh, self.shapes = node, mesh, shapes
        self.priced = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        if self.priced:
            self.inputs = tensor_inputs(node)
            self.in_shapes = {a: tuple(a.meta["val"].shape) for a in self.inputs}
            self.out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None
                               for v in leaves(node.meta.get("val"))]
        self.seconds: dict = {}

    def _local(self, shape, sbp):
        if shape is None or sbp is None:
            return None
        key = (shape, sbp)
        if key not in self.shapes:
            self.shapes[key] = local_shape(shape, sbp, self.mesh.shape)
        return self.shapes[key]

    def __call__(self, sig: NdSignature) -> float:
        if not self.priced:
            return 0.0
        key = (tuple(self._local(self.in_shapes[a], x) for a, x in zip(self.inputs, sig.inputs)),
               tuple(self._local(s, x) for s, x in zip(self.out_shapes, sig.outputs)))
        if key not in self.seconds:
            self.seconds[key] = compute_seconds(self.node, sig, self.mesh)
        return self.seconds[key]


class PriceCache:
    """The prices of one :func:`build_problem` call, cached so that repeated layers are
    cheap: every variable gets a *kind* (an int standing for what its candidates and
    costs depend on: the op with its shapes and arguments, or a placeholder's
    placements), and compute, memory and edge-matrix vectors are priced once per kind.
    A build makes its own, or reuses one of an earlier build of the same graph and mesh
    (every key names all its value depends on), so the caches grow with one graph's
    distinct kinds and no further."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.meshes = {frozenset(): mesh}  # start-up-free axes -> the mesh pricing them
        self.kinds: dict = {}
        self.vectors: dict = {}
        self.nbytes: dict = {}
        self.tables: dict = {}
        self.shapes: dict = {}

    def kind(self, key) -> int:
        return self.kinds.setdefault(key, len(self.kinds))

    def cached(self, key, make):
        """``make()`` once per ``key``; the array is shared, so it is made read-only."""
        if key not in self.vectors:
            value = make()
            value.flags.writeable = False
            self.vectors[key] = value
        return self.vectors[key]

    def tensor_bytes(self, val: torch.Tensor, sbp: NdSBP) -> int:
        key = (tuple(val.shape), val.element_size(), sbp)
        if key not in self.nbytes:
            self.nbytes[key] = key[1] * math.prod(local_shape(key[0], sbp, self.mesh.shape))
        return self.nbytes[key]

    def edge_matrix(self, val: torch.Tensor, src_sbps: Sequence[NdSBP],
                    dst_sbps: Sequence[NdSBP], bucketed: bool | frozenset[int] = False) -> np.ndarray:
        """Boxing seconds for every (src candidate, dst candidate), priced once per
        distinct pair (:func:`cost_models.boxing.boxing_table`); without start-up
        latency when the collectives are ``bucketed`` (True: on every mesh axis; a set:
        on those axes)."""
        axes = frozenset(range(self.mesh.ndim) if bucketed is True else bucketed or ())
        if axes not in self.meshes:
            self.meshes[axes] = self.mesh.bucketed(axes)
        src_ids = {x: i for i, x in enumerate(dict.fromkeys(src_sbps))}
        dst_ids = {x: i for i, x in enumerate(dict.fromkeys(dst_sbps))}
        # tensors of one shape and dtype between the same SBPs share their table
        key = (tuple(val.shape), val.element_size(), tuple(src_ids), tuple(dst_ids), axes)
        table = self.tables.get(key)
        if table is None:
            table = boxing_table(key[0], key[1], list(src_ids), list(dst_ids), self.meshes[axes])
            table[~np.isfinite(table)] = FORBIDDEN
            self.tables[key] = table
        return table[np.ix_([src_ids[x] for x in src_sbps], [dst_ids[x] for x in dst_sbps])]


# -- building ---------------------------------------------------------------------

def _saved_for_backward(node: fx.Node) -> bool:
    origin = ORIGIN.get(node)
    if origin is None or origin.phase != "forward":
        return False
    return any((ORIGIN.get(u) or origin).phase == "backward" for u in node.users)


def _hyperparameter_scalars(nodes: Sequence[fx.Node]) -> set[fx.Node]:
    """The hyper-parameter inputs and the operators computed from them alone (``1 - beta``,
    ``-lr``: once per param group)."""
    found: set[fx.Node] = set()
    for node in nodes:
        if (node.op == "placeholder" and ROLE.get(node) == "hparam") or (
                node.op == "call_function" and node.all_input_nodes
                and all(a in found for a in node.all_input_nodes)):
            found.add(node)
    return found


def build_problem(gm: fx.GraphModule, mesh: Mesh, fixed: Mapping[str, NdSBP] | None = None,
                  lone_scalars: Collection[int] = (), move_activations: bool = True,
                  prices: "PriceCache | None" = None, bucket_traffic: bool = True) -> ShardingProblem:
    """Enumerate candidates and price them for every node of ``gm`` on ``mesh``.

    ``fixed`` pins placeholders (by node name) to one placement, e.g. the batch.
    Scalars that only graph outputs read (:func:`ddlc.ir.output_scalars`: the loss) are
    redistributed without start-up latency, as :mod:`passes.fuse` puts their all-reduce in
    a gradient bucket, except on the mesh axes ``lone_scalars``, where there is no other
    all-reduce to share one with (:func:`lone_scalar_axes`). With ``move_activations=False``
    an edge that is neither parameter traffic nor a scalar may only be redistributed by
    local steps (a slice, keeping one copy): a collective on it costs :data:`FORBIDDEN`.
    ``prices``: the :class:`PriceCache` of an earlier build of ``gm`` on ``mesh`` to reuse
    (default: a new one). ``bucket_traffic=False`` prices parameter traffic with the
    start-ups of every collective it needs, as if nothing were bucketed: the pessimistic
    bound of what bucketing shares (see :func:`ddlc.pipeline.choose_plan`).
    """
    fixed = dict(fixed or {})
    sig = STEP.get(gm)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    unknown = sorted(set(fixed) - set(placeholders))
    if unknown:
        raise ShardingError(f"cannot fix placement of {unknown}: not graph inputs "
                            f"(inputs are {sorted(placeholders)})")

    # variables: a parameter and its same-shaped optimizer state move together
    owner: dict[str, str] = {}
    if sig is not None:
        param_node = {i.key: i.name for i in sig.inputs if i.role == "param"}
        for i in sig.inputs:
            if i.role == "opt_state":
                p = param_node[i.key.split(":")[0]]
                if placeholders[i.name].meta["val"].shape == placeholders[p].meta["val"].shape:
                    owner[i.name] = p
    members: list[list[fx.Node]] = []
    var_of: dict[fx.Node, int] = {}
    for n in nodes:
        if n.name in owner:
            continue
        var_of[n] = len(members)
        members.append([n])
    for name, p in owner.items():
        v = var_of[placeholders[p]]
        var_of[placeholders[name]] = v
        members[v].append(placeholders[name])

    prices = PriceCache(mesh) if prices is None else prices
    scalars = _hyperparameter_scalars(nodes)
    candidates, kinds = [], []
    for group in members:
        rep = group[0]
        if rep.op in ("placeholder", "get_attr"):
            cands = _placeholder_signatures(rep, mesh, fixed)
            kind = ("placeholder", tuple(rep.meta["val"].shape), rep.meta["val"].dtype,
                    tuple(c.outputs[0] for c in cands),
                    tuple((ROLE.get(n), _saved_for_backward(n)) for n in group))
        else:
            key = call_key(rep)
            cands = signatures_nd(rep, mesh.shape, key)
            if rep in scalars:  # replicated: a few scalars per param group, never worth a split
                cands = [c for c in cands if all(x is None or all(a.is_broadcast for a in x)
                                                 for x in c.inputs + c.outputs)]
            kind = (key, ROLE.get(rep), _saved_for_backward(rep), rep in scalars)
        if not cands:
            raise ShardingError(f"no valid distribution of {rep.name} ({rep.target}) on mesh "
                                f"{mesh}", where=where(rep))
        candidates.append(cands)
        kinds.append(prices.kind(kind))

    training = sig is not None and any(o.role in ("param", "grad") for o in sig.outputs)
    # micro-batches run one after another, each one's saved activations freed by its
    # backward before the next forward: one micro-batch's are live at a time, which the
    # additive model counts as a share of each (the micro-batches are alike)
    saved_share = 1 / sig.micro_batches if sig is not None else 1.0
    compute, memory = [], []
    for v, group in enumerate(members):
        compute.append(prices.cached(("compute", kinds[v]), lambda: _compute_vector(
            group, candidates[v], mesh, prices.shapes)))
        memory.append(prices.cached(("memory", kinds[v]), lambda: np.array(
            [_resident_bytes(group, c, training, prices, saved_share) for c in candidates[v]])))

    edges: list[Edge] = []
    sink = [np.zeros(len(c)) for c in candidates]
    tail = output_scalars(gm.graph)
    riding = frozenset(range(mesh.ndim)) - frozenset(lone_scalars)
    for n in nodes:
        if n.op != "call_function":
            continue
        v = var_of[n]
        for j, arg in enumerate(tensor_inputs(n)):
            u = var_of[arg]
            leaf = selected_leaf(n) if n.target is operator.getitem else None
            if leaf is not None and not isinstance(leaves(arg.meta["val"])[leaf], torch.Tensor):
                continue  # a getitem of a None output (e.g. an input gradient nobody needs)
            traffic = _parameter_traffic(arg, n)
            bucketed = (traffic and bucket_traffic) or (riding if n in tail else False)
            pinned = not (move_activations or traffic or
                          leaves(arg.meta["val"])[leaf or 0].numel() <= 1)
            edges.append(Edge(u, v, prices.cached(
                ("edge", kinds[u], leaf, kinds[v], j, bucketed, pinned),
                lambda: _local_only(_edge_matrix(arg, leaf, candidates[u], [c.inputs[j] for c in candidates[v]],
                                                 prices, bucketed), pinned)), f"{arg.name} -> {n.name}"))

    output = next(n for n in gm.graph.nodes if n.op == "output")
    loop_target = {k: placeholders[name] for k, name in sig.loop_inputs().items()} if sig else {}
    for k, arg in enumerate(leaves(output.args[0])):
        if not isinstance(arg, fx.Node):
            continue
        u = var_of[arg]
        if k in loop_target:
            target = loop_target[k]
            t = var_of[target]
            edges.append(Edge(u, t, prices.cached(
                ("loop", kinds[u], kinds[t], bucket_traffic),
                lambda: _edge_matrix(arg, None, candidates[u], [c.outputs[0] for c in candidates[t]],
                                     prices, bucket_traffic)), f"{arg.name} -> next step's {target.name}"))
        else:
            bucketed = riding if is_scalar_valued(arg) else False
            sink[u] = sink[u] + prices.cached(("sink", kinds[u], bucketed), lambda: _edge_matrix(
                arg, None, candidates[u], [NdSBP.broadcast(mesh.ndim)], prices, bucketed)[:, 0])
    return ShardingProblem(gm, mesh, nodes, var_of, members, candidates, compute, sink, memory, edges)


def _compute_vector(group: list[fx.Node], cands: Sequence[NdSignature], mesh: Mesh,
                    shapes: dict) -> np.ndarray:
    """Per candidate, the compute seconds of the nodes of ``group`` (summed in order)."""
    priced = [_NodeSeconds(n, mesh, shapes) for n in group]
    return np.array([sum(seconds(c) for seconds in priced) for c in cands])


def _resident_bytes(group: list[fx.Node], cand: NdSignature, training: bool, prices: PriceCache,
                    saved_share: float = 1.0) -> float:
    """Bytes per device the nodes of ``group`` keep resident under ``cand``: parameters
    (twice when training: the gradient shares the placement), optimizer state, inputs
    and forward activations saved for the backward pass (``saved_share`` of them: one
    micro-batch's of several)."""
    total = 0.0
    for n in group:
        role = ROLE.get(n)
        saved = role is None and _saved_for_backward(n)
        if role is None and not saved:
            continue
        outs = [x for x in cand.outputs if x is not None]
        factor = 2 if role == "param" and training else saved_share if saved else 1
        total += factor * sum(prices.tensor_bytes(t, x) for t, x in zip(_tensor_vals(n), outs))
    return total


def _local_only(matrix: np.ndarray, pinned: bool) -> np.ndarray:
    """``matrix`` with every redistribution that costs time (a collective) forbidden, when
    ``pinned``: what stays is the same placement or a local step, which are free."""
    return np.where(matrix > 0, FORBIDDEN, matrix) if pinned else matrix


def lone_scalar_axes(gm: fx.GraphModule, mesh: Mesh) -> frozenset[int]:
    """Where the annotated plan of ``gm`` all-reduces a scalar that only outputs read
    (priced start-up free by :func:`build_problem`) on a mesh axis with no other
    all-reduce of that dtype to share its bucket (its start-ups are paid after all): every
    mesh axis that has no such all-reduce, since a search priced so may move the scalar to
    any of them; else nothing. An all-reduce is a change from ``P`` to ``B`` on an edge
    (or at the output)."""
    needs, rides, _ = _all_reduces(gm, mesh)
    if all((a, dtype) in rides for a, dtype in needs):
        return frozenset()
    # the search may move the loss to another axis: every axis without a ride counts
    return frozenset(range(mesh.ndim)) - {a for a, dtype in rides if any(d == dtype for _, d in needs)}


def gradient_only_rides(gm: fx.GraphModule, mesh: Mesh) -> frozenset[int]:
    """The mesh axes on which the annotated plan of ``gm`` all-reduces a scalar that only
    outputs read (the loss) and no other all-reduce of its dtype is there to share its
    bucket but gradients': without them, it would pay its start-up on its own."""
    needs, _, others = _all_reduces(gm, mesh)
    return frozenset(a for a, dtype in needs if (a, dtype) not in others)


def _read_after_the_loss(reader: fx.Node, tail: set[fx.Node]) -> bool:
    """Whether ``reader`` takes what it reads after the loss exists, so that an all-reduce
    on its edge can share a bucket with the loss's (:mod:`passes.fuse` fuses collectives
    whose inputs all exist before any result is read, and moves the scalar arithmetic of
    outputs, ``tail``, to the end): a backward or update operator, a tail scalar, or a
    shared read (:mod:`passes.shared_reads`) or getitem whose readers all do (the count
    of a cross-entropy, read by its backward). A forward operator needs its input before
    the loss is computed."""
    if SHARED_READ.get(reader, False) or reader.target is operator.getitem:
        return all(_read_after_the_loss(user, tail) for user in reader.users)
    return reader in tail or reader.op == "output" or phase_of(reader) in ("backward", "optimizer")


def _all_reduces(gm: fx.GraphModule, mesh: Mesh) -> tuple[set, set, set]:
    """The all-reduces of the annotated plan of ``gm`` as ``(mesh axis, dtype)`` pairs: of
    scalars that only outputs read, of the rest that the loss's can share a bucket with
    (read in backward or the update), and of those but gradients."""
    tail = output_scalars(gm.graph)
    needs, rides, others = set(), set(), set()

    def reduced(src: NdSBP, dst: NdSBP) -> list[int]:
        return [a for a, (x, y) in enumerate(zip(src, dst)) if x.is_partial and y.is_broadcast]

    for n in gm.graph.nodes:
        if n.op == "output":
            pairs = [(a, NdSBP.broadcast(mesh.ndim)) for a in leaves(n.args[0])
                     if isinstance(a, fx.Node) and is_scalar_valued(a) and SHARDING.has(a)]
        elif n.op == "call_function" and SHARDING.has(n):
            pairs = list(zip(tensor_inputs(n), SHARDING(n).inputs))
        else:
            continue
        for arg, dst in pairs:
            if dst is None or not any(y.is_broadcast for y in dst):
                continue  # no all-reduce can end here (most edges: the cheap test first)
            outs = SHARDING(arg).outputs if SHARDING.has(arg) else ()
            leaf = selected_leaf(n) if n.target is operator.getitem else None
            if leaf is not None and len(outs) > leaf:   # one output of several (a count)
                outs, val = outs[leaf:leaf + 1], leaves(arg.meta["val"])[leaf]
            else:
                val = arg.meta["val"]
            if len(outs) != 1 or outs[0] is None or not isinstance(val, torch.Tensor):
                continue
            axes = reduced(outs[0], dst)
            if not axes:
                continue
            found = {(a, val.dtype) for a in axes}
            if n.op == "output" or n in tail:
                needs |= found
            elif _read_after_the_loss(n, tail):
                rides |= found
                if not _parameter_traffic(arg, n):
                    others |= found
    return needs, rides, others


def _parameter_traffic(arg: fx.Node, user: fx.Node) -> bool:
    """Whether the edge ``arg -> user`` carries parameter traffic that gets bucketed: a
    parameter or optimizer state read from its placeholder, or a gradient (a
    backward-phase value) entering the optimizer update."""
    if arg.op == "placeholder":
        return ROLE.get(arg) in ("param", "opt_state")
    return phase_of(arg) == "backward" and phase_of(user) == "optimizer"


def _edge_matrix(arg: fx.Node, leaf: int | None, src_cands: Sequence[NdSignature],
                 dst_sbps: Sequence[NdSBP], prices: PriceCache, bucketed: bool = False) -> np.ndarray:
    """Boxing matrix of the tensor ``arg`` produces (its output ``leaf`` when read
    through getitem) from each producer candidate to each required input SBP."""
    if leaf is not None:
        return prices.edge_matrix(leaves(arg.meta["val"])[leaf],
                                  [c.outputs[leaf] for c in src_cands], dst_sbps, bucketed)
    return prices.edge_matrix(arg.meta["val"], [_output_sbp(c, arg) for c in src_cands], dst_sbps,
                              bucketed)


def _output_sbp(cand: NdSignature, arg: fx.Node) -> NdSBP:
    outs = [x for x in cand.outputs if x is not None]
    if len(outs) != 1:
        raise ShardingError(f"{arg.name} has {len(outs)} tensor outputs; read it through getitem")
    return outs[0]


# -- exact reduction ------------------------------------------------------------------

#: Largest (K_u * K_v * K_w) min-plus product a series reduction may build.
MAX_SERIES_PRODUCT = 2_000_000


def reduce_problem(problem: ShardingProblem, memory_budget: float = float("inf")):
    """:func:`reduce_costs` on a whole problem; returns ``(core, expand, fixed_memory)``
    where ``core`` is a ShardingProblem over the surviving variables."""
    keep, unary, edges, expand, fixed_memory = reduce_costs(
        problem.unary, problem.memory, problem.edges, memory_budget)
    core = ShardingProblem(
        problem.gm, problem.mesh, [problem.members[v][0] for v in keep],
        {problem.members[v][0]: i for i, v in enumerate(keep)}, [problem.members[v] for v in keep],
        [problem.candidates[v] for v in keep], unary, [np.zeros(len(u)) for u in unary],
        [problem.memory[v] for v in keep], edges)
    return core, expand, fixed_memory


def reduce_costs(unary_in: Sequence[np.ndarray], memory: Sequence[np.ndarray], edges: Sequence,
                 memory_budget: float = float("inf")):
    """Eliminate variables of degree <= 2 whose memory does not depend on their choice
    (any variable, when the largest possible footprint fits ``memory_budget``: the
    ``removable`` list), exactly (min-plus algebra, as in dynamic programming on chains
    and trees). First every edge goes into one matrix per unordered pair (``add_pair``:
    parallel edges add up, ``M`` is stored for ``a < b`` and read either way round by
    ``oriented``; a self-loop ``src == dst`` adds its diagonal to the unary cost). Then,
    until a pass over the variables removes none, variable ``v`` with neighbours:

    - a single candidate (a pinned or replicated-only variable), any number of
      neighbours: ``unary[u] += M_uv[:, 0]`` for each neighbour ``u``, then as with none;
    - none: it is fixed at its cheapest candidate (the ``else`` branch);
    - one, ``u`` (the ``len(near) == 1`` branch):
      ``unary[u] += min_k (M_uv[:, k] + unary[v][k])``;
    - two, ``u < w`` (the ``len(near) == 2`` branch, skipped while
      ``K_u * K_v * K_w > MAX_SERIES_PRODUCT``): the new pair
      ``N[a, b] = min_k (M_uv[a, k] + unary[v][k] + M_vw[k, b])`` replaces both edges
      (and adds to an existing ``u``-``w`` matrix through ``add_pair``).

    Each removal logs the argmin table ``expand`` back-substitutes, last removal first.
    Elementwise optimizer chains, view chains and similar collapse this way. Returns
    ``(keep, unary, edges, expand, fixed_memory)``: the surviving variables with their
    new unary costs and edges (indices into ``keep``), a function mapping a choice for
    them back to a full choice, and the bytes of the eliminated variables (their
    largest: exact when constant, an upper bound that already fits otherwise).
    """
    n = len(unary_in)
    unary = [u.astype(float).copy() for u in unary_in]
    pair: dict[tuple[int, int], np.ndarray] = {}
    nbrs = [set() for _ in range(n)]

    def add_pair(a: int, b: int, m: np.ndarray) -> None:
        if a == b:
            unary[a] += np.diag(m)
            return
        if a > b:
            a, b, m = b, a, m.T
        pair[(a, b)] = pair[(a, b)] + m if (a, b) in pair else m.astype(float).copy()
        nbrs[a].add(b)
        nbrs[b].add(a)

    def oriented(a: int, b: int) -> np.ndarray:
        return pair[(a, b)] if a < b else pair[(b, a)].T

    for e in edges:
        add_pair(e.src, e.dst, e.cost)
    unconstrained = sum(float(m.max()) for m in memory) <= memory_budget
    removable = [unconstrained or float(np.ptp(m)) == 0.0 for m in memory]
    alive = [True] * n
    log = []
    fixed_memory = 0.0
    changed = True
    while changed:
        changed = False
        for v in range(n):
            if alive[v] and len(unary[v]) == 1 and len(nbrs[v]) > 2:  # one choice: fold it out
                for u in sorted(nbrs[v]):
                    unary[u] += oriented(u, v)[:, 0]
                    del pair[(min(u, v), max(u, v))]
                    nbrs[u].discard(v)
                nbrs[v].clear()
            if not (alive[v] and removable[v] and len(nbrs[v]) <= 2):
                continue
            near = sorted(nbrs[v])
            if len(near) == 2:
                u, w = near
                if len(unary[u]) * len(unary[v]) * len(unary[w]) > MAX_SERIES_PRODUCT:
                    continue
                total = oriented(u, v)[:, :, None] + unary[v][None, :, None] + oriented(v, w)[None, :, :]
                log.append((v, (u, w), total.argmin(axis=1)))
                del pair[(min(u, v), max(u, v))], pair[(min(v, w), max(v, w))]
                nbrs[u].discard(v), nbrs[w].discard(v)
                add_pair(u, w, total.min(axis=1))
            elif len(near) == 1:
                (u,) = near
                total = oriented(u, v) + unary[v][None, :]
                log.append((v, (u,), total.argmin(axis=1)))
                unary[u] += total.min(axis=1)
                del pair[(min(u, v), max(u, v))]
                nbrs[u].discard(v)
            else:
                log.append((v, (), int(np.argmin(unary[v]))))
            nbrs[v].clear()
            alive[v] = False
            fixed_memory += float(memory[v].max())
            changed = True

    keep = [v for v in range(n) if alive[v]]
    index = {v: i for i, v in enumerate(keep)}
    new_edges = [Edge(index[a], index[b], m, "reduced") for (a, b), m in sorted(pair.items())]

    def expand(core_choice: Sequence[int]) -> list[int]:
        choice = [-1] * n
        for v, k in zip(keep, core_choice):
            choice[v] = int(k)
        for v, near, table in reversed(log):
            choice[v] = int(table if not near else table[tuple(choice[u] for u in near)])
        return choice

    return keep, [unary[v] for v in keep], new_edges, expand, fixed_memory
