"""The traced step, run eagerly, reproduces the eager model and torch.optim."""
import contextlib
import copy
import re

import pytest
import torch
import torch.nn.functional as F

import ddlc
from conftest import MODELS, OPTIMIZERS, assert_matches_reference, batches, model_and_loss, optimizer, train
from ddlc.errors import TraceError, UnsupportedInputError
from ddlc.optim import AdagradSpec, AdamSpec, AdamWSpec, RMSpropSpec, SGDSpec, optimizer_spec
from ddlc.zoo import GPT, MLP, lm_loss


def run_traced(gm, model, batches):
    """Run the traced step eagerly for each batch; return losses and final state."""
    sig = gm.meta["ddlc_step"]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    state = sig.init_opt_state(params)
    losses = []
    for batch in batches:
        out = sig.unflatten(gm(*sig.flatten(params, buffers, state, batch)))
        losses.append(out["loss"]["loss"])
        params.update(out["param"])
        state.update(out.get("opt_state", {}))
    return losses, params, state


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("case", sorted(MODELS))
def test_traced_step_matches_eager(case, opt_name):
    model, loss_fn = model_and_loss(case)
    eager = copy.deepcopy(model)
    data = batches(case)
    gm = ddlc.trace(model, data[0], loss_fn, optimizer(opt_name, model))
    losses, params, state = run_traced(gm, model, data)
    assert_matches_reference({"losses": losses, "params": params, "opt_state": state},
                             train(eager, loss_fn, opt_name, data), opt_state=(1e-4, 1e-6))


def test_gradients_without_optimizer_match_autograd():
    torch.manual_seed(0)
    model = GPT()
    idx, tgt = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    gm = ddlc.trace(model, (idx, tgt), lm_loss)
    sig = gm.meta["ddlc_step"]
    out = sig.unflatten(gm(*sig.flatten(dict(model.named_parameters()),
                                        dict(model.named_buffers()), {}, (idx, tgt))))
    lm_loss(model(idx), tgt).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(out["grad"][name], p.grad, rtol=1e-5, atol=1e-6)


def test_gradients_without_optimizer_leave_out_what_eager_leaves_none():
    """Without an optimizer the step's gradients are its outputs; a parameter the loss does
    not reach gets torch.func's zeros, where eager's ``.grad`` stays None: the signature
    names it (``untrained``), and ``CompiledStep.gradients`` leaves it out."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    gm = ddlc.trace(_Used(model), (x, y), F.mse_loss)
    assert gm.meta["ddlc_step"].untrained == ("model.unused.weight", "model.unused.bias")
    F.mse_loss(_Used(model)(x), y).backward()
    assert model["unused"].weight.grad is None and model["used"].weight.grad is not None


class _Used(torch.nn.Module):
    """Calls the ``used`` layer of a ModuleDict and leaves its ``unused`` one alone."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model["used"](x)


def test_forward_only_and_roles():
    model = MLP()
    x = torch.randn(8, 32)
    gm = ddlc.trace(model, x)
    sig = gm.meta["ddlc_step"]
    assert [i.role for i in sig.inputs] == ["param"] * 4 + ["input"]
    assert [o.role for o in sig.outputs] == ["output"]
    (y,) = gm(*sig.flatten(dict(model.named_parameters()), {}, {}, (x,)))
    torch.testing.assert_close(y, model(x))
    for node in gm.graph.nodes:
        assert "val" in node.meta or node.op == "output"
        assert node.meta["ddlc_origin"].phase in ("input", "forward", "optimizer")


