"""Shared machinery of the SBP rules: signatures, the dim-label rule model, the registry.

A rule describes one operator call with dim *labels* (:class:`Labels`), einsum
style: one character per tensor dim, the same character for dims that split
together, ``.`` for a dim that must never be split. One generic enumerator turns
labels into every valid 1-D signature:

- all ``B`` (always valid for a deterministic op);
- per label ``x``: every tensor holding ``x`` is ``S`` at that dim, the others
  ``B``; an output without ``x`` whose inputs hold it is *contracted* over ``x``
  and becomes ``P`` (and so do the ``addends`` added to that contraction);
- per linear set (argument names the op is jointly linear in): those inputs
  ``P``, the rest ``B``; an output is ``P`` if it depends on one of them, else ``B``;
- ``shape_only`` inputs (values never read) may also be ``P``; ``metadata_only``
  inputs (neither values nor shape read: ``new_zeros``' ``self``) may also be split
  along any dim; a ``zero_output`` op's outputs may also be ``P``.

``P`` is never claimed for a boolean tensor (``add`` of booleans is an or, not a sum);
integer partial sums are exact (a count of the tokens not ignored over a split batch), but
a linear set does not carry a floating ``P`` into an integer output (a cast rounds each
rank's piece alone). A number in a linear set (``x + 1``) is a broadcast value, so that
set gives no signature.

Rules are found by operator (``RULES``) or, for a whole family, by a torch op tag the
operator carries (``TAG_RULES``: every functional ``torch.Tag.pointwise`` overload is
elementwise); :func:`rule_for` looks up both.
"""
from __future__ import annotations

import itertools
import logging
import operator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch
from torch import fx

from ddlc.ir import NdSignature, Signature, leaves
from ddlc.sbp import B, P, S, SBP, NdSBP, fills_every_piece, plannable

log = logging.getLogger("ddlc.rules")

UNSPLIT = "."


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True)
class Call:
    """One operator call as the rules see it: arguments bound to schema names
    (tensors as :class:`TensorMeta`), the tensor-input slots and the output leaves."""

    target: Any
    args: Mapping[str, Any]
    slots: tuple[tuple[str, Optional[int]], ...]      # (argument name, list index) per tensor input
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[Optional[TensorMeta], ...]

    def __getitem__(self, name: str) -> Any:
        return self.args[name]

    def get(self, name: str, default: Any = None) -> Any:
        value = self.args.get(name)
        return default if value is None else value

    def dim(self, name: str, ndim: int) -> int:
        """Argument ``name`` as a non-negative dim of an ``ndim``-d tensor."""
        return self.args[name] % max(ndim, 1)


@dataclass(frozen=True)
class Labels:
    """The dim-label description of one call (see the module docstring).

    ``inputs`` maps argument names to a label string (a list of them for a tensor
    list); an unnamed tensor input is never split. ``deps`` maps an output index to
    the arguments it depends on (default: every input neither ``shape_only`` nor ``metadata_only``)."""

    inputs: Mapping[str, Any]
    outputs: Sequence[Optional[str]]
    linear: Sequence[Collection[str]] = ()
    deps: Mapping[int, Collection[str]] = field(default_factory=dict)
    addends: Collection[str] = ()
    shape_only: Collection[str] = ()
    metadata_only: Collection[str] = ()
    zero_output: bool = False


Rule = Callable[[Call], Labels]
RULES: dict[Any, Rule] = {}

#: Rules for whole families of operators, by torch op tag (``torch.Tag.pointwise``): every
#: functional overload carrying the tag gets the family's rule unless ``RULES`` names the op
#: itself. In-place and ``out=`` overloads (a written argument) and overloads returning
#: anything but tensors are not functional and get no rule from a tag.
TAG_RULES: dict[Any, Rule] = {}


