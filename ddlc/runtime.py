"""``ddlc.compile`` and the distributed glue around the pipeline.

Every rank of an initialised process group calls :func:`compile` with the same
model, inputs and mesh; the ranks first check that they were given the same (in kind and
shape) and take rank 0's parameter and buffer values. Ranks 0 and 1 trace the step; the
others wait, leaving the host's cores to them. Rank 0 plans it (checking the search's
plan against data parallelism, whose candidate rank 1 plans and lowers meanwhile from its
own graph) and broadcasts every node's decision (so even a time-limited solver gives one
plan). Where the plan splits every tensor evenly, the rank that lowered the chosen plan's
program while planning (or rank 0, now) sends it to the others (:mod:`ddlc.portable`),
and each makes it its own mesh coordinate's (``pipeline.retarget``: process groups carry
the same names on every rank); else rank 0 sends its planned graph to the ranks that hold
none, lowers it (where planning has not already) and broadcasts lowering's choices
(bucket cap, piece size, node order), with which each other rank lowers it for its own
mesh coordinate. Each rank checks with the others that the collective sequence is identical,
and keeps only its own shards of the parameters and optimizer state
(:class:`ddlc.step.CompiledStep`). The passes themselves are listed and run by
:mod:`ddlc.pipeline`; what the ranks send each other, by :mod:`ddlc.ranks`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import pickle
import warnings
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cost_models.measured import local_gloo_ranks
from cost_models.program import program_timeline

from . import holding, inductor, pipeline
from .errors import (DDLCError, LoweringError, MemoryBudgetWarning, MeshError, RuntimeMismatchError,
                     UnsupportedInputError, as_shared)
from .ir import SHARDING, collective_sequence
from .mesh import Mesh
from .model_state import PLAIN, autocast_state, autocast_words
from .optim import group_hyperparameters, refuse_non_optimizer, structure as optimizer_structure
from .options import CompileOptions
from .portable import attributes_read, from_portable, set_attribute, to_portable
from .printing import format_bytes
from .random_stream import STREAM, share_generator
from .ranks import (compiling, on_rank, on_rank0, receive_from, receive_from_rank1, send_to_rank0,
                    take_rank0_optimizer_state, take_rank0_state, tensor_fingerprint)
from .sbp import NdSBP
from .step import CompiledStep
from .tracing import refuse_wrapped

log = logging.getLogger("ddlc.runtime")

__all__ = ["compile", "CompiledStep"]


def _check_fingerprint(gm: fx.GraphModule, coord: tuple[int, ...]) -> str:
    """A digest of ``gm``'s collective sequence (kind and mesh axis of each), checked to
    agree on every rank, and each collective's bytes checked equal across the ranks of its
    group (:func:`mismatched_sequences`; a ``RuntimeMismatchError`` on every rank if not:
    the programs would deadlock or exchange pieces of other sizes). Ranks of different
    groups may move other bytes: a dim split unevenly over one axis gives the groups of
    another axis pieces of other sizes."""
    sequence = collective_sequence(gm)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (coord, sequence))
    mismatch = mismatched_sequences(everyone)
    if mismatch is not None:
        raise RuntimeMismatchError(f"ranks built different collective sequences (this would deadlock): {mismatch}")
    return hashlib.sha256(repr([(kind, axis) for kind, axis, _ in sequence]).encode()).hexdigest()[:16]


def mismatched_sequences(by_rank: Sequence[tuple[tuple[int, ...], list[tuple[str, int, int]]]]) -> str | None:
    """Where the ranks' collective sequences (each rank's mesh coordinate and its
    ``(kind, axis, bytes)`` in order) disagree, or None: every rank must issue the same
    kinds on the same axes in the same order, and the ranks of one group (coordinates
    equal but on the collective's axis) the same bytes."""
    shapes = [[(kind, axis) for kind, axis, _ in sequence] for _, sequence in by_rank]
    for rank, shape in enumerate(shapes):
        if shape != shapes[0]:
            at = next((i for i, (a, b) in enumerate(zip(shape, shapes[0])) if a != b), min(len(shape), len(shapes[0])))
            return (f"rank {rank} issues {len(shape)} collectives, rank 0 {len(shapes[0])}; the first difference "
                    f"is collective {at}: {shape[at] if at < len(shape) else 'none'} against "
                    f"{shapes[0][at] if at < len(shapes[0]) else 'none'}")
    first: dict[tuple, tuple[int, int]] = {}  # (axis, its group, collective index) -> (rank, bytes)
    for rank, (coord, sequence) in enumerate(by_rank):
        for index, (kind, axis, nbytes) in enumerate(sequence):
            seen, seen_bytes = first.setdefault((axis, coord[:axis] + coord[axis + 1:], index), (rank, nbytes))
            if seen_bytes != nbytes:
                return (f"collective {index} ({kind} on axis {axis}) moves {seen_bytes} bytes on rank {seen} "
                        f"and {nbytes} on rank {rank}, of one group")
    return None


def _given(model: nn.Module, example_inputs, loss_fn, optimizer, mesh: Mesh,
           options: CompileOptions) -> list[str]:
    """What this rank was given to compile, in kind and shape (no tensor values), one line
    per item: parameters, buffers, example inputs, loss function, optimizer structure and
    hyper-parameters, mesh, options and where ``torch.autocast`` is on. Every rank runs
    the program rank 0 traces and plans, so these must agree."""
    def plain(x) -> str:  # without memory addresses, which differ by process
        return repr(x) if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__

    if not isinstance(model, nn.Module):  # rank 0's trace says what is wrong
        return [f"model {type(model).__name__}"]
    lines = [f"parameter {k}: {tuple(p.shape)} {p.dtype} {p.device.type}" + ("" if p.requires_grad else " frozen")
             for k, p in model.named_parameters()]
    lines += [f"buffer {k}: {tuple(b.shape)} {b.dtype} {b.device.type}" for k, b in model.named_buffers()]
    leaves, spec = pytree.tree_flatten(example_inputs)
    lines.append(f"example inputs structured as {spec}")
    lines += [f"example input {i}: " + (f"{tuple(x.shape)} {x.dtype} {x.device.type}"
                                        if isinstance(x, torch.Tensor) else plain(x))
              for i, x in enumerate(leaves)]
    lines += [f"module {name or '(the model)'}: {type(m).__qualname__} {_settings(m)}" for name, m in model.named_modules()]
    lines.append(f"loss_fn {getattr(loss_fn, '__qualname__', plain(loss_fn))} {_settings(loss_fn)}")
    if optimizer is not None:
        try:
            lines.append(f"optimizer {type(optimizer).__name__} {optimizer_structure(optimizer)}")
            lines += [f"optimizer hyper-parameters of param group {g}: {values}"
                      for g, values in enumerate(group_hyperparameters(optimizer))]
        except DDLCError:  # unsupported: rank 0's trace says so
            lines.append(f"optimizer {type(optimizer).__name__}")
    lines.append(f"mesh {mesh.shape} {mesh.axis_names} profile {mesh.profile.name}")
    lines.append(f"options {options}")
    lines.append(f"torch.autocast {autocast_words(autocast_state())}")
    return lines


def _device_mesh_given(device_mesh: DeviceMesh | None) -> str:
    """The DeviceMesh given to compile, in words for :func:`_check_given`: its ranks by
    mesh coordinate, or that ddlc makes one."""
    if device_mesh is None:
        return "a mesh shape, for which ddlc makes the DeviceMesh"
    return f"a DeviceMesh of the ranks {device_mesh.mesh.tolist()}"


def _is_plain(value) -> bool:
    return isinstance(value, PLAIN) or (isinstance(value, tuple) and all(map(_is_plain, value)))


def _settings(obj) -> str:
    """The plain values (numbers, strings, flags, tuples of them) an object computes with,
    as text the same in every process: a module's or a loss object's attributes (its
    ``training`` flag, dropout's ``p``), a function's defaults, constants and the values
    its closure holds (a loss weight)."""
    if callable(obj) and hasattr(obj, "__code__"):
        cells = []
        for cell in obj.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                cells.append(cell.cell_contents)
        values = [*(obj.__defaults__ or ()), *obj.__code__.co_consts, *cells]
        return repr([v for v in values if _is_plain(v)])
    fields = vars(obj) if hasattr(obj, "__dict__") else {}
    return ", ".join(f"{k}={v!r}" for k, v in sorted(fields.items()) if not k.startswith("_") and _is_plain(v))


def _check_devices(model: nn.Module, example_inputs, device_type: str) -> None:
    """Refuse a sparse (or otherwise not strided) parameter, buffer or example input, and a
    model or example input off this rank's device type (the process group's:
    CUDA for NCCL, else the CPU): the trace would record the other device in the
    program (a position index made on the inputs' device, say), which then fails or
    copies at every step. Every rank has the same device types (:func:`_given`)."""
    if not isinstance(model, nn.Module):  # rank 0's trace says what is wrong
        return
    tensors = [(f"parameter {k}", t) for k, t in model.named_parameters()]
    tensors += [(f"buffer {k}", t) for k, t in model.named_buffers()]
    tensors += [(f"example input {i}", x) for i, x in enumerate(pytree.tree_leaves(example_inputs))
                if isinstance(x, torch.Tensor)]
    sparse = next(((what, t.layout) for what, t in tensors if t.layout != torch.strided), None)
    if sparse is not None:
        raise UnsupportedInputError(
            f"{sparse[0]} is a {str(sparse[1]).removeprefix('torch.')} tensor: ddlc traces, shards and "
            "updates dense (strided) tensors only; store it dense (.to_dense()), or build the sparse "
            "tensor inside the forward from dense indices and values (a graph's adjacency: "
            "index_add_ or scatter over an edge list)")
    elsewhere = [(what, t.device) for what, t in tensors if t.device.type != device_type]
    if elsewhere:
        what, device = elsewhere[0]
        there = "this rank's GPU (model.cuda())" if device_type == "cuda" else "the CPU"
        raise UnsupportedInputError(
            f"{what} is on {device}, but this rank's program runs on {device_type} (the "
            f"{dist.get_backend()} process group's device); {len(elsewhere)} of the model's "
            f"tensors and example inputs are elsewhere: move the model and the example inputs "
            f"to {there} before ddlc.compile")


def _check_one_example(example_inputs, batch: str) -> None:
    """With ``batch="local"`` the example inputs are still the whole global batch, the same
    on every rank (their shapes set the plan; ``step`` then takes each rank's part). Refuse,
    on every rank at once, examples that differ between ranks: each rank's own part given as
    the example would be planned as a global batch of that size. A collective of every rank
    whatever its ``batch`` (a rank given another ``batch`` than rank 0 is refused here,
    where it would otherwise pair this collective with the next one of the others)."""
    mine = [tensor_fingerprint(x.cpu()) for x in pytree.tree_leaves(example_inputs)
            if isinstance(x, torch.Tensor)] if batch == "local" else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (batch, mine))
    for rank, (theirs, _) in enumerate(everyone):
        if theirs != everyone[0][0]:
            raise RuntimeMismatchError(
                f"rank {rank} was given batch={theirs!r} where rank 0 was given batch={everyone[0][0]!r}: "
                "every rank must call ddlc.compile with the same options")
    if batch != "local":
        return
    everyone = [prints for _, prints in everyone]
    for rank, theirs in enumerate(everyone):
        for i, (a, b) in enumerate(zip(everyone[0], theirs)):
            if not torch.equal(a, b):
                raise UnsupportedInputError(
                    f"with batch='local', ddlc.compile takes the whole global batch as its example, "
                    f"the same on every rank (its shapes set the plan), but rank {rank}'s example "
                    f"input {i} differs from rank 0's: pass the whole batch to compile, and each "
                    "rank's own part to step() (its shapes: step.local_input_shapes)")


