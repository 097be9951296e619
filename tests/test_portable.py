"""One rank traces, the others receive the graph: a traced step survives pickling with its
nodes, names, meta and fake values, lowers to the same program as the traced graph, and
ranks given different models or inputs are told so instead of running rank 0's program."""
import dataclasses
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import ddlc
from conftest import MODELS, batches, model_and_loss, optimizer
from ddlc import pipeline
from ddlc.errors import RuntimeMismatchError
from ddlc.ir import STEP
from ddlc.launch import WorkerError, spawn
from ddlc.options import CompileOptions
from ddlc.portable import FakeSpec, from_portable, to_portable
from ddlc.zoo import MLP


def _traced(case: str, opt_name: str | None = "adamw"):
    model, loss_fn = model_and_loss(case)
    return pipeline.trace_step(model, batches(case)[0], loss_fn, optimizer(opt_name, model), CompileOptions())


def _shipped(gm):
    return from_portable(pickle.loads(pickle.dumps(to_portable(gm))))


def _layout(value):
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return [_layout(v) for v in value]
    return value


@pytest.mark.parametrize("opt_name", ["adamw", None])
@pytest.mark.parametrize("case", MODELS)
def test_a_shipped_trace_has_the_same_nodes_meta_and_values(case, opt_name):
    gm = _traced(case, opt_name)
    got = _shipped(gm)
    assert got.code == gm.code
    assert got.meta.keys() == gm.meta.keys() and repr(got.meta) == repr(gm.meta)
    modes = set()
    for a, b in zip(gm.graph.nodes, got.graph.nodes, strict=True):
        assert (a.op, a.name, a.target) == (b.op, b.name, b.target)
        assert a.meta.keys() == b.meta.keys(), a.name
        for key in a.meta:
            if key == "val":
                assert _layout(b.meta[key]) == _layout(a.meta[key]), a.name
            elif key == "original_aten":  # the same operator (torch made another object of it)
                assert str(b.meta[key]) == str(a.meta[key]), a.name
            elif key != "tensor_meta":  # tensor_meta compares by value below
                assert b.meta[key] == a.meta[key], (a.name, key)
        assert b.meta.get("tensor_meta") == a.meta.get("tensor_meta"), a.name
        if isinstance(b.meta.get("val"), FakeTensor):
            modes.add(id(b.meta["val"].fake_mode))
    assert len(modes) == 1  # one fake mode, as one trace has
    # the names passes give new nodes: every name given before (erased nodes' too), counters
    for namespace in ("_used_names", "_base_count"):
        assert getattr(got.graph._graph_namespace, namespace) == getattr(gm.graph._graph_namespace, namespace)


def test_a_shipped_trace_lowers_to_the_same_program():
    """A ResNet with BatchNorm: its trace erased nodes, whose names nodes added later must
    not take on one rank and take on another."""
    torch.manual_seed(0)
    model = ddlc.zoo.resnet18(width=4)
    gm = pipeline.trace_step(model, (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))),
                             F.cross_entropy, optimizer("sgd", model), CompileOptions())
    got = _shipped(gm)
    mesh = ddlc.Mesh((4,))
    programs = []
    for graph in (gm, got):
        options = CompileOptions()
        pipeline.plan(graph, mesh, options, {})
        pipeline.lower(graph, mesh, (1,), ["axis0"], options)
        programs.append(graph.code)
    assert programs[0] == programs[1]
    assert "all_reduce" in programs[0] or "all_gather" in programs[0]


def test_values_move_to_the_receiving_ranks_device_of_the_same_type():
    gm = _traced("mlp")
    shipped = pickle.loads(pickle.dumps(to_portable(gm)))
    meta_device = from_portable(shipped, torch.device("meta"))  # another type: kept on the CPU
    fakes = [n.meta["val"] for n in meta_device.graph.nodes if isinstance(n.meta.get("val"), FakeTensor)]
    assert {v.device.type for v in fakes} == {"cpu"}
    on_gpu0 = FakeSpec((2, 3), (3, 1), 0, torch.float32, torch.device("cuda", 0), False)
    assert on_gpu0.fake(FakeTensorMode(), torch.device("cuda", 1)).device == torch.device("cuda", 1)
    assert on_gpu0.fake(FakeTensorMode(), torch.device("cpu")).device == torch.device("cuda", 0)


