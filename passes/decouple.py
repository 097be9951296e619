"""Decouple gradient all-reduces: reduce-scatter, update on the shard, all-gather.

After sharding, a parameter that is ``B`` on mesh axis ``a`` while its gradient
arrives as a partial sum (``P``) on ``a`` is synchronised by an all-reduce (or a
reduce-scatter and an all-gather), and every rank then runs the whole optimizer
update. This pass re-annotates that
update so it runs on a shard (DeAR; ZeRO-style sharded optimizer state): every
parameter-shaped tensor of the update (gradient, parameter, optimizer state)
becomes ``S(d)`` on ``a``, ``d`` the dim the gradient is already split along, else
the first dim that splits evenly, else the dim that needs the least zero padding.
The collectives pass then emits a reduce-scatter for the gradient instead of the
all-reduce (or nothing, if it is already split); each rank updates its piece of
the parameter and keeps only that piece of its optimizer state between steps.

When no dim splits evenly (a bias of 10 on 4 ranks), the pieces are uneven, with
``torch.chunk`` bounds as everywhere in :mod:`ddlc.sbp` (10 = 3 + 3 + 3 + 1;
6 = 2 + 2 + 2 + 0): local shapes then differ by rank, and the collectives pass
pads each piece with zeros to the even size for the reduce-scatter / all-gather
and cuts the padding off after them (DTensor's and ZeRO's padding), so the update
and the state only ever hold real elements. Such a split is only taken where the
outer mesh axes cut the dim evenly, and only with signatures whose split dims all
have the parameter's size (:func:`_uneven_candidates`): those cut every tensor of
the update alike.

Where the parameter's all-gather goes is decided per parameter:

- ``"forward"``: the parameter stays sharded between steps and is gathered
  before its first use in the next step's forward (DeAR's order);
- ``"backward"``: the updated parameter is gathered at once, in the step that
  produced it (the placeholder stays ``B``);
- ``"auto"``: per layer, as the timeline model's schedule places that layer's
  all-gather (:func:`cost_models.layer_schedules.search_schedule` on a per-layer profile
  built from the plan: PipeDAP's merge and piggy-back moves mean "backward").

Only signatures that the rules list for an operator are used; a parameter whose
update cannot run on a shard (or a 0-d one) keeps its all-reduce, and so does one
whose reduce-scatter and all-gather are modeled slower than its all-reduce plus the
update compute saved (the update priced whole minus priced on the shard), with its
share of the start-up of the bucket of all-gathers that decoupling adds (on backends
that run a reduce-scatter as an all-reduce, such as gloo: the profile's
``emulated_collectives``; and where the per-operator cost of a small update does not
shrink on a shard).
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
from torch import fx

from cost_models.collectives import affine_fit, axis_time
from cost_models.layer_schedules import LayerProfile, search_schedule
from ddlc.ir import ORIGIN, ROLE, SHARDING, STEP, NdSignature, is_getitem, leaves, phase_of
from ddlc.mesh import Mesh
from ddlc.sbp import B, NdSBP, S, divides, local_shape, padded_shape
from passes.rules import selected_leaf, signatures_1d, signatures_nd, tensor_inputs
from passes.sharding.problem import compute_seconds, gradient_only_rides

__all__ = ["decouple", "update_chain", "GraphIndex"]

log = logging.getLogger("ddlc.decouple")


def _sbp(node: fx.Node) -> NdSBP:
    return SHARDING(node).outputs[0]


def gradient_scalars(graph: fx.Graph) -> set[fx.Node]:
    """The optimizer-phase scalars computed from several parameters' gradients: the global
    norm and the coefficient of ``clip_grad_norm``, which every parameter's update reads
    but which belong to none (their inputs are every parameter's norm term)."""
    many = object()
    source: dict[fx.Node, object] = {}  # optimizer node -> the one gradient it reads, or many
    for node in graph.nodes:
        if node.op != "call_function" or phase_of(node) != "optimizer":
            continue
        found = {a if phase_of(a) == "backward" else source.get(a) for a in node.all_input_nodes} - {None}
        if found:
            source[node] = found.pop() if len(found) == 1 else many
    return {n for n, s in source.items() if s is many and getattr(n.meta.get("val"), "dim", lambda: -1)() == 0}


class GraphIndex(NamedTuple):
    """What :func:`update_chain` looks up in a graph, found once for all parameters: its
    output node, its placeholders by name and every node's position."""

    output: fx.Node
    placeholders: dict[str, fx.Node]
    position: dict[fx.Node, int]

    @staticmethod
    def of(graph: fx.Graph) -> "GraphIndex":
        position = {n: i for i, n in enumerate(graph.nodes)}
        return GraphIndex(graph.output_node(), {n.name: n for n in position if n.op == "placeholder"}, position)


def update_chain(gm: fx.GraphModule, key: str, shared: set[fx.Node] | None = None,
                 index: GraphIndex | None = None) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the nodes that compute parameter ``key``'s new value and state: its optimizer-phase
    nodes and the parameter-shaped reshapes only they read, in graph order, up to the
    scalars computed from all gradients, ``shared`` (default :func:`gradient_scalars`),
    which it reads as it reads the learning rate; its optimizer-state placeholders, in
    graph order). ``index``: :meth:`GraphIndex.of` the graph (default: found here)."""
    sig = STEP(gm)
    shared = gradient_scalars(gm.graph) if shared is None else shared
    index = GraphIndex.of(gm.graph) if index is None else index
    output = index.output
    results = [a for spec, a in zip(sig.outputs, output.args[0])
               if spec.key == key or spec.key.startswith(key + ":")]
    chain, stack = set(), list(results)
    while stack:
        node = stack.pop()
        origin = ORIGIN.get(node)
        if node in chain or node in shared or node.op != "call_function" or origin is None \
                or origin.phase != "optimizer":
            continue
        chain.add(node)
        stack.extend(node.all_input_nodes)
    # the gradient's last reshapes (e.g. the view of a bias gradient) belong to the update
    # when only it reads them and they map the parameter's elements one to one: one tensor
    # input of the parameter's size (a matmul whose operands happen to have that many
    # elements, as when the batch equals the width, is no reshape)
    param = next(i.name for i in sig.inputs if i.key == key)
    shape = index.placeholders[param].meta["val"].shape
    grew = True
    while grew:
        grew = False
        for node in [a for n in chain for a in n.all_input_nodes]:
            if node in chain or node.op != "call_function" or not all(u in chain for u in node.users):
                continue
            vals = [a.meta.get("val") for a in node.all_input_nodes]
            if getattr(node.meta.get("val"), "shape", None) == shape and len(vals) == 1 and \
                    getattr(vals[0], "numel", lambda: -1)() == math.prod(shape):
                chain.add(node)
                grew = True
    own_states = [index.placeholders[i.name] for i in sig.inputs if i.key.startswith(key + ":")]
    states = sorted((n for n in own_states if ROLE.get(n) == "opt_state"), key=index.position.__getitem__)
    return sorted(chain, key=index.position.__getitem__), states


def _update_sbp(chain: list[fx.Node], shape) -> NdSBP:
    """The placement of an update's parameter-shaped values (its last such node's output;
    with the all-gather in "backward" it differs from the parameter's)."""
    return next(_sbp(n) for n in reversed(chain) if tuple(n.meta["val"].shape) == shape)


