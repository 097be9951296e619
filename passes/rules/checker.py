"""The generic SBP rule checker: run an operator on simulated shards in one process.

For a node and an n-D signature, every tensor input is cut into the pieces each
mesh coordinate holds (``S``: ``local_slices``; ``B``: a full copy; ``P``: random
summands that add up to the value), the op runs once per coordinate with
``localize_args``, and the outputs are reassembled by their SBP (``S``: placed
at their slices, ``B``: one copy, checked equal to the others, ``P``: summed) and
compared with the op on the whole inputs. A wrong rule fails here.

Pieces are contiguous, as a rank's local tensors are: some CPU kernels give wrong
results on strided views (``native_layer_norm_backward`` with a non-contiguous
``mean``/``rstd``, torch 2.13), so lowering must hand ops contiguous shards too.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx
from torch.utils._pytree import tree_leaves, tree_map

from ddlc.sbp import NdSBP, local_shape, local_slices
from passes.rules import NdSignature, localize_args, signatures_nd, tensor_inputs

__all__ = ["capture_values", "make_node", "node_inputs", "run_local", "check_signature",
           "check_node", "sample"]


def capture_values(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    """Run ``gm`` eagerly on real ``inputs``; return every node's value."""
    env: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            env[n] = result = super().run_node(n)
            return result

    Recorder(gm).run(*inputs)
    return env


def make_node(op: Callable, *args, val: Any = None, **kwargs) -> tuple[fx.Node, list[torch.Tensor]]:
    """A one-op graph over tensor ``args``: the op's node (``meta["val"]``: ``val``, or
    the op run on the args) and its tensor inputs."""
    graph = fx.Graph()
    values: list[torch.Tensor] = []

    def placeholder(t):
        if not isinstance(t, torch.Tensor):
            return t
        node = graph.placeholder(f"x{len(values)}")
        node.meta["val"] = t
        values.append(t)
        return node

    node = graph.call_function(op, *tree_map(placeholder, (args, kwargs)))
    node.meta["val"] = op(*args, **kwargs) if val is None else val
    return node, values


def node_inputs(node: fx.Node, env: dict[fx.Node, Any]) -> list[Any]:
    """The values of ``tensor_inputs(node)`` (for getitem: the selected element)."""
    if node.target is operator.getitem:
        return [env[node]]
    return [env[a] for a in tensor_inputs(node)]


def run_local(node: fx.Node, values: Sequence[torch.Tensor],
              out_shapes: Sequence[tuple[int, ...] | None]) -> list[Any]:
    """Run ``node``'s op on ``values`` (its tensor inputs, in order) with localized args."""
    if node.target is operator.getitem:
        return list(values)
    args, kwargs = localize_args(node, [tuple(v.shape) for v in values], out_shapes)
    feed = iter(values)
    args, kwargs = tree_map(lambda a: next(feed) if isinstance(a, fx.Node) else a, (args, kwargs))
    return tree_leaves(node.target(*args, **kwargs))


def _coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(p) for p in mesh_shape)))


def _shard(value: torch.Tensor, sbp: NdSBP, mesh_shape: Sequence[int],
           generator: torch.Generator) -> dict[tuple[int, ...], torch.Tensor]:
    """The piece each coordinate holds; P axes hold random summands of their slice."""
    partial_axes = [a for a, x in enumerate(sbp) if x.is_partial]
    pieces = {}
    for coord in _coords(mesh_shape):
        if _rep(coord, sbp, mesh_shape) != coord or any(coord[a] for a in partial_axes):
            continue
        part = value[local_slices(value.shape, sbp, mesh_shape, coord)].contiguous()
        group = [c for c in _coords(mesh_shape)
                 if all(c[a] == coord[a] for a in range(len(mesh_shape)) if a not in partial_axes)]
        noise = [_noise_like(part, generator) for _ in group[1:]]
        pieces[group[0]] = part - sum(noise) if noise else part
        pieces.update(zip(group[1:], noise))
    return pieces


