"""The annotations every pass shares: node-annotation types, meta keys, collective ops,
and the walk over the trees of arguments and values (:func:`leaves`, :func:`map_leaves`).

A leaf module: it imports nothing of the project (SBP types appear in annotations
only), so every layer -- cost models, passes, the pipeline, the runtime -- can read
and write annotations without importing the layer that made them.

One meta key holds one type, the way torch.fx's ``ShapeProp`` keeps
``tensor_meta: TensorMetadata``; read and write them through the :class:`MetaKey`
objects below, never by string:

================  =====================  =======================  =============================
key               holds                  written by               read by
================  =====================  =======================  =============================
``ORIGIN``        :class:`Origin`        trace                    printing, sharding, decouple,
                                                                  schedule, errors
``ROLE``          ``str`` (:data:`ROLES`) trace                   sharding, schedule
``SHARDING``      :class:`NdSignature`   shard, decouple,         collectives, localize,
                                         collectives              runtime, printing
``COLLECTIVE``    :class:`CollectiveInfo` collectives, fuse,      program timeline, fingerprint,
                                         partition                schedule, printing
``PIECE``         :class:`Piece`         partition                schedule
``FUSED``         ``int`` (members)      fuse                     fuse
``GLOBAL_VAL``    global ``val``         localize                 runtime
``STEP``          :class:`StepSignature` trace (on the graph)     every pass, runtime
``BUCKET_CAP``    ``float`` (bytes)      fuse (on the graph)      pipeline (leader choices)
``PIECE_BYTES``   ``float`` (bytes)      partition (on the graph) pipeline (leader choices)
``UPDATES``       ``str`` (schedule's)   schedule (on the graph) tests, bench
``RANK_ARG``      :class:`RankArg`       collectives, random      retarget
``DRAW_STRIDES``  ``tuple`` (strides)    trace                    random
================  =====================  =======================  =============================
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, NamedTuple, Optional, Sequence, TypeVar

import torch
from torch import fx
from torch._ops import OpOverload
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import (SUPPORTED_NODES, TreeSpec, register_pytree_node, tree_leaves, tree_map,
                                 tree_unflatten, treespec_leaf)

if TYPE_CHECKING:  # annotations only: ir imports nothing of the project at run time
    from .sbp import SBP, NdSBP

__all__ = ["MetaKey", "Origin", "InputSpec", "OutputSpec", "StepSignature", "Signature",
           "NdSignature", "CollectiveInfo", "Piece", "ROLES", "ORIGIN", "ROLE", "SHARDING",
           "COLLECTIVE", "PIECE", "FUSED", "GLOBAL_VAL", "STEP", "BUCKET_CAP", "PIECE_BYTES",
           "RECOMPUTE", "RECOMPUTED", "UPDATES", "RankArg", "RANK_ARG", "DRAW_STRIDES", "SHARED_READ", "COLLECTIVE_KINDS", "BUCKETABLE", "STRIDED_READERS", "is_collective", "is_wait", "is_mutating", "phase_of", "in_update",
           "collective_kind", "collective_sequence", "name_alike", "is_scalar_valued", "output_scalars",
           "frozen"]

T = TypeVar("T")


class MetaKey(Generic[T]):
    """One annotation key of ``node.meta`` (or ``gm.meta``) and the one type it holds."""

    __slots__ = ("name", "type")

    def __init__(self, name: str, type_: type | tuple[type, ...]):
        self.name, self.type = name, type_

    def get(self, owner: fx.Node | fx.GraphModule, default: T | None = None) -> T | None:
        return owner.meta.get(self.name, default)

    def __call__(self, owner: fx.Node | fx.GraphModule) -> T:
        """The annotation; a KeyError naming the node and the key if it is missing."""
        try:
            return owner.meta[self.name]
        except KeyError:
            raise KeyError(f"{getattr(owner, 'name', type(owner).__name__)} has no "
                           f"{self.name!r} annotation") from None

    def set(self, owner: fx.Node | fx.GraphModule, value: T) -> T:
        if not isinstance(value, self.type):
            raise TypeError(f"meta key {self.name!r} holds {self.type}, not {type(value).__name__}")
        owner.meta[self.name] = value
        return value

    def has(self, owner: fx.Node | fx.GraphModule) -> bool:
        return self.name in owner.meta

    def __repr__(self) -> str:
        return f"MetaKey({self.name!r})"


# -- argument and value trees ----------------------------------------------------------------

#: The containers fx arguments and values are made of (exact types), walked by
#: :func:`leaves` and :func:`map_leaves` themselves; any other goes to ``torch.utils._pytree``.
_SEQUENCES = frozenset({tuple, list, immutable_list})
_MAPPINGS = frozenset({dict, immutable_dict})
#: Leaf types besides tensors and nodes (what arguments mostly are).
_PLAIN = frozenset({int, float, bool, str, type(None), slice, torch.dtype, torch.device, torch.layout,
                    torch.memory_format})


def leaves(tree) -> list:
    """``torch.utils._pytree.tree_leaves(tree)``: the same leaves in the same order, with
    tuples, lists and dicts (fx's immutable ones too) walked here instead of through
    pytree's registry, which the passes would consult for every argument of every node."""
    out: list = []
    _gather(tree, out)
    return out


def _gather(tree, out: list) -> None:
    kind = type(tree)
    if kind in _SEQUENCES:
        for x in tree:
            _gather(x, out)
    elif kind in _MAPPINGS:
        for x in tree.values():
            _gather(x, out)
    elif kind in _PLAIN or isinstance(tree, (torch.Tensor, fx.Node)):
        out.append(tree)
    else:
        out.extend(tree_leaves(tree))


def map_leaves(fn: Callable[[Any], Any], tree):
    """``torch.utils._pytree.tree_map(fn, tree)``, walked like :func:`leaves`: the same
    containers rebuilt around ``fn`` of each leaf."""
    kind = type(tree)
    if kind in _SEQUENCES:
        return kind(map_leaves(fn, x) for x in tree)
    if kind in _MAPPINGS:
        return kind((k, map_leaves(fn, v)) for k, v in tree.items())
    if kind in _PLAIN or isinstance(tree, (torch.Tensor, fx.Node)):
        return fn(tree)
    return tree_map(fn, tree)


def frozen(x, tensor_key: Callable[[torch.Tensor], Any]):
    """A hashable stand-in for an operator's argument (or output) by its metadata: a tensor
    as ``tensor_key(t)``, an fx.Node as its value (``meta["val"]``), a tuple, list or dict
    (fx's immutable ones too) by its type and items, anything else by its type and value
    (1, 1.0 and True pick different dtypes). Unhashable where a leaf is."""
    kind = type(x)
    if kind is fx.Node:
        return frozen(x.meta.get("val"), tensor_key)
    if isinstance(x, torch.Tensor):
        return tensor_key(x)
    if kind in _SEQUENCES:
        return (kind, tuple(frozen(a, tensor_key) for a in x))
    if kind in _MAPPINGS:
        return (kind, tuple((k, frozen(v, tensor_key)) for k, v in x.items()))
    return (kind, x)


# -- what the tracer records -------------------------------------------------------------

#: The roles of the step's flat inputs ("hparam": an optimizer hyper-parameter, 0-d).
ROLES = ("param", "buffer", "opt_state", "hparam", "input")
_ROLE_WORDS = {"param": "parameter", "buffer": "buffer", "opt_state": "optimizer state",
               "hparam": "hyper-parameter", "input": "batch input"}


@dataclass(frozen=True)
class Origin:
    """Where a node came from: ``phase`` in forward/backward/optimizer/input,
    the module path (``""`` for the root) and the user's source line."""

    phase: str
    module: str
    source: str = ""

    def where(self, node_name: str) -> str:
        """``name [module] source``: how errors point at a node."""
        return f"{node_name} [{self.module}] {self.source}"


@dataclass(frozen=True)
class InputSpec:
    """One flat graph input: ``role`` in ROLES; ``key`` is the parameter/buffer name,
    ``"<param>:<state>"`` for optimizer state, ``"group<g>.<name>"`` for a param group's
    hyper-parameter, or ``"input<i>"`` for batch tensors."""

    name: str
    role: str
    key: str


@dataclass(frozen=True)
class OutputSpec:
    """One flat graph output: role ``loss``, ``grad_norm`` (before clipping), ``param``
    (updated), ``opt_state``, ``grad`` (loss without optimizer), ``buffer`` (a buffer the
    step updates, e.g. BatchNorm running statistics) or ``output`` (forward only)."""

    role: str
    key: str


def micro_batch_key(key: str, index: int, micro_batches: int) -> str:
    """The program's input key of micro-batch ``index`` of batch entry ``key``: ``key``
    itself without micro-batches, else ``key[index]``."""
    return key if micro_batches == 1 else f"{key}[{index}]"


def micro_batch(t: torch.Tensor, index: int, micro_batches: int) -> torch.Tensor:
    """Micro-batch ``index`` of a batch tensor: rows ``index * m`` to ``(index + 1) * m``
    of ``t``'s first dim, ``m = len(t) / micro_batches``, as the eager loop over
    ``t.chunk(micro_batches)`` takes them (where :func:`uneven_micro_batches` finds none)."""
    rows = t.shape[0] // micro_batches
    return t.narrow(0, index * rows, rows)


def uneven_micro_batches(batch: Mapping[str, torch.Tensor], micro_batches: int) -> str | None:
    """Why ``batch`` cannot be cut into ``micro_batches`` equal micro-batches (a tensor
    whose first dim they do not divide), or None where it can."""
    if micro_batches == 1:
        return None
    for key, t in batch.items():
        if t.dim() == 0:
            return (f"batch entry {key!r} is 0-d, and micro_batches={micro_batches} cuts every batch "
                    "tensor along its first dim (the batch dim): keep a value that is not per sample "
                    "out of the batch (on the model, or in the loss function)")
        if t.shape[0] % micro_batches:
            return (f"batch entry {key!r} has shape {tuple(t.shape)}, whose first dim cannot be cut "
                    f"into micro_batches={micro_batches} equal micro-batches: every batch tensor is "
                    "split along its first dim (the batch dim), so give each a multiple of "
                    f"{micro_batches} rows")
    return None


#: Output role -> the input role whose placement it must end in (loop-carried state).
LOOP_ROLE = {"param": "param", "opt_state": "opt_state", "grad": "param", "buffer": "buffer"}


@dataclass(frozen=True)
class StepSignature:
    """The roles of a traced step's flat inputs and outputs, and its optimizer specs
    (``(param name, spec)`` pairs; a spec has ``init_state(param)`` and ``state_names``),
    the specs by param-group index, and the hyper-parameter inputs' compile-time values."""

    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    optimizer: tuple[tuple[str, Any], ...] = ()
    num_targets: int = 0
    param_groups: tuple[tuple[int, Any], ...] = ()
    hyperparameters: tuple[tuple[str, float], ...] = ()
    #: the batch is a dict, given to the model as keyword arguments
    keyword_batch: bool = False
    #: how a forward pass's outputs rebuild the model's output structure
    output_tree: "OutputTree | None" = None
    #: the optimizer's parameters the loss does not read: never updated, and without state
    #: in torch.optim (which creates a parameter's state at its first gradient); without an
    #: optimizer, the trainable parameters whose gradient eager leaves None
    untrained: tuple[str, ...] = ()
    #: the shape of the loss the model or ``loss_fn`` returns (one element; the graph's is 0-d)
    loss_shape: tuple[int, ...] = ()
    #: the batch inputs that ``step()`` lays out as their examples were: all of them where the
    #: program reads storage through given strides (:data:`STRIDED_READERS`), else none
    strided_inputs: tuple[str, ...] = ()
    #: gradient accumulation: the batch is split along its first dim into this many equal
    #: micro-batches, each its own forward and backward, their gradients summed before the
    #: one update; the program's batch inputs are each micro-batch's (:func:`micro_batch_key`)
    micro_batches: int = 1

    def keys(self, role: str) -> list[str]:
        return [i.key for i in self.inputs if i.role == role]

    def batch_keys(self) -> list[str]:
        """The batch's keys as ``step()`` takes them: the program's batch inputs, or with
        micro-batches the first micro-batch's keys without their index."""
        keys = self.keys("input")
        if self.micro_batches == 1:
            return keys
        return [k.removesuffix("[0]") for k in keys[:len(keys) // self.micro_batches]]

    def split_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` (by :meth:`batch_keys`) as the program's batch inputs: with micro-batches,
        each tensor cut along its first dim into ``micro_batches`` equal parts, micro-batch
        ``i`` of ``key`` under ``key[i]`` (views of the batch's storage)."""
        if self.micro_batches == 1:
            return dict(batch)
        n = self.micro_batches
        return {micro_batch_key(key, i, n): micro_batch(t, i, n) for i in range(n) for key, t in batch.items()}

    def input_name(self, role: str, key: str) -> str:
        """The placeholder name of the input with ``role`` and ``key``."""
        return next(i.name for i in self.inputs if (i.role, i.key) == (role, key))

    def describe_input(self, name: str) -> str:
        """The input placeholder ``name`` as the user knows it: "parameter 'fc.weight'",
        "batch input 'input0'", ...; "input 'name'" where it is none of the step's."""
        spec = next((i for i in self.inputs if i.name == name), None)
        if spec is None:
            return f"input {name!r}"
        words = f"{_ROLE_WORDS[spec.role]} {spec.key!r}"
        if spec.role == "input" and self.micro_batches > 1:
            key, index = spec.key[:-1].rsplit("[", 1)
            words += f" (micro-batch {index} of {key}, cut into micro_batches={self.micro_batches})"
        return words

    def loop_inputs(self) -> dict[int, str]:
        """Output index -> the placeholder whose placement that output must end in
        (updated parameters and optimizer state; gradients: their parameter's)."""
        name_of = {(i.role, i.key): i.name for i in self.inputs}
        return {k: name_of[(LOOP_ROLE[o.role], o.key)] for k, o in enumerate(self.outputs)
                if o.role in LOOP_ROLE}

    @property
    def has_loss(self) -> bool:
        return any(o.role == "loss" for o in self.outputs)

    def flatten(self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                opt_state: Mapping[str, torch.Tensor],
                batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                hyperparameters: Mapping[str, float] | None = None) -> list:
        """Arrange named state, the hyper-parameters (default: their compile-time values)
        and the batch (tensors in input order, or by input key) as the graph's flat input
        list."""
        hyper = dict(self.hyperparameters) if hyperparameters is None else hyperparameters
        if not isinstance(batch, Mapping):
            batch = dict(zip(self.batch_keys(), batch))
        if set(batch) != set(self.keys("input")):
            batch = self.split_batch(batch)
        tables = {"param": params, "buffer": buffers, "opt_state": opt_state,
                  "hparam": hyperparameter_tensors(hyper), "input": batch}
        return [tables[i.role][i.key] for i in self.inputs]

    def init_opt_state(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fresh optimizer state for ``params``, keyed ``"<param>:<state>"``."""
        return {f"{k}:{s}": t for k, spec in self.optimizer
                for s, t in spec.init_state(params[k].detach()).items()}

    def unflatten(self, outputs: Sequence[Any]) -> dict[str, dict[str, Any]]:
        """Split the flat outputs by role: ``{"loss": {"loss": t}, "param": {...}, ...}``."""
        result: dict[str, dict[str, Any]] = {}
        for spec, value in zip(self.outputs, outputs):
            result.setdefault(spec.role, {})[spec.key] = value
        return result


@dataclass(frozen=True)
class _Fields:
    """A dataclass instance that pytree does not know, as pytree sees it in an
    :class:`OutputTree`: its class and its fields' names and values (see
    :func:`dataclasses_as_nodes`). Its spec rebuilds the instance itself."""

    cls: type
    names: tuple[str, ...]
    values: tuple


def _fields_flatten(node: _Fields):
    return list(node.values), (node.cls, node.names)


def _fields_unflatten(values, context):
    cls, names = context
    instance = object.__new__(cls)   # the fields as they were, without __init__'s work again
    for name, value in zip(names, values):
        object.__setattr__(instance, name, value)
    return instance


register_pytree_node(_Fields, _fields_flatten, _fields_unflatten, serialized_type_name="ddlc.ir._Fields")


def dataclasses_as_nodes(tree):
    """``tree`` with every instance of a dataclass that pytree does not know (a plain
    ``@dataclass`` a model returns; Hugging Face's ``ModelOutput`` registers itself) made
    a node whose leaves are its fields, so that flattening reaches the tensors inside and
    unflattening gives the instance back."""
    def node(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in SUPPORTED_NODES:
            fields = dataclasses.fields(x)
            return _Fields(type(x), tuple(f.name for f in fields),
                           tuple(dataclasses_as_nodes(getattr(x, f.name)) for f in fields))
        return x
    return tree_map(node, tree)


@dataclass(frozen=True)
class OutputTree:
    """The structure of a model's output (a tensor, tuple, dict, dataclass or Hugging Face
    ``ModelOutput``): its pytree spec (of :func:`dataclasses_as_nodes`), and per leaf
    whether it is a tensor (a graph output, in order) or the constant kept in
    ``constants``."""

    spec: Any
    constants: tuple
    is_tensor: tuple[bool, ...]

    @property
    def num_tensors(self) -> int:
        return sum(self.is_tensor)

    def __deepcopy__(self, memo):  # immutable; a TreeSpec does not deep-copy cleanly
        return self

    def __reduce__(self):
        # a pickled TreeSpec's leaves unpickle through the deprecated ``LeafSpec``
        # constructor, which warns on every rank that receives rank 0's graph: the spec
        # travels as nested (type, context, children) instead, a leaf as None
        return _output_tree, (_spec_as_tuples(self.spec), self.constants, self.is_tensor)

    def rebuild(self, tensors: Sequence[Any]):
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self.is_tensor, self.constants)]
        return tree_unflatten(leaves, self.spec)


def _spec_as_tuples(spec: TreeSpec):
    if spec.is_leaf():
        return None
    return (spec.type, spec.context, [_spec_as_tuples(c) for c in spec.children()])


def _spec_from_tuples(plain) -> TreeSpec:
    if plain is None:
        return treespec_leaf()
    node_type, context, children = plain
    return TreeSpec(node_type, context, [_spec_from_tuples(c) for c in children])


def _output_tree(plain, constants: tuple, is_tensor: tuple) -> OutputTree:
    return OutputTree(_spec_from_tuples(plain), constants, is_tensor)


def hyperparameter_tensors(values: Mapping[str, float | torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hyper-parameter values as the step's 0-d inputs (tensors pass through), in float64,
    as torch's optimizers compute with them (Python floats: Adam's bias corrections, the
    step size; an operator with a tensor then takes the tensor's dtype)."""
    return {k: v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=HYPERPARAMETER_DTYPE)
            for k, v in values.items()}


#: the dtype of the step's hyper-parameter inputs (:func:`hyperparameter_tensors`)
HYPERPARAMETER_DTYPE = torch.float64


# -- what the planner and the lowering passes record ----------------------------------------

@dataclass(frozen=True, order=True)
class Signature:
    """One mesh axis: the SBP of each tensor input (``tensor_inputs`` order) and of
    each output leaf (``None`` for a non-tensor leaf)."""

    inputs: tuple[Optional[SBP], ...]
    outputs: tuple[Optional[SBP], ...]

    def __str__(self) -> str:
        return f"{','.join(map(str, self.inputs))}->{','.join(map(str, self.outputs))}"


@dataclass(frozen=True, order=True)
class NdSignature:
    """A :class:`Signature` with one ``NdSBP`` (one SBP per mesh axis) per entry: a node's
    candidate distribution, and (``SHARDING``) the one the plan chose."""

    inputs: tuple[Optional[NdSBP], ...]
    outputs: tuple[Optional[NdSBP], ...]

    def axis(self, k: int) -> Signature:
        """The 1-D signature on mesh axis ``k``."""
        pick = lambda xs: tuple(None if x is None else x[k] for x in xs)  # noqa: E731
        return Signature(pick(self.inputs), pick(self.outputs))

    @property
    def output(self) -> NdSBP:
        """The one tensor output's SBP (a ValueError if there is not exactly one)."""
        outs = [x for x in self.outputs if x is not None]
        if len(outs) != 1:
            raise ValueError(f"a signature with {len(outs)} tensor outputs has no single output")
        return outs[0]

    def __str__(self) -> str:
        return f"{','.join(map(str, self.inputs))}->{','.join(map(str, self.outputs))}"


@dataclass(frozen=True)
class CollectiveInfo:
    """An inserted collective (or local boxing step: ``slice``, ``zero``): its kind, mesh
    axis, bytes and modeled seconds, and the SBP it turns ``before`` into ``after``."""

    kind: str
    axis: int
    axis_name: str
    group_size: int
    nbytes: int
    seconds: float
    before: NdSBP
    after: NdSBP

    @property
    def communicates(self) -> bool:
        """Whether it moves data between ranks (not a local slice or zeroing)."""
        return self.kind not in ("slice", "zero")

    def __str__(self) -> str:
        return (f"{self.kind} on axis {self.axis} ({self.axis_name}, {self.group_size} ranks) "
                f"{self.nbytes} B {self.seconds * 1e6:.1f} us: {self.before} -> {self.after}")


@dataclass(frozen=True)
class RankArg:
    """The argument at ``position`` of a lowered node whose value depends on the rank's
    mesh coordinate, and how: ``index``, the coordinate on mesh ``axis`` (the piece a
    local slice keeps); ``first``, whether that coordinate is 0 (the rank that keeps a
    value becoming a partial sum); ``piece``, the slices of a tensor of global ``shape``
    placed ``sbp`` that the rank holds (a random draw's). ``passes.retarget`` recomputes
    it for another coordinate."""

    position: int
    kind: str
    axis: int = -1
    shape: tuple[int, ...] = ()
    sbp: Optional["NdSBP"] = None


class Piece(NamedTuple):
    """One piece of a split collective: the split collective's name, this piece's index
    and how many pieces there are."""

    split: str
    index: int
    count: int


ORIGIN: MetaKey[Origin] = MetaKey("ddlc_origin", Origin)
ROLE: MetaKey[str] = MetaKey("ddlc_role", str)
SHARDING: MetaKey[NdSignature] = MetaKey("ddlc_sharding", NdSignature)
COLLECTIVE: MetaKey[CollectiveInfo] = MetaKey("ddlc_collective", CollectiveInfo)
PIECE: MetaKey[Piece] = MetaKey("ddlc_piece", Piece)
FUSED: MetaKey[int] = MetaKey("ddlc_fused", int)
GLOBAL_VAL: MetaKey[Any] = MetaKey("ddlc_global_val", object)
STEP: MetaKey[StepSignature] = MetaKey("ddlc_step", StepSignature)
BUCKET_CAP: MetaKey[float] = MetaKey("ddlc_bucket_cap", (int, float))
PIECE_BYTES: MetaKey[float] = MetaKey("ddlc_piece_bytes", (int, float))
#: the activation-checkpointed call (``torch.utils.checkpoint``) a forward node was traced in,
#: numbered in forward order: ``passes.recompute`` recomputes its values for the backward pass
RECOMPUTE: MetaKey[int] = MetaKey("ddlc_recompute", int)
#: a backward node that recomputes a value of that checkpointed call: it runs where it is, as
#: late as its readers allow (a scheduler that hoisted it would keep the activation alive again)
RECOMPUTED: MetaKey[int] = MetaKey("ddlc_recomputed", int)
#: where the schedule put the optimizer updates: "end", "early" (inside backward) or "mixed" (per group)
UPDATES: MetaKey[str] = MetaKey("ddlc_updates", str)
RANK_ARG: MetaKey[RankArg] = MetaKey("ddlc_rank_arg", RankArg)
#: a random draw that eager makes into a tensor laid out otherwise than row-major and
#: contiguous (dropout's mask of a permuted activation, ``normal_`` of a slice): its strides
DRAW_STRIDES: MetaKey[tuple] = MetaKey("ddlc_draw_strides", tuple)
#: an alias that ``passes.shared_reads`` put between a tensor and its readers, so that the
#: search prices one redistribution shared by them; lowering drops it after the collectives
SHARED_READ: MetaKey[bool] = MetaKey("ddlc_shared_read", bool)


def phase_of(node: fx.Node) -> str | None:
    """The ``ORIGIN`` phase of ``node`` (forward, backward, optimizer, input); None if it has none."""
    origin = ORIGIN.get(node)
    return origin.phase if origin is not None else None


def in_update(node: fx.Node) -> bool:
    """Whether ``node`` is an operator of the optimizer update (its ``ORIGIN`` phase)."""
    return phase_of(node) == "optimizer"


def where(node: fx.Node) -> str:
    """How errors point at ``node``: its name, module and user source line when known."""
    origin = ORIGIN.get(node)
    return origin.where(node.name) if origin else node.name


# -- collective ops --------------------------------------------------------------------------

_c10d = torch.ops._c10d_functional

#: Every ``_c10d_functional`` collective issue op -> its kind.
COLLECTIVE_KINDS = {_c10d.all_reduce.default: "all_reduce",
                    _c10d.all_reduce_.default: "all_reduce",   # in place: passes.inplace
                    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
                    _c10d.all_gather_into_tensor.default: "all_gather",
                    _c10d.all_to_all_single.default: "all_to_all"}

#: The kinds that fusion buckets and partition splits (dim-0 layouts).
BUCKETABLE = frozenset({"all_reduce", "reduce_scatter", "all_gather"})

#: Operators that read their input's storage through strides and an offset they are given
#: (``as_strided``: ``torch.stft``, overlapping frames, autograd's replays of views), not
#: through the input's own layout: their input must be laid out as it was traced.
STRIDED_READERS = frozenset({torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_copy.default,
                             torch.ops.aten.as_strided_scatter.default})


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` issues a ``_c10d_functional`` collective."""
    return node.op == "call_function" and node.target in COLLECTIVE_KINDS


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _c10d.wait_tensor.default


def collective_kind(node: fx.Node) -> str | None:
    """The kind of the collective ``node`` issues, or None."""
    return COLLECTIVE_KINDS.get(node.target) if node.op == "call_function" else None


def is_mutating(node: fx.Node) -> bool:
    """Whether ``node`` calls an operator that writes one of its inputs (``mul_``, ...)."""
    return node.op == "call_function" and isinstance(node.target, OpOverload) \
        and node.target._schema.is_mutable


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def collective_sequence(gm: fx.GraphModule) -> list[tuple[str, int, int]]:
    """The ordered (kind, mesh axis, bytes) of every communicating collective in ``gm``."""
    return [(info.kind, info.axis, info.nbytes) for n in gm.graph.nodes
            if (info := COLLECTIVE.get(n)) is not None and info.communicates]


def name_alike(copied: fx.Graph, original: fx.Graph) -> fx.Graph:
    """Give ``copied`` (a ``copy.deepcopy`` of ``original``) the namespace of ``original``,
    so that it names new nodes as ``original`` would: torch.fx remembers every name it
    gave, erased nodes' too, and the last number given to each base name, but a copy
    knows only the names of its nodes, so a pass could name a new node ``getitem_63`` in
    it and ``getitem_80`` in ``original`` (found on the example ResNet). Returns ``copied``."""
    namespace, names = copied._graph_namespace, original._graph_namespace
    namespace._used_names |= names._used_names
    namespace._base_count.update(names._base_count)
    return copied


def is_scalar_valued(node: fx.Node) -> bool:
    """Whether every output of ``node`` is a tensor of at most one element."""
    values = leaves(node.meta.get("val"))
    return bool(values) and all(isinstance(v, torch.Tensor) and v.numel() <= 1 for v in values)


def output_scalars(graph: fx.Graph, among: Callable[[fx.Node], bool] = lambda node: True) -> set[fx.Node]:
    """The scalar arithmetic that computes graph outputs alone: operator nodes whose
    outputs are tensors of at most one element (:func:`is_scalar_valued`) and that only the
    output or other such nodes read (the loss's ``sum / count``; an optimizer's step
    count). A collective of a scalar that only these read can wait until the end of the
    step, and so share a bucket with the gradients' (:mod:`passes.fuse`, priced so by
    :mod:`passes.sharding.problem`). Only nodes ``among`` accepts count."""
    found: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "call_function" and node.users and among(node) and is_scalar_valued(node) and \
                all(u.op == "output" or u in found for u in node.users):
            found.add(node)
    return found