def _check_given(given: list[str]) -> None:
    """Raise on every rank, naming the first difference, unless every rank's
    :func:`_given` equals rank 0's."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, given)
    first_rank = everyone[0] + ["nothing more"]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs != everyone[0]:
            theirs = theirs + ["nothing more"]
            i = next(i for i, (a, b) in enumerate(zip(first_rank, theirs)) if a != b)
            raise RuntimeMismatchError(
                f"rank {rank} was given {theirs[i]} where rank 0 was given {first_rank[i]}: "
                "every rank must call ddlc.compile with the same model, example input shapes, "
                "loss, optimizer and options (rank 0 traces and plans for all)")


def _trace_on_ranks01(model: nn.Module, example_inputs, loss_fn, optimizer, options: CompileOptions,
                      ndim: int) -> tuple[fx.GraphModule | None, dict[str, NdSBP]]:
    """Ranks 0 and 1 trace the step and resolve the user's placements on it (each on its
    own core: rank 1 plans data parallelism from its graph while rank 0 searches,
    :func:`_plan_with_rank1`); returns the graph and those placements. Every other rank
    holds no graph (None): it waits for rank 0's outcome, then receives the program
    (:func:`_program`), or where the plan splits unevenly the planned graph
    (:func:`_planned_graph`), rather than take the host's cores from the planners while
    they plan. Tracing is deterministic (the ranks were given the same,
    :func:`_check_given`), so the two graphs are the same, node names included; rank 1
    checks it against rank 0's :func:`_graph_digest` (a step that traces otherwise on
    another rank, e.g. one whose forward reads the rank, would run another program).
    Rank 0's failure is raised on every rank: ranks 1 and up wait for rank 0's outcome
    before going on. Rank 1's own failure, or a graph of its own, is sent to rank 0 as its
    one message (:func:`send_to_rank0`) and raised there."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank >= 2:
        status = receive_from(0)
        if isinstance(status, Exception):
            raise status
        return None, {}
    try:
        traced = pipeline.trace_step(model, example_inputs, loss_fn, optimizer, options)
        fixed, failure = pipeline.resolve_placements(traced, options.placements, ndim), None
    except Exception as error:
        traced, fixed, failure = None, {}, error
    if rank == 0:
        shared = None if failure is None else as_shared(failure, "rank 0 failed while tracing")
        for other in range(2, world):
            dist.send_object_list([shared], dst=other)
        if world > 1:
            dist.send_object_list([shared or (_graph_digest(traced), _constants(traced))], dst=1)
    else:
        status = receive_from(0)
        if isinstance(status, Exception):
            raise status
        digest, constants = status
        if failure is None and _graph_digest(traced) != digest:
            failure = RuntimeMismatchError(
                "rank 1 traced another training step than rank 0: the model's forward, loss "
                "and optimizer must trace alike on every rank (does the forward depend on the "
                "rank, on Python's random numbers or on the environment?)")
        if failure is None:
            _take_constants(traced, constants)
        if failure is not None:  # rank 0 raises it while planning, and shares it with all
            send_to_rank0(as_shared(failure, "rank 1 failed while tracing"))
            on_rank0("planning", None)
    if failure is not None:
        raise failure
    return traced, fixed