def test_a_hugging_face_trace_ships():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (4, 8))
    gm = pipeline.trace_step(model, {"input_ids": ids, "labels": ids}, None,
                             torch.optim.AdamW(model.parameters()), CompileOptions())
    assert _shipped(gm).code == gm.code


@dataclasses.dataclass
class _Out:
    """A model's plain dataclass output, with a constant beside its tensors."""

    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "x"


class _DataclassOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return _Out(self.b(h), h, "y")


def test_an_inference_step_returning_a_dataclass_ships_and_rebuilds_it():
    """A forward returning a plain ``@dataclass`` (not a pytree node) traces for inference,
    its output tree ships to the other ranks without torch's pytree warnings (a pickled
    TreeSpec's leaves unpickle through the deprecated ``LeafSpec``), and rebuilds the
    dataclass with the program's tensors in its fields and its constants as they were."""
    gm = pipeline.trace_step(_DataclassOutput(), (torch.randn(8, 4),), None, None, CompileOptions())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shipped = _shipped(gm)
    tree = STEP(shipped).output_tree
    logits, hidden = torch.zeros(8, 3), torch.ones(8, 8)
    out = tree.rebuild([logits, hidden])
    assert type(out) is _Out and out.logits is logits and out.hidden is hidden and out.note == "y"


def _compile_other_widths(rank):
    model = MLP(d_hidden=64 if rank == 1 else 48)
    ddlc.compile(model, (2,), (torch.randn(8, 32), torch.randn(8, 16)), F.mse_loss,
                 torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_given_different_models_are_told_so():
    with pytest.raises(WorkerError, match=r"rank 1 was given .*parameter .*64.*rank 0.*48") as caught:
        spawn(_compile_other_widths, 2, timeout=30, deadline=90)
    assert RuntimeMismatchError.__name__ in str(caught.value)


def _compile_other_learning_rates(rank):
    model = MLP()
    ddlc.compile(model, (2,), (torch.randn(8, 32), torch.randn(8, 16)), F.mse_loss,
                 torch.optim.SGD(model.parameters(), lr=0.2 if rank == 1 else 0.1))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_given_different_hyperparameters_are_told_so():
    # each rank fed its own learning rate to the program: shards updated at another rate,
    # replicated parameters apart between ranks, silently
    with pytest.raises(WorkerError, match=r"rank 1 was given optimizer hyper-parameters .*'lr': 0\.2.*"
                                          r"rank 0 .*'lr': 0\.1") as caught:
        spawn(_compile_other_learning_rates, 2, timeout=30, deadline=90)
    assert RuntimeMismatchError.__name__ in str(caught.value)


def _trained_from_other_seeds(rank):
    from conftest import batches, model_and_loss, optimizer
    model, loss_fn = model_and_loss("mlp")  # seed 0 ...
    if rank == 1:
        torch.manual_seed(7)  # ... but rank 1 initialises its model otherwise
        model = MLP()
    data = batches("mlp")
    step = ddlc.compile(model, (2,), data[0], loss_fn, optimizer("sgd", model))
    losses = [step.step(*b) for b in data]
    return {"losses": losses, "params": step.state_dict(), "opt_state": step.optimizer_state()}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_that_initialised_other_weights_train_from_rank_0s():
    from conftest import assert_matches_reference, train
    got = spawn(_trained_from_other_seeds, 2, timeout=30, deadline=90)[0]
    model, loss_fn = model_and_loss("mlp")
    assert_matches_reference(got, train(model, loss_fn, "sgd", batches("mlp")), "mlp from rank 0's weights",
                             **dict.fromkeys(("losses", "params", "opt_state"), (1e-4, 1e-5)))