def test_nodes_know_phase_module_and_source_line():
    model = GPT(n_layers=1)
    gm = ddlc.trace(model, (torch.randint(0, 64, (2, 16)),) * 2, lm_loss,
                    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    origins = {n.name: n.meta["ddlc_origin"] for n in gm.graph.nodes}
    phases = {o.phase for o in origins.values()}
    assert phases == {"input", "forward", "backward", "optimizer"}
    attn = [n for n in gm.graph.nodes
            if "flash_attention_for_cpu.default" in str(n.target)]
    assert origins[attn[0].name].module == "blocks.0.attn"
    assert "zoo.py" in origins[attn[0].name].source and "scaled_dot_product" in origins[attn[0].name].source
    attn_bwd = [n for n in gm.graph.nodes if "flash_attention_for_cpu_backward" in str(n.target)]
    assert origins[attn_bwd[0].name].phase == "backward"
    assert origins[attn_bwd[0].name].module == "blocks.0.attn"
    assert "scaled_dot_product" in origins[attn_bwd[0].name].source


class PreNorm(torch.nn.Module):
    """Residual blocks ``x + fc(norm(x))`` and a final norm, as LLaMA's layers."""

    def __init__(self, width=8, layers=3):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        for norm, fc in zip(self.norms, self.fcs):
            x = x + fc(norm(x))
        return self.norm(x)


def test_backward_nodes_belong_to_the_module_of_their_forward_op():
    """A backward node is attributed to the module whose forward op it differentiates,
    not to the module of the gradient it reads: the final norm's backward is its own
    layer-norm backward alone, and each linear's gradients stay in that linear."""
    model = PreNorm()
    gm = ddlc.trace(model, (torch.randn(4, 8), torch.randn(4, 8)), torch.nn.functional.mse_loss,
                    torch.optim.SGD(model.parameters(), lr=0.1))
    backward = [(n, n.meta["ddlc_origin"]) for n in gm.graph.nodes
                if n.meta.get("ddlc_origin") and n.meta["ddlc_origin"].phase == "backward"]
    in_final_norm = {str(n.target) for n, o in backward if o.module == "norm"}
    # the loss, outside any module, takes the module of what it reads, in forward and backward
    assert in_final_norm == {"aten.native_layer_norm_backward.default", "<built-in function getitem>",
                             "aten.mse_loss_backward.default", "aten.ones_like.default"}
    matmuls = [(n, o) for n, o in backward if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    assert len(matmuls) == 2 * len(model.fcs)
    assert {o.module for _, o in matmuls} == {f"fcs.{i}" for i in range(len(model.fcs))}
    norms = [o.module for n, o in backward if n.target == torch.ops.aten.native_layer_norm_backward.default]
    assert norms == ["norm", "norms.2", "norms.1", "norms.0"]


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent control flow
            return y * 2
        return y


def test_data_dependent_control_flow_names_the_line():
    with pytest.raises(TraceError, match="data-dependent") as info:
        ddlc.trace(Branchy(), torch.randn(2, 4))
    assert "test_trace.py" in str(info.value) and "if y.sum() > 0" in str(info.value)


def test_mismatched_inputs_name_the_line():
    with pytest.raises(TraceError, match="do not match|not match") as info:
        ddlc.trace(MLP(d_in=32), torch.randn(8, 31))
    assert "zoo.py" in str(info.value)


@pytest.mark.parametrize("bad", [[1, 2], "text", (torch.randn(2, 32), 3)])
def test_unsupported_inputs(bad):
    with pytest.raises(UnsupportedInputError):
        ddlc.trace(MLP(), bad)


@pytest.mark.parametrize("loss_fn,cause", [
    (lambda out, y: (out.argmax(-1) == y.argmax(-1)).sum(), "int64 loss, which has no gradient"),
    (lambda out, y: F.mse_loss(out.detach(), y), "depends on no trainable parameter"),
], ids=["count", "detached"])
def test_a_loss_without_gradient_is_refused(loss_fn, cause):
    # both traced and ran a step that trained nothing, where eager's backward() raises
    model = MLP()
    with pytest.raises(UnsupportedInputError, match=cause):
        ddlc.trace(model, (torch.randn(8, 32), torch.randn(8, 16)), loss_fn,
                   torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("trains", [True, False], ids=["trainable", "frozen"])
def test_another_modules_trainable_parameters_read_by_the_loss_are_refused(trains):
    # a GAN's generator step whose loss calls the discriminator: its parameters were
    # constants of their values at compile (stale once it trained), and the step crashed
    # in autograd at run time; a frozen network (a perceptual loss's) is a constant indeed
    torch.manual_seed(0)
    generator, critic = MLP(d_in=4, d_out=8), MLP(d_in=8, d_out=1)
    critic.requires_grad_(trains)

    def loss_fn(out, y):
        return F.binary_cross_entropy_with_logits(critic(out), y)
    with pytest.raises(UnsupportedInputError, match="trainable tensor") if trains else contextlib.nullcontext():
        ddlc.trace(generator, (torch.randn(8, 4), torch.ones(8, 1)), loss_fn,
                   torch.optim.Adam(generator.parameters()))


def test_unsupported_optimizer_and_options():
    model = MLP()
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    with pytest.raises(UnsupportedInputError, match="optimizer ASGD is not supported; use one of"):
        ddlc.trace(model, (x, y), F.mse_loss, torch.optim.ASGD(model.parameters()))
    with pytest.raises(UnsupportedInputError, match="capturable=True"):
        ddlc.trace(model, (x, y), F.mse_loss, torch.optim.NAdam(model.parameters(), capturable=True))
    with pytest.raises(UnsupportedInputError, match="dampening"):
        ddlc.trace(model, (x, y), F.mse_loss,
                   torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5))
    # a subclass with a step() of its own would be compiled as the base class's update
    class ClampingSGD(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.clamp_(-0.01, 0.01)

    with pytest.raises(UnsupportedInputError, match="ClampingSGD subclasses torch.optim.SGD with a step"):
        ddlc.trace(model, (x, y), F.mse_loss, ClampingSGD(model.parameters(), lr=0.1))

    class NamedSGD(torch.optim.SGD):  # the base's step: traced as SGD
        pass

    ddlc.trace(model, (x, y), F.mse_loss, NamedSGD(model.parameters(), lr=0.1))
    # without a loss_fn the model must compute its own loss: an MLP's (8, 16) output is not one
    with pytest.raises(UnsupportedInputError, match=r"compiled without loss_fn.*one-element"):
        ddlc.trace(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_an_optimizers_structure_names_its_update():
    """Adam turned into AdamW after compile (``decoupled_weight_decay``) is another update:
    the compiled step refuses it (it had run Adam's, silently)."""
    from ddlc.optim import structure
    opt = torch.optim.Adam(MLP().parameters(), lr=0.1, weight_decay=0.1)
    before = structure(opt)
    opt.param_groups[0]["decoupled_weight_decay"] = True
    assert structure(opt) != before
    adamw = torch.optim.AdamW(MLP().parameters(), lr=0.1, weight_decay=0.1)
    before = structure(adamw)
    adamw.param_groups[0]["decoupled_weight_decay"] = False  # torch.optim's AdamW then runs Adam's
    assert structure(adamw) != before


def test_an_initial_value_edited_after_the_state_exists_is_no_change():
    """Adagrad reads ``initial_accumulator_value`` once, when the optimizer makes its state:
    an edit after compile changes nothing torch does (it was refused as a change), while
    its weight decay turned on is another update."""
    from ddlc.optim import structure
    opt = torch.optim.Adagrad(MLP().parameters(), lr=0.1, initial_accumulator_value=0.1)
    before = structure(opt)
    opt.param_groups[0]["initial_accumulator_value"] = 0.5
    assert structure(opt) == before
    opt.param_groups[0]["weight_decay"] = 0.1
    assert structure(opt) != before


def test_node_stack_traces_match_torchs_own_capture(monkeypatch):
    """ddlc records node stack traces through a cheap stand-in for torch's capture
    (tracing._ForwardFrames): the text on every node, and so each node's user source line,
    is what torch's own capture of the whole stack gives."""
    from ddlc import tracing
    from ddlc.ir import ORIGIN
    torch.manual_seed(0)
    model = GPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8)
    tokens = torch.zeros(2, 8, dtype=torch.long)

    def traced():
        gm = ddlc.trace(model, (tokens, tokens), lm_loss, torch.optim.AdamW(model.parameters()))
        return [(n.name, n.meta.get("stack_trace"), ORIGIN.get(n)) for n in gm.graph.nodes]

    fast = traced()
    monkeypatch.setattr(tracing, "_forward_frames_only", contextlib.nullcontext)
    assert fast == traced()
    assert sum(1 for _, text, _ in fast if text) > 20
    assert any("zoo.py" in origin.source for _, _, origin in fast if origin)


def test_optimizer_state_inputs_keep_their_metadata():
    """The optimizer state is traced from uninitialised stand-ins (tracing._initial_state):
    the same shapes, dtypes, strides and devices as the optimizer's own initial state."""
    from ddlc.optim import AdamWSpec
    from ddlc.tracing import _initial_state
    param = torch.randn(3, 4).t()  # a strided parameter
    want = AdamWSpec(lr=1e-3).init_state(param)
    got = _initial_state(AdamWSpec(lr=1e-3), param)
    assert list(got) == list(want)
    for name, t in want.items():
        assert (got[name].shape, got[name].stride(), got[name].dtype, got[name].device) == \
            (t.shape, t.stride(), t.dtype, t.device)


@pytest.mark.parametrize("spec", [SGDSpec(lr=0.1, momentum=0.9), AdamSpec(lr=0.1), AdamWSpec(lr=0.1),
                                  RMSpropSpec(lr=0.1, momentum=0.9, centered=True),
                                  AdagradSpec(lr=0.1, initial_accumulator_value=0.5)],
                         ids=lambda s: type(s).__name__)
def test_every_optimizer_state_starts_at_its_initial_value(spec):
    """The contract CompiledStep relies on to make each rank's pieces of a fresh optimizer
    state without the whole: every state tensor of a parameter that has not stepped is
    filled with the spec's ``initial_value`` (zeros; Adagrad's sum its initial value)."""
    state = spec.init_state(torch.randn(3, 4))
    assert list(state) == list(spec.state_names) and state
    assert all(torch.all(t == spec.initial_value(name)) for name, t in state.items())


def test_passes_generate_no_code_until_the_program_runs():
    """A traced step is a lazy graph module: the passes' ``recompile()`` calls only mark it,
    the code is generated once when the lowered program first runs (or is printed), and
    that code is the final graph's."""
    import torch.fx as fx

    from ddlc.simulate import axis_group_names, lower_rank
    from passes.canonicalize import canonicalize
    from passes.sharding import shard

    model = MLP()
    gm = canonicalize(ddlc.trace(model, batches("mlp", 8)[0], F.mse_loss,
                                 torch.optim.AdamW(model.parameters())))
    mesh = ddlc.Mesh((1,))
    shard(gm, mesh)
    lower_rank(gm, mesh, (0,), axis_group_names(mesh))
    assert type(gm)._needs_recompile()  # marked, not generated
    expected = fx.GraphModule(gm, gm.graph).code  # what generating it now gives
    assert gm.code == expected and not type(gm)._needs_recompile()


@pytest.mark.parametrize("spec", [SGDSpec(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
                                  AdamSpec(lr=0.1, weight_decay=0.01),
                                  AdamWSpec(lr=0.1),
                                  RMSpropSpec(lr=0.1, momentum=0.9, centered=True, weight_decay=0.01),
                                  AdagradSpec(lr=0.1, lr_decay=0.01, weight_decay=0.01)],
                         ids=lambda s: type(s).__name__)
def test_updates_stamped_per_kind_equal_a_trace_of_each_parameters_update(spec):
    """ddlc.updates stamps one ``ddlc::optimizer_update`` node per parameter, and
    ``passes/expand_updates.py`` turns them into a graph that is node for node (names,
    targets, arguments, values' metadata, phase) the one tracing every parameter's update
    gives. Three parameters, two of one shape."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from ddlc.fused_update import OP
    from ddlc.updates import Update, stamp_updates
    from passes.expand_updates import expand_updates
    shapes = [(4, 3), (5,), (4, 3)]
    n_state, names = len(spec.state_names), tuple(spec.derived({k: torch.tensor(1.0) for k in spec.inputs}))
    inputs = [torch.randn(s) for s in shapes + shapes] + [torch.zeros(s) for s in shapes for _ in range(n_state)] \
        + [torch.tensor(0.5) for _ in spec.inputs]

    def unpack(flat):
        params, grads = flat[:3], flat[3:6]
        state = [dict(zip(spec.state_names, flat[6 + i * n_state:6 + (i + 1) * n_state])) for i in range(3)]
        return params, grads, state, spec.derived(dict(zip(spec.inputs, flat[6 + 3 * n_state:])))

    def each(*flat):
        params, grads, state, hp = unpack(flat)
        new = [spec.update(p, g, s, hp) for p, g, s in zip(params, grads, state)]
        return (*(p for p, _ in new), *(s[k] for _, s in new for k in spec.state_names))

    def up_to_updates(*flat):
        params, grads, state, hp = unpack(flat)
        return (*grads, *hp.values())

    def described(gm):
        return [(n.format_node(), tuple(n.meta["val"].shape), n.meta["val"].stride(), n.meta["val"].dtype)
                if n.op != "output" else n.format_node() for n in gm.graph.nodes]

    reference = make_fx(each, tracing_mode="fake")(*inputs)
    stamped = make_fx(up_to_updates, tracing_mode="fake")(*inputs)
    holders = [n for n in stamped.graph.nodes if n.op == "placeholder"]
    output = next(n for n in stamped.graph.nodes if n.op == "output")
    grads, scalars = output.args[0][:3], tuple(output.args[0][3:])
    updates = [Update(spec, holders[i], grads[i], tuple(holders[6 + i * n_state:6 + (i + 1) * n_state]),
                      names, scalars) for i in range(3)]
    traced = set(stamped.graph.nodes)
    new = stamp_updates(stamped.graph, updates, {"ddlc_phase": "optimizer", "ddlc_module": None})
    output.args = ((*(n[0] for n in new), *(s for n in new for s in n[1:])),)
    assert sum(n.target is OP for n in stamped.graph.nodes) == 3
    expand_updates(stamped)
    stamped.graph.eliminate_dead_code()
    assert described(stamped) == described(reference)
    assert all(n.meta["custom"]["ddlc_phase"] == "optimizer" for n in stamped.graph.nodes if n not in traced)


class _InPlaceOnViews(torch.nn.Module):
    """In-place updates of non-contiguous views, as Hugging Face models write them:
    DeBERTa divides a permuted projection in place (``pos_query_layer /= c``), RWKV fills
    rows of a preallocated tensor through a strided view (``out[:, t] = ...``)."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.k = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x).view(x.shape[0], 2, 2, 2).permute(0, 2, 1, 3)  # (B, 2, 2, 2), permuted
        q /= 2.0
        h = self.k(x).view(x.shape[0], 2, 4)
        out = torch.zeros_like(h)
        for t in range(h.shape[1]):
            out[:, t] = h[:, t] * (t + 1)
        return (q * q.sum(-1, keepdim=True)).sum((1, 2, 3)) + out.tanh().sum((1, 2))


def test_in_place_updates_of_views_get_eager_gradients():
    """functionalize(remove="mutations_and_views") replays such a view with the contiguous
    strides of its copy, so the gradient lands on the wrong elements (torch 2.13);
    ddlc.strided_views gives each replay the strides the trace with views records: the
    traced step's gradients equal eager autograd's. The replays are there to repair."""
    from ddlc.strided_views import needs_repair
    torch.manual_seed(0)
    model, x, y = _InPlaceOnViews(), torch.randn(6, 8), torch.randn(6)
    gm = ddlc.trace(model, (x, y), F.mse_loss)
    assert needs_repair(gm)
    sig = gm.meta["ddlc_step"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = sig.unflatten(gm(*sig.flatten(params, {}, {}, (x, y))))
    F.mse_loss(model(x), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(out["grad"][k], p.grad, rtol=1e-5, atol=1e-6)


def test_tensors_sized_by_tensor_values_are_refused():
    """A boolean-mask assignment (Wav2Vec2's SpecAugment: ``h[mask] = v``) gives its
    backward a tensor whose size depends on the mask's values: refused while tracing,
    naming the cause, rather than failing deep inside planning."""
    class MaskedFill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.embed = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.randn(8))

        def forward(self, x):
            h = self.lin(x)
            h[h[..., 0] > 0] = self.embed
            return h.mean(1)

    with pytest.raises(TraceError, match="size depends on tensor values") as info:
        ddlc.trace(MaskedFill(), (torch.randn(4, 6, 8), torch.randn(4, 8)), F.mse_loss)
    assert "test_trace.py" in str(info.value)


def test_rows_picked_by_a_per_row_mask_are_refused_as_sized_by_values():
    """X-MOD's language adapters: ``h[lang == 0]`` of a (batch, seq, hidden) activation by a
    (batch,) mask, then a linear layer. torch fails at the layer's shape check on the
    unbacked size, which the refusal called data-dependent control flow."""
    class Adapters(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x, lang):
            h = self.a(x)
            out = torch.zeros_like(h)
            out[lang == 0] = self.b(h[lang == 0])
            return out.sum(-1)

    with pytest.raises(TraceError, match=r"size depends on tensor values \(a boolean-mask index"):
        ddlc.trace(Adapters(), (torch.randn(8, 4, 8), torch.randint(0, 2, (8,)), torch.randn(8, 4)), F.mse_loss)


def test_a_mean_over_a_boolean_mask_is_refused_naming_the_mask():
    """``loss[mask].mean()``: the mean's gradient needs the masked size as a number, and
    torch fails inside autograd ("SymIntArrayRef expected to contain only concrete
    integers"); the refusal names the boolean mask and the fixed-size rewrite, and the
    user's line of the forward op whose gradient failed (torch's frames alone are on the
    stack then)."""
    mask = torch.tensor([1, 0, 0, 1], dtype=torch.bool)

    def masked_loss(out, y):
        return F.cross_entropy(out, y, reduction="none")[mask].mean()
    with pytest.raises(TraceError, match=r"boolean-mask index .*torch\.where\(mask, loss, 0\)") as info:
        ddlc.trace(torch.nn.Linear(6, 3), (torch.randn(4, 6), torch.randint(0, 3, (4,))), masked_loss)
    assert "test_trace.py" in str(info.value) and "[mask].mean()" in str(info.value)


@pytest.mark.parametrize("style", ["ctx", "setup_context"])
def test_a_custom_autograd_function_is_refused_with_its_cause(style):
    """A custom autograd.Function, old style (forward takes ``ctx``, Bloom's GeLU: it cannot
    run under the torch.func transforms) or new (a separate ``setup_context``: torch's
    functionalization has no rule for it, "NYI: Functionalize rule for
    custom_function_call"), is refused as such, at the user's line, with the plain-tensor
    rewrite as the fix."""
    if style == "ctx":
        class STE(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return torch.round(x)

            @staticmethod
            def backward(ctx, grad):
                return grad
    else:
        class STE(torch.autograd.Function):
            @staticmethod
            def forward(x):
                return torch.round(x)

            @staticmethod
            def setup_context(ctx, inputs, output):
                pass

            @staticmethod
            def backward(ctx, grad):
                return grad

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return STE.apply(self.lin(x))

    with pytest.raises(UnsupportedInputError, match="custom torch.autograd.Function") as info:
        ddlc.trace(Model(), (torch.randn(2, 4), torch.randn(2, 4)), F.mse_loss)
    assert "plain tensor operations" in str(info.value) and "test_trace.py" in str(info.value)


def test_a_torch_distributions_sample_through_torchs_own_function_is_refused_with_its_fix():
    """A Beta sample (a mixup coefficient) runs torch's own ``_Dirichlet`` Function: the
    refusal told the user to rewrite their custom Function, which they do not have."""
    class Mixup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            lam = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4), validate_args=False).sample()
            return self.lin(x * lam + x.flip(0) * (1 - lam))

    with pytest.raises(UnsupportedInputError, match=r"torch's own autograd.Function torch.distributions"
                                                    r".dirichlet._Dirichlet .*draw the number with torch.rand") as info:
        ddlc.trace(Mixup(), (torch.randn(2, 4), torch.randn(2, 4)), F.mse_loss)
    assert "test_trace.py" in str(info.value) and "Beta(" in str(info.value)


def _linear_pair():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("hook", ["tensor", "post_accumulate", "module_backward", "module_backward_pre"])
def test_hooks_on_gradients_are_refused(hook):
    """Hooks that autograd runs on gradients would not run in the traced step (eager gives
    other numbers with them): refused naming the parameter or module. Forward hooks and
    hooks on activations are traced (``test_forward_hooks_are_traced``)."""
    model = _linear_pair()
    if hook == "tensor":
        model[2].weight.register_hook(lambda g: g * 0.5)
    elif hook == "post_accumulate":
        model[2].weight.register_post_accumulate_grad_hook(lambda p: None)
    elif hook == "module_backward":
        model[2].register_full_backward_hook(lambda m, gi, go: None)
    else:
        model[2].register_full_backward_pre_hook(lambda m, go: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedInputError) as info:
        ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 2)), F.mse_loss, opt)
    assert ("parameter '2.weight'" if hook in ("tensor", "post_accumulate") else "module 2 (Linear)") \
        in str(info.value)


def test_forward_hooks_are_traced():
    """A forward hook that changes the output, a pre-hook that changes the input and a hook
    on an activation's gradient run inside the traced step, as in eager."""
    model = _linear_pair()
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model[2].register_forward_hook(lambda m, args, out: out + 1)

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            h = self.inner[0](x)
            h.register_hook(lambda g: g * 3)
            return self.inner[2](self.inner[1](h))

    net = Scaled()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    gm = ddlc.trace(net, (x, y), F.mse_loss)
    loss, *grads = gm(*[p.detach() for p in net.parameters()], x, y)
    F.mse_loss(net(x), y).backward()
    assert float(loss) == pytest.approx(float(F.mse_loss(net(x), y).detach()), rel=1e-6)
    for got, p in zip(grads, net.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)


class _Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) / self.calls


