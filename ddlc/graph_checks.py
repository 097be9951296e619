"""Checks of the traced step graph: what one static program, alike on every rank, cannot
carry is refused here with its cause and the user's line (``ddlc.tracing`` runs them on
every trace): a trainable tensor read as a constant, an input written in place, a size
that depends on tensor values, operands eager would refuse for their dtypes, random
numbers ddlc cannot reproduce across ranks, draws inside a recomputed checkpoint, and a
kernel's hidden in-place write.
"""
from __future__ import annotations

import itertools
from typing import Collection, NamedTuple, Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten

from . import rng
from .errors import TraceError, UnsupportedInputError
from .fake import element_span
from .ir import ORIGIN, RECOMPUTE, STRIDED_READERS, InputSpec, where
from .sources import source_from_stack

__all__ = ["checkpointed_draws", "describe_tensors", "hidden_mutations", "no_captured_parameters",
           "no_input_mutation", "no_shared_memory", "operand_dtypes", "random_ops", "static_shapes", "strided_inputs"]


def describe_tensors(flat) -> str:
    """Tensors as error messages list them: ``float32[8, 32], int64[8]``."""
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in flat)


class _Held(NamedTuple):
    """A tensor of the step's state, for :func:`no_shared_memory`."""

    kind: str            # "parameter", "buffer" or "constant"
    what: str            # as an error message names it
    tensor: torch.Tensor
    written: bool        # whether the step writes it
    where: str | None    # where the refusal points


def no_shared_memory(gm: fx.GraphModule, model: nn.Module, trained: Collection[str],
                     updated_buffers: Collection[str]) -> None:
    """Refuse two tensors of the step's state that share elements of one storage where the
    step writes either: parameters (``trained``, by name: the update writes them), buffers
    (``updated_buffers``: the forward's in-place updates) and the tensors ``gm`` holds as
    constants (a tensor attribute or a global the step reads). Eager's in-place write of one
    moves the other: ``b = nn.Parameter(a.data[:3])``, ``register_buffer("head", full[:3])``
    with ``full`` updated, a buffer or an attribute made from a parameter's ``.data`` or
    ``.detach()``. The step holds each as a tensor of its own (a constant at its value at
    compile). The same tensor under two names (tied weights) is one tensor, and views of
    disjoint parts of one tensor share no element."""
    held: list[_Held] = []
    seen: set[int] = set()
    for kind, named, written in (("parameter", model.named_parameters(), trained),
                                 ("buffer", model.named_buffers(), updated_buffers)):
        for name, t in named:
            if id(t) not in seen:
                seen.add(id(t))
                held.append(_Held(kind, f"{kind} {name!r}", t, name in written, f"{kind} {name}"))
    for node in gm.graph.find_nodes(op="get_attr"):
        t = getattr(gm, node.target, None)
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            held.append(_Held("constant", f"a tensor {tuple(t.shape)} the step reads as a constant (an "
                              "attribute or a global)", t, False, source_from_stack(node.meta.get("stack_trace"))))
    spans: dict[tuple, list[tuple[int, int, _Held]]] = {}
    for h in held:
        t = h.tensor
        if t.layout != torch.strided or t.numel() == 0 or is_fake(t) or t.device.type == "meta":
            continue
        start = t.storage_offset() * t.element_size()
        end = start + element_span(t.shape, t.stride()) * t.element_size()
        spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((start, end, h))
    for shared in spans.values():
        for (start, end, first), (start_too, end_too, second) in itertools.combinations(shared, 2):
            if not (start < end_too and start_too < end and (first.written or second.written)):
                continue
            if first.kind == second.kind == "parameter":
                raise UnsupportedInputError(
                    f"parameters {first.what.removeprefix('parameter ')} and "
                    f"{second.what.removeprefix('parameter ')} share memory (one is a view of the other's "
                    "tensor, e.g. nn.Parameter(a.data[:3])): eager's in-place update of one changes the "
                    "other, which the compiled step, holding each as a tensor of its own, would not do; "
                    "make them separate tensors (.clone()), or compute one from the other in forward",
                    where=second.where)
            written, other = (first, second) if first.written else (second, first)
            write = "optimizer update of the parameter" if written.kind == "parameter" \
                else "in-place update of the buffer"
            raise UnsupportedInputError(
                f"{written.what} and {other.what} share memory (one is a view of the other's tensor: "
                "register_buffer('head', full[:3]), or a buffer or attribute made from a parameter's "
                f".data or .detach()): eager's {write} changes the other too, where the compiled step "
                "holds each as a tensor of its own and would leave the other as it was: make them "
                "separate tensors (.clone()), or compute one from the other when forward runs "
                "(full[:3], self.fc.weight.detach() inside forward)", where=other.where or written.where)


