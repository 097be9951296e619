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
import torch.utils._python_dispatch
from torch import fx

from .ir import leaves, map_leaves

__all__ = ["DRAWS", "draw", "draws_random_numbers", "eager_layouts", "may_draw_permuted", "reseeds_refused",
           "supported", "traced_layouts"]

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


def _exponential(g, out, lambd=1.0):
    return out.exponential_(lambd, generator=g)


def _cauchy(g, out, median=0.0, sigma=1.0):
    return out.cauchy_(median, sigma, generator=g)


def _geometric(g, out, p):
    return out.geometric_(p, generator=g)


def _log_normal(g, out, mean=1.0, std=2.0):
    return out.log_normal_(mean, std, generator=g)


def _random(g, out):
    return out.random_(generator=g)


def _random_to(g, out, to):
    return out.random_(to, generator=g)


def _randperm(g, out, n):
    return torch.randperm(n, generator=g, out=out)


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
    aten.exponential.default: (("lambd",), _exponential),  # t.exponential_(): F.gumbel_softmax
    aten.cauchy.default: (("median", "sigma"), _cauchy),
    aten.geometric.default: (("p",), _geometric),
    aten.log_normal.default: (("mean", "std"), _log_normal),
    aten.random.default: ((), _random),  # t.random_()
    aten.random.to: (("to",), _random_to),  # t.random_(to)
    aten.randint_like.default: (("low", "high"), _randint),  # low defaults to 0 below
    aten.randint_like.low_dtype: (("low", "high"), _randint),
    aten.randperm.default: (("n",), _randperm),
}


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether ``node`` is an op torch tags as seeded-random, other than one whose draw is
    switched off by its arguments (attention with ``dropout_p=0``, ``train=False``; RReLU
    in eval mode, ``training=False``: a leaky ReLU of the mean slope)."""
    return node.op == "call_function" and _draws(node.target, node.args, node.kwargs)


def _draws(target, args, kwargs) -> bool:
    """:func:`draws_random_numbers` of a call of ``target``."""
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    values = _bound(target, args, kwargs)
    return not (values.get("dropout_p", None) == 0 or values.get("train", None) is False
                or values.get("training", None) is False)


def supported(node: fx.Node) -> bool:
    """Whether :data:`DRAWS` draws ``node``'s numbers: its operator is there, and it draws
    from the default generator (a ``generator=`` of the user's is another stream)."""
    return node.target in DRAWS and bound_arguments(node).get("generator") is None


def bound_arguments(node: fx.Node) -> dict:
    """``node``'s arguments by schema name, defaults filled in."""
    return _bound(node.target, node.args, node.kwargs)


def _bound(target, args, kwargs) -> dict:
    schema = target._schema
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update(zip((a.name for a in schema.arguments), args))
    values.update(kwargs)
    return values


def scalars(node: fx.Node) -> tuple:
    """The scalar arguments of a random ``node`` that its draw takes, in table order."""
    names, _ = DRAWS[node.target]
    values = bound_arguments(node)
    if node.target in (aten.randint.default, aten.randint_like.default):
        values["low"] = 0
    return tuple(values[name] for name in names)


#: random operators traced from an in-place fill of their first argument: ``t.uniform_()``,
#: ``t.normal_()``, ``t.bernoulli_(p)`` (the functional trace's ``bernoulli.p`` is also
#: ``torch.bernoulli(t, p)``, which eager fills row-major: :func:`_fills` tells them apart)
_FILLS_IN_PLACE = (aten.uniform.default, aten.normal_functional.default, aten.bernoulli.p, aten.exponential.default,
                   aten.cauchy.default, aten.geometric.default, aten.log_normal.default, aten.random.default,
                   aten.random.to)
#: random operators that fill ``empty_like`` of their first argument (its ``memory_format=``
#: where given): ``torch.rand_like(x)``
_FILLS_LIKE = (aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
               aten.randint_like.low_dtype)
#: random operators that make their tensor from a shape (``out=`` fills a given one)
_FACTORIES = (aten.rand.default, aten.randn.default, aten.randint.low, aten.randint.default,
              aten.normal.float_float, aten.randperm.default)
#: operators whose output is a new tensor whose values a fill of it never reads: a
#: ``bernoulli.p`` of one is ``x.new_empty(...).bernoulli_(p)`` (dropout's
#: ``empty_like(x).bernoulli_(q)``), not ``torch.bernoulli`` of a template
_FRESH = (aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
          aten.new_empty.default, aten.new_empty_strided.default, aten.zeros.default, aten.zeros_like.default,
          aten.ones.default, aten.ones_like.default, aten.full.default, aten.full_like.default,
          aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.clone.default)
#: the expanded template a traced dropout fills (no eager fill is of an expanded tensor)
_EXPANDS = (aten.expand.default, aten.expand_copy.default)


def _fills(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node | None, bool]]:
    """The random fills of ``graph`` in order, each with the tensor eager lays it out as
    (None: row-major) and whether eager fills that tensor itself (an in-place fill: its
    own strides, gaps included) or ``empty_like`` of it (``torch.rand_like``: dense, in
    its memory order). A ``bernoulli.p`` is
    - dropout's mask where it fills a 0-d ``empty`` expanded (:func:`_dropout_template`,
      the trace's form of eager's ``empty_like(activation).bernoulli_(q)``): ``empty_like``
      of the activation of its shape that a ``mul`` applies it to (through its scaling);
      of another expanded tensor, ``torch.bernoulli``'s new row-major tensor;
    - ``t.bernoulli_(p)`` of a new tensor ``t`` (``x.new_empty(...).bernoulli_(p)``), or
      of one nothing reads after it (an in-place fill replaced it);
    - ``torch.bernoulli(t, p)`` of a tensor read afterwards (itself or what it views),
      which eager fills in a new row-major tensor."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _FILLS_IN_PLACE + _FILLS_LIKE:
            continue
        template, in_place = node.args[0], node.target in _FILLS_IN_PLACE
        if node.target is aten.bernoulli.p and _dropout_template(template):
            template, in_place = _multiplied(node), False
        elif node.target is aten.bernoulli.p and template.target in _EXPANDS:
            template = None  # torch.bernoulli of an expanded tensor (vmap's dropout): a new one
        elif node.target is aten.bernoulli.p and template.target not in _FRESH and any(
                position[user] > position[node] and not (user.target is aten.copy_.default and user.args[0] is alias)
                for alias in _aliases(template) for user in alias.users):  # (copy_ into an input: an in-place fill's)
            template = None
        found.append((node, template, in_place))
    return found


def _dropout_template(node: fx.Node) -> bool:
    """Whether ``node`` is the template the trace of ``F.dropout`` fills: a 0-d ``empty``
    expanded to the activation's shape (eager fills ``empty_like(activation)``; under
    ``vmap`` the 0-d tensor is expanded twice, and eager fills a new row-major tensor)."""
    source = node.args[0] if node.target in _EXPANDS else None
    return (isinstance(source, fx.Node) and source.target is aten.empty.memory_format
            and len(source.args[0]) == 0)


def _aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and the tensors it is a view of (``*_copy`` nodes stand for views)."""
    chain = [node]
    while (chain[-1].op == "call_function" and isinstance(chain[-1].target, torch._ops.OpOverload)
           and (chain[-1].target.is_view or torch.Tag.view_copy in chain[-1].target.tags)):
        chain.append(chain[-1].args[0])
    return chain