class _KeptTensor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.scale = torch.ones(2)

    def forward(self, x):
        self.scale = self.scale * 1.5
        return self.lin(x) * self.scale


class _ReassignedBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.register_buffer("last", torch.zeros(2))

    def forward(self, x):
        out = self.lin(x) + self.last
        self.last = out.detach().mean(0)
        return out


@pytest.mark.parametrize("cls, said", [(_Counter, "changes calls (0 -> 1)"),
                                       (_KeptTensor, "changes scale (a tensor of shape (2,)"),
                                       (_ReassignedBuffer, "assigns buffer 'last' a new tensor")])
def test_state_the_forward_keeps_across_calls_is_refused(cls, said):
    """State the forward keeps by assignment (a Python counter, a tensor attribute, a
    buffer given a new tensor) would keep its value at compile in every step, where eager
    moves it on each call: refused at the assignment's line, and the module keeps the
    attribute it had (not a traced value). Buffers updated in place are carried."""
    torch.manual_seed(0)
    model = cls()
    before = dict(vars(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedInputError, match=re.escape(said)) as info:
        ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 2)), F.mse_loss, opt)
    assert "test_trace.py" in str(info.value) and "self." in str(info.value)
    assert all(vars(model)[k] is v for k, v in before.items()) and vars(model).keys() == before.keys()


