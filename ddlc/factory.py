"""Load the model factory that the command line names: ``path/to/file.py:name`` or
``package.module:name``.

The factory is called with no arguments and returns ``(model, example_inputs, loss_fn)``;
``loss_fn`` may be None (the model returns its own loss, or inference). Whatever goes
wrong -- no such file or module, no such name, the factory raising, a result of the
wrong shape -- is a :class:`ddlc.errors.FactoryError` naming the factory and the cause
(the original exception chained).
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from torch import nn

from .errors import FactoryError

__all__ = ["load_factory", "call_factory"]


def _execute(spec, name: str, where: str, spec_text: str):
    """Run the module that ``spec`` finds, registered as ``sys.modules[name]``."""
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # sys.exit at import, too: the command says why it ends
        del sys.modules[name]
        raise FactoryError(f"{spec_text}: importing {where} raised {type(e).__name__}: {e}") from e
    return module


def _module_from_file(path: str, spec_text: str):
    """The module of the file ``path``, with the file's folder first on ``sys.path`` (as
    ``python path/to/file.py`` puts it: the file may import the modules beside it)."""
    if not os.path.isfile(path):
        raise FactoryError(f"{spec_text}: no such file {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = "_ddlc_factory_" + os.path.splitext(os.path.basename(path))[0]
    return _execute(importlib.util.spec_from_file_location(name, path), name, path, spec_text)


def _module_by_name(name: str, spec_text: str):
    """The module ``name``, found as ``python -m`` would: on ``sys.path`` with the working
    directory first (a console script's path lacks it); one already imported is reused."""
    if name in sys.modules:
        return sys.modules[name]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        raise FactoryError(f"{spec_text}: no module {name!r} ({e})") from e
    if spec is None:
        raise FactoryError(f"{spec_text}: no module {name!r}")
    return _execute(spec, name, name, spec_text)


def load_factory(spec_text: str) -> Callable[[], Any]:
    """The callable that ``spec_text`` (``file.py:name`` or ``module:name``) names. A spec
    ending in ``.py`` or holding a path separator is a file, else a module path."""
    where, sep, attr = spec_text.rpartition(":")
    if not sep or not where or not attr:
        raise FactoryError(f"{spec_text!r}: name a factory as path/to/file.py:function or "
                           "package.module:function")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    module = _module_from_file(where, spec_text) if is_file else _module_by_name(where, spec_text)
    if not hasattr(module, attr):
        raise FactoryError(f"{spec_text}: {where} has no function {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise FactoryError(f"{spec_text}: {where}'s {attr!r} is of type {type(factory).__name__}, not a "
                           "function to call")
    return factory


def call_factory(spec_text: str) -> tuple[nn.Module, Any, Callable | None]:
    """Load and call the factory; check that it returned ``(model, example_inputs, loss_fn)``."""
    factory = load_factory(spec_text)
    try:
        inspect.signature(factory).bind()
    except TypeError as e:
        raise FactoryError(f"{spec_text}: ddlc calls the factory with no arguments, and it needs some "
                           f"({e}): give its parameters defaults, or name a function that takes none") from e
    except ValueError:  # no signature to read (a builtin): calling it tells
        pass
    try:
        result = factory()
    except (Exception, SystemExit) as e:
        raise FactoryError(f"{spec_text}: the factory raised {type(e).__name__}: {e}") from e
    if not (isinstance(result, tuple) and len(result) == 3):
        raise FactoryError(f"{spec_text}: the factory must return (model, example_inputs, loss_fn), "
                           f"got {type(result).__name__}")
    model, inputs, loss_fn = result
    if not isinstance(model, nn.Module):
        raise FactoryError(f"{spec_text}: the factory's model is of type {type(model).__name__}, not a "
                           "torch.nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise FactoryError(f"{spec_text}: the factory's loss_fn is of type {type(loss_fn).__name__}, "
                           "neither None nor callable")
    return model, inputs, loss_fn