def _constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensor constants ``gm`` reads (:func:`ddlc.portable.attributes_read`)."""
    return {k: v for k, v in attributes_read(gm).items() if isinstance(v, torch.Tensor)}


def _take_constants(gm: fx.GraphModule, constants: Mapping[str, torch.Tensor]) -> None:
    """Give rank 1's graph rank 0's tensor ``constants`` (each on the device of rank 1's
    own), as the ranks take rank 0's parameters and buffers: a tensor attribute of the
    model that is neither, set up otherwise on rank 1 (no common seed), would otherwise
    make rank 1's program compute with another value."""
    own = attributes_read(gm)
    for target, value in constants.items():
        set_attribute(gm, target, value.to(own[target].device))


def _graph_digest(gm: fx.GraphModule) -> str:
    """A digest of ``gm``'s nodes as fx prints them (names, targets, arguments)."""
    return hashlib.sha256("\n".join(n.format_node() for n in gm.graph.nodes).encode()).hexdigest()


def _plan_on_rank0(gm: fx.GraphModule | None, mesh: Mesh, make_plan) -> tuple[pipeline.ChosenPlan, bool]:
    """Rank 0 plans (``make_plan() -> ChosenPlan``); every rank adopts its decisions
    (``ir.SHARDING`` by node name, where it holds a graph), the plan and, where planning
    chose them already, lowering's choices, so all ranks lower the same program whatever
    the solver does. Rank 0 returns ``make_plan``'s result, the others a ``ChosenPlan``
    without program; with it, whether the plan splits every tensor evenly
    (:func:`ddlc.pipeline.splits_evenly`, on rank 0's graph)."""
    chosen = None

    def decide():
        nonlocal chosen
        chosen = make_plan()
        decisions = {n.name: SHARDING(n) for n in gm.graph.nodes if SHARDING.has(n)}
        return chosen.plan.without_solver(), decisions, chosen.choices, pipeline.splits_evenly(gm, mesh)

    shared, decisions, choices, even = on_rank0("planning", decide)
    if dist.get_rank() == 0:
        return chosen, even
    if gm is not None:
        for node in gm.graph.nodes:
            if node.name in decisions:
                SHARDING.set(node, decisions[node.name])
    return pipeline.ChosenPlan(shared, choices), even


