"""passes/inplace.py: the optimizer update writes into its inputs and temporaries only
where nothing reads them afterwards, and the numbers stay those of the functional update."""
from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

import ddlc
from ddlc import pipeline
from conftest import OPTIMIZERS, assert_matches_reference, batches, model_and_loss, train
from ddlc.ir import ORIGIN, STEP, Origin
from ddlc.options import CompileOptions
from ddlc.simulate import lower_ranks, simulate_steps
from passes.inplace import inplace_form, update_in_place

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def test_inplace_forms_come_from_the_operator_tables():
    assert inplace_form(aten.mul.Tensor) is aten.mul_.Tensor
    assert inplace_form(aten.lerp.Scalar) is aten.lerp_.Scalar
    assert inplace_form(aten.addcmul.default) is aten.addcmul_.default
    assert inplace_form(aten.sqrt.default) is aten.sqrt_.default
    assert inplace_form(aten.rsub.Scalar) is None      # no in-place form
    assert inplace_form(aten.mm.default) is None       # not pointwise
    assert inplace_form(aten.view.default) is None
    assert inplace_form(aten.mul_.Tensor) is None      # already in place


def _update_graph(build) -> tuple[fx.GraphModule, set[str]]:
    """A hand-made graph whose operators are all of the optimizer update, and the names of
    the nodes expected in place: ``build(graph, x, expected)`` adds nodes after the
    placeholder ``x`` (an undonated input), appends the expected ones to ``expected`` and
    returns the outputs."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 3)
    expected: list[fx.Node] = []
    outputs = build(graph, x, expected)
    graph.output(tuple(outputs))
    for node in graph.nodes:
        if node.op == "call_function":
            ORIGIN.set(node, Origin("optimizer", ""))
            if node.target is not c10d.wait_tensor.default and "val" not in node.meta:
                node.meta["val"] = torch.empty(4, 3)
    return fx.GraphModule(torch.nn.Module(), graph), {n.name for n in expected}


def _check(gm: fx.GraphModule, in_place: set[str]):
    """Run ``gm``, rewrite it, run it again on a fresh copy of the same input: the same
    outputs, the input untouched, and exactly the nodes ``in_place`` rewritten."""
    x = torch.randn(4, 3)
    want = gm(x.clone())
    update_in_place(gm)
    rewritten = {n.name for n in gm.graph.nodes if n.op == "call_function"
                 and getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable}
    assert rewritten == in_place
    given = x.clone()
    got = gm(given)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(given, x, rtol=0, atol=0)   # not donated: never written


def test_a_temporary_read_later_is_not_overwritten():
    def build(g, x, expected):
        t = g.call_function(aten.mul.Tensor, (x, 2.0))            # fresh
        u = g.call_function(aten.add.Tensor, (t, 1.0))            # t still read by v: a copy
        v = g.call_function(aten.mul.Tensor, (t, 3.0))            # t's last reader: in place
        w = g.call_function(aten.abs.default, (v,))               # v read by the output: a copy
        expected.append(v)
        return [u, v, w]
    _check(*_update_graph(build))


def test_an_input_that_is_not_donated_is_never_written():
    def build(g, x, expected):
        return [g.call_function(aten.mul.Tensor, (x, 2.0))]
    _check(*_update_graph(build))


@pytest.mark.parametrize("wait_first", [False, True])
def test_a_collective_reads_its_input_until_its_wait(wait_first):
    def build(g, x, expected):
        t = g.call_function(aten.mul.Tensor, (x, 2.0))
        issued = g.call_function(c10d.all_reduce.default, (t, "sum", "group"))
        if wait_first:
            waited = g.call_function(c10d.wait_tensor.default, (issued,))
        u = g.call_function(aten.add.Tensor, (t, 1.0))   # in place only once t has landed
        if not wait_first:
            waited = g.call_function(c10d.wait_tensor.default, (issued,))
        if wait_first:
            expected.append(u)
        return [u, waited]
    gm, expected = _update_graph(build)
    update_in_place(gm)
    assert {n.name for n in gm.graph.nodes if n.op == "call_function"
            and n.target._schema.is_mutable} == expected


@pytest.mark.parametrize("input_kind", ["packed", "temporary", "undonated input", "read after"])
def test_an_all_reduce_sums_into_an_input_nothing_else_reads(input_kind):
    """The functional all-reduce copies its input before reducing; a temporary made for
    it (a bucket's packed gradients) takes the sum in place instead: ``all_reduce_``, with
    its ``ir.COLLECTIVE`` kept. Not so for an input the program may not write, nor for one
    read after the collective's wait."""
    from ddlc.ir import COLLECTIVE, CollectiveInfo, collective_kind
    from ddlc.sbp import NdSBP, P
    from passes.fuse import pack

    def build(g, x, expected):
        source = x if input_kind == "undonated input" else g.call_function(aten.mul.Tensor, (x, 2.0))
        if input_kind == "packed":  # a bucket: passes.fuse.pack, a torch.cat
            source = g.call_function(pack, ("all_reduce", [source, g.call_function(aten.neg.default, (x,))], 4))
        issued = g.call_function(c10d.all_reduce.default, (source, "sum", "group"))
        waited = g.call_function(c10d.wait_tensor.default, (issued,))
        if input_kind in ("packed", "temporary"):
            expected.append(issued)
        outputs = [waited]
        if input_kind == "read after":  # the last reader of the temporary: abs_ instead
            outputs.append(g.call_function(aten.abs.default, (source,)))
            expected.append(outputs[-1])
        return outputs
    gm, expected = _update_graph(build)
    issued = next(n for n in gm.graph.nodes if n.target is c10d.all_reduce.default)
    info = CollectiveInfo("all_reduce", 0, "dp", 4, 48, 1e-6, NdSBP((P,)), NdSBP.broadcast(1))
    COLLECTIVE.set(issued, info)
    update_in_place(gm)
    assert {n.name for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable} == expected
    assert COLLECTIVE(issued) is info and collective_kind(issued) == "all_reduce"
    in_place = input_kind in ("packed", "temporary")
    assert issued.target is (c10d.all_reduce_.default if in_place else c10d.all_reduce.default)


def test_a_view_read_later_keeps_its_memory_unwritten():
    def build(g, x, expected):
        t = g.call_function(aten.mul.Tensor, (x, 2.0))
        view = g.call_function(aten.view.default, (t, [12]))
        view.meta["val"] = torch.empty(12)
        u = g.call_function(aten.add.Tensor, (t, 1.0))            # the view is read after: a copy
        return [u, view]
    _check(*_update_graph(build))


def test_a_composite_operator_may_return_its_input():
    def build(g, x, expected):
        t = g.call_function(aten.mul.Tensor, (x, 2.0))
        same = g.call_function(aten.to.dtype, (t, torch.float32))   # returns t itself
        u = g.call_function(aten.add.Tensor, (t, 1.0))            # `same` is read after: a copy
        return [u, same]
    _check(*_update_graph(build))


def test_an_argument_in_the_same_memory_is_not_written_while_read():
    def build(g, x, expected):
        t = g.call_function(aten.mul.Tensor, (x, 2.0))
        row = g.call_function(aten.select.int, (t, 0, 0))        # a view of t's first row
        row.meta["val"] = torch.empty(3)
        return [g.call_function(aten.add.Tensor, (t, row))]        # t + its own row: a copy
    _check(*_update_graph(build))


def _lowered(model_name: str, optimizer: str, mesh: ddlc.Mesh, **options):
    model, loss = model_and_loss(model_name)
    data = batches(model_name)
    opt = OPTIMIZERS[optimizer](model.parameters())
    gm = pipeline.trace_step(model, data[0], loss, opt, CompileOptions.from_kwargs(**options))
    pipeline.plan(gm, mesh, CompileOptions(), {})
    return model, data, gm


def _storage_root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target._schema.is_mutable:
        node = node.args[0]
    return node


def test_an_adamw_update_writes_into_its_parameters_and_state():
    """On one device, each parameter's new value, and its new moments, are written into
    the input's own memory; what the update still allocates is about two tensors of the
    parameter's size (sqrt of the second moment, the step's quotient), not ten."""
    model, _, gm = _lowered("mlp", "adamw", ddlc.Mesh((1,)))
    (program,) = lower_ranks(gm, ddlc.Mesh((1,)))
    sig = STEP(program)
    output = next(n for n in program.graph.nodes if n.op == "output")
    for spec, value in zip(sig.outputs, output.args[0]):
        if spec.role == "param" or spec.key.endswith(("exp_avg", "exp_avg_sq")):
            role = "param" if spec.role == "param" else "opt_state"
            assert _storage_root(value).name == sig.input_name(role, spec.key), spec.key
    sizes = {tuple(p.shape) for p in model.parameters()}
    fresh = [n for n in program.graph.nodes if n.op == "call_function" and ORIGIN(n).phase == "optimizer"
             and not n.target._schema.is_mutable and tuple(n.meta["val"].shape) in sizes
             and n.meta["val"].dim() > 0]
    assert len(fresh) <= 3 * len(list(model.parameters()))


@pytest.mark.parametrize("model_name,mesh,optimizer", [("gpt_tied", (2,), "adamw"),
                                                       ("mlp", (4,), "sgd"), ("mlp", (2,), "nesterov")])
def test_in_place_updates_give_the_functional_numbers(model_name, mesh, optimizer):
    """Three steps on simulated ranks with clipping: parameters and optimizer state equal
    to the last bit with and without in-place updates, and those of the single-device
    model trained with torch.optim and clip_grad_norm_."""
    mesh = ddlc.Mesh(mesh)
    runs = []
    for inplace in (False, True):
        model, data, gm = _lowered(model_name, optimizer, mesh, clip_grad_norm=0.5)
        if inplace:
            program = lower_ranks(gm, mesh, inplace=True)[0]
            assert any(n.op == "call_function" and getattr(n.target, "_schema", None) is not None
                       and n.target._schema.is_mutable for n in program.graph.nodes)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        runs.append(simulate_steps(gm, mesh, params, dict(model.named_buffers()), data, inplace=inplace))
    (losses0, params0, state0, _), (losses1, params1, state1, _) = runs
    assert [float(a) for a in losses0] == [float(b) for b in losses1]
    for k in params0:
        torch.testing.assert_close(params1[k], params0[k], rtol=0, atol=0)
    for k in state0:
        torch.testing.assert_close(state1[k], state0[k], rtol=0, atol=0)
    assert_matches_reference({"losses": losses1, "params": params1, "opt_state": state1},
                             train(*model_and_loss(model_name), optimizer, batches(model_name), 0.5), model_name)


def _state_graph(build) -> fx.GraphModule:
    """Parameters ``a`` and ``b`` (4 floats each, donated) whose new values ``build(graph,
    a, b)`` returns, as a step's loop-carried outputs."""
    from ddlc.ir import InputSpec, OutputSpec, StepSignature
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    for p in (a, b):
        p.meta["val"] = torch.empty(4)
    graph.output(tuple(build(graph, a, b)))
    for node in graph.nodes:
        if node.op == "call_function":
            ORIGIN.set(node, Origin("optimizer", ""))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    STEP.set(gm, StepSignature(inputs=(InputSpec("a", "param", "a"), InputSpec("b", "param", "b")),
                               outputs=(OutputSpec("param", "a"), OutputSpec("param", "b"))))
    return gm


def test_loop_outputs_that_would_share_memory_get_their_own():
    """One value returned as two parameters' new values would make the next step's two
    donated inputs one tensor: the second gets a clone."""
    def build(g, a, b):
        total = g.call_function(aten.add.Tensor, (a, b))
        total.meta["val"] = torch.empty(4)
        return [total, total]
    gm = _state_graph(build)
    update_in_place(gm)
    new_a, new_b = gm(torch.ones(4), torch.ones(4))
    assert new_a.untyped_storage().data_ptr() != new_b.untyped_storage().data_ptr()
    torch.testing.assert_close(new_b, torch.full((4,), 2.0))


def test_disjoint_pieces_of_one_buffer_keep_sharing_it():
    """Items of one split (a fused all-gather's parameters) share a storage without
    overlapping: no clone."""
    def build(g, a, b):
        both = g.call_function(aten.cat.default, ([a, b],))
        both.meta["val"] = torch.empty(8)
        pieces = g.call_function(aten.split.Tensor, (both, 4))
        pieces.meta["val"] = [torch.empty(4), torch.empty(4)]
        return [g.call_function(operator.getitem, (pieces, i)) for i in range(2)]
    gm = _state_graph(build)
    update_in_place(gm)
    assert aten.clone.default not in [n.target for n in gm.graph.nodes]
    new_a, new_b = gm(torch.ones(4), torch.zeros(4))
    assert new_a.untyped_storage().data_ptr() == new_b.untyped_storage().data_ptr()


def test_an_item_of_an_unsafe_split_is_a_view_of_its_input():
    """``unsafe_split`` (``nn.LSTM``'s and ``nn.GRU``'s backward, ``torch.unsafe_chunk``)
    returns views of its input though its schema says nothing of it: writing the update
    into an item wrote into the input, which the program still returned (1.9 off)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import functionalize

    def fn(x):
        y = x.exp()
        first, _ = torch.unsafe_split(y, 2)
        return first * 2, y

    x = torch.randn(4, 3)
    gm = make_fx(functionalize(fn, remove="mutations_and_views"), tracing_mode="fake")(x)
    assert aten.unsafe_split.Tensor in [n.target for n in gm.graph.nodes]
    for node in gm.graph.nodes:
        if node.op == "call_function":
            ORIGIN.set(node, Origin("optimizer", ""))
    want = gm(x.clone())
    update_in_place(gm)
    torch.testing.assert_close(gm(x.clone()), want)
