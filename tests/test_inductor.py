"""backend="inductor" (ddlc/inductor.py): each rank's program compiled by Inductor gives
the single-device numbers, and its collectives are checked to be the planned ones."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import ddlc
from ddlc import inductor
from ddlc.errors import UnsupportedInputError
from ddlc.launch import spawn
from ddlc.zoo import MLP

STEPS = 3
#: an excerpt of an Inductor wrapper (torch 2.13, CPU): calls, asserts and comments
WRAPPER = """
        # Topologically Sorted Source Nodes: [all_gather_into_tensor_default_4], Original ATen: [_c10d_functional.all_gather_into_tensor]
        buf5 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf4, 2, '0')
        assert_size_stride(buf5, (2632, ), (1, ), 'torch.ops._c10d_functional.all_gather_into_tensor.default')
        torch.ops._c10d_functional.wait_tensor.default(buf5)
        torch.ops._c10d_functional.all_reduce_.default(buf15, 'sum', '0')
        buf31 = torch.ops._c10d_functional.reduce_scatter_tensor.default(reinterpret_tensor(buf30, (2632, ), (1, ), 0), 'sum', 2, '1')
"""


def test_the_collectives_of_a_wrapper_are_read_in_call_order():
    assert inductor.compiled_collectives(WRAPPER) == [
        ("all_gather_into_tensor", "0"), ("all_reduce", "0"), ("reduce_scatter_tensor", "1")]


def test_collectives_in_flight_at_once_are_counted():
    """The excerpt waits for its all-gather, then issues an all-reduce and a reduce-scatter
    without waiting: two in flight (which a gloo rank refuses, passes/waits.py)."""
    assert inductor.most_in_flight(WRAPPER) == 2
    assert inductor.most_in_flight(WRAPPER.split("all_reduce_")[0]) == 1


def test_a_reordered_or_missing_collective_is_named():
    planned = [("all_gather_into_tensor", "0"), ("all_reduce", "0")]
    assert inductor.check_order(planned, planned) is None
    assert "collective 0 is all_reduce" in inductor.check_order(planned, planned[::-1])
    assert "1 collectives compiled, 2 planned" == inductor.check_order(planned, planned[:1])


def test_a_program_that_draws_random_numbers_is_refused():
    holder = torch.nn.Module()
    holder.rng = torch.Generator()
    graph = fx.Graph()
    with warnings.catch_warnings():   # fx warns that a generator is not a module attribute
        warnings.simplefilter("ignore", UserWarning)
        graph.output(graph.get_attr("rng"))
    gm = fx.GraphModule(holder, graph)
    with pytest.raises(UnsupportedInputError, match="random numbers"):
        inductor.compile_program(gm, [])


#: the batch split (data parallelism: one bucket); and with the first layer's weight split
#: too (an all-gather in forward, its gradient's reduce-scatter, the loss's all-reduce:
#: Inductor had sunk a wait past the next collective, which gloo's refusal caught)
PLACEMENTS = {"data_parallel": {"input0": "(S0)", "input1": "(S0)"},
              "weight_split": {"input0": "(S0)", "input1": "(S0)", "layers.0.weight": "(S0)"}}


def _train(rank, backend, placements):
    torch.manual_seed(0)
    model = MLP(d_in=16, d_hidden=32, d_out=4, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]
    step = ddlc.compile(model, (2,), data[0], F.mse_loss, opt, backend=backend, placements=placements)
    losses = [float(step.step(*batch)) for batch in data]
    return losses, {k: v.clone() for k, v in step.state_dict().items()}, \
        inductor.planned_collectives(step.gm), step.program is step.gm


NEEDS_COMPILER = pytest.mark.skipif(not inductor.has_compiler(),
                                    reason="Inductor's CPU kernels need a C++ compiler")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@NEEDS_COMPILER
@pytest.mark.parametrize("placements", PLACEMENTS)
def test_inductor_programs_match_single_device(placements):
    torch.manual_seed(0)
    model = MLP(d_in=16, d_hidden=32, d_out=4, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    want = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    for losses, state, planned, eager in spawn(_train, 2, "inductor", PLACEMENTS[placements],
                                               timeout=500, deadline=580):
        assert not eager and planned   # Inductor's program ran, and it communicates
        assert placements == "data_parallel" or len(planned) > 2, planned
        assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


@NEEDS_COMPILER
def test_an_inductor_failure_is_a_lowering_error(monkeypatch):
    import torch._inductor.compile_fx as compile_fx_module
    from ddlc.errors import LoweringError

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this\nlong trace")
    monkeypatch.setattr(compile_fx_module, "compile_fx", broken)
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(LoweringError, match="Inductor could not compile.*no kernel for this"):
        inductor.compile_program(gm, [torch.zeros(1, 2)])