class _SettingBeforeReading(torch.nn.Module):
    """Sets attributes at the start of forward and reads them after, as BigBird switches
    to full attention on short sequences and Funnel keeps its pooling bookkeeping."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.attention_type = "block_sparse"
        self.pooling_mult = None

    def forward(self, x):
        if x.shape[0] < 16:
            self.attention_type = "original_full"
        self.pooling_mult = 1
        out = self.lin(x)
        self.pooling_mult *= 2
        return out * self.pooling_mult if self.attention_type == "original_full" else out


def test_settings_the_forward_makes_before_reading_them_are_not_state():
    """A setting a second call of the forward leaves as the first did is not state: traced,
    and it keeps the value the forward gave it, as in eager."""
    torch.manual_seed(0)
    model = _SettingBeforeReading()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 2)), F.mse_loss, opt)
    assert model.attention_type == "original_full" and model.pooling_mult == 2


class _RebuildsOnFirstCall(torch.nn.Module):
    """Replaces a layer on its first call, as BigBird does when it switches to full
    attention (the new layer's construction draws random numbers, once in eager)."""

    def __init__(self):
        super().__init__()
        self.attention = torch.nn.Identity()
        self.lin = torch.nn.Linear(4, 2)
        self.mode = "sparse"

    def forward(self, x):
        if self.mode == "sparse":
            self.mode = "full"
            self.attention = torch.nn.Dropout(0.0)  # a new submodule
        return self.lin(self.attention(x))


def test_a_forward_that_changes_the_model_itself_is_refused_until_called_once():
    """A forward that replaces a submodule on its first call would repeat that call's work
    (and its random draws) at every step: refused naming the submodule, with the model
    given back what it had; after one eager call, compile traces the calls that follow."""
    torch.manual_seed(0)
    model = _RebuildsOnFirstCall()
    identity = model.attention
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(8, 4), torch.randn(8, 2))
    with pytest.raises(UnsupportedInputError, match=r"a submodule of the model \(attention\) was replaced") as info:
        ddlc.trace(model, batch, F.mse_loss, opt)
    assert "call the model once" in str(info.value)
    assert model.attention is identity and model.mode == "sparse"
    with torch.no_grad():
        model(batch[0])
    ddlc.trace(model, batch, F.mse_loss, opt)


