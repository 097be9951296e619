"""Which compiled step holds a model's training, and the guard on eager reads of it.

A compiled step keeps the parameters, buffers and optimizer state it trains as its own
shards: the model and its optimizer keep the values compile took until the step's
``write_back`` puts the step's into them. This module records, per model, the live step
whose training is not written back (:func:`hold`, :func:`release`, :func:`holder`), finds
every live step that trains a model's parameters (:func:`trainers`: the model's own, and
those of models sharing a submodule with it), and makes eager reads of weights a step has
trained past raise at the user's call instead of reading the values compile took
(:func:`guard`): a call of any module holding such a parameter (a global forward pre-hook,
registered once) and ``state_dict()`` of the model or its optimizer (hooks that exist only
while a step holds the training, so a model written back pickles and scripts as before).
Reading ``model.parameters()`` directly cannot be seen.

A step here is a :class:`ddlc.step.CompiledStep`; this module reads its public
``steps_done``, ``trained_ids``, ``compiled_as`` and ``signature``.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.nn.utils.stateless import _reparametrize_module

from .errors import UnsupportedInputError

if TYPE_CHECKING:
    from .step import CompiledStep

__all__ = ["buffer_holders", "current", "guard", "hold", "release", "holder", "now", "statistics_holders",
           "trainers", "register", "steps_of", "written_by_another", "wrote"]

#: per model, the compiled step whose steps trained it last and whose state was not written
#: back: compiling the model again writes it back first
_HOLDER: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
#: per module of a compiled model (its submodules too), the models it belongs to (weakly):
#: what :func:`_refuse_stale_call` looks a called module up in
_MODELS_OF: "weakref.WeakKeyDictionary[nn.Module, list[weakref.ref]]" = weakref.WeakKeyDictionary()
#: per compiled optimizer, its model (weakly)
_MODEL_OF: "weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref]" = weakref.WeakKeyDictionary()
#: per model whose training a compiled step holds, the handles of the ``state_dict`` guards
#: on it and its optimizer (:func:`hold`)
_STATE_DICT_GUARDS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
#: the handle of :func:`_refuse_stale_call`, registered for every module once (first compile)
_CALL_GUARD = None
#: per model, the training step that last wrote its training back into it, and when
#: (:func:`now`)
_WRITER: "weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, int]]" = weakref.WeakKeyDictionary()
_CLOCK = itertools.count()
#: per model, its live compiled programs
_LIVE: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()
#: the models that hold a step's current state in place of their own (:func:`current`)
_CURRENT: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def now() -> int:
    """A serial number of this moment (the same sequence on every rank)."""
    return next(_CLOCK)


def wrote(step: "CompiledStep", model: nn.Module) -> None:
    """``step``, a training step, has just written its training back into ``model``."""
    _WRITER[model] = (weakref.ref(step), now())


def written_by_another(step: "CompiledStep", model: nn.Module, since: int) -> bool:
    """Whether a training step other than ``step`` (alive or not) wrote its training back
    into ``model`` after moment ``since``."""
    ref, when = _WRITER.get(model, (None, -1))
    return ref is not None and when > since and ref() is not step


def register(step: "CompiledStep", model: nn.Module) -> None:
    """``step`` was compiled from ``model``."""
    _LIVE.setdefault(model, weakref.WeakSet()).add(step)


def steps_of(model: nn.Module) -> "list[CompiledStep]":
    """The live compiled programs of ``model``, in the order they were compiled."""
    return sorted(_LIVE.get(model, ()), key=lambda step: step.compiled_as)


def guard(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse eager reads of ``model``'s weights (and ``optimizer``'s state) while a compiled
    step holds training of it that is not written back: a call of the model or of any of
    its modules (evaluation, ``generate``; a model holding one of them), through a global
    forward pre-hook registered once, before any ``ModelWatch`` snapshot; and
    ``model.state_dict()`` (``torch.save``, ``save_pretrained``, an EMA copied from it) and
    ``optimizer.state_dict()``, through hooks that :func:`hold` adds."""
    global _CALL_GUARD
    if _CALL_GUARD is None:
        _CALL_GUARD = module_mod.register_module_forward_pre_hook(_refuse_stale_call)
    for module in model.modules():
        models = _MODELS_OF.setdefault(module, [])
        if not any(ref() is model for ref in models):
            models.append(weakref.ref(model))
    if optimizer is not None:
        _MODEL_OF[optimizer] = weakref.ref(model)