def _plan_with_rank1(gm: fx.GraphModule | None, mesh: Mesh, coord: tuple[int, ...], options: CompileOptions,
                     fixed: dict, groups: list[str]) -> tuple[pipeline.ChosenPlan, fx.GraphModule | None, bool]:
    """:func:`_plan_on_rank0` with :func:`ddlc.pipeline.choose_plan`, and this rank's
    program where planning lowered it already. Where choose_plan compares the searched plan
    with data parallelism (:func:`ddlc.pipeline.data_parallel_reference`, the same on every
    rank), rank 1 makes the data-parallel candidate (lowering its own coordinate's program
    where the plan splits evenly) while rank 0 searches and lowers its own, and sends it to
    rank 0 through the store (:func:`send_to_rank0`; rank 1's failure goes in its place and
    is raised on rank 0). Rank 0 receives it exactly once, whether or not it needed it and even where its own
    planning failed, so no rank is left waiting. Rank 0 keeps the program choose_plan
    lowered where its coordinate is 0, rank 1 its candidate's where rank 0 adopts it; every
    rank, whether the plan splits evenly. Ranks 2 and up hold no graph (None)."""
    reference = pipeline.data_parallel_reference(gm, mesh, options, fixed) if gm is not None else None
    world = dist.get_world_size()
    mine = None  # rank 1: the candidate's program, if it is this rank's
    if dist.get_rank() == 1:
        message = None
        if reference is not None:
            try:
                message = pipeline.plan_pinned(gm, mesh, options, reference, groups, coord)
                if isinstance(message, pipeline.Candidate):
                    mine, message = message.program, message.to_send()
            except Exception as error:  # raised on rank 0, which shares it with every rank
                message = as_shared(error, "rank 1 failed while planning data parallelism")
        send_to_rank0(message)
    received = []

    def candidate() -> pipeline.Candidate | pipeline.NoCandidate:
        if not received:
            received.append(receive_from_rank1())
        if isinstance(received[0], Exception):
            raise received[0]
        return received[0]

    def make_plan() -> pipeline.ChosenPlan:
        try:
            chosen = pipeline.choose_plan(gm, mesh, options, fixed, groups,
                                          candidate if reference is not None and world > 1 else None)
        finally:
            if world > 1 and not received:  # rank 1 sent its message all the same
                received.append(receive_from_rank1())
        if world > 1:
            candidate()  # rank 1's failure, even where its candidate was not needed
        return chosen

    chosen, even = _plan_on_rank0(gm, mesh, make_plan)
    if dist.get_rank() == 0:
        return chosen, chosen.program, even
    return chosen, mine if chosen.plan.stats.get("chosen_over_search") else None, even


