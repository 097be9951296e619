"""``batch="local"``: ``compile`` takes the whole global batch as its example and each rank
then passes its own part to ``step``. Split parts train like single device; examples that
differ between ranks, and different data on ranks the plan gives the same piece, are
refused on every rank instead of training each rank on its own data."""
import pytest
import torch
import torch.nn.functional as F

import ddlc
from conftest import eager
from ddlc.launch import spawn

STEPS = 3


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(STEPS)]
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data


def _train_local(rank, placements, parts_of_rank):
    model, opt, data = _setup()
    try:
        step = ddlc.compile(model, (4,), data[0], F.cross_entropy, opt, batch="local",
                            placements=placements)
        shapes = step.local_input_shapes
        losses = []
        for x, y in data:
            # each rank's own rows (a per-rank data loader), or the whole batch
            part = (x.chunk(4)[rank], y.chunk(4)[rank]) if parts_of_rank else (x, y)
            assert [tuple(t.shape) for t in part] == shapes, (shapes, part[0].shape)
            losses.append(float(step.step(*part)))
        return losses, step.state_dict()
    except ddlc.errors.DDLCError as e:
        return str(e)


def _eager():
    model, _, data = _setup()
    losses, _ = eager(model, F.cross_entropy, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                      data)
    return [float(x) for x in losses], model.state_dict()


def _different_data(rank, differ=True, nan=False):
    model, opt, data = _setup()
    step = ddlc.compile(model, (4,), data[0], F.cross_entropy, opt, batch="local",
                        placements={"input0": "(B)", "input1": "(B)"})
    x, y = data[1]
    if nan:
        x = x.clone()
        x[0, 0] = float("nan")
    try:
        step.step(x + rank if differ else x, y)  # each rank its own batch of the whole batch's shape
    except ddlc.errors.DDLCError as e:
        return str(e)


def _own_example(rank, rows):
    model, opt, _ = _setup()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)
    try:
        ddlc.compile(model, (4,), (x.chunk(4)[rank], y.chunk(4)[rank]), F.cross_entropy, opt,
                     batch="local")
    except ddlc.errors.DDLCError as e:
        return str(e)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_each_ranks_own_part_of_a_split_batch_trains_like_single_device():
    results = spawn(_train_local, 4, {"input0": "(S0)", "input1": "(S0)"}, True, timeout=300, deadline=100)
    want_losses, want_state = _eager()
    for losses, state in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_different_data_on_ranks_that_hold_the_same_piece_is_refused():
    # the input pinned whole on every rank: each rank's own rows would train each rank on
    # its own data; the step compares the ranks' inputs and refuses on every rank
    messages = spawn(_train_local, 4, {"input0": "(B)", "input1": "(B)"}, False, timeout=300, deadline=100)
    assert not isinstance(messages[0], str), messages[0]  # the same whole batch on every rank: fine
    want_losses, _ = _eager()
    torch.testing.assert_close(torch.tensor(messages[0][0]), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    messages = spawn(_different_data, 4, timeout=300, deadline=100)
    assert len(set(messages)) == 1, messages
    assert "with batch='local', ranks 0 and 1 must pass the same input0" in messages[0], messages[0]
    assert "does not split it along mesh axes [0]" in messages[0]
    # a NaN in the batch: equal batches still pass, different ones are still told apart
    assert spawn(_different_data, 4, False, True, timeout=300, deadline=100) == [None] * 4
    messages = spawn(_different_data, 4, True, True, timeout=300, deadline=100)
    assert len(set(messages)) == 1 and "must pass the same input0" in messages[0], messages


def _own_part_of_a_whole_input(rank):
    model, opt, data = _setup()
    step = ddlc.compile(model, (4,), data[0], F.cross_entropy, opt, batch="local",
                        placements={"input0": "(B)", "input1": "(B)"})  # as a replicated plan has it
    x, y = data[0]
    try:
        step.step(x.chunk(4)[rank], y.chunk(4)[rank])  # a DistributedSampler's part
    except ddlc.errors.DDLCError as e:
        return str(e)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_ranks_own_part_of_an_input_the_plan_keeps_whole_is_refused_naming_the_pin():
    messages = spawn(_own_part_of_a_whole_input, 4, timeout=300, deadline=100)
    assert len(set(messages)) == 1, messages
    assert "input0 has shape (2, 12) but the program was compiled for local shape (8, 12)" in messages[0]
    assert """pin it split, placements={'input0': "(S0)"} for every batch input""" in messages[0], messages[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rows", [8, 10], ids=["even", "uneven"])
def test_each_ranks_own_part_given_to_compile_is_refused(rows):
    # 10 rows: parts of 3, 3, 2, 2 (other shapes on other ranks), still this message
    messages = spawn(_own_example, 4, rows, timeout=300, deadline=100)
    assert len(set(messages)) == 1, messages
    assert "ddlc.compile takes the whole global batch as its example" in messages[0], messages[0]
    assert "rank 1's example input 0 differs from rank 0's" in messages[0]