def no_captured_parameters(gm: fx.GraphModule, model: nn.Module, updated_buffers=frozenset(),
                           hook_sites: Sequence[str] = ()) -> None:
    """Refuse a trainable parameter the step read as a constant: a reference the forward or
    the loss took before ``compile`` (``params = list(model.parameters())`` or
    ``w = model.fc.weight`` in a closure, an optimizer's ``param_groups``), or a hook that
    reads it while the backward runs, holds the real tensor, not the step's, so a penalty
    on it would keep its value at compile and give it no gradient. (Through the model,
    ``model.parameters()`` inside the loss, it is the step's.) Likewise any other
    trainable tensor the step reads (another module's parameter: a GAN's discriminator
    called in the generator's loss), whose training the step would not see, and a buffer
    that the step updates (``updated_buffers``, by name) read so: the real buffer keeps its
    value at compile while the step's moves on (a gradient hook reading a count the
    forward increments). A constant read while the backward runs has no frame of the
    forward: the refusal then points at the first hook the forward registered
    (``hook_sites``, the user's lines)."""
    names = {id(p): k for k, p in model.named_parameters() if p.requires_grad}
    buffers = {id(b): k for k, b in model.named_buffers() if k in updated_buffers}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        at = source_from_stack(node.meta.get("stack_trace")) or (hook_sites[0] if hook_sites else None)
        if id(value) in buffers:
            raise UnsupportedInputError(
                f"the step reads buffer {buffers[id(value)]!r}, which it updates, outside the "
                "model's call (a hook registered in the forward that reads it while the backward "
                "runs, or a reference kept before compile): it would read the value at compile, "
                "where eager reads the buffer's value then. Bind the value in the forward "
                "(c = self.count.clone(); h.register_hook(lambda g: g * c))", where=at)
        name = names.get(id(value))
        if name is None and isinstance(value, torch.Tensor) and value.requires_grad:
            raise UnsupportedInputError(
                f"the step reads a trainable tensor {tuple(value.shape)} that is not the model's (a "
                "parameter of another module, e.g. a discriminator the loss calls), which it would "
                "hold as a constant of its value at compile: stale once that module trains, and "
                "without a gradient. Compile one model that holds both (a module calling each), "
                "or freeze it (requires_grad_(False)) if it never trains (a perceptual loss's network)",
                where=source_from_stack(node.meta.get("stack_trace")) or None)
        if name is not None:
            raise UnsupportedInputError(
                f"the step reads parameter {name!r} through a reference taken outside the model "
                "(a list of model.parameters() or a tensor kept before compile, or an optimizer's "
                "param_groups), or in a hook that reads it while the backward runs, which would be "
                "a constant of its value at compile with no gradient: read it through the model "
                "when the loss or forward runs (model.parameters(), model.fc.weight; for a hook, "
                "bind it in the forward: w = self.fc.weight; h.register_hook(lambda g: g * w))",
                where=at)


def no_traced_constants(gm: fx.GraphModule) -> None:
    """Refuse a constant of the graph that is a value of the trace itself (a fake tensor,
    which holds no data): a function the forward built around traced values and called
    outside them kept them (``torch.func.linearize`` in the forward returns a function
    holding its primals). No program could run it (it failed when the graph was copied
    or sent to the other ranks, with torch's traceback)."""
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor) and is_fake(value):
            raise UnsupportedInputError(
                "the step holds a value of its own trace as a constant, kept by a function the "
                "forward built and called later (torch.func.linearize's function keeps its "
                "primals), which no program can run: use torch.func.jvp at the point of use "
                "instead (out, tangent_out = torch.func.jvp(f, (x,), (v,)))",
                where=next((at for n in (node, *node.users) if (at := source_from_stack(n.meta.get("stack_trace")))),
                           None))