def test_a_lazy_module_is_refused_until_called_once():
    """A lazy module's parameters have no shape before its first call: refused naming it
    (not torch's ValueError from inside the trace); after one call it traces."""
    model = torch.nn.Sequential(torch.nn.LazyLinear(2))
    batch = (torch.randn(8, 4), torch.randn(8, 2))
    with pytest.raises(UnsupportedInputError, match="0.weight is not initialised yet .*lazy module"):
        ddlc.trace(model, batch, F.mse_loss)
    with torch.no_grad():
        model(batch[0])
    ddlc.trace(model, batch, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_model_or_example_input_on_the_meta_device_is_refused_naming_it():
    """A model built on meta (``ddlc plan`` of a factory that builds it so) failed inside
    torch's fake tensors with a device clash; refused naming the tensor."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 2)
    with pytest.raises(UnsupportedInputError, match="weight is on the meta device"):
        ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 2)), F.mse_loss)
    with pytest.raises(UnsupportedInputError, match="example input input1 is on the meta device"):
        ddlc.trace(torch.nn.Linear(4, 2), (torch.randn(8, 4), torch.randn(8, 2, device="meta")), F.mse_loss)


def test_a_model_wrapped_for_distribution_or_by_torch_compile_is_refused_naming_the_wrapper():
    """ddlc takes the plain single-device module: a module inside a DDP, DataParallel,
    fully_shard or torch.compile wrapper, or holding DTensor parameters, is refused naming
    the wrapper (or the parameter) and what to pass instead, by ``trace`` and by
    ``ddlc.compile`` before any collective (it crashed deep inside torch, or failed at the
    first step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def plain():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    batch = (torch.randn(8, 4), torch.randn(8, 2))

    def refused(model, match):
        with pytest.raises(UnsupportedInputError, match=match):
            ddlc.trace(model, batch, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(UnsupportedInputError, match=match):  # no process group needed
            ddlc.compile(model, (4,), batch, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))

    refused(torch.compile(plain()), r"the model is wrapped by torch.compile: pass the module "
                                    r"before torch.compile \(model._orig_mod\)")
    nested = plain()
    nested[2] = torch.compile(nested[2])
    refused(nested, r"module 2 is wrapped by torch.compile")
    refused(torch.nn.DataParallel(plain()), r"the model is wrapped by DataParallel: pass the module it "
                                            r"wraps \(model.module\)")
    scripted = plain()
    scripted[2] = torch.jit.script(scripted[2])  # its state was read as a module's (AttributeError)
    refused(scripted, r"module 2 is wrapped by TorchScript")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = plain()  # a sparse buffer failed in the broadcast of rank 0's state
        model.register_buffer("adjacency", torch.eye(4).to_sparse())
        with pytest.raises(UnsupportedInputError, match="buffer adjacency is a sparse_coo tensor"):
            ddlc.compile(model, (4,), batch, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(UnsupportedInputError, match="example input 0 is a sparse_coo tensor"):
            ddlc.compile(plain(), (4,), (batch[0].to_sparse(), batch[1]), F.mse_loss)
        refused(torch.nn.parallel.DistributedDataParallel(plain()), "the model is wrapped by DistributedDataParallel")
        mesh = init_device_mesh("cpu", (4,))
        refused(fully_shard(plain(), mesh=mesh), r"wrapped by fully_shard \(FSDP2\)")
        model = plain()
        model[0].weight = torch.nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Replicate()]))
        refused(model, r"0.weight is a DTensor .*already distributed")
    finally:
        dist.destroy_process_group()
    ddlc.trace(plain(), batch, F.mse_loss)


