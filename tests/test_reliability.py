"""Inputs that would give silently wrong results are refused with a ddlc.errors error that
names the cause (the rest of the reliability catalogue grows here)."""
import pytest
import torch
import torch.nn.functional as F

import ddlc
from ddlc import pipeline
from ddlc.errors import MeshError, SBPError, UnsupportedInputError
from ddlc.ir import SHARDING
from ddlc.launch import WorkerError, spawn
from ddlc.options import CompileOptions
from ddlc.sbp import local_slices
from ddlc.simulate import lower_ranks, run_ranks
from ddlc.zoo import MLP


def test_a_mesh_of_non_ascii_digits_is_refused():
    with pytest.raises(MeshError, match="cannot parse mesh shape"):
        ddlc.Mesh("²")


@pytest.mark.parametrize("key", ["input0", "layers.0.weight"])
def test_a_partial_placement_of_user_data_is_refused(key):
    x = torch.randn(8, 32)
    gm = pipeline.trace_step(MLP(), (x, torch.randn(8, 16)), F.mse_loss, None, CompileOptions())
    with pytest.raises(SBPError, match="partial sum"):
        pipeline.resolve_placements(gm, {key: "(P)"}, 1)


class _Dropping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.1, training=True)


def test_random_ops_in_the_step_are_refused_at_the_users_line():
    x = torch.randn(8, 4)
    with pytest.raises(UnsupportedInputError, match="random numbers") as info:
        ddlc.trace(_Dropping(), (x, x), F.mse_loss)
    assert "test_reliability.py" in str(info.value) and "F.dropout" in str(info.value)


@pytest.mark.parametrize("loss_fn", [None, F.mse_loss])
def test_a_model_without_parameters_compiles(loss_fn):
    x = torch.randn(8, 4)
    inputs = (x,) if loss_fn is None else (x, torch.zeros(8, 4))
    mesh = ddlc.Mesh((2,))
    gm = pipeline.trace_step(torch.nn.ReLU(), inputs, loss_fn, None, CompileOptions())
    pipeline.plan(gm, mesh, CompileOptions(), {})
    placed = [SHARDING(n).outputs[0] for n in gm.graph.nodes if n.op == "placeholder"]
    pieces = [[t[local_slices(tuple(t.shape), sbp, mesh.shape, (r,))] for t, sbp in zip(inputs, placed)]
              for r in range(2)]
    out = run_ranks(lower_ranks(gm, mesh), mesh, pieces)
    want = torch.relu(x) if loss_fn is None else F.mse_loss(torch.relu(x), inputs[1])
    for rank in range(2):  # every output is B: each rank holds the whole value
        torch.testing.assert_close(out[rank][0], want)


def _step_after_scheduler(rank):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(8, 32), torch.randn(8, 16))
    step = ddlc.compile(model, "1", batch, F.mse_loss, opt)
    step.step(*batch)  # unchanged hyper-parameters: fine
    torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5).step()
    step.step(*batch)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_learning_rate_changed_after_compile_is_not_silently_ignored():
    with pytest.raises(WorkerError, match="lr changed after compile"):
        spawn(_step_after_scheduler, 1, timeout=60, deadline=100)