def _program(gm: fx.GraphModule | None, mesh: Mesh, coord: tuple[int, ...], groups: list[str],
             options: CompileOptions, chosen: pipeline.ChosenPlan, held: fx.GraphModule | None,
             even: bool, device: torch.device) -> fx.GraphModule:
    """This rank's program. ``held``: the program this rank lowered while planning (rank 0
    the searched or replicated plan's, for mesh coordinate 0; rank 1 data parallelism's, for
    its own coordinate, where rank 0 adopted it). Where the plan splits every tensor
    evenly, one program serves every rank (``pipeline.retarget``): the rank that holds it
    (or rank 0, lowering coordinate 0's now where planning lowered none) sends it to all
    (:mod:`ddlc.portable`), and each rank makes it its own coordinate's; no other rank
    lowers. Else each rank lowers its own (:func:`_lower_after_rank0`) from rank 0's
    planned graph (:func:`_planned_graph`)."""
    zero = (0,) * mesh.ndim
    if not even:
        gm = _planned_graph(gm, device)
        mine = held if held is not None and (dist.get_rank() == 1 or coord == zero) else None
        return mine if mine is not None else _lower_after_rank0(gm, mesh, coord, groups, options, chosen)
    source, program = (1 if chosen.plan.stats.get("chosen_over_search") else 0), held

    def send():
        nonlocal program
        if program is None:  # rank 0, whose planning lowered no program
            program = gm if coord == zero else pipeline.named_alike_copy(gm)
            pipeline.lower(program, mesh, zero, groups, options, chosen.choices)
        return pickle.dumps(to_portable(program)) if dist.get_world_size() > 1 else None

    payload = on_rank(source, "lowering", send)
    if dist.get_rank() != source:
        program = pipeline.run_pass("receive program", from_portable, pickle.loads(payload), device)
    try:
        program, failure = pipeline.retarget(program, mesh, coord), None
    except LoweringError as error:  # every rank raises it, rather than leave the others waiting
        program, failure = None, as_shared(error, f"rank {dist.get_rank()} failed to retarget the program")
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f is not None), None)
    if first is not None:
        raise first
    return program