def _split_dim(shape, sbp: NdSBP, axis: int, mesh: Mesh, prefer: int | None = None) -> int | None:
    """The dim ``axis`` splits, among those no inner axis splits and the outer axes split
    evenly: ``prefer`` if the pieces come out even, else the first dim whose do, else the
    dim that needs the least zero padding (uneven ``torch.chunk`` pieces); None if none
    (a 0-d tensor, or every dim taken)."""
    def free(d: int) -> bool:
        return not any(x.is_split and x.dim == d for x in sbp.per_axis[axis + 1:]) \
            and shape[d] % sbp.split_factor(d, mesh.shape) == 0

    def padded_numel(d: int) -> int:
        split = sbp.replace(axis, S(d))
        return math.prod(padded_shape(shape, split, axis, mesh.shape))

    dims = [d for d in range(len(shape)) if free(d)]
    even = [d for d in dims if padded_numel(d) == math.prod(shape)]
    if prefer in even:
        return prefer
    return even[0] if even else min(dims, key=padded_numel, default=None)


def _sharded(entry: NdSBP | None, val, shape, axis: int, d: int) -> NdSBP | None:
    if entry is None or tuple(getattr(val, "shape", ())) != shape or not entry[axis].is_broadcast:
        return entry
    return entry.replace(axis, S(d))


