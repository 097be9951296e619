"""What a traced step fixes of the user's model, and what changed since.

A compiled step runs the model as it was traced: every module's attributes (train/eval
mode, dropout's ``p``, batch norm's ``momentum`` and ``eps``, a Python counter), its hooks
(module, global and parameter ones), the parameters and buffers it holds (their identity,
``requires_grad``, version counter (an in-place write bumps it) and data address (an
assignment to ``.data`` moves it)), its tensor attributes' versions and addresses (constants
of the trace) and the submodules.
A change to any of them after compile is one the program cannot see, so
:class:`ModelWatch` notices it before every step and names it.

The check is cheap enough for every step (about 0.15 ms on a GPT-2-small-sized model):
a snapshot is each module's attribute values, parameters, buffers and submodules as
tuples compared by identity first, the hook dictionaries' lengths, the versions, and
torch's hook handle counter (``RemovableHandle.next_id``, which every hook registration
anywhere advances). Only when the snapshot differs does :meth:`ModelWatch.change` look
for what changed; a registration elsewhere (the handle counter moved, no hook of this
model did) is accepted there.
"""
from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import numbers
import operator
import types
import weakref

import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils.hooks import RemovableHandle

__all__ = ["PLAIN", "ModelWatch", "OptimizerStateWatch", "autocast_state", "autocast_words", "change_words", "describe",
           "same_plain", "settings"]

#: torch's hooks on every module (``register_module_forward_hook`` and friends)
_GLOBAL_HOOKS = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_pre_hooks",
                 "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                 "_global_forward_hooks_always_called")

#: a tensor's hooks on its gradient (``register_hook``, ``register_post_accumulate_grad_hook``)
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")

def recomputed_attribute(hook) -> str | None:
    """The attribute a forward pre-hook sets from its module's parameters (and buffers) at
    every call, where it is one of torch's that do: the hook-based ``weight_norm`` and
    ``spectral_norm``, and ``nn.utils.prune``'s (``weight = weight_orig * weight_mask``);
    None for another hook."""
    if isinstance(hook, BasePruningMethod):
        return hook._tensor_name
    return hook.name if isinstance(hook, (WeightNorm, SpectralNorm)) else None


def recompute_pruned(model: nn.Module) -> None:
    """Give each attribute ``nn.utils.prune``'s hooks compute (``weight = weight_orig *
    weight_mask``) its value from the model's tensors as they are, as eager's last forward
    left it: a compiled step computes it inside its program, and the attribute kept its
    value at compile, which the next pruning ranks its entries by (``l1_unstructured``,
    ``global_unstructured``). The hooks compute nothing else (spectral norm's would run a
    power iteration)."""
    for module in model.modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, BasePruningMethod):
                hook(module, None)
#: what a module holds besides attributes, and what to call one
_MEMBERS = {"_modules": "a submodule", "_parameters": "a parameter", "_buffers": "a buffer"}

#: values compared by value (numbers, strings, flags, None); other objects by identity
PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _hook_dicts(modules, params) -> list[tuple[str, dict | None, str]]:
    """(where, hook dictionary, what kind of hook) for every hook dictionary that can change
    what the model computes: each module's, the global ones and each parameter's."""
    found = [(f"module {name or '<root>'}", hooks, attr.strip("_").replace("_", " "))
             for name, m in modules for attr, hooks in vars(m).items()
             if attr.endswith("hooks") and isinstance(hooks, dict) and "state_dict" not in attr]
    found += [("every module", getattr(module_mod, attr), attr.strip("_").replace("_", " "))
              for attr in _GLOBAL_HOOKS]
    found += [(f"parameter {name}", getattr(p, attr, None), attr.strip("_").replace("_", " "))
              for name, p in params for attr in _TENSOR_HOOKS]
    return found


def _is_plain(value) -> bool:
    return isinstance(value, (numbers.Number, str, bytes, type(None))) or (
        isinstance(value, tuple) and all(map(_is_plain, value)))