def _planned_graph(gm: fx.GraphModule | None, device: torch.device) -> fx.GraphModule:
    """The planned graph on every rank: rank 0 sends its own (:mod:`ddlc.portable`, every
    node's decision with it) to the ranks that hold none (2 and up); rank 1 holds its
    trace with rank 0's decisions (:func:`_plan_on_rank0`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and world > 2:
        payload = pickle.dumps(to_portable(gm))
        for other in range(2, world):
            dist.send_object_list([payload], dst=other)
    if gm is not None:
        return gm
    return pipeline.run_pass("receive plan", from_portable, receive_from(0), device)


def _lower_after_rank0(gm: fx.GraphModule, mesh: Mesh, coord: tuple[int, ...], groups: list[str],
                       options: CompileOptions, chosen: pipeline.ChosenPlan) -> fx.GraphModule:
    """This rank's program. Where planning chose lowering's choices already (``chosen``,
    from :func:`_plan_on_rank0`), every rank lowers with them. Else rank 0 lowers mesh
    coordinate 0's program, which chooses the bucket cap, piece size and node order by
    searching over modeled timelines, and broadcasts those choices
    (:class:`ddlc.pipeline.LoweringChoices`); every other rank meanwhile localizes its own
    program, then takes the choices and skips the searches. Returns ``gm``, lowered in place."""
    zero = (0,) * mesh.ndim
    if chosen.choices is not None:
        pipeline.lower(gm, mesh, coord, groups, options, chosen.choices)
        return gm
    if dist.get_rank() != 0:
        pipeline.lower(gm, mesh, coord, groups, options, lambda: on_rank0("lowering", None))
        return gm

    def lead():
        leader = gm if coord == zero else pipeline.named_alike_copy(gm)
        return pipeline.lower(leader, mesh, zero, groups, options)

    choices = on_rank0("lowering", lead)
    if coord != zero:
        pipeline.lower(gm, mesh, coord, groups, options, choices)
    return gm


def _axis_group_names(device_mesh: DeviceMesh) -> list[str]:
    """For each mesh axis, a name of this rank's process group on that axis that is the
    same on every rank, so that every rank's program is the same graph but for its
    coordinate (``pipeline.retarget``). torch names groups by creation order, so ranks in
    different groups of one axis hold different names: each rank registers its own group
    under a name made from every rank's group name on that axis (functional collectives
    find groups by name in torch's registry). A ``MeshError`` on every rank where some rank's
    place in a group is not its mesh coordinate on that axis (a collective assembles the
    pieces in the group's order)."""
    groups = [device_mesh.get_group(axis) for axis in range(device_mesh.ndim)]
    mine = [group.group_name for group in groups]
    in_order = [dist.get_rank(g) for g in groups] == list(device_mesh.get_coordinate())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, in_order))
    if not all(ok for _, ok in everyone):
        raise MeshError(f"the DeviceMesh {device_mesh.mesh.tolist()} lays ranks out along some mesh "
                        "axis in another order than their process group ranks them (torch orders a "
                        "group's ranks by number), so collectives would put pieces in other places "
                        "than the plan; lay every row and column out in increasing rank order "
                        "(e.g. [[0, 2], [1, 3]])")
    names = []
    for axis, own in enumerate(mine):
        name = "ddlc-" + hashlib.sha256(repr([names_of[axis] for names_of, _ in everyone]).encode()).hexdigest()[:16]
        try:
            registered = c10d._resolve_process_group(name).group_name
        except RuntimeError:
            registered = None
        if registered != own:  # new, or left by a group destroyed since
            if registered is not None:
                c10d._unregister_process_group(name)
            c10d._register_process_group(name, c10d._resolve_process_group(own))
        names.append(name)
    return names


