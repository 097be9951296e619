"""Which line of the user's code a traced node or an exception comes from.

Errors name the user's source line (``ddlc.errors``' ``where``): the innermost frame of the
user's own files (not torch's, ddlc's or the standard library's), and for a model from a
third-party library (transformers, timm) also that library's innermost line below it.
"""
from __future__ import annotations

import os
import re
import traceback
from typing import Sequence

import torch

__all__ = ["autograd_function", "caller", "cite", "custom_operator", "is_library_file", "is_torch_file", "is_user_file",
           "source_from_stack", "torch_compiled_call", "torch_module_frame", "user_frame"]

#: torch's and ddlc's own folders, which call torch's generator functions themselves
_TORCH_AND_DDLC = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_DIRS = (*_TORCH_AND_DDLC, os.path.dirname(os.__file__))


def is_user_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.endswith(os.path.join("ddlc", "zoo.py")):
        return True
    return not path.startswith(_INTERNAL_DIRS) and "site-packages" not in path \
        and not filename.startswith("<")


def is_torch_file(filename: str) -> bool:
    """torch's own file (or ddlc's: both call torch's generator functions themselves)."""
    return os.path.abspath(filename).startswith(_TORCH_AND_DDLC)


def is_library_file(filename: str) -> bool:
    """A third-party model library's file (transformers, timm, ...): not torch, not ddlc."""
    path = os.path.abspath(filename)
    return "site-packages" in path and not path.startswith(_INTERNAL_DIRS)


def _installed(file: str, line: int | str, func: str, code: str) -> str:
    """A frame of an installed package's file, as ``package/path.py:line in func: code``."""
    short = os.path.abspath(file).split("site-packages" + os.sep, 1)[-1]
    return f"{short}:{line} in {func}: {code.strip()}"


def cite(frames: Sequence[tuple[str, int | str, str, str]]) -> str | None:
    """The user's innermost frame, and where the innermost library frame lies below it
    (a Hugging Face model's own line), as ``file:line in func: code [in lib/file:line ...]``."""
    users = [k for k, f in enumerate(frames) if is_user_file(f[0])]
    libraries = [k for k, f in enumerate(frames) if is_library_file(f[0])]
    parts = []
    if users:
        file, line, func, code = frames[users[-1]]
        parts.append(f"{file}:{line} in {func}: {code.strip()}")
    if libraries and (not users or libraries[-1] > users[-1]):
        parts.append(f"[in {_installed(*frames[libraries[-1]])}]")
    return " ".join(parts) or None


def custom_operator(exc: BaseException) -> str | None:
    """The innermost operator outside torch's own namespaces that was running when
    ``exc`` was raised (a ``torch.library`` custom op), by name; None if there is none."""
    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        op = frame.f_locals.get("self") if frame.f_code.co_name == "__call__" else None
        if isinstance(op, torch._ops.OpOverload) and op.namespace not in _TORCH_NAMESPACES:
            found = op.name()
        # called as ``torch.ops.ns.op(...)``: the packet picks its overload in C++
        elif isinstance(op, torch._ops.OpOverloadPacket) and \
                op._qualified_op_name.partition("::")[0] not in _TORCH_NAMESPACES:
            found = op._qualified_op_name
    return found


def torch_compiled_call(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside a call of a function ``torch.compile`` made (its
    ``compile_wrapper``)."""
    return any(frame.f_code.co_name == "compile_wrapper" and "_dynamo" in frame.f_code.co_filename
               for frame, _ in traceback.walk_tb(exc.__traceback__))


def validating_distribution(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a ``torch.distributions`` distribution validated
    its arguments or a value given to it (``validate_args``, on by default)."""
    return any(frame.f_code.co_name in ("__init__", "_validate_sample")
               and frame.f_code.co_filename.endswith(os.path.join("torch", "distributions", "distribution.py"))
               for frame, _ in traceback.walk_tb(exc.__traceback__))


def autograd_function(exc: BaseException) -> type | None:
    """The innermost ``torch.autograd.Function`` subclass whose ``apply`` was running when
    ``exc`` was raised; None if there is none."""
    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        cls = frame.f_locals.get("cls") if frame.f_code.co_name == "apply" else None
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            found = cls
    return found


#: operator namespaces of torch itself
_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d", "higher_order", "profiler"})


def user_frame(exc: BaseException) -> str | None:
    return cite([(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_tb(exc.__traceback__)])


#: torch's modules a user builds models from (``nn``'s layers, ``ao``'s quantization): their
#: Python code is what the user reads when a value check inside one of them is refused
_TORCH_MODULE_DIRS = tuple(os.path.join(os.path.dirname(torch.__file__), *d) + os.sep
                           for d in (("nn", "modules"), ("nn", "utils"), ("ao",)))


def torch_module_frame(exc: BaseException) -> str | None:
    """The innermost frame of ``exc``'s traceback in the code of torch's modules (a layer of
    ``torch.nn``, ``torch.ao``'s fake quantization) below the user's innermost frame, as
    ``torch/...:line in func: code``; None if there is none."""
    frames = traceback.extract_tb(exc.__traceback__)
    users = [k for k, f in enumerate(frames) if is_user_file(f.filename)]
    found = None
    for k, f in enumerate(frames):
        if (not users or k > users[-1]) and os.path.abspath(f.filename).startswith(_TORCH_MODULE_DIRS):
            found = f
    return None if found is None else _installed(found.filename, found.lineno, found.name, found.line or "")


def caller() -> str | None:
    """:func:`cite` of the stack that calls this (a refusal raised while the forward runs)."""
    return cite([(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_stack()[:-1]])


def source_from_stack(stack_trace: str | None) -> str:
    if not stack_trace:
        return ""
    return cite(re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', stack_trace)) or ""
