"""Per-device memory: local tensor bytes, peak live bytes of a graph, and a report.

Placeholders carry ``node.meta["ddlc_role"]`` in ``{"param", "buffer",
"opt_state", "input"}``. Parameters and buffers (model state) and optimizer
state stay resident for the whole step; gradients are counted as the
parameters' bytes again (a gradient shares its parameter's placement);
activations are the peak of the live bytes of everything else, inputs included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch.fx as fx

from ddlc.mesh import Mesh
from ddlc.sbp import NdSBP, local_shape

__all__ = ["tensor_bytes", "peak_live_bytes", "MemoryReport", "memory_report"]

_RESIDENT = {"param": "parameters", "buffer": "parameters", "opt_state": "optimizer_state"}


def tensor_bytes(shape: Sequence[int], itemsize: int, ndsbp: NdSBP, mesh: Mesh) -> int:
    """Bytes of the largest local piece of a ``shape`` tensor placed ``ndsbp`` on ``mesh``."""
    return itemsize * math.prod(local_shape(shape, ndsbp, mesh.shape))


def peak_live_bytes(gm: fx.GraphModule, local_bytes_of: Callable[[fx.Node], int]) -> int:
    """Peak over the graph, in node order, of the bytes of all live node outputs.

    A node's output is allocated when it runs and freed after its last user
    runs (right after itself when unused); the output node allocates nothing.
    """
    nodes = list(gm.graph.nodes)
    last_use = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = i
    frees = [0] * len(nodes)
    live = peak = 0
    for i, node in enumerate(nodes):
        size = 0 if node.op == "output" else local_bytes_of(node)
        live += size
        peak = max(peak, live)
        frees[last_use.get(node, i)] += size
        live -= frees[i]
    return peak


@dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes by kind."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def __str__(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("activations", self.activations),
                ("total", self.total)]
        return "\n".join(f"{name:<16}{n / 2**20:>12.2f} MiB" for name, n in rows)


def memory_report(gm: fx.GraphModule, local_bytes_of: Callable[[fx.Node], int]) -> MemoryReport:
    """Split the per-device bytes of ``gm`` by placeholder role (see the module docstring)."""
    resident = {"parameters": 0, "optimizer_state": 0}
    grads = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        role = node.meta.get("ddlc_role")
        if role in _RESIDENT:
            resident[_RESIDENT[role]] += local_bytes_of(node)
        if role == "param":
            grads += local_bytes_of(node)
    activations = peak_live_bytes(
        gm, lambda n: 0 if n.op == "placeholder" and n.meta.get("ddlc_role") in _RESIDENT
        else local_bytes_of(n))
    return MemoryReport(resident["parameters"], grads, resident["optimizer_state"], activations)