def test_recomputed_attributes_are_not_state():
    """Attributes the forward recomputes from parameters before reading them (the old
    ``torch.nn.utils.spectral_norm``/``weight_norm``'s ``weight``) and lists torch's modules
    refresh when their parameters are set (``nn.LSTM``'s) are not refused."""
    torch.manual_seed(0)
    norm = torch.nn.Sequential(torch.nn.utils.spectral_norm(torch.nn.Linear(4, 8)),
                               torch.nn.utils.weight_norm(torch.nn.Linear(8, 2)))

    class LSTM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 2, batch_first=True)

        def forward(self, x):
            return self.rnn(x[:, None])[0][:, 0]

    for model in (norm, LSTM()):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 2)), F.mse_loss, opt)


def test_a_saved_tensor_hook_is_refused_as_such():
    """Activation offloading (``torch.autograd.graph.save_on_cpu``, a saved-tensor hook)
    cannot run under the torch.func transforms: refused naming the hook, at the user's
    line (activation checkpointing is traced: tests/test_recompute.py)."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            with torch.autograd.graph.save_on_cpu():
                return self.lin(x).relu()

    with pytest.raises(UnsupportedInputError, match="saved-tensor hook") as info:
        ddlc.trace(Model(), (torch.randn(2, 4), torch.randn(2, 4)), F.mse_loss)
    assert "test_trace.py" in str(info.value)


class _Embedder(torch.nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.emb, self.fc = torch.nn.Embedding(20, 8, **options), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.emb(x)).mean(1)


@pytest.mark.parametrize("options, cause", [
    ({"sparse": True}, "sparse=True: ddlc trains with dense gradients only"),
    ({"max_norm": 1.0}, "the forward writes parameter 'emb.weight' in place")],
    ids=["sparse", "max_norm"])
def test_embedding_options_ddlc_cannot_carry_are_refused_with_their_cause(options, cause):
    """A sparse gradient failed deep inside the update's trace (addcmul on SparseCPU); an
    embedding's max_norm renormalizes its weight in place in forward, which was refused as
    a mutated "batch tensor or captured tensor". Each names the module or the line."""
    model = _Embedder(**options)
    with pytest.raises(UnsupportedInputError, match=re.escape(cause)) as info:
        ddlc.trace(model, (torch.randint(0, 20, (8, 5)), torch.randn(8, 3)), F.mse_loss,
                   torch.optim.SGD(model.parameters(), lr=0.1))
    assert "emb" in str(info.value).split("\n  at ")[1]  # the module, or the line calling it


def test_an_operator_without_a_static_shape_rule_is_named():
    """F.ctc_loss's ``aten._ctc_loss`` has no static output shape under fake tensors: refused
    as such at the user's line, not as inputs that "may not match"."""
    def loss(out, target):
        return F.ctc_loss(out, target, torch.full((8,), 10), torch.full((8,), 3))

    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LogSoftmax(-1))
    with pytest.raises(UnsupportedInputError, match="output size torch cannot tell") as info:
        ddlc.trace(model, (torch.randn(10, 8, 6), torch.randint(1, 6, (8, 3))), loss,
                   torch.optim.SGD(model.parameters(), lr=0.1))
    assert "the step calls aten._ctc_loss.Tensor, an operator" in str(info.value)
    assert "test_trace.py" in str(info.value)