def _entry_shapes(node: fx.Node) -> list[tuple[int, ...] | None]:
    """The global shape of each signature entry (tensor inputs, then output leaves)."""
    outs = [tuple(v.shape) if isinstance(v, torch.Tensor) else None
            for v in leaves(node.meta.get("val"))]
    ins = outs if is_getitem(node) else \
        [tuple(a.meta["val"].shape) for a in tensor_inputs(node)]
    return ins + outs


def _uneven_candidates(node: fx.Node, axis: int, size: int) -> list[NdSignature]:
    """The node's current signature with each of its 1-D signatures on ``axis`` that split
    only dims of ``size`` elements. The rules' dim labels make every tensor holding a
    split dim split it alike, so with equal sizes ``torch.chunk`` gives each rank the same
    index range in all of them: the local op stays correct on uneven pieces (a reshape
    that merges that dim with others would not be, and is excluded by its other size)."""
    current, shapes = SHARDING(node), _entry_shapes(node)
    found = []
    for sig in signatures_1d(node):
        entries = sig.inputs + sig.outputs
        if any(x is not None and x.is_split and shape[x.dim] != size for x, shape in zip(entries, shapes)):
            continue
        found.append(NdSignature(
            tuple(c if c is None else c.replace(axis, x) for c, x in zip(current.inputs, sig.inputs)),
            tuple(c if c is None else c.replace(axis, x) for c, x in zip(current.outputs, sig.outputs))))
    return found


def _reannotate(node: fx.Node, shape, axis: int, d: int, mesh: Mesh, even: bool) -> NdSignature | None:
    """The node's signature with its parameter-shaped outputs ``S(d)`` on ``axis``: the
    first listed signature that gives those outputs, keeps every other axis as it is and
    splits the parameter-shaped inputs the same way (other inputs as the rule allows,
    e.g. the pre-reshape gradient of a view). Signatures come from the rules' n-D list
    (even splits) or, when ``axis`` cuts ``d`` unevenly, :func:`_uneven_candidates`."""
    current = SHARDING(node)
    inputs = tensor_inputs(node)
    outs = tuple(_sharded(x, v, shape, axis, d)
                 for x, v in zip(current.outputs, leaves(node.meta.get("val"))))
    wanted_ins = tuple(_sharded(x, a.meta.get("val"), shape, axis, d)
                       for x, a in zip(current.inputs, inputs))

    def fits(cand: NdSignature) -> bool:
        if cand.outputs != outs:
            return False
        for have, want, now in zip(cand.inputs, wanted_ins, current.inputs):
            if want != now and have != want:  # a parameter-shaped input: exactly S(d)
                return False
            if have is not None and any(h != w for k, (h, w) in enumerate(zip(have, now)) if k != axis):
                return False
        return True

    candidates = signatures_nd(node, mesh.shape) if even else _uneven_candidates(node, axis, shape[d])
    for cand in candidates:
        if fits(cand):
            return cand
    return None


def _redistributable(chain: list[fx.Node], new: dict[fx.Node, NdSignature]) -> bool:
    """Whether every input of the re-annotated ``chain`` can be redistributed to what its
    new signature reads (``new``: the chain's new signatures and its parameter's and
    states' split placements): never a split to a partial sum (a chain node reading another's
    output, or a state, as ``P``, which the re-annotation splits, keeps ``P`` where the
    rules allow it)."""
    for node in chain:
        for a, dst in zip(tensor_inputs(node), new[node].inputs):
            sig = new.get(a) or SHARDING.get(a)
            if dst is None or sig is None:
                continue
            if is_getitem(node):  # it reads the output it selects (an update's new parameter)
                src = sig.outputs[selected_leaf(node)]
            else:
                srcs = [x for x in sig.outputs if x is not None]
                src = srcs[0] if len(srcs) == 1 else None
            if src is not None and any(x.is_split and y.is_partial for x, y in zip(src, dst)):
                return False
    return True


