"""A traced step graph as a picklable value, so that one rank traces and the others
receive the graph instead of tracing it again (``ddlc.compile``).

A ``GraphModule`` pickles as its generated code, which drops every node's ``meta``; the
passes need it (fake values, roles, origins, phases). :func:`to_portable` records each
node as (op, name, target, args, kwargs, meta), with node references and operator
overloads by name, plus the graph module's ``meta`` and the tensors its ``get_attr`` nodes
read. Fake tensors become :class:`FakeSpec` records (shape, stride, storage offset, dtype,
device); :func:`from_portable` rebuilds them as fake tensors of one new ``FakeTensorMode``
(as one trace gives), so the rebuilt graph has the same nodes, names, values and meta as
the traced one. A value shared by several nodes stays shared. The graph's namespace
travels too (the names given, and the counters): a pass that adds a node then names it as
it would in the traced graph, so every rank's program names its nodes alike (lowering's
choices refer to nodes by name).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule

from .fake import strided_fake

__all__ = ["FakeSpec", "PortableGraph", "to_portable", "from_portable", "attributes_read", "set_attribute"]


@dataclass(frozen=True)
class FakeSpec:
    """What a fake tensor is: its layout, dtype and device (no data)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def fake(self, mode: FakeTensorMode, device: torch.device | None = None) -> FakeTensor:
        """A fake tensor of this layout in ``mode``, on ``device`` where that is a device of
        the same type (another GPU of the receiving rank), else on this spec's device."""
        device = device if device is not None and device.type == self.device.type else self.device
        return strided_fake(mode, self.shape, self.stride, self.dtype, device, self.offset, self.requires_grad)


@dataclass(frozen=True)
class _Ref:
    """A reference to the node of this name (in args, kwargs and meta)."""

    name: str


@dataclass(frozen=True)
class _Op:
    """An aten (or other ``torch.ops``) operator overload by name: they do not pickle."""

    namespace: str
    name: str
    overload: str

    @classmethod
    def of(cls, op: torch._ops.OpOverload) -> "_Op":
        return cls(op.namespace, op._opname, op._overloadname)

    def resolve(self) -> torch._ops.OpOverload:
        return getattr(getattr(getattr(torch.ops, self.namespace), self.name), self.overload)


@dataclass
class PortableGraph:
    """A graph module as plain picklable data (see the module docstring)."""

    nodes: list[tuple[str, str, Any, Any, Any, dict]]
    meta: dict
    attributes: dict[str, torch.Tensor]
    codegen: fx.graph.CodeGen
    #: the graph's namespace (torch.fx's: every name given, erased nodes' included, and the
    #: last number given to each base name), so that passes name new nodes alike on every rank
    used_names: set[str]
    name_counters: dict[str, int]


def _mapped(x, on_tensor, on_node, memo: dict):
    """``x`` with fake tensors mapped by ``on_tensor`` (each object once: ``memo``) and nodes by
    ``on_node``, through lists, tuples (named tuples too), dicts and ``torch.Size``."""
    if isinstance(x, (FakeTensor, FakeSpec)):
        if id(x) not in memo:
            memo[id(x)] = (x, on_tensor(x))
        return memo[id(x)][1]
    if isinstance(x, (fx.Node, _Ref)):
        return on_node(x)
    if isinstance(x, torch._ops.OpOverload):
        return _Op.of(x)
    if isinstance(x, _Op):
        return x.resolve()
    if isinstance(x, torch.Size):
        return x
    if isinstance(x, (list, tuple)):
        items = [_mapped(i, on_tensor, on_node, memo) for i in x]
        if hasattr(x, "_fields"):  # a named tuple
            return type(x)(*items)
        return type(x)(items)
    if isinstance(x, dict):
        return type(x)((k, _mapped(v, on_tensor, on_node, memo)) for k, v in x.items())
    return x


def _spec(t: FakeTensor) -> FakeSpec:
    return FakeSpec(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device,
                    t.requires_grad)


def attributes_read(gm: fx.GraphModule) -> dict[str, Any]:
    """What ``gm``'s ``get_attr`` nodes read, by target: the constants the trace captured
    (tensor attributes of the model that are neither parameters nor buffers, tensors a
    loss captures from outside the model)."""
    return {n.target: functools.reduce(getattr, n.target.split("."), gm)
            for n in gm.graph.find_nodes(op="get_attr")}


def set_attribute(gm: fx.GraphModule, target: str, value) -> None:
    """Set the attribute a ``get_attr`` node of ``target`` (a dotted path) reads."""
    *path, name = target.split(".")
    setattr(functools.reduce(getattr, path, gm), name, value)


def to_portable(gm: fx.GraphModule) -> PortableGraph:
    """``gm`` as a :class:`PortableGraph` (its values fake; see the module docstring)."""
    memo: dict = {}

    def node_ref(n: fx.Node) -> _Ref:
        return _Ref(n.name)

    def portable(x):
        return _mapped(x, _spec, node_ref, memo)
    nodes = [(n.op, n.name, portable(n.target), portable(n.args), portable(n.kwargs), portable(dict(n.meta)))
             for n in gm.graph.nodes]
    return PortableGraph(nodes, portable(dict(gm.meta)), attributes_read(gm),
                         gm.graph._codegen, set(gm.graph._graph_namespace._used_names),
                         dict(gm.graph._graph_namespace._base_count))


def from_portable(portable: PortableGraph, device: torch.device | None = None) -> fx.GraphModule:
    """The graph module :func:`to_portable` recorded: the same nodes (names, targets,
    arguments, meta) in the same order, its fake values in one new ``FakeTensorMode``;
    values and tensor attributes on a device of ``device``'s type are put on ``device`` (the
    receiving rank's GPU where the sender's was another)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    graph = fx.Graph()
    graph._codegen = portable.codegen
    made: dict[str, fx.Node] = {}
    memo: dict = {}

    def fake(spec: FakeSpec) -> FakeTensor:
        return spec.fake(mode, device)

    def node(ref: _Ref) -> fx.Node:
        return made[ref.name]

    def rebuilt(x):
        return _mapped(x, fake, node, memo)

    for op, name, target, args, kwargs, meta in portable.nodes:
        new = graph.create_node(op, rebuilt(target), rebuilt(args), rebuilt(kwargs), name=name)
        if new.name != name:
            raise ValueError(f"node {name!r} was renamed {new.name!r} on rebuilding")
        made[name] = new
        new.meta.update(rebuilt(meta))
    graph._graph_namespace._used_names.update(portable.used_names)
    graph._graph_namespace._base_count.update(portable.name_counters)
    attributes = {name: value.to(device) if isinstance(value, torch.Tensor) and device is not None
                  and value.device.type == device.type else value
                  for name, value in portable.attributes.items()}
    gm = _LazyGraphModule(attributes, graph)  # its code generated when first run
    gm.meta.update(rebuilt(portable.meta))
    return gm
