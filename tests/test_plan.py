"""The Plan: printing, explain, JSON round trip, diff."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddlc
from ddlc import NdSBP, S
from ddlc.plan import Plan
from passes.canonicalize import canonicalize
from passes.sharding import shard


@pytest.fixture(scope="module")
def plans():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.Linear(256, 64, bias=False))
    x = torch.zeros(32, 64)
    gm = canonicalize(ddlc.trace(model, (x, x), F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1)))
    mesh = ddlc.Mesh((2, 2))
    free = shard(gm, mesh)
    pinned = shard(gm, mesh, fixed={"input0": NdSBP((S(0), S(0)))})
    return free, pinned


def test_prints_summary_and_table(plans):
    plan, _ = plans
    text = str(plan)
    assert text.startswith("plan on mesh 2x2(dp,tp)")
    assert "planner objective" in text and "signature" in text
    assert all(n.name in text for n in plan.nodes)
    assert plan.objective == pytest.approx(plan.compute + plan.communication, rel=1e-9)


def test_explain_node_and_module(plans):
    plan, _ = plans
    text = plan.explain("mm")
    assert text.startswith("mm (aten.mm, module 0)") and text.count("*") == 1
    assert "chosen:" in text
    module = plan.explain("1")
    assert "mm_1" in module and "mm " not in module.split("\n")[0]
    with pytest.raises(KeyError):
        plan.explain("no_such_thing")


def test_json_round_trip(plans, tmp_path):
    plan, _ = plans
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = Plan.load(str(path))
    assert loaded == plan
    assert loaded.to_json() == plan.to_json()
    with pytest.raises(ValueError, match="explain needs"):
        loaded.explain("mm")


def test_diff(plans):
    free, pinned = plans
    assert free.diff(free).splitlines() == [f"objective {free.objective * 1e3:.4f} ms -> "
                                            f"{free.objective * 1e3:.4f} ms (+0.00%)"]
    text = free.diff(pinned)
    assert "~ input0:" in text and "(S0, S0)" in text
    assert text.splitlines()[-1].startswith("objective")


@pytest.mark.parametrize("n, shown", [
    (40, "40 B"), (1023, "1023 B"), (1024, "1 KiB"), (12.3 * 1024, "12.3 KiB"),
    (1010.3 * 1024, "1010 KiB"), (1023.9 * 1024, "1024 KiB"), (1024 ** 2, "1 MiB"),
    (7.45 * 1024 ** 3, "7.45 GiB"), (2048 * 1024 ** 3, "2048 GiB")])
def test_byte_counts_never_print_in_exponent_form(n, shown):
    # a value from 1000 up to the next unit printed as 1.01e+03 KiB in the plan's report
    from ddlc.printing import format_bytes
    assert format_bytes(n) == shown
