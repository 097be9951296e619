"""Order collectives for overlap: issue early, wait late (DeAR/PipeDAP in graph form).

A list scheduler re-emits the nodes of a lowered graph in a new topological
order:

- an *issue* node (a ``_c10d_functional`` collective, together with the local
  copies that only feed it) is emitted as soon as its inputs exist, as long as
  the bytes of issued-but-unwaited collectives stay under ``max_inflight_bytes``;
- a ``wait_tensor`` is emitted only right before the first node that reads it;
- everything else keeps its original relative order.

So a gradient's reduce-scatter starts the moment backward produces the
gradient and is waited just before the optimizer update reads it, and a
parameter's all-gather for the forward pass starts ahead of the layers before
it. The order depends on the graph alone (ties go to the original position),
so every rank computes the same collective sequence. :func:`check_waits`
verifies statically that no collective output is read except through its wait.
"""
from __future__ import annotations

import heapq

import torch
from torch import fx

from ddlc.errors import LoweringError

__all__ = ["schedule", "check_waits", "is_issue", "is_wait"]

_c10d = torch.ops._c10d_functional
ISSUE_OPS = {_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default,
             _c10d.all_reduce.default, _c10d.all_to_all_single.default}


def is_issue(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ISSUE_OPS


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _c10d.wait_tensor.default


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _depends_on(node: fx.Node) -> set[fx.Node]:
    """Inputs for readiness: a wait counts as its collective (it is emitted on demand)."""
    return {a.args[0] if is_wait(a) else a for a in node.all_input_nodes}


def _eager(nodes: list[fx.Node]) -> set[fx.Node]:
    """Collectives that read no other collective's result, plus the local copies that only
    feed them: these are issued as soon as they can be. (A collective chained after
    another stays in place, so the first one's wait is not forced early.)"""
    eager = {n for n in nodes if is_issue(n) and not any(is_wait(a) for a in n.all_input_nodes)}
    for node in reversed(nodes):
        if node.op == "call_function" and node.users and not is_wait(node) \
                and all(u in eager for u in node.users) \
                and not any(is_wait(a) for a in node.all_input_nodes):
            eager.add(node)
    return eager


def schedule(gm: fx.GraphModule, max_inflight_bytes: float = float("inf")) -> fx.GraphModule:
    """Reorder ``gm`` in place (see the module docstring) and return it."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    eager = _eager(nodes)
    deps = {n: _depends_on(n) for n in nodes}
    waiting_on = {n: [] for n in nodes}
    for node, inputs in deps.items():
        for a in inputs:
            waiting_on[a].append(node)
    missing = {n: len(deps[n]) for n in nodes}
    ready_eager: list[tuple[int, fx.Node]] = []
    ready_other: list[tuple[int, fx.Node]] = []
    order: list[fx.Node] = []
    emitted: set[fx.Node] = set()
    inflight: dict[fx.Node, int] = {}  # issued, not yet waited; in issue order

    def emit(node):
        if node in emitted:
            return
        if is_issue(node):  # respect the cap: retire the oldest collectives first
            while inflight and sum(inflight.values()) + _nbytes(node) > max_inflight_bytes:
                emit(next(iter(next(iter(inflight)).users)))
        for arg in node.all_input_nodes:  # a wait goes right before its first reader
            if arg not in emitted:
                emit(arg)
        order.append(node)
        emitted.add(node)
        if is_issue(node):
            inflight[node] = _nbytes(node)
        elif is_wait(node):
            inflight.pop(node.args[0], None)
        for user in waiting_on[node]:
            missing[user] -= 1
            if missing[user] == 0 and not is_wait(user):
                heapq.heappush(ready_eager if user in eager else ready_other, (position[user], user))

    for node in nodes:
        if missing[node] == 0 and not is_wait(node):
            heapq.heappush(ready_eager if node in eager else ready_other, (position[node], node))
    while ready_eager or ready_other:
        fits = bool(ready_eager) and (not inflight or sum(inflight.values())
                                      + _nbytes(ready_eager[0][1]) <= max_inflight_bytes)
        _, node = heapq.heappop(ready_eager if ready_eager and (fits or not ready_other) else ready_other)
        emit(node)
    for node in nodes:  # only waits nobody reads remain (none in a valid graph)
        emit(node)
    _reorder(gm, order)
    check_waits(gm)
    return gm


def _reorder(gm: fx.GraphModule, order: list[fx.Node]) -> None:
    """Move the nodes into ``order`` (placeholders first; the output stays last)."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in order if n.op == "placeholder"]
    body = [n for n in order if n.op != "placeholder" and n is not output]
    anchor = next(iter(graph.nodes))
    for node in placeholders + body:  # prepend in order: placeholders first
        if node is not anchor:
            anchor.append(node)
        anchor = node
    graph.lint()
    gm.recompile()


def check_waits(gm: fx.GraphModule) -> None:
    """Raise LoweringError if a collective's output is read other than through its wait,
    or a collective is never waited."""
    for node in gm.graph.nodes:
        if is_issue(node):
            users = list(node.users)
            if not users or not all(is_wait(u) for u in users):
                raise LoweringError(f"collective {node.name} is read before (or without) its "
                                    f"wait_tensor: users {[u.name for u in users]}")