def _text(value) -> str | None:
    """What :func:`settings` compares of a value: a plain one's ``repr``, a tensor's identity
    and writes (:func:`_written`); None for anything else."""
    if _is_plain(value):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} (id {id(value)}, writes {_written(value)})"
    return None


def change_words(name: str, before: str, after: str) -> str:
    """A change between two :func:`_text` values of ``name``, in words."""
    if before.startswith("a tensor") and after.startswith("a tensor"):
        return f"{name}, {before.split(' (id ')[0]}, was replaced or written in place"
    return f"{name} changed ({before} -> {after})"


def _items(prefix: str, items) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{k}", text) for k, v in items if (text := _text(v)) is not None)


#: the instructions that load an attribute (``x.name``, ``x.name(...)``) and a global
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


@functools.lru_cache(maxsize=4096)
def _loads(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """The attribute names and the global names ``code`` and the code nested in it
    (lambdas, comprehensions, inner functions) load (``co_names`` mixes the two, and
    stores: ``self.out`` is no read of a global ``out``)."""
    attributes, globals_ = set(), set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in _ATTRIBUTE_LOADS:
            attributes.add(instruction.argval)
        elif instruction.opname in _GLOBAL_LOADS:
            globals_.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            nested = _loads(const)
            attributes |= nested[0]
            globals_ |= nested[1]
    return frozenset(attributes), frozenset(globals_)


@functools.lru_cache(maxsize=4096)
def _reads(function, cls: type | None) -> tuple[frozenset[str], tuple[tuple[str, dict], ...]]:
    """The attribute names ``function`` reads (:func:`_loads`), with those of the methods
    and properties of ``cls`` it names, and theirs (``self.scale(x)`` reading
    ``self.alpha``); and the globals they read, as (name, the module globals it is looked
    up in) pairs."""
    attributes, seen, todo, globals_read = set(), set(), [function], {}
    while todo:
        current = inspect.unwrap(todo.pop())
        code = getattr(current, "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        found, global_names = _loads(code)
        attributes |= found
        for name in global_names:
            globals_read.setdefault((name, id(current.__globals__)), (name, current.__globals__))
        for name in found if cls is not None else ():
            member = inspect.getattr_static(cls, name, None)
            member = getattr(member, "fget", None) or getattr(member, "__func__", member)
            if inspect.isfunction(member):
                todo.append(member)
    return frozenset(attributes), tuple(sorted(globals_read.values(), key=lambda pair: pair[0]))


def _read_values(obj, function, cls: type) -> tuple[tuple[str, str], ...]:
    """The values of the names ``function`` reads (:func:`_reads`) on ``obj`` (its own
    attributes, else its class's, base classes included) and in its module's globals."""
    names, globals_read = _reads(function, cls)
    own = getattr(obj, "__dict__", {}) if not isinstance(obj, type) else {}
    values = [(name, own[name] if name in own else inspect.getattr_static(obj, name, None))
              for name in sorted(names) if name in own or hasattr(cls, name)]
    return (*_items("", values), *_items("global ", ((name, space.get(name)) for name, space in globals_read)))


def settings(obj) -> tuple[tuple[str, str], ...]:
    """The values a loss function that is not a module computes with and a trace fixes, as
    (name, text) pairs (:func:`_text`: numbers, strings, flags, tuples of them, and tensors
    by identity and writes): a ``functools.partial``'s arguments; a function's defaults,
    closure cells and the globals it reads; for a bound method (a classmethod too) or a
    callable object, the attributes its code reads of its object or class (with those the
    methods it calls read: ``self.weight``, not a ``self.global_step`` it never reads)."""
    if isinstance(obj, functools.partial):
        return (*settings(obj.func), *_items("argument ", enumerate(obj.args)),
                *_items("", sorted(obj.keywords.items())))
    if inspect.ismethod(obj):
        owner = obj.__self__
        return _read_values(owner, obj.__func__, owner if isinstance(owner, type) else type(owner))
    if inspect.isfunction(obj):
        cells = []
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                cells.append((name, cell.cell_contents))
        names, globals_read = _reads(obj, None)
        held = [(f"{name}.{attr}", getattr(value, attr)) for name, value in cells
                if _text(value) is None and not isinstance(value, nn.Module)
                for attr in sorted(names & set(getattr(value, "__dict__", {})))]
        return (*_items("default ", enumerate(obj.__defaults__ or ())),
                *_items("", sorted((obj.__kwdefaults__ or {}).items())), *_items("", cells), *_items("", held),
                *_items("global ", ((name, space.get(name)) for name, space in globals_read)))
    call = getattr(type(obj), "__call__", None)
    if inspect.isroutine(obj) or isinstance(obj, nn.Module) or not inspect.isfunction(call):
        return ()
    return _read_values(obj, call, type(obj))


def _class_reads(cls: type) -> list[tuple[str, str, tuple]]:
    """What a module class's ``forward`` reads of the class (its bases' too) and of the
    globals (:func:`_reads`) that is a plain value or a tensor now (``Net.temperature``, a
    module-level constant), and ``forward`` itself (one replaced on the class): (label,
    name, the namespaces it is looked up in, in order), for :func:`_read_now`."""
    mro = tuple(vars(k) for k in cls.__mro__)
    forward = _lookup(mro, "forward")
    if not inspect.isfunction(forward):
        return []
    names, globals_read = _reads(forward, cls)
    return [("forward", "forward", mro)] + \
        [(name, name, mro) for name in sorted(names) if _text(_lookup(mro, name)) is not None] + \
        [(f"global {name}", name, (space,)) for name, space in globals_read if _text(space.get(name)) is not None]


def _lookup(spaces: tuple, name: str):
    for space in spaces:
        if name in space:
            return space[name]
    return _MISSING


def _read_now(label: str, name: str, spaces: tuple) -> str:
    value = _lookup(spaces, name)
    return f"function at {id(value)}" if label == "forward" else (_text(value) or describe(value))


def _written(t: torch.Tensor) -> tuple[int, int]:
    """What changes when ``t`` is written: its version counter (an in-place write bumps it)
    and its data's address (an assignment to ``t.data`` moves it). A write through ``t.data``
    (``p.data.clamp_()``) changes neither: it goes unseen."""
    if t.is_inference():  # made under torch.inference_mode: no version counter, never written
        return -1, t.data_ptr()
    try:
        return t._version, t.data_ptr()
    except RuntimeError:  # a tensor without storage (sparse): its version alone
        return t._version, 0


class ModelWatch:
    """A snapshot of what a traced step fixes of ``model`` (see the module docstring);
    :meth:`change` says what differs now, or None."""

    def __init__(self, model: nn.Module):
        self._modules = list(model.named_modules())
        self._params = list(model.named_parameters())
        self._buffers = list(model.named_buffers())
        self._attributes = [dict(vars(m)) for _, m in self._modules]
        self._members = [{kind: dict(getattr(m, kind)) for kind in _MEMBERS} for _, m in self._modules]
        self._module_hooks = [h for _, m in self._modules for attr, h in vars(m).items()
                              if attr.endswith("hooks") and isinstance(h, dict)]
        #: tensor attributes that are neither parameters nor buffers: constants of the trace
        #: (an attribute holding one of the model's parameters or buffers is that one)
        held = {id(t) for _, t in [*self._params, *self._buffers]}
        self._tensor_attributes = [(f"{name}.{attr}" if name else attr, t) for name, m in self._modules
                                   for attr, t in vars(m).items()
                                   if isinstance(t, torch.Tensor) and id(t) not in held]
        #: what the forward of the model's classes (other than torch's) reads of the classes
        #: and globals, which :meth:`_settings` looks up
        self._class_reads = [(f"class {cls.__qualname__}", *read)
                             for cls in dict.fromkeys(type(m) for _, m in self._modules)
                             if not cls.__module__.startswith("torch.") for read in _class_reads(cls)]
        self._snapshot = self._take()
        self._hook_keys = [tuple(h or ()) for _, h, _ in _hook_dicts(self._modules, self._params)]
        self._next_id = RemovableHandle.next_id

    def _take(self) -> tuple[list, tuple]:
        """(objects to compare by identity, numbers to compare by value)."""
        objects = []
        for _, m in self._modules:
            objects += [*vars(m).values(), *m._parameters.values(), *m._buffers.values(), *m._modules.values()]
        numbers = (tuple(map(len, self._module_hooks)),
                   tuple(len(getattr(module_mod, attr)) for attr in _GLOBAL_HOOKS),
                   tuple((p.requires_grad, _written(p), len(p._backward_hooks or ()),
                          len(getattr(p, "_post_accumulate_grad_hooks", None) or ())) for _, p in self._params),
                   tuple(_written(b) for _, b in self._buffers),
                   tuple(_written(t) for _, t in self._tensor_attributes),
                   self._settings())
        return objects, numbers

    def _settings(self) -> tuple:
        """What the model's classes' ``forward`` reads of the classes and globals
        (:func:`_class_reads`), as (where, name, value) triples."""
        return tuple((where, label, _read_now(label, name, spaces)) for where, label, name, spaces in self._class_reads)

    def _unchanged(self) -> bool:
        objects, numbers = self._take()
        then_objects, then_numbers = self._snapshot
        return RemovableHandle.next_id == self._next_id and numbers == then_numbers and \
            len(objects) == len(then_objects) and all(map(operator.is_, objects, then_objects))

    def change(self) -> str | None:
        """What changed in the model since the snapshot, in words; None if nothing did."""
        if self._unchanged():
            return None
        for (name, m), before in zip(self._modules, self._attributes):
            if m.training != before["training"]:
                return f"{name or 'the model'} is now in {'training' if m.training else 'eval'} mode"
        member = self.member_change()
        if member is not None:
            return member
        for (name, p), (requires_grad, *_) in zip(self._params, self._snapshot[1][2]):
            if p.requires_grad != requires_grad:
                return f"parameter {name} was {'unfrozen' if p.requires_grad else 'frozen'} (requires_grad)"
        for (name, p), (_, version, *_) in zip(self._params, self._snapshot[1][2]):
            if _written(p) != version:
                return (f"parameter {name} was written in place (model.load_state_dict, an eager "
                        "optimizer step, an initializer, an assignment to its .data)")
        for (name, b), version in zip(self._buffers, self._snapshot[1][3]):
            if _written(b) != version:
                return (f"buffer {name} was written in place (an eager call of the model in train "
                        "mode, which moves BatchNorm's running statistics; model.load_state_dict, "
                        "reset_running_stats)")
        for (name, t), version in zip(self._tensor_attributes, self._snapshot[1][4]):
            if _written(t) != version:
                return (f"the tensor attribute {name}, which the step holds as a constant (it is "
                        "neither a parameter nor a buffer), was written in place; register it as a "
                        "buffer (module.register_buffer) if it is state that changes")
        for (where, hooks, kind), keys in zip(_hook_dicts(self._modules, self._params), self._hook_keys):
            if tuple(hooks or ()) != keys:
                return f"a {kind.removesuffix('s')} was added to or removed from {where}"
        now, then = self._settings(), self._snapshot[1][5]
        if now != then:
            changed = sorted(set(now) ^ set(then))[0][:2]
            before = dict(((w, k), v) for w, k, v in then).get(changed, "<unset>")
            after = dict(((w, k), v) for w, k, v in now).get(changed, "<unset>")
            return change_words(f"{changed[1]} of {changed[0]}", before, after)
        for (name, m), before in zip(self._modules, self._attributes):
            now = vars(m)
            for attr in (now.keys() | before.keys()) - _recomputed(m):
                if now.get(attr, _MISSING) is not before.get(attr, _MISSING) and \
                        not _alike(now.get(attr, _MISSING), before.get(attr, _MISSING)):
                    return (f"{name + '.' if name else ''}{attr} changed "
                            f"({describe(before.get(attr, _MISSING))} -> {describe(now.get(attr, _MISSING))})")
        # a hook registered on something else, or an attribute given an equal value again
        self._next_id = RemovableHandle.next_id
        self._attributes = [dict(vars(m)) for _, m in self._modules]
        self._snapshot = self._take()
        return None

    def member_change(self, skip: frozenset[int] = frozenset()) -> str | None:
        """Which submodule, parameter or buffer of which module (other than those whose
        ``id`` is in ``skip``) was replaced, added or removed since the snapshot, in words;
        None if none was."""
        for (name, m), members in zip(self._modules, self._members):
            if id(m) in skip:
                continue
            for kind, what in _MEMBERS.items():
                now, then = getattr(m, kind), members[kind]
                if now.keys() != then.keys() or any(now[k] is not then[k] for k in now):
                    changed = [k for k in now.keys() | then.keys() if now.get(k) is not then.get(k)]
                    return f"{what} of {name or 'the model'} ({', '.join(sorted(changed))}) was replaced, added or removed"
        return None

    def restore_members(self) -> None:
        """Give every module back the submodules, parameters and buffers it had."""
        for (_, m), members in zip(self._modules, self._members):
            for kind in _MEMBERS:
                held = getattr(m, kind)
                if held.keys() != members[kind].keys() or any(held[k] is not members[kind][k] for k in held):
                    held.clear()
                    held.update(members[kind])

    def written(self) -> set[str]:
        """The names of the parameters and buffers written in place since the snapshot
        (their version counters moved)."""
        then, now = self._snapshot[1], self._take()[1]
        return {name for (name, _), (_, before, *_), (_, after, *_) in zip(self._params, then[2], now[2])
                if before != after} | \
            {name for (name, _), before, after in zip(self._buffers, then[3], now[3]) if before != after}

    def accept_writes(self, names: set[str] | None = None) -> None:
        """Take the parameters' and buffers' values as they are now (version counters):
        the step's own weights were just replaced (a checkpoint loaded), so earlier writes
        into the model's are not ignored any more; or the step wrote its own into the model
        (which moves the versions of tensor attributes that view them too). Nothing else is
        accepted. ``names``: those parameters and buffers alone (another program's
        statistics, taken by the step), tensor attributes left as they were."""
        objects, numbers = self._snapshot
        now = self._take()[1]
        taken = (lambda name: True) if names is None else names.__contains__
        params = tuple((r, v_now if taken(name) else v, *hooks) for (name, _), (r, v, *hooks), (_, v_now, *_)
                       in zip(self._params, numbers[2], now[2]))
        buffers = tuple(after if taken(name) else before
                        for (name, _), before, after in zip(self._buffers, numbers[3], now[3]))
        self._snapshot = objects, (*numbers[:2], params, buffers, now[4] if names is None else numbers[4],
                                   *numbers[5:])

    def restore_attributes(self) -> None:
        """Give every module back the plain attributes it had at the snapshot (those that
        are not parameters, buffers, submodules or hooks)."""
        for (_, m), before in zip(self._modules, self._attributes):
            now = vars(m)
            for attr in list(now.keys() - before.keys()):
                del now[attr]
            for attr, value in before.items():
                if now.get(attr, _MISSING) is not value:
                    now[attr] = value

    def attributes_changed(self) -> list[tuple[str, str, object, object]]:
        """(module name, attribute, value at the snapshot, value now) for each plain
        attribute that differs (not parameters, buffers, submodules or hooks)."""
        found = []
        for (name, m), before in zip(self._modules, self._attributes):
            now = vars(m)
            for attr in sorted(now.keys() | before.keys()):
                old, new = before.get(attr, _MISSING), now.get(attr, _MISSING)
                if old is not new and not same_plain(old, new):
                    found.append((name, attr, old, new))
        return found


class _Missing:
    def __repr__(self) -> str:
        return "<unset>"


_MISSING = _Missing()


def _recomputed(module: nn.Module) -> set[str]:
    """The attributes a forward pre-hook of ``module`` sets from its parameters before every
    call (the hook-based ``weight_norm`` and ``spectral_norm``): the step computes them
    itself, so an eager forward's new value is no change."""
    return {attr for hook in module._forward_pre_hooks.values()
            if (attr := recomputed_attribute(hook)) is not None}


def _alike(a, b) -> bool:
    """Whether attribute values ``a`` and ``b`` hold the same: equal plain values
    (:func:`same_plain`), or lists of the same objects (an RNN rebuilds its lists of
    weights, and of weak references to them, on every ``.to()``)."""
    if same_plain(a, b):
        return True
    if type(a) is list and type(b) is list and len(a) == len(b):
        return all(x is y or same_plain(x, y) or (isinstance(x, weakref.ref) and isinstance(y, weakref.ref)
                                                  and x() is not None and x() is y())
                   for x, y in zip(a, b))
    return False


def same_plain(a, b) -> bool:
    """Whether ``a`` and ``b`` are equal numbers, strings, flags or tuples of them."""
    if isinstance(a, PLAIN) and isinstance(b, PLAIN):
        return type(a) is type(b) and a == b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y or same_plain(x, y) for x, y in zip(a, b))
    return False


def describe(value) -> str:
    """A short description of an attribute's value for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """Where ``torch.autocast`` is on now: (device type, dtype) per device type. A traced
    step has the dtypes autocast gave it while tracing, so it runs under the same state
    and with autocast itself off (the casts are in the graph)."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


def autocast_words(state: tuple[tuple[str, torch.dtype], ...]) -> str:
    """``state`` of :func:`autocast_state` in words."""
    return " and ".join(f"on for {device} ({str(dtype).removeprefix('torch.')})" for device, dtype in state) or "off"


class OptimizerStateWatch:
    """What ``optimizer.state`` holds at a snapshot: the state object itself (its
    ``load_state_dict`` puts a new one in place) and every value it keeps per parameter
    (a tensor by identity and version counter: an in-place write bumps it; anything else by
    value); :meth:`changed` says whether it differs now. Parameters without state are left
    out (``optimizer.state`` is a defaultdict: reading it adds empty entries)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = optimizer
        self.accept()

    def _take(self) -> tuple:
        state = self._optimizer.state
        return state, [(p, k, v, v._version if isinstance(v, torch.Tensor) else None)
                       for p, values in state.items() for k, v in values.items()]

    def accept(self) -> None:
        """Take the optimizer's state as it is now."""
        self._snapshot = self._take()

    def changed(self) -> bool:
        """Whether the optimizer's state changed since the snapshot."""
        return self._optimizer.state is not self._snapshot[0] or bool(self.changed_params())

    def changed_params(self) -> set[int]:
        """The ids of the parameters whose state changed since the snapshot (any of its
        entries: :meth:`changed_entries`)."""
        return {p for p, _ in self.changed_entries()}

    def changed_entries(self) -> set[tuple[int, str]]:
        """``(id(parameter), state name)`` of every entry added, removed, replaced or
        written in place since the snapshot (every entry, after ``optimizer.load_state_dict``)."""
        def by_entry(values) -> dict[tuple[int, str], tuple]:
            return {(id(p), k): (v, version) for p, k, v, version in values}
        now, then = by_entry(self._take()[1]), by_entry(self._snapshot[1])
        return {key for key in now.keys() | then.keys()
                if key not in now or key not in then or not _same_entry(now[key], then[key])}


def _same_entry(now: tuple, then: tuple) -> bool:
    """Whether one state entry ``(value, version)`` is as it was."""
    (v, version), (w, then_version) = now, then
    return version == then_version and (v is w or (not isinstance(w, torch.Tensor) and same_plain(v, w)))
