import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cost_models import op_bytes, op_flops, op_time
from ddlc.mesh import HardwareProfile, LinkModel

aten = torch.ops.aten
LINK = LinkModel(1e-5, 1e9)
PROFILE = HardwareProfile(
    name="test", devices_per_node=8, flops=(("bfloat16", 4e12), ("float32", 1e12)),
    memory_bandwidth=1e11, memory_capacity=8e9, intra_node=LINK, inter_node=LINK)


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, device="meta", dtype=dtype)


def call(op, *args, **kwargs):
    return op, args, kwargs, op(*args, **kwargs)


def test_mm_is_compute_bound_at_2mnk():
    op, args, kwargs, out = call(aten.mm.default, meta(128, 256), meta(256, 512))
    flops = 2 * 128 * 256 * 512
    assert op_flops(op, args, kwargs, out) == flops
    assert op_bytes(args, kwargs, out) == 4 * (128 * 256 + 256 * 512 + 128 * 512)
    assert op_time(op, args, kwargs, out, PROFILE) == pytest.approx(flops / 1e12)


def test_dtype_selects_the_throughput():
    op, args, kwargs, out = call(aten.mm.default, meta(512, 512, dtype=torch.bfloat16),
                                 meta(512, 512, dtype=torch.bfloat16))
    assert op_time(op, args, kwargs, out, PROFILE) == pytest.approx(2 * 512**3 / 4e12)


def test_thin_matmul_is_memory_bound():
    op, args, kwargs, out = call(aten.mm.default, meta(4096, 2), meta(2, 4096))
    nbytes = 4 * (4096 * 2 * 2 + 4096 * 4096)
    assert op_time(op, args, kwargs, out, PROFILE) == pytest.approx(nbytes / 1e11)


def test_addmm_and_bmm():
    assert op_flops(*call(aten.addmm.default, meta(32), meta(16, 8), meta(8, 32))) == 2 * 16 * 8 * 32
    assert op_flops(*call(aten.bmm.default, meta(3, 16, 8), meta(3, 8, 32))) == 2 * 3 * 16 * 8 * 32


def test_convolution_and_its_backward():
    x, w = meta(2, 3, 16, 16), meta(8, 3, 3, 3)
    fwd = call(aten.convolution.default, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    expected = 2 * 2 * (16 * 16) * (8 * 3 * 3 * 3)  # 2 · batch · output pixels · weight size
    assert op_flops(*fwd) == expected
    bwd = call(aten.convolution_backward.default, fwd[3], x, w, None, [1, 1], [1, 1], [1, 1],
               False, [0, 0], 1, [True, True, False])
    assert op_flops(*bwd) == 2 * expected  # grad input + grad weight
    assert op_time(*bwd, PROFILE) > op_time(*fwd, PROFILE)


def test_cpu_attention_uses_the_registry_formula():
    b, h, s, d = 2, 4, 64, 16
    q = meta(b, h, s, d)
    fwd = call(aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q)
    assert op_flops(*fwd) == 4 * b * h * s * s * d            # QK^T and AV
    out, lse = fwd[3]
    bwd = call(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
               out, q, q, q, out, lse, 0.0, False)
    assert op_flops(*bwd) == 10 * b * h * s * s * d           # five batched matmuls


def test_elementwise_ops_cost_their_bytes():
    op, args, kwargs, out = call(aten.add.Tensor, meta(1024, 1024), meta(1024, 1024))
    assert op_flops(op, args, kwargs, out) == 0
    assert op_time(op, args, kwargs, out, PROFILE) == pytest.approx(3 * 4 * 2**20 / 1e11)


def test_free_ops():
    x = meta(8, 8)
    assert op_time(*call(aten.t.default, x), PROFILE) == 0.0            # a view
    assert op_time(*call(aten.view.default, x, [64]), PROFILE) == 0.0
    assert op_time(*call(aten.sym_size.int, x, 0), PROFILE) == 0.0     # no tensor output
    assert op_time(operator.getitem, ((x, x), 0), {}, x, PROFILE) == 0.0


def test_fake_tensors_work_like_meta_tensors():
    with FakeTensorMode():
        a, b = torch.empty(64, 32), torch.empty(32, 16)
        out = aten.mm.default(a, b)
    assert op_flops(aten.mm.default, (a, b), {}, out) == 2 * 64 * 32 * 16
    assert op_time(aten.mm.default, (a, b), {}, out, PROFILE) > 0


@pytest.mark.parametrize("compute", ["roofline", "measured"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "rmsprop", "adagrad"])
def test_an_optimizer_update_costs_the_operators_it_expands_into(optimizer, compute, tmp_path, monkeypatch):
    """A parameter's update is one ``ddlc::optimizer_update`` node until lowering expands
    it: its price is that of the operators it becomes, each priced alone, at the same
    shapes, on the roofline and measured alike (the search prices the one, the program's
    timeline the other: where they differ, the decouple pass's estimate of the update
    compute a shard saves misleads it). (The memory its intermediates hold while it runs
    is checked against the expanded program by ``tests/test_schedule.py``'s memory-cap
    test.)"""
    import dataclasses

    import ddlc
    from cost_models import measured
    monkeypatch.setenv("DDLC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "_TABLES", {})
    profile = PROFILE if compute == "roofline" else dataclasses.replace(PROFILE, compute="measured")
    from cost_models.program import temporary_bytes
    from ddlc.fused_update import OP
    from passes.expand_updates import expand_updates
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
            "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, centered=True, momentum=0.5),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1)}[optimizer]
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    batch = (torch.randn(16, 64), torch.randn(16, 8))
    gm = ddlc.trace(model, batch, torch.nn.functional.mse_loss, make(model.parameters()))
    updates = [n for n in gm.graph.nodes if n.target is OP]
    assert len(updates) == 4

    def price(node):
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        return op_time(node.target, args, kwargs, node.meta["val"], profile)

    def optimizer_nodes():  # the updates', and the scalars computed once per param group
        return [n for n in gm.graph.nodes if n.op == "call_function"
                and n.meta["ddlc_origin"].phase == "optimizer" and n.target is not operator.getitem]

    fused = sum(price(n) for n in optimizer_nodes())
    temporaries = {n.args[2].name: temporary_bytes(n) for n in updates}
    assert fused > 0 and min(temporaries.values()) > 0
    expand_updates(gm)
    assert not any(n.target is OP for n in gm.graph.nodes)
    assert sum(price(n) for n in optimizer_nodes()) == pytest.approx(fused, rel=1e-12)
