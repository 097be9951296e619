"""ddlc: a distributed deep-learning compiler for PyTorch.

``ddlc.compile(model, mesh, example_inputs, loss_fn, optimizer)`` traces the whole
training step into one aten graph, plans and lowers it (:mod:`ddlc.pipeline` lists
every pass in order) and returns a per-rank program (``CompiledStep``);
``ddlc.spawn`` starts local gloo workers.

Only the core types are imported eagerly; the compiler and runtime load on first use
(PEP 562), so that ``cost_models`` and ``passes`` can import ``ddlc.mesh`` and friends
without pulling in the layers above them.
"""
import importlib

from . import errors
from .errors import DDLCError
from .mesh import HardwareProfile, LinkModel, Mesh, load_profile
from .sbp import B, NdSBP, P, S, SBP

#: Public name -> the module that defines it, imported on first access.
_LAZY = {"spawn": "launch", "run": "launch", "Plan": "plan", "CompiledStep": "step", "compile": "runtime",
         "CompileOptions": "options", "trace": "tracing"}

__all__ = ["B", "CompiledStep", "CompileOptions", "DDLCError", "HardwareProfile", "LinkModel", "Mesh",
           "NdSBP", "P", "Plan", "S", "SBP", "compile", "errors", "load_profile", "run", "spawn", "trace"]


def __getattr__(name: str):
    if name in _LAZY:
        # imported here, not at the top: the runtime sits above every other layer
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddlc' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