def is_functional(op: Any) -> bool:
    """Whether ``op`` writes none of its arguments and returns one or more plain tensors."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.returns:
        return False
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return not writes and all(isinstance(r.type, torch.TensorType) for r in schema.returns)


def rule_for(target: Any) -> Optional[Rule]:
    """The rule of an operator: its own entry in ``RULES``, else the rule of a tag it
    carries (``TAG_RULES``, functional overloads only), else None."""
    rule = RULES.get(target)
    if rule is not None:
        return rule
    tags = getattr(target, "tags", ())
    for tag, family_rule in TAG_RULES.items():
        if tag in tags and is_functional(target):
            return family_rule
    return None


def letters(n: int, start: int = 0) -> str:
    """``n`` distinct labels: "abc..."."""
    return "".join(chr(ord("a") + start + i) for i in range(n))


def aligned(meta: TensorMeta | None, out_shape: Sequence[int], out_labels: str) -> str:
    """Labels of a tensor broadcast against an output (trailing alignment): a dim that
    matches the output dim takes its label, a broadcast (size-1) dim takes ``.``, and so
    does a leading dim the output lacks (the tensor broadcasts the output up)."""
    if meta is None:
        return ""
    offset = len(out_shape) - meta.ndim
    return "".join(out_labels[offset + i] if offset + i >= 0 and n == out_shape[offset + i] else UNSPLIT
                   for i, n in enumerate(meta.shape))


# ---------------------------------------------------------------- calls and keys

def _val(node: fx.Node):
    return node.meta.get("val")


def is_tensor_node(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor inputs of ``node`` in signature order: the fx.Node arguments of the
    flattened ``(args, kwargs)`` whose value is a tensor. For ``operator.getitem``
    the one input is ``args[0]``, standing for its selected leaf (``selected_leaf``)."""
    if node.target is operator.getitem:
        return [node.args[0]]
    return [a for a in leaves((node.args, node.kwargs)) if is_tensor_node(a)]


def selected_leaf(node: fx.Node) -> int:
    """For a getitem node: the index of the selected element among its source's output leaves."""
    source, index = node.args
    return sum(len(leaves(x)) for x in _val(source)[:index])


def output_metas(val: Any) -> tuple[Optional[TensorMeta], ...]:
    return tuple(_meta(x) if isinstance(x, torch.Tensor) else None for x in leaves(val))


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(n) for n in t.shape), t.dtype)


def _freeze(a: Any) -> Any:
    if isinstance(a, fx.Node):
        v = _val(a)
        return _meta(v) if isinstance(v, torch.Tensor) else ("node", type(v).__name__)
    if isinstance(a, (list, tuple)):
        return tuple(_freeze(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, _freeze(v)) for k, v in a.items())
    return a


def call_key(node: fx.Node) -> tuple:
    """What a node's signatures depend on: op, tensor shapes/dtypes, non-tensor args, and
    which arguments read one tensor (:func:`_partial_alike`)."""
    if node.target is operator.getitem:
        outputs = output_metas(_val(node))
        return (operator.getitem, outputs)
    return (node.target, _freeze(node.args), _freeze(node.kwargs), output_metas(_val(node)),
            _repeated_inputs(node))


def bind(node: fx.Node) -> Call:
    """Bind a node's arguments to its schema names (defaults filled in)."""
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    args: dict[str, Any] = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    slots, metas = [], []
    for name, value in list(zip(names, node.args)) + list(node.kwargs.items()):
        args[name] = _freeze(value)
        items = value if isinstance(value, (list, tuple)) else [value]
        for j, item in enumerate(items):
            if is_tensor_node(item):
                slots.append((name, j if isinstance(value, (list, tuple)) else None))
                metas.append(_meta(_val(item)))
    return Call(node.target, args, tuple(slots), tuple(metas), output_metas(_val(node)))


# ---------------------------------------------------------------- enumeration

