"""ddlc: a distributed deep-learning compiler for PyTorch.

``ddlc.trace`` turns a model's training step into one aten graph; the passes
in ``passes/`` shard, schedule and lower it (see DESIGN.md).
"""
from . import errors
from .errors import DDLCError
from .mesh import HardwareProfile, LinkModel, Mesh, load_profile
from .sbp import B, NdSBP, P, S, SBP
from .trace import trace

__all__ = ["B", "DDLCError", "HardwareProfile", "LinkModel", "Mesh", "NdSBP", "P", "S", "SBP",
           "errors", "load_profile", "trace"]
