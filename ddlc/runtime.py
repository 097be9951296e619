"""``ddlc.compile``: trace -> shard -> insert collectives -> localize -> per-rank program.

Every rank of an initialised process group calls :func:`compile` with the same
model, inputs and mesh. Each rank traces the same graph; rank 0 plans it and
broadcasts every node's decision (so even a time-limited solver gives one
plan); each rank lowers it for its own mesh coordinate, checks with the others
that the collective sequence is identical, and keeps only its own shards of
the parameters and optimizer state.
"""
from __future__ import annotations

import copy
import hashlib
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from .errors import MeshError, RuntimeMismatchError, UnsupportedInputError
from .mesh import Mesh
from .plan import Plan
from .printing import format_graph
from .sbp import NdSBP, divides, local_shape, local_slices, parse_sbp
from .trace import trace

__all__ = ["compile", "lower", "CompiledStep", "collective_sequence"]


class _GraphText:
    """The lowered per-rank graph; prints each node with its SBP and each collective
    with its mesh axis and bytes. ``.module`` is the runnable GraphModule."""

    def __init__(self, gm: fx.GraphModule):
        self.module = gm

    def __str__(self) -> str:
        return format_graph(self.module)

    __repr__ = __str__


def collective_sequence(gm: fx.GraphModule) -> list[tuple]:
    """The ordered (kind, mesh axis, bytes) of every collective in ``gm``."""
    from passes.collectives import CollectiveInfo
    return [(n.meta["ddlc"].kind, n.meta["ddlc"].axis, n.meta["ddlc"].nbytes)
            for n in gm.graph.nodes if isinstance(n.meta.get("ddlc"), CollectiveInfo)
            and n.meta["ddlc"].kind not in ("slice", "zero")]


def _check_fingerprint(gm: fx.GraphModule) -> str:
    digest = hashlib.sha256(repr(collective_sequence(gm)).encode()).hexdigest()[:16]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest)
    if len(set(everyone)) != 1:
        raise RuntimeMismatchError("ranks built different collective sequences (this would "
                                   f"deadlock): fingerprints by rank {everyone}")
    return digest


def _resolve_placements(gm: fx.GraphModule, placements, ndim: int) -> dict[str, NdSBP]:
    """Map user placements keyed by parameter name or ``input<i>`` to placeholder names."""
    sig = gm.meta["ddlc_step"]
    by_key = {i.key: i.name for i in sig.inputs}
    fixed = {}
    for key, sbp in (placements or {}).items():
        if key not in by_key and key not in by_key.values():
            raise UnsupportedInputError(f"placement given for {key!r}, which is neither a "
                                        f"parameter nor an input (inputs are input0, input1, ...)")
        sbp = parse_sbp(sbp) if isinstance(sbp, str) else NdSBP(tuple(sbp))
        if len(sbp) != ndim:
            raise MeshError(f"placement {sbp} of {key!r} has {len(sbp)} axes; the mesh has {ndim}")
        fixed[by_key.get(key, key)] = sbp
    return fixed


def _plan_on_rank0(gm: fx.GraphModule, mesh: Mesh, make_plan) -> Plan:
    """Rank 0 plans; every rank adopts its decisions (``node.meta["ddlc"]`` by node name)
    and the plan, so all ranks lower the same program whatever the solver does."""
    if dist.get_rank() == 0:
        plan = make_plan()
        decisions = {n.name: n.meta["ddlc"] for n in gm.graph.nodes if "ddlc" in n.meta}
        shared = copy.copy(plan)
        shared.problem, shared.choice = None, None
        box = [(shared, decisions)]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() != 0:
        plan, decisions = box[0]
        for node in gm.graph.nodes:
            if node.name in decisions:
                node.meta["ddlc"] = decisions[node.name]
    return plan