def no_input_mutation(gm: fx.GraphModule, inputs: Sequence[InputSpec]) -> None:
    """Refuse a step that writes one of its inputs in place, other than a buffer."""
    by_name = {i.name: i for i in inputs}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and node.args[0].op == "placeholder":
            spec = by_name.get(node.args[0].name)
            # the write-back has no source line; the operator computing the written value has
            written = node.args[1] if isinstance(node.args[1], fx.Node) else node
            at = source_from_stack(written.meta.get("stack_trace")) or None
            if spec is not None and spec.role == "param":
                how = (f" with the result of {written.target}" if written.op == "call_function"
                       and written.target is not torch.ops.aten.copy.default else "")
                raise UnsupportedInputError(
                    f"the forward writes parameter {spec.key!r} in place{how} (a clamp_, copy_ or "
                    "write to .data under no_grad, or nn.Embedding(max_norm=...) renormalizing "
                    "the rows it reads); ddlc carries in-place updates of the model's buffers "
                    "only, a parameter changes through the optimizer: compute the value where "
                    "it is read instead (`w.clamp(lo, hi)` for `w.clamp_(lo, hi)`, F.normalize "
                    "on the rows an embedding looks up), or keep the tensor in a buffer", where=at)
            raise UnsupportedInputError(
                f"the step mutates its input {node.args[0].name!r} in place (a batch tensor "
                "or a tensor captured from outside the model); ddlc carries in-place updates "
                "of the model's own buffers only", where=at)


