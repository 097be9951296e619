"""Property-based numerics: random layered models (widths, depths, residuals, activations,
tied weights) on random meshes of up to 8 simulated devices, compiled and run rank by rank,
match single-device training (losses and parameters after two steps)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import ddlc
from conftest import assert_matches_reference, optimizer, train
from ddlc import pipeline
from ddlc.options import CompileOptions
from ddlc.simulate import simulate_steps

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "none": lambda x: x}
MESHES = [(2,), (4,), (2, 2), (8,), (2, 4), (4, 2), (2, 2, 2)]
BATCH = 8


class Layered(torch.nn.Module):
    """Linear layers of ``widths``; a residual around every layer whose width is kept; the
    ``tied`` layer (if any) applied twice."""

    def __init__(self, widths, activation, residual, tied):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.activation, self.residual, self.tied = ACTIVATIONS[activation], residual, tied

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            y = self.activation(layer(x))
            if i == self.tied and layer.in_features == layer.out_features:
                y = self.activation(layer(y))
            x = x + y if self.residual and y.shape == x.shape else y
        return x


@st.composite
def cases(draw):
    widths = draw(st.lists(st.sampled_from([4, 8, 12, 16]), min_size=2, max_size=4))
    return {"widths": widths, "activation": draw(st.sampled_from(sorted(ACTIVATIONS))),
            "residual": draw(st.booleans()), "tied": draw(st.integers(-1, len(widths) - 2)),
            "mesh": draw(st.sampled_from(MESHES)), "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
            "fast_link": draw(st.booleans()), "seed": draw(st.integers(0, 2**16))}


@pytest.mark.timeout(600)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_layered_models_match_single_device(case):
    torch.manual_seed(case["seed"])
    model = Layered(case["widths"], case["activation"], case["residual"], case["tied"])
    g = torch.Generator().manual_seed(case["seed"])
    data = [(torch.randn(BATCH, case["widths"][0], generator=g),
             torch.randn(BATCH, case["widths"][-1], generator=g)) for _ in range(2)]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    links = [ddlc.LinkModel(1e-7, 1e10)] * len(case["mesh"]) if case["fast_link"] else None
    mesh = ddlc.Mesh(case["mesh"], **({"links": links} if links else {}))
    options = CompileOptions()
    gm = pipeline.trace_step(model, data[0], F.mse_loss, optimizer(case["optimizer"], model), options)
    pipeline.plan(gm, mesh, options, {})
    losses, got, _, _ = simulate_steps(gm, mesh, params, {}, data)

    assert_matches_reference({"losses": losses, "params": got}, train(model, F.mse_loss, case["optimizer"], data),
                             str(case), losses=(1e-4, 1e-5))