def _mesh_for_world(mesh, options: CompileOptions) -> tuple[Mesh, DeviceMesh | None, str]:
    """The ddlc mesh, the DeviceMesh given (None: ddlc makes one, :func:`_device_mesh`) and
    the device type; no collective, so that ranks given different meshes are refused
    (:func:`_check_given`) before any rank makes process groups the others would not."""
    device_mesh = mesh if isinstance(mesh, DeviceMesh) else None
    mesh = Mesh.of(mesh, **({"profile": options.profile} if options.profile else {}))
    if options.compute != mesh.profile.compute:
        mesh = mesh.with_(profile=dataclasses.replace(mesh.profile, compute=options.compute))
    profile = mesh.profile.for_local_ranks(local_gloo_ranks())
    if profile is not mesh.profile:
        log.info("profile %s: its contention was measured for %d local gloo ranks, not this "
                 "process group's; pricing without it", profile.name, mesh.profile.contention.local_ranks)
        mesh = mesh.with_(profile=profile)
    mesh.check_world_size(dist.get_world_size())
    return mesh, device_mesh, "cuda" if dist.get_backend() == "nccl" else "cpu"


def _device_mesh(mesh: Mesh, given: DeviceMesh | None, device_type: str) -> DeviceMesh:
    """The DeviceMesh whose groups the program uses: ``given``, else one of ``mesh``'s
    shape over the world's ranks in order (a collective: it makes process groups)."""
    if given is not None:
        return given
    return init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)


def compile(model: nn.Module, mesh, example_inputs, loss_fn=None, optimizer=None,
            **options) -> "CompiledStep":
    """Compile ``model``'s training step (or forward pass without ``loss_fn``) for ``mesh``.

    ``mesh``: a :class:`ddlc.Mesh`, shape tuple, string like ``"2x2"`` or a
    ``DeviceMesh``. ``options`` are the fields of :class:`ddlc.options.CompileOptions`
    (placements, batch mode, solver, memory budget, profile, decoupling, fusion,
    partition, scheduling caps, where updates run); they are validated before any work.

    A model that an earlier compiled step has trained (whose weights and optimizer state
    that step holds) gets them back first (:meth:`CompiledStep.write_back`), so the new
    step continues the training, as eager would after changing the model.

    Under ``torch.inference_mode()`` the step's state is still made of normal tensors
    (inference tensors could not be updated by the steps run outside it).
    """
    if optimizer is not None:
        refuse_non_optimizer(optimizer)
    if isinstance(model, nn.Module):  # else rank 0's trace says what is wrong
        refuse_wrapped(model)  # before the wrapper's tensors meet a collective
        holding.guard(model, optimizer)
    with torch.inference_mode(False):
        return _compile(model, mesh, example_inputs, loss_fn, optimizer, CompileOptions.from_kwargs(**options))