def _even(gm: fx.GraphModule, mesh: Mesh) -> bool:
    """Whether every planned tensor splits into equal pieces (then every rank's local
    shapes are the same)."""
    for node in gm.graph.nodes:
        info = node.meta.get("ddlc")
        leaves = tree_leaves(node.meta.get("val"))
        if info is not None and any(isinstance(v, torch.Tensor) and x is not None
                                    and not divides(tuple(v.shape), x, mesh.shape)
                                    for v, x in zip(leaves, info.outputs)):
            return False
    return True


def lower(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int], groups: Sequence[str], *,
          schedule: bool = True, fuse: bool | float = True, partition: bool | float = True,
          max_inflight_bytes: float = float("inf"),
          max_live_bytes: float | None = None, updates: str = "auto") -> fx.GraphModule:
    """The lowering passes for one rank of a sharded graph (annotated by the plan):
    insert collectives on the per-axis process groups ``groups``, localize shapes,
    fuse small collectives (``fuse``: True lets the timeline model choose the bucket cap,
    a number fixes it in bytes), split large ones (``partition``: likewise, the piece
    size), order collectives and place optimizer updates (``updates``: "end", "early"
    inside backward, or "auto": by the timeline model, :func:`passes.schedule.schedule`).
    Needs no process group, so tests can lower every rank in one process."""
    from passes.collectives import insert_collectives
    from passes.fuse import fuse as fuse_with_cap, fuse_best
    from passes.localize import localize
    from passes.partition import partition as partition_with_size, partition_best
    from passes.schedule import follow, schedule as schedule_collectives
    leader = None
    if any(coord) and not _even(gm, mesh):
        # local shapes differ by rank, and so may the modeled timelines: every rank takes the
        # bucket cap, piece size and order that mesh coordinate 0 (the largest pieces) chooses
        leader = lower(copy.deepcopy(gm), mesh, (0,) * mesh.ndim, groups, schedule=schedule,
                       fuse=fuse, partition=partition, max_inflight_bytes=max_inflight_bytes,
                       max_live_bytes=max_live_bytes, updates=updates)
        fuse = leader.meta.get("ddlc_bucket_cap", fuse)
        partition = leader.meta.get("ddlc_piece_bytes", partition)
    insert_collectives(gm, mesh, groups, coord)
    localize(gm, mesh, coord)
    order = (lambda g: schedule_collectives(g, max_inflight_bytes, max_live_bytes, mesh.profile,
                                            updates)) if schedule else None
    if fuse is True:
        gm.meta["ddlc_bucket_cap"] = fuse_best(gm, mesh, order)
    elif fuse:
        fuse_with_cap(gm, mesh, fuse)
    if partition is True:
        gm.meta["ddlc_piece_bytes"] = partition_best(gm, mesh, order)
    elif partition:
        partition_with_size(gm, mesh, partition)
    if leader is not None and schedule:
        follow(gm, [n.name for n in leader.graph.nodes])
    elif order:
        order(gm)
    return gm


