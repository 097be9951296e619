"""Random numbers in a compiled step: one policy for every rank.

Every random operator of the traced step (dropout's ``bernoulli``, ``rand``,
``randn``, ``randint``, ``normal``, ``uniform``, ...) draws from the program's own
generator (``CompiledStep.generator``), never from a rank's default generator, so
ranks seeded differently for data loading still agree. At compile time that
generator takes rank 0's default CPU generator state; afterwards every rank draws
the same numbers in the same order, because each draw is made for the operator's
*global* shape and each rank keeps its own piece (the slices of its mesh
coordinate under the operator's SBP). The numbers therefore equal those of the
single-device model run with the same seed (a ``torch.manual_seed(s)`` before
``compile`` here, before training there, with no other draws in between), at the
price of each rank generating the whole tensor. Ops whose result depends on an
input's values (``bernoulli(probabilities)``, ``multinomial``) are refused.

:data:`DRAWS` is the table: operator -> (its scalar arguments, the draw for a
global shape, dtype and device). :func:`draw` is what lowered graphs call.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import fx

__all__ = ["DRAWS", "draw", "draws_random_numbers", "supported"]

aten = torch.ops.aten


def _bernoulli(g, shape, dtype, device, p=0.5):
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(p, generator=g)


def _uniform(g, shape, dtype, device, low=0.0, high=1.0):
    return torch.empty(shape, dtype=dtype, device=device).uniform_(low, high, generator=g)


def _rand(g, shape, dtype, device):
    return torch.rand(shape, dtype=dtype, device=device, generator=g)


def _randn(g, shape, dtype, device):
    return torch.randn(shape, dtype=dtype, device=device, generator=g)


def _randint(g, shape, dtype, device, low, high):
    return torch.randint(low, high, shape, dtype=dtype, device=device, generator=g)


def _normal(g, shape, dtype, device, mean=0.0, std=1.0):
    return torch.normal(mean, std, shape, dtype=dtype, device=device, generator=g)


#: Random operator -> (names of its scalar arguments, the draw). Each draw's output
#: depends on the shape and dtype of the operator's output only, never on an input's
#: values, and consumes the generator exactly as the eager operator does.
DRAWS: dict[torch._ops.OpOverload, tuple[tuple[str, ...], Callable]] = {
    aten.bernoulli.p: (("p",), _bernoulli),
    aten.bernoulli_.float: (("p",), _bernoulli),
    aten.uniform.default: (("from", "to"), _uniform),
    aten.uniform_.default: (("from", "to"), _uniform),
    aten.rand.default: ((), _rand),
    aten.rand_like.default: ((), _rand),
    aten.randn.default: ((), _randn),
    aten.randn_like.default: ((), _randn),
    aten.randint.low: (("low", "high"), _randint),
    aten.randint.default: (("low", "high"), _randint),  # low defaults to 0 below
    aten.normal.float_float: (("mean", "std"), _normal),
    aten.normal_functional.default: (("mean", "std"), _normal),  # t.normal_(mean, std)
}


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether ``node`` is an op torch tags as seeded-random, other than one whose dropout
    is switched off by its arguments (attention with ``dropout_p=0``, ``train=False``)."""
    target = node.target
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    values = bound_arguments(node)
    return not (values.get("dropout_p", None) == 0 or values.get("train", None) is False)


def supported(node: fx.Node) -> bool:
    """Whether :data:`DRAWS` draws ``node``'s numbers: its operator is there, and it draws
    from the default generator (a ``generator=`` of the user's is another stream)."""
    return node.target in DRAWS and bound_arguments(node).get("generator") is None


def bound_arguments(node: fx.Node) -> dict:
    """``node``'s arguments by schema name, defaults filled in."""
    schema = node.target._schema
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    return values


def scalars(node: fx.Node) -> tuple:
    """The scalar arguments of a random ``node`` that its draw takes, in table order."""
    names, _ = DRAWS[node.target]
    values = bound_arguments(node)
    if node.target is aten.randint.default:
        values["low"] = 0
    return tuple(values[name] for name in names)


@fx.node.has_side_effect  # it advances the generator: dead code elimination keeps it
def draw(generator: torch.Generator, after, op: str, shape: Sequence[int], dtype: torch.dtype,
         params: tuple, piece: tuple[slice, ...]) -> torch.Tensor:
    """The numbers random operator ``op`` (``str`` of an entry of :data:`DRAWS`) draws for
    its global ``shape``, from ``generator``; this rank's ``piece`` of them. ``after`` is
    the previous draw of the step (unused: it orders the draws for any scheduler). A draw
    nothing reads still runs, as eager's does: the draws after it, and the next step's,
    take the numbers that follow it."""
    _, fn = _BY_NAME[op]
    whole = fn(generator, list(shape), dtype, generator.device, *params)
    return whole[piece].contiguous()


_BY_NAME = {str(op): entry for op, entry in DRAWS.items()}