def test_the_operator_without_a_static_shape_rule_is_the_one_named():
    """``torch.linalg.lstsq`` on the CPU has no static output shape either: its refusal named
    ``aten._ctc_loss`` (the message's example) before the operator itself."""
    class Solved(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.linalg.lstsq(self.lin(x), x).solution

    with pytest.raises(UnsupportedInputError, match=r"^the step calls aten\.linalg_lstsq\.default, an operator"):
        ddlc.trace(Solved(), (torch.randn(6, 4),))


def test_a_gradient_penalty_on_the_input_is_refused_with_the_cause():
    """``x.requires_grad_()`` then ``autograd.grad(..., x)`` inside forward (a gradient
    penalty on the input batch): only parameters carry gradients in ddlc's trace, so it
    is refused naming the cause and the fix (a penalty on an activation traces)."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            x = x.detach().requires_grad_(True)
            y = self.lin(x).tanh()
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            return y + g.pow(2).mean()

    model = Model()
    with pytest.raises(UnsupportedInputError, match="gradient penalty on the input") as info:
        ddlc.trace(model, (torch.randn(2, 4), torch.randn(2, 4)), F.mse_loss,
                   torch.optim.SGD(model.parameters(), lr=0.1))
    assert "test_trace.py" in str(info.value)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.9)),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True, weight_decay=0.1),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2, maximize=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2, amsgrad=True, maximize=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.9), amsgrad=True),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, maximize=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1, maximize=True),
    lambda ps: torch.optim.Adadelta(ps, lr=0.5, weight_decay=0.1),
    lambda ps: torch.optim.Adadelta(ps, maximize=True),
    lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adamax(ps, lr=1e-2, maximize=True),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, momentum_decay=0.1),
    lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.RAdam(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, decoupled_weight_decay=True,
                                 maximize=True),
], ids=["sgd-nesterov", "adam-l2", "adamw", "rmsprop", "rmsprop-centered-momentum", "adagrad", "adagrad-decay",
        "sgd-maximize", "adam-amsgrad-maximize", "adamw-amsgrad", "rmsprop-maximize", "adagrad-maximize",
        "adadelta", "adadelta-maximize", "adamax", "adamax-maximize", "nadam", "nadam-decoupled", "radam",
        "radam-decoupled-maximize"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=["real", "complex"])
def test_each_update_equals_torch_optims(make, dtype):
    """Every spec's update (:meth:`OptimizerSpec.apply`, the hyper-parameters as float64
    0-d tensors, as the step takes them) gives torch.optim's single-tensor update,
    parameter and state, over ten steps: within a rounding step for SGD and Adam (whose
    graphs fuse some products otherwise), bit for bit for RMSprop and Adagrad on real
    parameters. A complex parameter is updated as its real and imaginary parts, as
    torch.optim updates it (its weight decay in complex arithmetic: within a rounding step)."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5, 3, dtype=dtype))
    opt = make([param])
    spec = optimizer_spec(opt, {"p": param})["p"][1]
    mine = param.detach().clone()
    state = {k: v.clone() for k, v in opt.state[param].items()} or spec.init_state(mine)
    hp = spec.derived({k: torch.tensor(float(v), dtype=torch.float64)
                       for k, v in type(spec).group_values(opt.param_groups[0]).items()})
    for _ in range(10):
        grad = torch.randn(5, 3, dtype=dtype)
        param.grad = grad.clone()
        opt.step()
        mine, state = spec.apply(mine, grad, state, hp)
        exact = isinstance(spec, (RMSpropSpec, AdagradSpec)) and not dtype.is_complex
        tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine, param.detach(), **tolerance)
        assert set(state) == set(opt.state[param])
        for name, value in opt.state[param].items():
            torch.testing.assert_close(state[name].to(value.dtype), value, **tolerance, msg=name)