def compile(model: nn.Module, mesh, example_inputs, loss_fn=None, optimizer=None, *,
            num_targets: int = 1, solver: str = "cd", memory_budget: float | None = None,
            placements: Mapping[str, object] | None = None, batch: str = "global",
            profile: str | None = None, decouple: bool | str = True, ag_placement: str = "auto",
            schedule: bool = True, fuse: bool = True,
            max_inflight_bytes: float = float("inf"),
            max_live_bytes: float | None = None, updates: str = "auto") -> "CompiledStep":
    """Compile ``model``'s training step (or forward pass without ``loss_fn``) for ``mesh``.

    ``mesh``: a :class:`ddlc.Mesh`, shape tuple, string like ``"2x2"`` or a
    ``DeviceMesh``. ``placements`` pins parameters (by name) or batch inputs
    (``"input0"``, ...) to an SBP such as ``"(S0, B)"``. ``batch="global"`` means
    ``step`` receives the whole batch and each rank takes its part; ``"local"``
    means each rank passes its own part (shape: see ``CompiledStep.local_input_shapes``).
    ``decouple`` turns gradient all-reduces into reduce-scatter + update on the shard +
    all-gather where the cost model says it pays (``"always"``: wherever it can), the
    all-gather placed per ``ag_placement`` ("forward", "backward" or
    "auto": :mod:`passes.decouple`). ``fuse`` buckets small collectives (:mod:`passes.fuse`).
    ``schedule`` reorders collectives for overlap (:mod:`passes.schedule`), keeping at
    most ``max_inflight_bytes`` in flight and, with ``max_live_bytes``, not issuing a
    collective early where that would take the live bytes above it. ``updates``: optimizer
    updates at the end of the step ("end"), inside backward as their reduce-scatters land
    ("early"), or whichever the timeline model predicts faster ("auto").
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from passes.canonicalize import canonicalize
    from passes.decouple import decouple as decouple_updates
    from passes.sharding import shard

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeMismatchError("ddlc.compile needs an initialised process group: launch the "
                                   "script with torchrun, or use ddlc.spawn for local workers")
    if batch not in ("global", "local"):
        raise UnsupportedInputError(f"batch must be 'global' or 'local', got {batch!r}")
    device_mesh = mesh if isinstance(mesh, DeviceMesh) else None
    kwargs = {"profile": profile} if profile else {}
    mesh = Mesh.of(mesh, **kwargs)
    mesh.check_world_size(dist.get_world_size())
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_mesh is None:
        device_mesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)

    gm = canonicalize(trace(model, example_inputs, loss_fn, optimizer, num_targets=num_targets))
    fixed = _resolve_placements(gm, placements, mesh.ndim)

    def make_plan():
        plan = shard(gm, mesh, solver=solver, memory_budget=memory_budget, fixed=fixed)
        if decouple:
            plan.stats["decoupled"] = len(decouple_updates(gm, mesh, ag_placement, frozenset(fixed),
                                                           always=decouple == "always"))
        return plan

    plan = _plan_on_rank0(gm, mesh, make_plan)
    coord = tuple(device_mesh.get_coordinate())
    groups = [device_mesh.get_group(i).group_name for i in range(mesh.ndim)]
    lower(gm, mesh, coord, groups, schedule=schedule, fuse=fuse, max_inflight_bytes=max_inflight_bytes,
          max_live_bytes=max_live_bytes, updates=updates)
    fingerprint = _check_fingerprint(gm)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    return CompiledStep(model, gm, plan, mesh, coord, batch, fingerprint, device)


class CompiledStep:
    """One rank's compiled program and its shards of the model and optimizer state."""

    def __init__(self, model: nn.Module, gm: fx.GraphModule, plan: Plan, mesh: Mesh,
                 coord: Sequence[int], batch: str, fingerprint: str, device: torch.device):
        self.gm, self.plan, self.mesh, self.coord = gm, plan, mesh, tuple(coord)
        self.batch_mode, self.fingerprint, self.device = batch, fingerprint, device
        self.signature = gm.meta["ddlc_step"]
        self._placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        self._spec = {i.key: i for i in self.signature.inputs}
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        self.params = {k: self._shard(k, params[k]) for k in self.signature.keys("param")}
        self.buffers = {k: self._shard(k, buffers[k]) for k in self.signature.keys("buffer")}
        global_state = self.signature.init_opt_state(params)
        self.opt_state = {k: self._shard(k, global_state[k]) for k in self.signature.keys("opt_state")}
        self.gradients_local: dict[str, torch.Tensor] = {}

    # -- placement helpers ---------------------------------------------------------------
    def _sbp(self, key: str) -> NdSBP:
        return self._placeholders[self._spec[key].name].meta["ddlc"].outputs[0]

    def _global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._placeholders[self._spec[key].name].meta["global_val"].shape)

    def _shard(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        index = local_slices(tuple(tensor.shape), self._sbp(key), self.mesh.shape, self.coord)
        return tensor.detach()[index].clone().to(self.device)

    def _gather(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's piece (a collective: every rank must call it).
        Pieces of an uneven split differ in size: each is zero-padded to the largest
        (coordinate 0's) for the all-gather, and placed without its padding."""
        shape, sbp = self._global_shape(key), self._sbp(key)
        largest = local_shape(shape, sbp, self.mesh.shape)
        padded = torch.zeros(largest, dtype=local.dtype, device=local.device)
        padded[tuple(slice(0, n) for n in local.shape)] = local
        pieces = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, padded)
        full = torch.empty(shape, dtype=local.dtype, device=local.device)
        for rank, piece in enumerate(pieces):
            where = local_slices(shape, sbp, self.mesh.shape, self.mesh.coordinate(rank))
            full[where] = piece[tuple(slice(0, s.stop - s.start) for s in where)]
        return full

    @property
    def local_input_shapes(self) -> list[tuple[int, ...]]:
        """Per batch input, the shape each rank passes with ``batch="local"``."""
        return [tuple(self._placeholders[self._spec[k].name].meta["val"].shape)
                for k in self.signature.keys("input")]

    def _local_batch(self, batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        keys = self.signature.keys("input")
        if len(batch) != len(keys):
            raise UnsupportedInputError(f"the compiled step takes {len(keys)} batch tensor(s), "
                                        f"got {len(batch)}")
        out = []
        for key, t, mine in zip(keys, batch, self.local_input_shapes):
            want = self._global_shape(key) if self.batch_mode == "global" else mine
            if tuple(t.shape) != want:
                raise UnsupportedInputError(
                    f"{key} has shape {tuple(t.shape)} but the program was compiled for "
                    f"{self.batch_mode} shape {want} (placement {self._sbp(key)} on mesh {self.mesh})")
            out.append(self._shard(key, t) if self.batch_mode == "global" else t.to(self.device))
        return out

    # -- running -----------------------------------------------------------------------
    def _run(self, batch):
        flat = self.signature.flatten(self.params, self.buffers, self.opt_state,
                                      self._local_batch(batch))
        return self.signature.unflatten(self.gm(*flat))

    def step(self, *batch: torch.Tensor) -> torch.Tensor:
        """One training step on ``batch``; returns the loss (same on every rank)."""
        if not any(o.role == "loss" for o in self.signature.outputs):
            raise UnsupportedInputError("this program has no loss: it was compiled without "
                                        "loss_fn; call it for inference instead")
        out = self._run(batch)
        self.params.update(out.get("param", {}))
        self.opt_state.update(out.get("opt_state", {}))
        self.gradients_local = out.get("grad", {})
        return out["loss"]["loss"].detach()

    def __call__(self, *inputs: torch.Tensor):
        """Inference (compiled without loss_fn): the model's outputs, full on every rank."""
        if any(o.role == "loss" for o in self.signature.outputs):
            raise UnsupportedInputError("this program is a training step; call .step(*batch)")
        outs = list(self._run(inputs)["output"].values())
        return outs[0] if len(outs) == 1 else tuple(outs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers under the model's own names (collective)."""
        state = {k: self._gather(k, v) for k, v in self.params.items()}
        state.update({k: self._gather(k, v) for k, v in self.buffers.items()})
        return state

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Full optimizer state keyed ``"<param>:<state>"`` (collective)."""
        return {k: self._gather(k, v) for k, v in self.opt_state.items()}

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full gradients of the last step (compiled with loss_fn, no optimizer; collective)."""
        return {k: self._gather(k, v) for k, v in self.gradients_local.items()}

    def timeline(self):
        """The modeled timeline of this rank's program (:mod:`cost_models.program`):
        ``.makespan``, ``.exposed_communication``, ``.write_chrome_trace(path)``."""
        from cost_models.program import program_timeline
        return program_timeline(self.gm, self.mesh.profile)

    @property
    def graph(self) -> _GraphText:
        return _GraphText(self.gm)