def _multiplied(mask: fx.Node) -> fx.Node | None:
    """The activation of ``mask``'s shape that a ``mul`` applies it to, directly or
    through its scaling (dropout's ``mul(x, div(mask, q))``); None where there is none."""
    shape = tuple(mask.meta["val"].shape)
    for user in [u for d in mask.users for u in (d, *d.users)]:
        if user.target is aten.mul.Tensor and len(user.args) == 2:
            other = next((a for a in user.args if isinstance(a, fx.Node) and a is not mask
                          and a not in mask.users), None)
            if other is not None and tuple(other.meta["val"].shape) == shape:
                return other
    return None


def may_draw_permuted(gm: fx.GraphModule, view_form: Callable[[fx.Node], Callable | None]) -> bool:
    """Whether a random fill's tensor (:func:`_fills`: a dropout mask's ``empty_like`` of
    its activation, the input of ``torch.rand_like``, a slice filled by ``normal_``) may
    be laid out otherwise than row-major and contiguous in eager, which fills it in its
    memory order (and ``normal_`` by another algorithm): a cheap look that decides whether
    :func:`eager_layouts` needs to run the step eagerly. The traced graph runs
    every view as a contiguous copy (``view_form(node)``: the view a ``*_copy`` node stands
    for), so the layouts are worked out on meta tensors: a tensor traced otherwise than
    row-major as traced (an input, a convolution of channels-last weights), each view as a
    view, and each operator that reads a tensor laid out otherwise (the others' outputs are
    row-major as traced; one that fails there counts as row-major)."""
    fills = _fills(gm.graph)
    if any(fill.target in _FILLS_LIKE and fill.kwargs.get("memory_format") not in (None, torch.preserve_format)
           for fill, _, _ in fills):  # torch.randn_like(x, memory_format=torch.channels_last)
        return True
    if any(node.target in _FACTORIES and any(view_form(user) is not None for user in node.users)
           for node in gm.graph.nodes):  # torch.randn(..., out=o) of a transposed o, read through views
        return True
    filled = [template for _, template, _ in fills if template is not None]
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
        if isinstance(out, torch.Tensor) and out.shape == val.shape and out.is_contiguous() and not (
                node.target is aten.clone.default and node.kwargs.get("memory_format") == torch.contiguous_format):
            # an operator may lay out its result as its first input where the meta kernel
            # does not (masked_fill, scatter, index_add, roll of a permuted tensor, and
            # the functional forms of their in-place calls, which keep their tensor's
            # layout): assume it does, for :func:`eager_layouts` to run the real kernels
            # (any operand of a pointwise one: logaddexp(c, y.t()))
            operands = node.all_input_nodes if torch.Tag.pointwise in getattr(node.target, "tags", ()) \
                else node.args[:1]
            alike = next((metas[a] for a in operands if isinstance(metas.get(a), torch.Tensor)
                          and metas[a].shape == out.shape), None)
            if alike is not None:
                out = torch.empty_like(alike)
        if isinstance(out, torch.Tensor) and out.shape == val.shape and not out.is_contiguous():
            metas[node] = out
        elif isinstance(out, (tuple, list)) and any(not t.is_contiguous() for t in _tensors(out)):
            metas[node] = out  # its getitems follow
    return any(template in metas for template in filled)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of a node's value (one, or a tuple's)."""
    return [v for v in leaves(value) if isinstance(v, torch.Tensor)]


def _as_meta(value):
    """A traced value as meta tensors of its layouts (a tuple's too)."""
    return map_leaves(lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                      if isinstance(v, torch.Tensor) else v, value)


def eager_layouts(gm: fx.GraphModule, run: Callable[[], None]) -> dict[fx.Node, tuple[int, ...]] | None:
    """Per random draw of ``gm`` that eager makes into a tensor laid out otherwise than
    row-major and contiguous, that tensor's strides, recorded while ``run`` runs the step's
    forward eagerly on its real inputs (to its end, as a forward the user calls: code after
    the last draw may restore what it set; the default generators as they were after it):
    each random operator the eager step calls, in order, pairs with a draw of
    ``gm``, and the tensor it returns is the one it filled (an in-place fill's own,
    ``empty_like``'s of ``rand_like``, dropout's ``empty_like(activation)``, an ``out=``).
    The real kernels decide those layouts, where the fake ones differ (batch norm of a
    permuted tensor is contiguous on the CPU, ``masked_fill_`` and ``roll`` keep a permuted
    tensor's layout), and the in-place calls are in place (the trace has their functional
    forms). None where the step does not run eagerly here, or its draws do not pair."""
    draws = [n for n in gm.graph.nodes if draws_random_numbers(n)]
    recorder = _DrawRecorder()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), recorder:
            run()
    except Exception:  # noqa: BLE001 - the caller takes the trace's layouts
        return None
    if [_name(n.target) for n in draws] != [name for name, _, _ in recorder.drawn] or any(
            shape != tuple(n.meta["val"].shape) for n, (_, shape, _) in zip(draws, recorder.drawn)):
        return None  # another sequence of draws than the trace's (a branch on the grad mode, say)
    return {node: strides for node, (_, shape, strides) in zip(draws, recorder.drawn)
            if not torch.empty_strided(shape, strides, device="meta").is_contiguous()}