def enumerate_signatures(call: Call, labels: Labels) -> list[Signature]:
    """Every 1-D signature the labels imply (module docstring), sorted."""
    n_in = len(call.slots)
    in_labels = [_slot_labels(labels, slot, meta) for slot, meta in zip(call.slots, call.inputs)]
    out_labels = [lab if meta is not None else None for lab, meta in zip(labels.outputs, call.outputs)]
    slots_of = lambda names: {i for i, (name, _) in enumerate(call.slots) if name in names}  # noqa: E731
    shape_only, metadata_only = slots_of(labels.shape_only), slots_of(labels.metadata_only)
    deps = [slots_of(labels.deps[k]) if k in labels.deps else set(range(n_in)) - shape_only - metadata_only
            for k in range(len(out_labels))]
    addends = slots_of(labels.addends)

    found = {Signature((B,) * n_in, tuple(None if lab is None else B for lab in out_labels))}
    all_labels = sorted({c for lab in in_labels + out_labels if lab for c in lab} - {UNSPLIT})
    for x in all_labels:
        ins = [S(lab.index(x)) if x in lab else B for lab in in_labels]
        outs = []
        for k, lab in enumerate(out_labels):
            if lab is None:
                outs.append(None)
            elif x in lab:
                outs.append(S(lab.index(x)))
            elif any(x in in_labels[i] for i in deps[k]):
                outs.append(P)
                for i in addends & deps[k]:
                    ins[i] = P
            else:
                outs.append(B)
        found.add(Signature(tuple(ins), tuple(outs)))
    for names in labels.linear:
        if any(_is_number(call.args.get(name)) for name in names):
            continue
        chosen = slots_of(names)
        if not chosen:
            continue
        if any(call.inputs[i].is_floating for i in chosen) and any(
                lab is not None and deps[k] & chosen and not call.outputs[k].is_floating
                for k, lab in enumerate(out_labels)):
            continue  # a floating partial sum cast to integers: each rank's piece rounds alone
        ins = tuple(P if i in chosen else B for i in range(n_in))
        outs = tuple(None if lab is None else P if deps[k] & chosen else B
                     for k, lab in enumerate(out_labels))
        found.add(Signature(ins, outs))
    for i in sorted(shape_only | metadata_only):
        found |= {Signature(s.inputs[:i] + (P,) + s.inputs[i + 1:], s.outputs)
                  for s in found if s.inputs[i] == B}
    for i in sorted(metadata_only):
        found |= {Signature(s.inputs[:i] + (S(d),) + s.inputs[i + 1:], s.outputs)
                  for s in found if s.inputs[i] == B for d in range(call.inputs[i].ndim)}
    if labels.zero_output:
        found |= {Signature(s.inputs, tuple(P if x == B else x for x in s.outputs)) for s in found}
    return sorted(s for s in found if _partial_not_on_booleans(s, call))


def _slot_labels(labels: Labels, slot: tuple[str, Optional[int]], meta: TensorMeta) -> str:
    name, index = slot
    lab = labels.inputs.get(name)
    if lab is not None and index is not None:
        lab = lab[index]
    if lab is None:
        return UNSPLIT * meta.ndim
    assert len(lab) == meta.ndim, f"labels {lab!r} for {name} of shape {meta.shape}"
    return lab


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, complex, bool)) and not isinstance(value, TensorMeta)


def _partial_not_on_booleans(sig: Signature, call: Call) -> bool:
    pairs = zip(sig.inputs + sig.outputs, call.inputs + call.outputs)
    return all(not (x == P and meta.dtype == torch.bool) for x, meta in pairs if x is not None)


# ---------------------------------------------------------------- public entry points

_FALLBACK_LOGGED: set[str] = set()


def has_rule(node: fx.Node) -> bool:
    """Whether ``node`` has a rule (its own or its tag family's), i.e. does not fall back."""
    return node.target is operator.getitem or rule_for(node.target) is not None


def signatures_1d(node: fx.Node) -> list[Signature]:
    """Every valid 1-D signature of ``node`` (any group size), sorted."""
    return list(_signatures_1d(call_key(node), node))


#: Most entries each signature cache keeps; a full cache is emptied (entries are cheap to
#: recompute, and a long-lived process tracing many models must not grow without bound).
MAX_CACHED_CALLS = 50_000

