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

:data:`DRAWS` is the table: operator -> (its scalar arguments, the draw, which fills a
tensor of the global shape, dtype and device, laid out as eager's). :func:`draw` is what lowered graphs call.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Sequence

import torch
import torch.cuda
import torch.random
from torch import fx

from .ir import leaves, map_leaves

__all__ = ["DRAWS", "draw", "draws_random_numbers", "eager_orders", "may_draw_permuted", "reseeds_refused",
           "supported"]

aten = torch.ops.aten


# Each draw fills ``out`` in place with the kernel eager's operator runs: torch.rand is
# ``empty(...).uniform_(0, 1)``, torch.randn ``normal_(0, 1)``, torch.randint ``random_``,
# the ``*_like`` forms the same on ``empty_like(x)``. On a tensor laid out otherwise than
# row-major the kernels fill in memory order, and ``normal_`` then takes another algorithm
# than on a contiguous one (other numbers, not only another order), so filling a tensor of
# eager's layout is what gives eager's numbers.

def _bernoulli(g, out, p=0.5):
    return out.bernoulli_(p, generator=g)


def _uniform(g, out, low=0.0, high=1.0):
    return out.uniform_(low, high, generator=g)


def _rand(g, out):
    return out.uniform_(0, 1, generator=g)


def _randn(g, out):
    return out.normal_(0, 1, generator=g)


def _randint(g, out, low, high):
    return out.random_(low, high, generator=g)


def _normal(g, out, mean=0.0, std=1.0):
    return out.normal_(mean, std, generator=g)


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
    """Whether ``node`` is an op torch tags as seeded-random, other than one whose draw is
    switched off by its arguments (attention with ``dropout_p=0``, ``train=False``; RReLU
    in eval mode, ``training=False``: a leaky ReLU of the mean slope)."""
    target = node.target
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    values = bound_arguments(node)
    return not (values.get("dropout_p", None) == 0 or values.get("train", None) is False
                or values.get("training", None) is False)


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


#: random operators whose numbers fill a tensor laid out as their first argument: eager
#: fills ``torch.rand_like(x)`` in ``empty_like(x)``'s memory order, and ``t.uniform_()``,
#: ``t.normal_()`` (traced as their functional forms) in ``t``'s own
_FILLS_LIKE_INPUT = (aten.rand_like.default, aten.randn_like.default, aten.uniform.default,
                     aten.normal_functional.default)


def _fills(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node | None]]:
    """The random fills of ``graph`` in order, each with the tensor whose memory order eager
    fills it in (None where there is none): a dropout mask (``bernoulli``) and the
    activation of its shape that a ``mul`` applies it to (through its scaling); a
    :data:`_FILLS_LIKE_INPUT` operator and its first argument."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _FILLS_LIKE_INPUT:
            found.append((node, node.args[0]))
        if node.target is not aten.bernoulli.p:
            continue
        activation = None
        for user in [u for d in node.users for u in (d, *d.users)]:
            if user.target is aten.mul.Tensor and len(user.args) == 2:
                other = next((a for a in user.args if isinstance(a, fx.Node) and a is not node
                              and a not in node.users), None)
                if other is not None and tuple(other.meta["val"].shape) == tuple(node.meta["val"].shape):
                    activation = other
                    break
        found.append((node, activation))
    return found


def may_draw_permuted(gm: fx.GraphModule, view_form: Callable[[fx.Node], Callable | None]) -> bool:
    """Whether a random fill's tensor (:func:`_fills`: a dropout mask's activation, the
    input of ``torch.rand_like``) may be laid out otherwise than row-major in eager, which
    fills it in that memory order (``empty_like``): a cheap look that
    decides whether :func:`eager_orders` needs the trace with views. The traced graph runs
    every view as a contiguous copy (``view_form(node)``: the view a ``*_copy`` node stands
    for), so the layouts are worked out on meta tensors: a tensor traced otherwise than
    row-major as traced (an input, a convolution of channels-last weights), each view as a
    view, and each operator that reads a tensor laid out otherwise (the others' outputs are
    row-major as traced; one that fails there counts as row-major)."""
    filled = [activation for _, activation in _fills(gm.graph) if activation is not None]
    if not filled:
        return False
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    last = max(position[n] for n in filled)
    metas: dict[fx.Node, object] = {}  # the nodes laid out otherwise than row-major

    def meta(x):
        if isinstance(x, fx.Node):
            if x in metas:
                return metas[x]
            val = x.meta.get("val")
            return torch.empty(val.shape, dtype=val.dtype, device="meta") if isinstance(val, torch.Tensor) else val
        if isinstance(x, (list, tuple)):
            return type(x)(meta(i) for i in x)
        return x

    for index, node in enumerate(gm.graph.nodes):
        if index > last:
            break
        val = node.meta.get("val")
        view = view_form(node)
        if node.op != "call_function" or (view is None and not any(a in metas for a in node.all_input_nodes)):
            if any(isinstance(v, torch.Tensor) and not v.is_contiguous() for v in _tensors(val)):
                metas[node] = _as_meta(val)  # as traced: an input, a convolution of channels-last weights
            continue
        attention = "scaled_dot_product" in str(node.target)
        try:
            out = (view or node.target)(*meta(node.args), **{k: meta(v) for k, v in node.kwargs.items()})
        except Exception:  # an op meta tensors do not run (or an input that is none): row-major
            if not attention:
                continue
            out = _as_meta(val)  # attention's CPU kernels have no meta form
        if isinstance(out, torch.Tensor) and node.target is aten.convolution.default and out.dim() in (4, 5):
            # on the CPU a convolution of a channels-last input is channels-last, which the
            # meta kernel does not say (the trace with views, on fake CPU tensors, does)
            out = out.contiguous(memory_format=torch.channels_last if out.dim() == 4 else torch.channels_last_3d)
        if attention and isinstance(out, (tuple, list)) and out:
            # on the CPU attention's output takes its query's layout, which the meta kernel
            # does not say (the trace with views, on fake CPU tensors, does)
            query = meta(node.args[0])
            if isinstance(query, torch.Tensor) and query.shape == out[0].shape:
                out = (torch.empty_like(query), *out[1:])
        if isinstance(out, torch.Tensor) and out.shape == val.shape and not out.is_contiguous():
            metas[node] = out
        elif isinstance(out, (tuple, list)) and any(not t.is_contiguous() for t in _tensors(out)):
            metas[node] = out  # its getitems follow
    return any(activation in metas for activation in filled)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of a node's value (one, or a tuple's)."""
    return [v for v in leaves(value) if isinstance(v, torch.Tensor)]


