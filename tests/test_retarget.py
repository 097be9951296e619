"""Every rank's program from coordinate 0's (passes/retarget.py): where a plan splits every
tensor evenly, ``ddlc.compile`` lowers one program and ships it, and each rank recomputes
the arguments that depend on its mesh coordinate. That must give, node for node, the
program lowering makes for that coordinate itself."""
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddlc
from conftest import batches, model_and_loss, optimizer
from ddlc import pipeline
from ddlc.errors import LoweringError
from ddlc.ir import RANK_ARG, STEP
from ddlc.options import CompileOptions
from ddlc.sbp import parse_sbp
from ddlc.simulate import axis_group_names, lower_rank
from passes.canonicalize import canonicalize
from passes.retarget import for_coordinate
from passes.sharding import shard


class DropoutMLP(nn.Module):
    """Dropout on split activations: each rank draws the whole mask and keeps its piece."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(32, 64), nn.Linear(64, 16), nn.Dropout(0.3)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def _planned(name: str, mesh: ddlc.Mesh, pins: dict | None):
    """The canonical training step of ``name`` planned on ``mesh`` (searched where ``pins``
    is None), with the options it was planned under."""
    if name == "dropout":
        torch.manual_seed(0)
        model, loss_fn, data = DropoutMLP(), F.mse_loss, batches("mlp")
    else:
        (model, loss_fn), data = model_and_loss(name), batches(name)
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer("adamw", model)))
    options = CompileOptions.from_kwargs(profile=mesh.profile.name)
    if pins is None:
        pipeline.plan(gm, mesh, options, {})
    else:
        names = {i.key: i.name for i in STEP(gm).inputs}
        shard(gm, mesh, fixed={names[k]: parse_sbp(v) for k, v in pins.items()})
    return gm, options


def _listing(gm) -> list[str]:
    return [n.format_node() for n in gm.graph.nodes]


CASES = [
    ("mlp", (2, 4), "cpu-gloo", {"input0": "(S0, B)", "layers.0.weight": "(B, S0)"}),
    ("mlp", (2, 2, 2), "cpu-gloo", {"input0": "(S0, S0, B)", "layers.1.weight": "(B, B, S1)"}),
    ("gpt", (2, 2), "dgx-h100-ib", None),
    ("cnn", (2, 2), "cpu-gloo", {"input0": "(S0, B)"}),
    ("dropout", (2, 2), "cpu-gloo", {"input0": "(S0, S0)", "fc1.weight": "(B, S0)"}),
]


@pytest.mark.parametrize("name,shape,profile,pins", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in CASES])
def test_the_retargeted_program_is_the_one_lowered_for_that_coordinate(name, shape, profile, pins):
    mesh = ddlc.Mesh(shape, profile=profile)
    gm, options = _planned(name, mesh, pins)
    groups = axis_group_names(mesh)
    first = copy.deepcopy(gm)
    choices = pipeline.lower(first, mesh, (0,) * mesh.ndim, groups, options)
    marked = {RANK_ARG(n).kind for n in first.graph.nodes if RANK_ARG.has(n)}
    assert marked, "the case should have rank-dependent arguments"
    if name == "dropout":
        assert "piece" in marked
    for coord in itertools.islice(itertools.product(*map(range, shape)), 1, None):
        own = lower_rank(copy.deepcopy(gm), mesh, coord, groups, choices=choices, profile=profile)
        shipped = for_coordinate(copy.deepcopy(first), mesh, coord)
        assert _listing(shipped) == _listing(own), coord


def test_the_program_of_an_uneven_plan_is_refused():
    """A split that leaves ranks pieces of different sizes makes programs of different
    shapes: one rank's program cannot serve another."""
    mesh = ddlc.Mesh((4,))
    model, loss_fn = model_and_loss("mlp")
    data = [(torch.randn(10, 32), torch.randn(10, 16))]
    gm = canonicalize(ddlc.trace(model, data[0], loss_fn, optimizer("sgd", model)))
    names = {i.key: i.name for i in STEP(gm).inputs}
    shard(gm, mesh, fixed={names["input0"]: parse_sbp("(S0)"), names["input1"]: parse_sbp("(S0)")})
    first = lower_rank(copy.deepcopy(gm), mesh, (0,))
    with pytest.raises(LoweringError, match="evenly"):
        for_coordinate(first, mesh, (3,))