def _gradient_dim(chain: list[fx.Node], axis: int, shape) -> int | None | bool:
    """Whether the update is fed through a redistribution to ``B`` on ``axis`` (an edge into
    a chain node from a non-``B`` producer): False if not (nothing to decouple); else the
    dim that the parameter-shaped producer is already split along, or None."""
    found = False
    for node in chain:
        for x, a in zip(SHARDING(node).inputs, tensor_inputs(node)):
            source = SHARDING.get(a)
            if source is None or x is None or a.op == "placeholder" or not x[axis].is_broadcast:
                continue
            outs = [y for y in source.outputs if y is not None]
            if len(outs) == 1 and not outs[0][axis].is_broadcast:
                if outs[0][axis].is_split and tuple(a.meta["val"].shape) == shape:
                    return outs[0][axis].dim
                found = None
    return found


def _reduce_scattered(chain: list[fx.Node], axis: int) -> bool:
    """Whether an update that runs on a shard on ``axis`` takes a partial sum there as a
    split (a reduce-scatter), rather than an all-reduced gradient that it slices (the
    partial sum may flow into the chain first, through the gradient's reshapes)."""
    for node in chain:
        for x, a in zip(SHARDING(node).inputs, tensor_inputs(node)):
            source = SHARDING.get(a)
            if source is None or x is None or not x[axis].is_split:
                continue
            if any(y is not None and y[axis].is_partial for y in source.outputs):
                return True
    return False


def _shard_states_of_a_split_update(chain: list[fx.Node], states: list[fx.Node], param: fx.Node,
                                    axis: int, shape) -> bool:
    """Where the search already runs an update on a shard on ``axis`` while the parameter
    and its state stay ``B`` there (the state would be sliced into the update and gathered
    back every step), keep the same-shaped state on the update's shard instead; True if
    any was moved. Only a state that the update alone reads, and reads on that shard."""
    placed = _update_sbp(chain, shape)[axis]
    if not placed.is_split or not _sbp(param)[axis].is_broadcast:
        return False
    inside, moved = set(chain), False
    for state in states:
        if tuple(state.meta["val"].shape) != shape or not _sbp(state)[axis].is_broadcast:
            continue
        if not state.users or any(user not in inside for user in state.users):
            continue
        reads = [x for user in state.users for x, a in zip(SHARDING(user).inputs, tensor_inputs(user))
                 if a is state]
        if all(x is not None and x[axis] == placed for x in reads):
            SHARDING.set(state, NdSignature((), (_sbp(state).replace(axis, placed),)))
            moved = True
    return moved


def _gatherable(param: fx.Node, chain: list[fx.Node], axis: int, even: bool) -> bool:
    """Whether every reader of the parameter outside its update can take it from a shard
    (an all-gather); a reader wanting a partial sum (e.g. a bias added to a partial
    matmul) could not, nor, from uneven pieces, one wanting a split on ``axis`` (no
    uneven all-to-all; its op was planned for even pieces), so such a parameter stays
    whole between steps."""
    inside = set(chain)
    for user in param.users:
        if user in inside or not SHARDING.has(user):
            continue
        for x, a in zip(SHARDING(user).inputs, tensor_inputs(user)):
            if a is param and x is not None and (x[axis].is_partial or (x[axis].is_split and not even)):
                return False
    return True


def _local_bytes(param: fx.Node, placed: NdSBP, axis: int, mesh: Mesh) -> int:
    """Bytes of ``param``'s piece with the update placed ``placed`` but whole on ``axis``."""
    val = param.meta["val"]
    return val.element_size() * math.prod(local_shape(tuple(val.shape), placed.replace(axis, B), mesh.shape))


def _margin(chain: list[fx.Node], new: dict, nbytes: int, axis: int, mesh: Mesh) -> float:
    """Seconds that decoupling one update adds, start-ups left out: a reduce-scatter and an
    all-gather of ``nbytes``, priced as the backend runs them (gloo runs a reduce-scatter as
    an all-reduce), bandwidth terms only (gradient collectives are bucketed, so start-ups
    are shared, as in the sharding cost model), minus the all-reduce they replace and the
    update compute that running on a shard saves (the chain priced at its current
    signatures minus at ``new``, the sharded ones). Negative where decoupling pays."""
    bucketed = mesh.bucketed()

    def seconds(kind: str) -> float:
        return axis_time(kind, nbytes, bucketed, axis)

    saved = sum(compute_seconds(n, SHARDING(n), mesh) - compute_seconds(n, new[n], mesh) for n in chain)
    return seconds("reduce_scatter") + seconds("all_gather") - seconds("all_reduce") - saved