def _as_meta(value):
    """A traced value as meta tensors of its layouts (a tuple's too)."""
    return map_leaves(lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                      if isinstance(v, torch.Tensor) else v, value)


def eager_orders(gm: fx.GraphModule, with_views: fx.GraphModule) -> dict[fx.Node, tuple]:
    """Per random fill of ``gm`` (:func:`_fills`) that eager fills in another order than
    row-major, the dims from outermost to innermost in eager's memory: the layout
    ``empty_like`` gives its tensor in ``with_views`` (the same step traced with its views as views,
    so with eager's layouts: a permuted view, an expanded one, ``.contiguous()``), whose
    fills pair with ``gm``'s in order."""
    ours, theirs = _fills(gm.graph), _fills(with_views.graph)
    if len(ours) != len(theirs):
        return {}
    orders = {}
    for (mask, _), (_, activation) in zip(ours, theirs):
        if activation is None:
            continue
        val = activation.meta["val"]
        laid_out = torch.empty_like(torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta"))
        order = tuple(sorted(range(val.dim()), key=lambda d: (-laid_out.stride(d), d)))
        sized = [d for d in order if val.shape[d] > 1]
        if tuple(mask.meta["val"].shape) == tuple(val.shape) and sized != sorted(sized):
            orders[mask] = order
    return orders


@fx.node.has_side_effect  # it advances the generator: dead code elimination keeps it
def draw(generator: torch.Generator, after, op: str, shape: Sequence[int], dtype: torch.dtype,
         params: tuple, piece: tuple[slice, ...], order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The numbers random operator ``op`` (``str`` of an entry of :data:`DRAWS`) draws for
    its global ``shape``, from ``generator``; this rank's ``piece`` of them. ``after`` is
    the previous draw of the step (unused: it orders the draws for any scheduler). A draw
    nothing reads still runs, as eager's does: the draws after it, and the next step's,
    take the numbers that follow it. ``order``: the dims from outermost to innermost in
    the memory order eager fills (:func:`eager_orders`), where it is not row-major."""
    _, fill = _BY_NAME[op]
    if order is None:
        whole = torch.empty(shape, dtype=dtype, device=generator.device)
    else:
        whole = torch.empty([shape[d] for d in order], dtype=dtype, device=generator.device).permute(
            [order.index(d) for d in range(len(shape))])
    return fill(generator, whole, *params)[piece].contiguous()


_BY_NAME = {str(op): entry for op, entry in DRAWS.items()}


#: torch's functions that seed or set the state of its default generators (CPU and CUDA),
#: and ``fork_rng``, which restores them on exit: (module, name)
_RESEEDS = tuple((module, name) for module in (torch, torch.random)
                 for name in ("manual_seed", "seed", "set_rng_state", "fork_rng")
                 if name != "fork_rng" or module is torch.random) + tuple(
    (torch.cuda, name) for name in ("manual_seed", "manual_seed_all", "seed", "seed_all",
                                    "set_rng_state", "set_rng_state_all"))


@contextlib.contextmanager
def reseeds_refused():
    """Within (the trace of a step), a call of :data:`_RESEEDS` from the user's code or a
    model library raises :class:`UnsupportedInputError` at its line. The step draws from
    the program's generator, one stream from step to step, so eager's reseeding inside
    the forward (``torch.manual_seed``, a mask drawn twice around
    ``get_rng_state``/``set_rng_state``, noise under ``fork_rng``) would silently not
    happen: other masks than eager's. torch's own calls (``torch.utils.checkpoint``
    recomputing its call's draws, ``fork_rng``'s own) pass. A reseed these names do not see
    (``torch.default_generator.manual_seed``, ``from torch import manual_seed`` bound before)
    is refused after the trace, without its line: the default CPU generator's state moved."""
    from . import sources
    from .errors import UnsupportedInputError
    patched = []

    def refusing(module: str, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def call(*args, **kwargs):
            if sources.is_torch_file(sys._getframe(1).f_code.co_filename):
                return original(*args, **kwargs)
            raise UnsupportedInputError(
                f"the step calls {module}.{name}, which reseeds or restores torch's default "
                "generator; a compiled step draws every random number from its own generator, one "
                "stream from step to step (eager's numbers when seeded alike before compile), so "
                "it would not: seed once outside the model, before ddlc.compile, and draw a mask "
                "once and reuse the tensor instead of redrawing it from a saved state",
                where=sources.caller())
        return call

    state = torch.default_generator.get_state()  # a fake trace draws nothing from it
    try:
        for owner, name in _RESEEDS:
            original = getattr(owner, name, None)
            if original is not None:
                setattr(owner, name, refusing(owner.__name__, name, original))
                patched.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
    if not torch.equal(torch.default_generator.get_state(), state):
        torch.default_generator.set_state(state)
        raise UnsupportedInputError(
            "the step reseeded or restored torch's default generator (its state changed while the "
            "step was traced, where tracing draws nothing from it: torch.default_generator."
            "manual_seed or set_state, or a seeding function imported by name before compile); a "
            "compiled step draws every random number from its own generator, one stream from step "
            "to step, so it would not: seed once outside the model, before ddlc.compile")