def _name(op) -> str:
    """A random operator's name, the same for its in-place, functional and ``out=`` forms."""
    return op._schema.name.removesuffix("_functional").rstrip("_")


class _DrawRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name (:func:`_name`), shape and strides of what each random operator call
    returns (the tensor it filled)."""

    def __init__(self):
        super().__init__()
        self.drawn = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _draws(func, args, kwargs or {}):
            value = out[0] if isinstance(out, (tuple, list)) else out
            self.drawn.append((_name(func), tuple(value.shape), tuple(value.stride())))
        return out


def traced_layouts(gm: fx.GraphModule, with_views: fx.GraphModule) -> dict[fx.Node, tuple[int, ...]]:
    """:func:`eager_layouts` where the step does not run eagerly: per random fill of ``gm``
    (:func:`_fills`), the strides of its template in ``with_views`` (the same step traced
    with its views as views, so with the fake kernels' layouts), or those ``empty_like``
    gives it (with the fill's ``memory_format=``); the fills of the two traces pair in order."""
    ours, theirs = _fills(gm.graph), _fills(with_views.graph)
    if len(ours) != len(theirs):
        return {}
    layouts = {}
    for (fill, _, _), (theirs_fill, template, in_place) in zip(ours, theirs):
        if template is None:
            continue
        val = template.meta["val"]
        laid_out = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        if not in_place:
            laid_out = torch.empty_like(laid_out, memory_format=theirs_fill.kwargs.get("memory_format")
                                        or torch.preserve_format)
        if tuple(fill.meta["val"].shape) == tuple(val.shape) and not laid_out.is_contiguous():
            layouts[fill] = tuple(laid_out.stride())
    return layouts


@fx.node.has_side_effect  # it advances the generator: dead code elimination keeps it
def draw(generator: torch.Generator, after, op: str, shape: Sequence[int], dtype: torch.dtype,
         params: tuple, piece: tuple[slice, ...], strides: tuple[int, ...] | None = None) -> torch.Tensor:
    """The numbers random operator ``op`` (``str`` of an entry of :data:`DRAWS`) draws for
    its global ``shape``, from ``generator``; this rank's ``piece`` of them. ``after`` is
    the previous draw of the step (unused: it orders the draws for any scheduler). A draw
    nothing reads still runs, as eager's does: the draws after it, and the next step's,
    take the numbers that follow it. ``strides``: those of the tensor eager fills
    (:func:`eager_layouts`), where it is not row-major and contiguous: eager's kernels fill
    in memory order, and ``normal_`` of a tensor that is not contiguous draws by another
    algorithm."""
    _, fill = _BY_NAME[op]
    whole = torch.empty_strided(shape, strides if strides is not None else torch.empty(shape, device="meta").stride(),
                                dtype=dtype, device=generator.device)
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