def _worth_decoupling(margins: dict[str, float], added: float, removed: float) -> list[str]:
    """The updates to decouple on one mesh axis, from their :func:`_margin` and the
    start-ups of the buckets: decoupling any adds ``added`` (one all-gather's and one
    reduce-scatter's start-up; 0 where those buckets come anyway), decoupling every
    parameter the all-reduce bucket holds removes ``removed`` (its start-up; 0 where some
    parameter keeps its all-reduce regardless). A bucket's start-up is paid once, whoever
    is in it, so the choice is global: of none, those whose margin alone is negative, and
    all, the least total (none on ties)."""
    paying = [k for k, m in margins.items() if m < 0]
    options = [(0.0, []),
               (sum(margins[k] for k in paying) + added, paying),
               (sum(margins.values()) + added - removed, list(margins))]
    return min(options, key=lambda option: option[0])[1]


def decouple(gm: fx.GraphModule, mesh: Mesh, ag_placement: str | dict = "forward",
             pinned: frozenset[str] = frozenset(), always: bool = False) -> list[str]:
    """Re-annotate (in place) every parameter update that an all-reduce feeds so it runs on
    a shard; returns the decoupled parameter names. ``ag_placement``: "forward",
    "backward", "auto", or a dict from parameter name to "forward"/"backward".
    Placeholders named in ``pinned`` keep their placement (their all-gather goes in the
    step that updates them). ``always`` decouples even where the model says it does not
    pay (for the sharded optimizer state's memory)."""
    sig = STEP(gm)
    if not sig.optimizer:  # inference, gradients only, or no trainable parameter
        return []
    index = GraphIndex.of(gm.graph)
    placeholders = {i.key: index.placeholders[i.name] for i in sig.inputs}
    shared = gradient_scalars(gm.graph)
    chains = {key: update_chain(gm, key, shared, index) for key, _ in sig.optimizer}
    loss_riding = gradient_only_rides(gm, mesh)
    done = set()
    for axis in range(mesh.ndim):
        proposed, margins, kept, gathers, scatters = {}, {}, False, False, False
        for key, _ in sig.optimizer:
            param = placeholders[key]
            shape = tuple(param.meta["val"].shape)
            chain, states = chains[key]
            if not chain:  # a parameter the loss does not read: no update (see ddlc.tracing)
                continue
            if _update_sbp(chain, shape)[axis].is_split:  # an update on a shard already:
                gathers = True                            # its all-gather comes anyway
                scatters = scatters or _reduce_scattered(chain, axis)
            if _shard_states_of_a_split_update(chain, states, param, axis, shape):
                done.add(key)
                continue
            arrives = _gradient_dim(chain, axis, shape)
            if mesh.shape[axis] == 1 or not _sbp(param)[axis].is_broadcast or arrives is False:
                continue
            placed = _update_sbp(chain, shape)
            d = _split_dim(shape, placed, axis, mesh, prefer=arrives)
            even = d is not None and divides(shape, placed.replace(axis, S(d)), mesh.shape)
            new = {n: _reannotate(n, shape, axis, d, mesh, even) for n in chain} if d is not None else {}
            split_inputs = {x: NdSignature((), (_sbp(x).replace(axis, S(d)),)) for x in (param, *states)
                            if d is not None and tuple(x.meta["val"].shape) == shape}
            if d is None or any(v is None for v in new.values()) or \
                    not _redistributable(chain, {**new, **split_inputs}):
                log.debug("parameter %s keeps its all-reduce on axis %d (no shardable update)", key, axis)
                kept = kept or arrives is None
                continue
            proposed[key] = (new, d, even)
            if arrives is None:
                margins[key] = _margin(chain, new, _local_bytes(param, placed, axis, mesh), axis, mesh)
            else:  # its gradient arrives split: a reduce-scatter
                scatters = True
        # the start-ups of the buckets decoupling adds, unless they come anyway
        added = (0.0 if gathers else axis_time("all_gather", 0, mesh, axis)) + \
            (0.0 if scatters else axis_time("reduce_scatter", 0, mesh, axis))
        # the all-reduce bucket goes, unless a gradient stays in it or the loss would be left
        # alone in it
        removed = 0.0 if kept or axis in loss_riding else axis_time("all_reduce", 0, mesh, axis)
        chosen = set(margins if always else _worth_decoupling(margins, added, removed))
        if margins:
            log.info("axis %d: %d of the %d updates fed by an all-reduce decoupled (the rest "
                     "modeled faster with their all-reduce)", axis, len(chosen), len(margins))
        decoupled = [key for key, _ in sig.optimizer if key in proposed and (key not in margins or key in chosen)]
        if decoupled and ag_placement == "auto":
            # searched once, by the first axis that decouples and before it re-annotates
            # (the search reads the plan): most plans decouple nothing, and the search
            # takes a noticeable part of a second on a large model
            ag_placement = auto_placement(gm, mesh)
        for key in decoupled:
            new, d, even = proposed[key]
            param = placeholders[key]
            shape = tuple(param.meta["val"].shape)
            chain, states = chains[key]
            for node, sharding in new.items():
                SHARDING.set(node, sharding)
            for state in states:
                if tuple(state.meta["val"].shape) == shape:
                    SHARDING.set(state, NdSignature((), (_sbp(state).replace(axis, S(d)),)))
            where = ag_placement if isinstance(ag_placement, str) else ag_placement.get(key, "forward")
            if where == "forward" and param.name not in pinned and _gatherable(param, chain, axis, even):
                SHARDING.set(param, NdSignature((), (_sbp(param).replace(axis, S(d)),)))
            done.add(key)
    return [key for key, _ in sig.optimizer if key in done]


