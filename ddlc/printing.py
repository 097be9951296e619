"""Readable text forms of traced and transformed graphs.

One line per node: name, operator, global shape, the node's SBP and collective
details once passes have annotated them (``ir.SHARDING``, ``ir.COLLECTIVE``), and
where it came from (``ir.ORIGIN``: phase and module path).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import fx

from .ir import COLLECTIVE, ORIGIN, SHARDING, NdSignature, leaves

__all__ = ["align_columns", "format_bytes", "format_graph", "format_graph_by_module", "format_sbps", "format_sharding",
           "op_name", "op_summary"]


def format_bytes(n: float) -> str:
    """``n`` bytes with a unit that keeps three significant digits (``12.3 KiB``), and
    whole numbers from 1000 up to the next unit (``1010 KiB``, never ``1.01e+03 KiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 1000 else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_sbps(sbps) -> str:
    """``(S0, B), -``: each entry's SBP, ``-`` for a non-tensor entry."""
    return ", ".join("-" if x is None else str(x) for x in sbps)


def format_sharding(sig: NdSignature) -> str:
    """A node's chosen signature: ``inputs -> outputs``, or just the outputs of an input."""
    outs = format_sbps(sig.outputs)
    return f"{format_sbps(sig.inputs)} -> {outs}" if sig.inputs else outs


def _annotation(node: fx.Node) -> str:
    collective = COLLECTIVE.get(node)
    if collective is not None:
        return str(collective)
    sharding = SHARDING.get(node)
    return format_sharding(sharding) if sharding is not None else ""


def op_name(node: fx.Node) -> str:
    """``aten.mm`` style name of a call_function target (overload dropped)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def _shape(node: fx.Node) -> str:
    vals = [v for v in leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return " ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for v in vals)


def op_summary(gm: fx.GraphModule) -> Counter:
    return Counter(op_name(n) for n in gm.graph.nodes if n.op == "call_function")


def _row(node: fx.Node) -> tuple[str, str, str, str]:
    return (node.name, op_name(node) if node.op == "call_function" else node.op, _shape(node),
            _annotation(node))


def align_columns(rows: list[tuple[str, ...]], indent: str = "", right=frozenset()) -> list[str]:
    """``rows`` as lines of aligned columns two spaces apart; the columns whose indices are in
    ``right`` are right-aligned, the others left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def format_graph(gm: fx.GraphModule, limit: int | None = None) -> str:
    """The graph as aligned text; ``limit`` keeps the first N lines."""
    rows = []
    for node in gm.graph.nodes:
        origin = ORIGIN.get(node)
        rows.append((*_row(node), f"{origin.phase}:{origin.module}" if origin else ""))
    if limit is not None and len(rows) > limit:
        rows = rows[:limit] + [(f"... {len(rows) - limit} more nodes", "", "", "", "")]
    return "\n".join(align_columns(rows))


def format_graph_by_module(gm: fx.GraphModule) -> str:
    """The graph in program order, cut into runs of consecutive nodes from the same phase
    and module: a ``[phase] module`` header line, then the run's nodes indented, columns
    aligned within the run. Nodes without an origin (buckets of fused collectives, the
    output) form runs headed ``[-]``."""
    runs: list[tuple[tuple[str, str], list]] = []
    for node in gm.graph.nodes:
        origin = ORIGIN.get(node)
        key = (origin.phase, origin.module or "(root)") if origin else ("-", "")
        if not runs or runs[-1][0] != key:
            runs.append((key, []))
        runs[-1][1].append(_row(node))
    lines = []
    for (phase, module), rows in runs:
        lines += [f"[{phase}] {module}".rstrip(), *align_columns(rows, "    ")]
    return "\n".join(lines)
