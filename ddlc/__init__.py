"""ddlc: a distributed deep-learning compiler for PyTorch.

``ddlc.compile(model, mesh, example_inputs, loss_fn, optimizer)`` traces the whole
training step into one aten graph (``ddlc.trace``), shards it (``passes.sharding``),
inserts collectives and localizes it, and returns a per-rank program
(``CompiledStep``); ``ddlc.spawn`` starts local gloo workers.
"""
from . import errors
from .errors import DDLCError
from .mesh import HardwareProfile, LinkModel, Mesh, load_profile
from .sbp import B, NdSBP, P, S, SBP
from .launch import spawn
from .plan import Plan
from .runtime import CompiledStep, compile
from .trace import trace

__all__ = ["B", "CompiledStep", "DDLCError", "HardwareProfile", "LinkModel", "Mesh", "NdSBP", "P",
           "Plan", "S", "SBP", "compile", "errors", "load_profile", "spawn", "trace"]