def hold(step: "CompiledStep", model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """``step`` holds training of ``model`` that is not written back; the model's and
    ``optimizer``'s ``state_dict()`` refuse until :func:`release`."""
    _HOLDER[model] = weakref.ref(step)
    if model not in _STATE_DICT_GUARDS:
        handles = [model.register_state_dict_pre_hook(_refuse_stale_state_dict)]
        if optimizer is not None:
            handles.append(optimizer.register_state_dict_pre_hook(_refuse_stale_optimizer_state))
        _STATE_DICT_GUARDS[model] = handles


def release(model: nn.Module) -> None:
    """The model's weights are current again (written back, or taken anew)."""
    _HOLDER.pop(model, None)
    for handle in _STATE_DICT_GUARDS.pop(model, ()):
        handle.remove()


def holder(model: nn.Module) -> "CompiledStep | None":
    """The live compiled step whose training of ``model`` is not written back, if any."""
    ref = _HOLDER.get(model)
    return ref() if ref is not None else None


def trainers(model: nn.Module) -> "list[CompiledStep]":
    """The live compiled steps whose training of ``model``'s parameters is not written back:
    the model's own (:func:`holder`) and those of other models that train one of its
    parameters (a submodule both hold, trainable there when that step was compiled, even
    if frozen here), in the order they were compiled (the same on every rank). Each step
    holds its own copy of the parameters it trains (an inference program holds only the
    buffers it updates: another model's is not one of these)."""
    mine = {id(p) for p in model.parameters()}
    found = []
    for other, ref in list(_HOLDER.items()):
        step = ref()
        if step is not None and (other is model or step.signature.has_loss and
                                 not mine.isdisjoint(step.trained_ids)):
            found.append(step)
    return sorted(found, key=lambda step: step.compiled_as)


def buffer_holders(model: nn.Module) -> "list[CompiledStep]":
    """The live compiled programs holding buffers of ``model`` they updated (BatchNorm's
    statistics: a training step, or an inference program called in train mode) and did not
    write back: the model's own (:func:`holder`) and those of other models holding one of
    its buffers (a submodule both hold, as ``model[:3]`` of an ``nn.Sequential`` does), in
    the order they were compiled (the same on every rank)."""
    mine = {id(b) for b in model.buffers()}
    found = []
    for other, ref in list(_HOLDER.items()):
        step = ref()
        if step is not None and (other is model or not mine.isdisjoint(id(b) for b in other.buffers())):
            found.append(step)
    return sorted(found, key=lambda step: step.compiled_as)


def statistics_holders(model: nn.Module) -> "list[CompiledStep]":
    """The inference programs among :func:`buffer_holders`."""
    return [step for step in buffer_holders(model) if not step.signature.has_loss]


@contextlib.contextmanager
def current(model: nn.Module, state: Mapping[str, torch.Tensor]):
    """Within, ``model``'s parameters and buffers are ``state`` (by name, tied names alike:
    a compiled step's current values), so that reading its ``state_dict()`` is not stale
    and the guard lets it pass."""
    _CURRENT.add(model)
    try:
        with _reparametrize_module(model, state, tie_weights=True):
            yield
    finally:
        _CURRENT.discard(model)


def _refuse_stale(model: nn.Module | None, what: str) -> None:
    step = holder(model) if model is not None and model not in _CURRENT else None
    if step is not None:
        raise UnsupportedInputError(
            f"{what}, but its compiled step has trained it {step.steps_done} step(s) since compile "
            "and holds the result as its own shards: the model and its optimizer keep the values "
            "compile took until step.write_back() puts the step's into them (a collective: call it "
            "on every rank). Call it first, or read step.state_dict() / step.optimizer_state(), or "
            "evaluate with an inference program compiled from the model (it reads the step's): "
            "each of these gathers the shards, so call it on every rank, also where only rank 0 "
            "saves or prints the result")


def _refuse_stale_call(module: nn.Module, args) -> None:
    """The global forward pre-hook of :func:`guard`: refuses a call of a module holding a
    parameter that a compiled step trains and has not written back. A module with no such
    parameter passes (a frozen encoder, an activation or positional module shared with
    another model), and so does one called with other weights than its own
    (``torch.func.functional_call`` of ``step.state_dict()``), and every call while
    ``torch.compile`` traces (the check would break its graphs; what it compiles then reads
    the model's values as they are). Every eager module call in the process passes here
    (about 2 us each)."""
    if not _HOLDER or torch.compiler.is_compiling():  # nothing held
        return
    for ref in _MODELS_OF.get(module, ()):
        model = ref()
        step = holder(model) if model is not None else None
        if step is not None and any(id(p) in step.trained_ids for p in module.parameters()):
            _refuse_stale(model, "the model is called eagerly" if model is module else
                          f"a {type(module).__name__} of the model is called eagerly")


def _refuse_stale_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _refuse_stale(module, "model.state_dict() is read")


def _refuse_stale_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    ref = _MODEL_OF.get(optimizer)
    _refuse_stale(ref() if ref is not None else None, "the optimizer's state_dict() is read")