def layer_profile(gm: fx.GraphModule, mesh: Mesh, axis: int = 0) -> dict:
    """The per-layer profile of an annotated step (the form of
    :class:`cost_models.layer_schedules.LayerProfile`): layers are the modules that own
    parameters, in forward order, with their parameter counts and the compute model's
    forward and backward times at the plan's local shapes; the all-reduce fit is the
    ring on mesh ``axis`` (4-byte elements)."""
    sig = STEP(gm)
    owners: dict[str, list[str]] = {}
    for key, _ in sig.optimizer or [(i.key, None) for i in sig.inputs if i.role == "param"]:
        owners.setdefault(key.rpartition(".")[0], []).append(key)
    times = {m: {"forward": 0.0, "backward": 0.0} for m in owners}
    by_length = sorted(owners, key=len, reverse=True)
    owner: dict[str, str | None] = {}  # a node's module -> the innermost module owning parameters
    for node in gm.graph.nodes:
        origin = ORIGIN.get(node)
        if origin is None or origin.phase not in ("forward", "backward") or not SHARDING.has(node):
            continue
        if origin.module not in owner:
            owner[origin.module] = next((m for m in by_length if origin.module == m
                                         or origin.module.startswith(m + ".") or not m), None)
        module = owner[origin.module]
        if module is not None:
            times[module][origin.phase] += compute_seconds(node, SHARDING(node), mesh)
    by_name = {n.name: n for n in gm.graph.nodes}
    numel = {i.key: math.prod(by_name[i.name].meta["val"].shape) for i in sig.inputs}
    a, b = affine_fit("all_reduce", mesh.shape[axis], mesh.links[axis])
    return {"allreduce": {"a": a, "b": b},
            "layers": [{"name": m or "<root>", "params": sum(numel[k] for k in keys),
                        "forward": times[m]["forward"], "backward": times[m]["backward"]}
                       for m, keys in owners.items()]}


def auto_placement(gm: fx.GraphModule, mesh: Mesh) -> dict[str, str]:
    """Per parameter, "forward" or "backward" as :func:`cost_models.layer_schedules.search_schedule`
    places its layer's all-gather on :func:`layer_profile` (deferred to the next forward,
    or merged / piggy-backed into backward, PipeDAP's moves)."""
    profile = LayerProfile.from_dict(layer_profile(gm, mesh))
    moved = {profile.layers[l].name for c in search_schedule(profile).collectives if c.reduced_layers()
             for kind, l in c.parts if kind == "ag"}
    sig = STEP(gm)
    return {k: "backward" if (k.rpartition(".")[0] or "<root>") in moved else "forward"
            for k, _ in sig.optimizer}