def test_nadams_product_of_momenta_rounds_as_torch_optims():
    """torch.optim's NAdam multiplies its float32 ``mu_product`` in place by a Python
    float, which rounds the factor to float32 first; the spec multiplied in float64 and
    rounded once, 1-2 ulp off from the second step (round AB). Bit for bit over 60 steps."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.NAdam([param], lr=1e-2, momentum_decay=0.1)
    spec = optimizer_spec(opt, {"p": param})["p"][1]
    state = spec.init_state(param.detach())
    hp = spec.derived({k: torch.tensor(float(v), dtype=torch.float64)
                       for k, v in type(spec).group_values(opt.param_groups[0]).items()})
    for _ in range(60):
        grad = torch.randn(3)
        param.grad = grad.clone()
        opt.step()
        _, state = spec.apply(param.detach(), grad, state, hp)
        assert torch.equal(state["mu_product"], opt.state[param]["mu_product"])


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_scalar_optimizer_state_has_torch_optims_dtype(default):
    """torch.optim makes its scalar state (step counts, NAdam's product of momenta) float64
    where float64 is the default dtype, else float32; the specs made it float32 always."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        param = torch.nn.Parameter(torch.randn(3))
        for opt in (torch.optim.NAdam([param]), torch.optim.Adam([param]), torch.optim.Adagrad([param])):
            param.grad = torch.randn(3)
            opt.step()
            spec = optimizer_spec(opt, {"p": param})["p"][1]
            made = spec.init_state(param.detach())
            assert {k: v.dtype for k, v in made.items()} == {k: v.dtype for k, v in opt.state[param].items()}
    finally:
        torch.set_default_dtype(saved)


def test_torch_func_linearize_in_the_forward_is_refused_with_the_fix():
    """``torch.func.linearize``'s function keeps its primals, fake tensors of the trace,
    which became constants of the graph: ddlc.compile then failed copying or sending the
    graph, with torch's traceback. Refused when traced, pointing at torch.func.jvp."""

    def linearized(f, h):
        out, push = torch.func.linearize(f, h)
        return out + 0.1 * push(h)

    model = _TransformInForward(linearized)
    with pytest.raises(UnsupportedInputError, match="linearize.*torch.func.jvp"):
        ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 4)), F.mse_loss,
                   torch.optim.SGD(model.parameters(), lr=0.1))


class _TransformInForward(torch.nn.Module):
    """A linear layer, then ``transform(f, h)`` of a small function ``f`` of its output."""

    def __init__(self, transform):
        super().__init__()
        self.transform = transform
        self.a, self.f = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())

    def forward(self, x):
        return self.transform(self.f, self.a(x))


def test_an_inference_program_taking_autograd_grad_of_its_input_is_refused_with_the_fix():
    """An inference program whose forward takes ``torch.autograd.grad`` of an energy with
    respect to its marked input (forces) failed with torch's 'does not require grad'
    message; the refusal names the cause and torch.func.grad, which traces."""

    class Energy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def forward(self, x):
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                (g,) = torch.autograd.grad(self.net(x).sum(), x)
            return -g

    with pytest.raises(UnsupportedInputError, match="torch.func.grad") as info:
        ddlc.trace(Energy(), (torch.randn(8, 4),))
    assert "test_trace.py" in str(info.value)


def test_torch_autograd_functional_in_the_forward_is_refused_naming_torch_func():
    """``torch.autograd.functional.vjp`` (hvp, jacobian...) marks its inputs with
    ``requires_grad_()``, which the transforms refuse; the refusal names the API and
    torch.func's own transforms (it was torch's message alone, wrapped in a TraceError)."""

    def vjp_term(f, h):
        _, v = torch.autograd.functional.vjp(f, h, torch.ones_like(h), create_graph=True)
        return h + v

    model = _TransformInForward(vjp_term)
    with pytest.raises(UnsupportedInputError, match=r"torch.autograd.functional \(vjp.*torch.func.vjp") as info:
        ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 4)), F.mse_loss,
                   torch.optim.SGD(model.parameters(), lr=0.1))
    assert "test_trace.py" in str(info.value)