_SIG_CACHE: dict[tuple, tuple[Signature, ...]] = {}
_ND_CACHE: dict[tuple, tuple[NdSignature, ...]] = {}


def clear_caches() -> None:
    """Forget every cached signature list (they depend only on the call and mesh shape)."""
    _SIG_CACHE.clear()
    _ND_CACHE.clear()
    _ndsbp.cache_clear()


def _remember(cache: dict, key, value):
    if len(cache) >= MAX_CACHED_CALLS:
        cache.clear()
    cache[key] = value
    return value


def _signatures_1d(key: tuple, node: fx.Node) -> tuple[Signature, ...]:
    cached = _SIG_CACHE.get(key)
    if cached is None:
        cached = _remember(_SIG_CACHE, key, tuple(_compute_1d(node)))
    return cached


def _compute_1d(node: fx.Node) -> list[Signature]:
    if node.target is operator.getitem:
        return _getitem_signatures(node)
    rule = rule_for(node.target)
    outputs = output_metas(_val(node))
    if rule is None:
        name = str(node.target)
        if name not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add(name)
            log.warning("no SBP rule for %s: it falls back to all-B", name)
        n_in = len(tensor_inputs(node))
        return [Signature((B,) * n_in, tuple(None if m is None else B for m in outputs))]
    call = bind(node)
    return enumerate_signatures(call, rule(call))


def _getitem_signatures(node: fx.Node) -> list[Signature]:
    """getitem passes the selected element's SBP through (any SBP; P not for booleans)."""
    (meta,) = output_metas(_val(node))
    if meta is None:
        return [Signature((None,), (None,))]
    choices = [B] + ([P] if meta.dtype != torch.bool else []) + [S(d) for d in range(meta.ndim)]
    return [Signature((x,), (x,)) for x in choices]