def static_shapes(gm: fx.GraphModule) -> None:
    """Refuse a step with a tensor whose size depends on tensor values (an unbacked
    symbolic size: ``x[mask]``, ``h[mask] = v``, ``nonzero``): one static plan cannot
    split or size it; or that reads a tensor's value into Python (``.item()`` whose number
    the step computes with, traced as ``_local_scalar_dense``): a rank holds a piece of
    the tensor, not the value."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._local_scalar_dense.default and node.users:  # not a print's
            raise TraceError(
                "the step reads a tensor's value into a Python number (`.item()`, `float(t)`, "
                "`int(t)`) and computes with it, which one static graph of per-rank pieces cannot "
                "express; keep it a tensor (`t` instead of `t.item()`)", where=where(node))
        vals = [v for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        if any(isinstance(d, torch.SymInt) for v in vals for d in v.shape):
            raise TraceError(
                f"the step computes a tensor whose size depends on tensor values ({node.target}), "
                "e.g. a boolean-mask index `x[mask]` or assignment `h[mask] = v`, which one static "
                "graph cannot plan; write it with a fixed size, e.g. "
                "`h = torch.where(mask[..., None], v, h)`", where=where(node))


_aten = torch.ops.aten
#: Operators whose floating-point tensor operands eager requires to share one dtype (it
#: raises "mat1 and mat2 must have the same dtype", "expected scalar type Double but found
#: Float", ...) where the meta kernels of the fake trace do not check it and promote
#: (``bmm``, ``dot``, ``prelu`` and attention's do check: tracing fails there already).
_SAME_DTYPE = frozenset({
    _aten.mm, _aten.addmm, _aten.mv, _aten.addmv, _aten.vdot, _aten.convolution, _aten._convolution,
    _aten.nll_loss_forward, _aten.nll_loss2d_forward, _aten._embedding_bag,
    _aten._embedding_bag_forward_only,
})
#: The same on CPU, except that a bfloat16 or float16 input may meet float32 weights
#: (CUDA's kernels take mixed operands).
_SAME_DTYPE_ON_CPU = frozenset({
    _aten.native_layer_norm, _aten.native_group_norm, _aten.native_batch_norm,
    _aten._native_batch_norm_legit, _aten._native_batch_norm_legit_no_training,
})


def _refused_by_eager(packet, floats: Sequence[torch.Tensor]) -> bool:
    """Whether eager refuses ``packet`` on the floating-point operands ``floats`` (the
    operator's input first) for their mixed dtypes (see :data:`_SAME_DTYPE`)."""
    dtypes = {v.dtype for v in floats}
    if len(dtypes) < 2:
        return False
    if packet in _SAME_DTYPE:
        return True
    reduced = floats[0].dtype in (torch.bfloat16, torch.float16) and dtypes == {floats[0].dtype, torch.float32}
    return packet in _SAME_DTYPE_ON_CPU and all(v.device.type == "cpu" for v in floats) and not reduced


def operand_dtypes(gm: fx.GraphModule, batch: Sequence[torch.Tensor]) -> None:
    """Refuse an operator that eager refuses for its operands' mixed floating-point dtypes
    (:func:`_refused_by_eager`: a float64 batch into a float32 layer), which the fake
    trace lets through, so that the step would first fail when it runs, inside the per-rank
    program."""
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if packet not in _SAME_DTYPE and packet not in _SAME_DTYPE_ON_CPU:
            continue
        floats = [v for a in node.all_input_nodes if isinstance(v := a.meta.get("val"), torch.Tensor)
                  and (v.is_floating_point() or v.is_complex())]
        if _refused_by_eager(packet, floats):
            dtypes = " and ".join(dict.fromkeys(str(v.dtype).removeprefix("torch.") for v in floats))
            raise TraceError(f"the example inputs' dtypes do not fit the model: {packet.__name__} gets "
                             f"{dtypes} operands, which eager refuses (the example inputs are "
                             f"{describe_tensors(batch)}); give inputs of the model's dtype or cast them "
                             "in forward", where=where(node))


def random_ops(gm: fx.GraphModule) -> None:
    """Refuse a random op that :mod:`ddlc.rng` does not draw: one whose numbers depend on
    an input's values (``bernoulli`` of a probability tensor, ``multinomial``; ddlc.rng draws
    every random tensor for its global shape on every rank, which such an op does not
    allow), or a distribution it has no draw for."""
    for node in gm.graph.nodes:
        if rng.draws_random_numbers(node) and not rng.supported(node):
            if rng.bound_arguments(node).get("generator") is not None:
                raise UnsupportedInputError(
                    f"the step draws random numbers with {node.target} from a generator of its "
                    "own (generator=...); ddlc draws every random number of the step from the "
                    "program's generator, the same on every rank (step.generator, seeded from "
                    "the default one at compile; step.manual_seed(s)): leave generator= out",
                    where=where(node))
            raise UnsupportedInputError(
                f"the step draws random numbers with {node.target}, which ddlc does not reproduce "
                "across ranks: it keeps ranks' random numbers consistent for dropout, rand, randn, "
                "randint, randperm, normal (torch.normal of tensors too), uniform, exponential "
                "(F.gumbel_softmax), cauchy, "
                f"geometric, log-normal and random_ fills only ({', '.join(sorted(map(str, rng.DRAWS)))}); "
                "one whose numbers depend on an input's values (bernoulli of a probability tensor, "
                "multinomial, poisson) cannot be",
                where=where(node))


def checkpointed_draws(gm: fx.GraphModule, fresh: set[int]) -> None:
    """Refuse a random draw inside a checkpointed call with ``preserve_rng_state=False``:
    eager's recomputation draws new numbers there (the backward pass sees other dropout
    masks than the forward did, and the generator moves on twice), which ddlc, whose
    copies reuse the forward's draw, does not reproduce."""
    for node in gm.graph.nodes:
        if RECOMPUTE.get(node) in fresh and rng.draws_random_numbers(node):
            raise UnsupportedInputError(
                f"the step draws random numbers ({node.target}) inside a call checkpointed with "
                "preserve_rng_state=False, whose recomputation in backward draws other numbers "
                "in eager; ddlc reuses the forward's: drop preserve_rng_state=False (the "
                "default keeps the masks), or the dropout in that call",
                where=ORIGIN(node).where(node.name))


def hidden_mutations(gm: fx.GraphModule) -> None:
    """Refuse a ``native_batch_norm`` in training mode with running statistics: its CPU
    kernel updates them in place though its schema does not say so, so the traced graph
    misses that write (``F.batch_norm`` and ``F.instance_norm`` are written as reductions
    while tracing, :class:`ddlc.forward_rewrites.ForwardRewrites`; this is another way to the kernel)."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.native_batch_norm.default and node.args[5] \
                and (node.args[3] is not None or node.args[4] is not None):
            raise UnsupportedInputError(
                "the step calls a batch norm kernel in training mode with running statistics "
                "other than through F.batch_norm or F.instance_norm (torch.batch_norm, "
                "torch.native_batch_norm, ...): its in-place update of the running statistics "
                "cannot be traced; call F.batch_norm", where=where(node))


#: the operator namespaces of torch's collectives (functional ones and c10d's own)
COLLECTIVE_NAMESPACES = frozenset({"c10d", "c10d_functional", "_c10d_functional", "_c10d_functional_autograd"})


def process_group_call(what: str, where: str | None) -> UnsupportedInputError:
    """The refusal of a step that calls torch.distributed (``what``) while traced."""
    return UnsupportedInputError(
        f"the step calls {what} while ddlc traces it: ddlc compiles the single-device step and "
        "places its communication itself, so the step is traced as it runs in one process "
        "without a process group (torch.distributed.is_initialized() is False meanwhile): make "
        "the model and loss compute the single-device result without torch.distributed (a "
        "loss's world_size=1, no gather of features across ranks: ddlc's step sees the whole "
        "global batch)", where=where)


def no_collectives(gm: fx.GraphModule) -> None:
    """Refuse a collective traced into the step (a functional collective of the forward,
    which traces as an operator where nothing needs its gradient): see
    :func:`process_group_call`."""
    for node in gm.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in COLLECTIVE_NAMESPACES:
            raise process_group_call(f"the collective {node.target.name()}", where(node))


_ROLE_WORDS = {"param": "parameter", "input": "batch input"}


def strided_inputs(gm: fx.GraphModule, inputs: Sequence[InputSpec]) -> tuple[str, ...]:
    """The keys of the batch inputs that ``step()`` lays out as their examples were: every
    one where an operator reads storage through strides and an offset it is given
    (:data:`ddlc.ir.STRIDED_READERS`: ``torch.stft``, ``as_strided``, autograd's replays of
    views), none elsewhere. Such an operator reads its input as laid out at compile, and a
    batch's layout carries into what is computed from it (``x + 1`` of a transposed batch
    is transposed). A parameter or buffer it reads directly must be row-major from offset
    0 (the compiled step holds its own row-major copies of the weights), and so must an
    example input (a batch given later is copied into a tensor of its own: a view into a
    larger tensor, ``big[1:]``, has an offset no such tensor has); else refused."""
    readers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in STRIDED_READERS]
    role = {spec.name: spec for spec in inputs}
    for reader in readers:
        node = reader.args[0]
        if node.op != "placeholder":
            continue
        val, spec = node.meta["val"], role[node.name]
        if spec.role in ("param", "buffer", "input") and not (val.is_contiguous() and val.storage_offset() == 0):
            what = f"{_ROLE_WORDS.get(spec.role, spec.role)} {spec.key!r}"
            fix = "pass the example as a tensor of its own (.contiguous() of a transpose, .clone() of " \
                  "a slice)" if spec.role == "input" else "make it a row-major tensor of its own (.clone())"
            raise UnsupportedInputError(
                f"{reader.target} (torch.stft, as_strided) reads {what} through strides and an offset "
                f"taken from its layout (strides {tuple(val.stride())}, offset {val.storage_offset()}), "
                f"which is not row-major from its start: the compiled step holds such a tensor as one "
                f"of its own, and would read other elements; {fix}", where=where(reader))
    return tuple(spec.key for spec in inputs if spec.role == "input") if readers else ()