def _compile(model: nn.Module, mesh, example_inputs, loss_fn, optimizer,
             options: CompileOptions) -> "CompiledStep":
    """:func:`compile` (outside inference mode)."""
    rng_state = torch.get_rng_state()  # before anything could draw from it
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeMismatchError("ddlc.compile needs an initialised process group: launch the "
                                   "script with torchrun, or use ddlc.spawn for local workers")
    mesh, device_mesh, device_type = _mesh_for_world(mesh, options)
    trainers = holding.trainers(model)
    held = [step.steps_done for step in trainers]
    _check_one_example(example_inputs, options.batch)  # before the shapes are compared: each rank's own part?
    _check_given(_given(model, example_inputs, loss_fn, optimizer, mesh, options)
                 + [_device_mesh_given(device_mesh),
                    f"steps trained by earlier compiled steps of this model or of models sharing "
                    f"its parameters: {held}"])
    _check_devices(model, example_inputs, device_type)
    device_mesh = _device_mesh(mesh, device_mesh, device_type)
    groups = _axis_group_names(device_mesh)  # a collective: before anything one rank may raise alone
    for trainer in trainers:
        log.info("an earlier compiled step trained this model's parameters %d step(s): its weights, "
                 "buffers and optimizer state are written back first", trainer.steps_done)
        trainer.write_back()
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    owner = STREAM.get(device)
    stream = None  # the new program goes on from the stream (an inference program's draws too)
    if owner is not None:
        stream = owner.unmoved_stream()
        owner.hand_back()
        rng_state = torch.get_rng_state()
    # compile's own writes (rank 0's values, which a program written back holds already) are
    # no user's change to the other programs of the model that saw none since they last ran
    unchanged = [step for step in holding.steps_of(model) if step.sees_no_change()]
    take_rank0_state(model)
    take_rank0_optimizer_state(optimizer)
    for step in unchanged:
        step.accept_compiles_writes()
    # the garbage collector is not deferred here as ``ddlc plan`` defers it: with it
    # deferred, a later step of a gloo worker once aborted on a corrupted heap (as with
    # ``gc.freeze`` before); most likely gloo's functional collectives overlapping, which
    # gloo programs no longer do (passes/waits.py)
    coord = tuple(device_mesh.get_coordinate())
    with compiling():  # a rank may wait minutes for another's plan: see ddlc/ranks.py
        gm, fixed = _trace_on_ranks01(model, example_inputs, loss_fn, optimizer, options, mesh.ndim)
        chosen, held, even = _plan_with_rank1(gm, mesh, coord, options, fixed, groups)
        gm = _program(gm, mesh, coord, groups, options, chosen, held, even, device)
    plan = chosen.plan
    if options.memory_budget is not None and dist.get_rank() == 0:
        _warn_over_budget(gm, mesh, options.memory_budget)
    if dist.get_backend() == "gloo":  # one collective in flight at a time: see passes/waits.py
        pipeline.run_pass("waits", pipeline.wait_at_once, gm)
    digest = _check_fingerprint(gm, coord)
    share_generator(gm, device, rng_state, stream)
    step = CompiledStep(model, gm, plan, mesh, coord, options.batch, digest, device, optimizer,
                        device_mesh, host_scalars=options.backend == "eager", loss_fn=loss_fn)
    if options.backend == "inductor":
        step.program = _compile_with_inductor(gm, device)
    return step


def _warn_over_budget(program: fx.GraphModule, mesh: Mesh, budget: float) -> None:
    """A :class:`ddlc.errors.MemoryBudgetWarning`, at the user's ``compile`` call, where the
    modeled peak memory of this rank's lowered ``program`` (what ``ddlc plan`` reports as
    "peak memory per device") exceeds the ``memory_budget`` the plan was searched under."""
    peak = program_timeline(program, mesh.profile).peak_memory
    if peak > budget:
        warnings.warn(MemoryBudgetWarning(
            f"the lowered program's modeled peak memory per device, {format_bytes(peak)}, is "
            f"{peak / budget - 1:.0%} over memory_budget={budget:.0f} ({format_bytes(budget)}): the search "
            "keeps the plan's parameters, gradients, optimizer state and saved activations within "
            "the budget, not the buffers lowering adds (weights all-gathered before use, gradient "
            "buckets, pieces) nor the order's live ranges; give a smaller budget to leave that "
            "headroom"), stacklevel=4)  # _warn_over_budget, _compile, compile, the caller


def _compile_with_inductor(gm: fx.GraphModule, device: torch.device):
    """``gm`` compiled by Inductor (:mod:`ddlc.inductor`), once every rank's compiled
    collectives are checked to be its planned ones, in order (and on gloo, waited one at
    a time: :mod:`passes.waits`)."""
    examples = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device).zero_()
                for v in (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")]
    gloo, planned = dist.get_backend() == "gloo", inductor.planned_collectives(gm)
    program, compiled, in_flight = pipeline.run_pass("inductor", inductor.compile_program, gm, examples,
                                                     one_in_flight=gloo and len(planned) > 1)
    problem = inductor.check_order(planned, compiled)
    if problem is None and in_flight > 1 and gloo:
        problem = (f"Inductor's program has {in_flight} collectives in flight at once, which gloo's "
                   "functional collectives do not survive (passes/waits.py)")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    if any(everyone):
        raise LoweringError("Inductor's program does not run the collectives as planned (another "
                            "sequence would deadlock the ranks or reduce mismatched tensors): "
                            + "; ".join(f"rank {r}: {p}" for r, p in enumerate(everyone) if p)
                            + "; use backend='eager'")
    strides = [e.stride() for e in examples]

    def run(*flat):
        # Inductor's program asserts the strides it was compiled for; a new parameter or
        # state tensor it returned with other strides is made contiguous on its way back in
        return program(*(x if x.stride() == s else x.contiguous() for x, s in zip(flat, strides)))
    return run