def _noise_like(part: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random summand of the size of each element (so float32 rounding stays relative);
    an integer one for an integer tensor (its partial sums are exact)."""
    if not (part.is_floating_point() or part.is_complex()):
        return torch.randint(-100, 100, part.shape, generator=generator, dtype=part.dtype).to(part.device)
    scale = part.abs() + 1e-3 * part.abs().mean()
    return torch.randn(part.shape, generator=generator, dtype=part.dtype).to(part.device) * scale


def _same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
        # float32 rounding of a different summation order, relative to the output's scale
        atol = 1e-5 * max(1.0, b.abs().max().item()) if b.numel() else 1e-5
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{what}: integer values differ"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def check_signature(node: fx.Node, sig: NdSignature, mesh_shape: Sequence[int],
                    inputs: Sequence[torch.Tensor], seed: int = 0) -> None:
    """Raise AssertionError unless ``sig`` computes ``node`` correctly on simulated shards."""
    mesh_shape = tuple(mesh_shape)
    generator = torch.Generator().manual_seed(seed)
    expected = run_local(node, inputs, [None if v is None else tuple(v.shape)
                                        for v in _out_leaves(node)])
    shards = [None if x is None else _shard(v, x, mesh_shape, generator)
              for v, x in zip(inputs, sig.inputs)]
    outs: dict[tuple[int, ...], list[Any]] = {}
    for coord in _coords(mesh_shape):
        local_out_shapes = [None if x is None else local_shape(tuple(e.shape), x, mesh_shape, coord)
                            for e, x in zip(expected, sig.outputs)]
        local_inputs = [v if s is None else s[_rep(coord, x, mesh_shape)]
                        for v, s, x in zip(inputs, shards, sig.inputs)]
        outs[coord] = run_local(node, local_inputs, local_out_shapes)
        for k, (got, want) in enumerate(zip(outs[coord], local_out_shapes)):
            if want is not None:
                assert tuple(got.shape) == want, \
                    f"output {k} at {coord}: local shape {tuple(got.shape)} != {want}"
    for k, (want, x) in enumerate(zip(expected, sig.outputs)):
        if x is None:
            continue
        _same(_assemble([outs[c][k] for c in _coords(mesh_shape)], want, x, mesh_shape),
              want, f"output {k} ({x}) of {node.format_node()} under {sig} on {mesh_shape}")


def _rep(coord: tuple[int, ...], sbp: NdSBP, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The coordinate whose piece ``coord`` holds: B axes all hold coordinate 0's copy."""
    return tuple(0 if x.is_broadcast else c for c, x in zip(coord, sbp))


def _assemble(locals_: list[torch.Tensor], like: torch.Tensor, sbp: NdSBP,
              mesh_shape: Sequence[int]) -> torch.Tensor:
    """Place S pieces, sum P pieces, take one B copy (after checking all copies agree)."""
    coords = _coords(mesh_shape)
    by_coord = dict(zip(coords, locals_))
    total = torch.zeros_like(like)
    for coord in coords:
        copy_of = _rep(coord, sbp, mesh_shape)
        if copy_of != coord:
            _same(by_coord[coord], by_coord[copy_of], f"B copy at {coord} of {sbp}")
            continue
        region = local_slices(tuple(like.shape), sbp, mesh_shape, coord)
        if sbp.has_partial:
            total[region] += by_coord[coord]
        else:
            total[region] = by_coord[coord]
    return total


def _out_leaves(node: fx.Node) -> list[Any]:
    return tree_leaves(node.meta.get("val"))


def sample(items: Sequence[Any], limit: int) -> list[Any]:
    """At most ``limit`` items, evenly spaced (deterministic)."""
    if len(items) <= limit:
        return list(items)
    step = len(items) / limit
    return [items[int(i * step)] for i in range(limit)]


def check_node(node: fx.Node, inputs: Sequence[torch.Tensor],
               meshes: Iterable[Sequence[int]] = ((2,), (4,), (2, 2)),
               nd_limit: int = 24) -> int:
    """Check every signature of ``node`` on each 1-D mesh and (a sample of at most
    ``nd_limit``) on each n-D mesh; return how many were checked. Raises naming the
    first wrong signature."""
    checked = 0
    for mesh_shape in meshes:
        sigs = signatures_nd(node, mesh_shape)
        if len(mesh_shape) > 1:
            sigs = sample(sigs, nd_limit)
        for seed, sig in enumerate(sigs):
            check_signature(node, sig, mesh_shape, inputs, seed)
            checked += 1
    return checked