def fallback_ops(gm: fx.GraphModule) -> list[str]:
    """Sorted names of the operators in ``gm`` that have no rule (they fall back to all-B)."""
    return sorted({str(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and not has_rule(n)})


def signatures_nd(node: fx.Node, mesh_shape: Sequence[int], key: tuple | None = None) -> list[NdSignature]:
    """One 1-D signature per mesh axis, every combination whose splits the tensors allow
    (:func:`_fits`, :func:`_fits_nd`). ``key``: ``call_key(node)``, where the caller has it
    already."""
    key = call_key(node) if key is None else key
    mesh_shape = tuple(int(p) for p in mesh_shape)
    cached = _ND_CACHE.get((key, mesh_shape))
    if cached is None:
        one_d = _signatures_1d(key, node)
        metas = _entry_shapes(node)
        per_axis = [[s for s in one_d if _fits(s.inputs + s.outputs, metas, p)] if p > 1
                    else _whole(one_d) for p in mesh_shape]
        repeated = _repeated_inputs(node)
        cached = _remember(_ND_CACHE, (key, mesh_shape),
                           tuple(sig for sig in (_nd(combo) for combo in itertools.product(*per_axis)
                                                 if _fits_nd(combo, metas, mesh_shape))
                                 if _partial_alike(sig, repeated)))
    return list(cached)


def _whole(one_d: tuple[Signature, ...]) -> list[Signature]:
    """The signatures of an axis of one device: those that keep every tensor whole (B),
    where one does; a split or partial sum over one device is the whole tensor too, at the
    same costs, so the others would only repeat it (a (1,2,2,1) mesh planned 15-30 times
    slower than (2,2) with them)."""
    whole = [s for s in one_d if all(x is None or x == B for x in s.inputs + s.outputs)]
    return whole or list(one_d)


def _repeated_inputs(node: fx.Node) -> tuple[tuple[int, ...], ...]:
    """The groups of input positions of ``node`` that read one tensor (``mul(g, g)``)."""
    positions: dict[fx.Node, list[int]] = {}
    for j, a in enumerate(tensor_inputs(node)):
        positions.setdefault(a, []).append(j)
    return tuple(tuple(js) for js in positions.values() if len(js) > 1)


def _partial_alike(sig: NdSignature, repeated) -> bool:
    """Whether each tensor read at several positions is partial on a mesh axis at all of
    them or at none. ``mul(g, g)`` as ``(B),(P)->(P)`` sums ``g * g_i`` over the ranks:
    ``g * g`` in exact arithmetic, but where ``g`` is rounding noise (a gradient that
    cancels) the sum can be negative, which a square never is (AdamW's ``sqrt`` of it:
    NaN losses)."""
    for js in repeated:
        sbps = [sig.inputs[j] for j in js]
        if any(x is None for x in sbps):
            continue
        for axis in range(len(sbps[0])):
            if len({x[axis].is_partial for x in sbps}) > 1:
                return False
    return True


def _entry_shapes(node: fx.Node) -> list[Optional[tuple[int, ...]]]:
    """The global shape of each signature entry (inputs, then output leaves)."""
    outs = [None if m is None else m.shape for m in output_metas(_val(node))]
    if node.target is operator.getitem:
        return outs + outs
    return [tuple(_val(a).shape) for a in tensor_inputs(node)] + outs


def _fits(entries: Sequence[Optional[SBP]], shapes, parts: int) -> bool:
    """Whether a 1-D signature can cut its tensors into ``parts``: each split divides its
    dim, or, an uneven split, every split entry cuts a dim of one same size into
    non-empty pieces. The signature's splits all come from one label (the module
    docstring), so equal sizes mean the same ``torch.chunk`` bounds in every tensor: the
    op on the local pieces computes the output's piece, as with even splits. Dims of
    different sizes that split together evenly (a view merging the split dim with
    another) are never cut unevenly."""
    sizes = {shape[x.dim] for x, shape in zip(entries, shapes) if x is not None and x.is_split}
    if all(n % parts == 0 for n in sizes):
        return True
    (n, *others) = sizes
    return not others and fills_every_piece(n, parts)


def _fits_nd(combo: Sequence[Signature], shapes, mesh_shape) -> bool:
    """Whether the per-axis signatures combine: every entry's n-D placement is one the
    search may take (:func:`ddlc.sbp.plannable`: a dim that several axes split divides)."""
    return all(shape is None or plannable(shape, NdSBP(tuple((sig.inputs + sig.outputs)[i] for sig in combo)),
                                          mesh_shape)
               for i, shape in enumerate(shapes))


@lru_cache(maxsize=MAX_CACHED_CALLS)
def _ndsbp(per_axis: tuple[Optional[SBP], ...]) -> Optional[NdSBP]:
    return None if per_axis[0] is None else NdSBP(per_axis)


def _nd(combo: Sequence[Signature]) -> NdSignature:
    ins = tuple(_ndsbp(xs) for xs in zip(*(s.inputs for s in combo)))
    outs = tuple(_ndsbp(xs) for xs in zip(*(s.outputs for s in combo)))
    return NdSignature(ins, outs)


# ---------------------------------------------------------------- localization

Localizer = Callable[[Call, Sequence[tuple[int, ...]], Sequence[Optional[tuple[int, ...]]]], dict]
LOCALIZERS: dict[Any, Localizer] = {}


def localize_args(node: fx.Node, in_shapes: Sequence[tuple[int, ...]],
                  out_shapes: Sequence[Optional[tuple[int, ...]]]) -> tuple[tuple, dict]:
    """``node``'s (args, kwargs) with every shape argument rewritten for local shards,
    given the local shapes of its tensor inputs and output leaves; Node args unchanged."""
    localizer = LOCALIZERS.get(node.target)
    if localizer is None:
        return tuple(node.args), dict(node.kwargs)
    changes = localizer(bind(node), in_shapes, out_shapes)
    names = [a.name for a in node.target._schema.arguments]
    args = list(node.args)
    kwargs = dict(node.kwargs)
    for name, value in changes.items():
        position = names.index(name)
        if position < len(args):
            args[position] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs
