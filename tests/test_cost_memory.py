import pytest
import torch
import torch.fx as fx

from cost_models import MemoryReport, memory_report, peak_live_bytes, tensor_bytes
from ddlc.mesh import Mesh
from ddlc.sbp import parse_sbp


def test_tensor_bytes_is_the_largest_local_piece():
    m = Mesh((2, 4))
    assert tensor_bytes((10, 8), 4, parse_sbp("S0, B"), m) == 5 * 8 * 4
    assert tensor_bytes((10, 8), 4, parse_sbp("S0, S1"), m) == 5 * 2 * 4
    assert tensor_bytes((7, 8), 2, parse_sbp("S0, S0"), m) == 1 * 8 * 2   # ceil(ceil(7/2)/4)
    assert tensor_bytes((10, 8), 4, parse_sbp("P, B"), m) == 10 * 8 * 4


def chain(x, w):
    a = torch.relu(x)       # x dies here
    b = a + w               # w dies here
    c = b * a               # a, b die here
    return c.sum()


SIZES = {"x": 100, "w": 1000, "relu": 10, "add": 20, "mul": 40, "sum_1": 1}


def graph(roles):
    gm = fx.symbolic_trace(chain)
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta["ddlc_role"] = roles[node.name]
    return gm


def size_of(node):
    return SIZES[node.name]


def test_peak_live_bytes_frees_after_the_last_user():
    gm = graph({"x": "input", "w": "input"})
    # live after each node runs (before its frees): x 100, w 1100, relu 1110 (peak; then x
    # dies: 1010), add 1030 (w dies: 30), mul 70 (relu, add die: 40), sum 41
    assert peak_live_bytes(gm, size_of) == 1110


def test_unused_outputs_are_counted_then_freed():
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_function(torch.relu, (x,))           # dead
    g.output(g.call_function(torch.neg, (x,)))
    sizes = {"x": 5, "relu": 7, "neg": 3}
    assert peak_live_bytes(fx.GraphModule({}, g), lambda n: sizes[n.name]) == 12


def test_memory_report_by_role():
    gm = graph({"x": "input", "w": "param"})
    report = memory_report(gm, size_of)
    # w is resident, so activations see x, relu, add, mul, sum only: peak x + relu = 110
    assert report == MemoryReport(parameters=1000, gradients=1000, optimizer_state=0,
                                  activations=110)
    assert report.total == 2110
    text = str(report)
    assert "parameters" in text and "total" in text


@pytest.mark.parametrize("role, field", [("buffer", "parameters"), ("opt_state", "optimizer_state")])
def test_buffers_and_optimizer_state_are_resident_without_gradients(role, field):
    report = memory_report(graph({"x": "input", "w": role}), size_of)
    assert getattr(report, field) == 1000 and report.gradients == 0
