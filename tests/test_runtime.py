"""End-to-end numerics on real gloo process groups: the compiled program matches the
single-device model (losses, gradients, outputs, parameters and optimizer state after
several steps) for automatic and forced plans on every claimed mesh shape."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import TOLERANCES, assert_matches_reference, reference
from ddlc.launch import WorkerDiedAfterResults, WorkerError, spawn
from ddlc.zoo import GPT, MLP
from distributed_cases import compiled_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

# (model, optimizer, mode, pinned placements[, compile options]); schedule=True is the default.
# FAST: a 0.1 us, 10 GB/s link, under which the search shards (data and tensor parallel)
# rather than replicating these small models, so every collective path runs.
FAST = {"link": (1e-7, 1e10)}
TENSOR_PARALLEL_MLP = {"input0": "(B)", "layers.0.weight": "(S0)", "layers.1.weight": "(S1)"}
MATMUL_2D_MLP = {"input0": "(S0, B)", "layers.0.weight": "(B, S0)", "layers.1.weight": "(S1, S0)"}
MIXED_GPT = {"input0": "(S0, B)", "blocks.0.fc.weight": "(B, S0)", "blocks.0.out.weight": "(B, S1)",
             "blocks.1.attn.qkv.weight": "(S0, S1)", "tok.weight": "(B, S1)"}

#: data parallelism and ZeRO-3, pinned: parameters (B) / (S0, S0), the batch split, no
#: activation moved (``move_activations=False``)
PURE_DP_GPT = {"input0": "(S0)", **{k: "(B)" for k, _ in GPT().named_parameters()}}
ZERO_MLP = {"input0": "(S0, S0)", **{k: "(S0, S0)" for k, _ in MLP().named_parameters()}}
PINNED = {"move_activations": False}
#: a GPU cluster's profile: no contention, so lowering searches the order of the
#: collectives by its timeline (updates early or late, pieces held back); the batch is
#: pinned split, as the search keeps this small GPT replicated under it
GPU = {"profile": "dgx-h100-ib"}

JOBS = {
    (2, 2): [("mlp", "sgd", "train", None), ("gpt", "adamw", "train", None),
             ("cnn", "sgd", "train", None, FAST), ("mlp", "adamw", "train", MATMUL_2D_MLP, FAST),
             ("gpt", "sgd", "train", MIXED_GPT, FAST), ("mlp", None, "gradients", {"input0": "(S0, S0)"}),
             ("gpt", None, "forward", {"input0": "(S0, B)"}),
             ("mlp", "sgd", "train", MATMUL_2D_MLP, {"schedule": False}),
             ("mlp", "adamw", "train", ZERO_MLP, PINNED), ("gpt_checkpointed", "adamw", "train", None),
             ("gpt", "sgd", "train", {"input0": "(S0, B)"}, GPU), ("mlp", "rmsprop", "train", MATMUL_2D_MLP, FAST),
             ("mlp", "adamw", "train", MATMUL_2D_MLP, {**FAST, "clip_grad_value": 0.02})],
    (4,): [("mlp", "adamw", "train", None), ("gpt", "sgd", "train", None),
           ("cnn", "adamw", "train", {"input0": "(S0)"}, FAST),
           ("mlp", "sgd", "train", TENSOR_PARALLEL_MLP, FAST),
           ("gpt", "adamw", "train", {"input0": "(S0)"}, {**FAST, "schedule": False, "fuse": False}),
           ("gpt", "adamw", "train", PURE_DP_GPT, {**PINNED, "decouple": False}),
           ("gpt", "adagrad", "train", {"input0": "(S0)"}, FAST)],
    (1, 4): [("gpt", "adamw", "train", {"input0": "(B, S0)"}),
             ("mlp", "sgd", "train", {"input0": "(B, S0)"}, FAST)],
    (2,): [("mlp", "sgd", "train", None), ("gpt", "adamw", "train", {"input0": "(S0)"}, FAST),
           ("cnn", "adamw", "train", None)],
}

#: the collective kinds each mesh's jobs must run between them (every kind runs on one mesh
#: at least; a plan change that stops exercising one fails here, not silently)
EXERCISED = {(2, 2): {"all_gather", "reduce_scatter", "all_reduce"},
             (4,): {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"},
             (1, 4): {"all_gather", "all_reduce"}, (2,): {"all_reduce"}}
#: one (rtol, atol) for every quantity
GLOO_TOLERANCES = dict.fromkeys(TOLERANCES, (1e-4, 1e-5))


@pytest.mark.parametrize("mesh", list(JOBS), ids=lambda m: "x".join(map(str, m)))
def test_compiled_step_matches_single_device(mesh):
    cases = JOBS[mesh]
    world = 1
    for p in mesh:
        world *= p
    per_rank = spawn(compiled_run, world, mesh, cases, timeout=120, deadline=360)
    exercised = set()
    for (model, opt, mode, placements, *options), got in zip(cases, per_rank[0]):
        clip_grad_value = options[0].get("clip_grad_value") if options else None
        collectives = got.pop("collectives")
        # gloo's functional collectives must not overlap (passes/waits.py)
        assert got.pop("most_in_flight") <= 1
        assert_matches_reference(got, reference(model, opt, mode, clip_grad_value=clip_grad_value),
                                 f"{model}/{opt}/{mode}/{placements}",
                                 **GLOO_TOLERANCES)
        exercised.update(collectives)
    assert exercised >= EXERCISED[mesh], exercised
    for rank, results in enumerate(per_rank[1:], start=1):  # every rank sees the same loss
        for r0, rk in zip(per_rank[0], results):
            for a, b in zip(r0.get("losses") or [], rk["losses"] or []):
                torch.testing.assert_close(a, b)


def _compile_on_wrong_world(rank):
    import torch.nn.functional as F

    from ddlc.runtime import compile
    from ddlc.zoo import MLP
    compile(MLP(), (2, 2), (torch.randn(8, 32), torch.randn(8, 16)), F.mse_loss)


def test_world_size_mismatch_is_a_clear_error():
    with pytest.raises(WorkerError, match="needs 4 processes but the world size is 2"):
        spawn(_compile_on_wrong_world, 2, timeout=30, deadline=120)


def _compile_on_another_mesh(rank, meshes):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh

    from ddlc.runtime import compile
    from ddlc.zoo import MLP
    mesh = meshes[rank]
    if mesh == "device mesh":
        mesh = DeviceMesh("cpu", torch.tensor([0, 1]))
    compile(MLP(), mesh, (torch.randn(8, 32), torch.randn(8, 16)), F.mse_loss)


@pytest.mark.parametrize("meshes, named", [
    [((2, 2), (2, 2), (2, 2), (4,)), r"rank 3 was given mesh \(4,\)"],
    [("device mesh", (2,)), r"rank 1 was given a mesh shape, for which ddlc makes the DeviceMesh where rank 0 "
                            r"was given a DeviceMesh of the ranks \[0, 1\]"]])
def test_ranks_given_different_meshes_are_refused_before_any_process_group_is_made(meshes, named):
    """Another mesh on one rank, which would make other process groups there (ranks
    waiting in ``new_group`` until the timeout, the innocent ones blamed: round AK), or a
    shape where the others give a DeviceMesh (that rank alone would make one), is
    refused on every rank, naming it."""
    with pytest.raises(WorkerError, match=f"RuntimeMismatchError: {named}"):
        spawn(_compile_on_another_mesh, len(meshes), meshes, timeout=20, deadline=120)


def _compile_under_autocast_on_rank1(rank):
    import contextlib

    import torch.nn.functional as F

    from ddlc.runtime import compile
    from ddlc.zoo import MLP
    with torch.autocast("cpu", dtype=torch.bfloat16) if rank == 1 else contextlib.nullcontext():
        compile(MLP(), (2,), (torch.randn(8, 32), torch.randn(8, 16)), F.mse_loss)


def test_autocast_on_one_rank_only_is_refused_naming_it():
    """Rank 1 compiling under torch.autocast traces another step; refused naming autocast
    (round AK: "rank 1 traced another training step than rank 0", the cause unnamed)."""
    with pytest.raises(WorkerError, match=r"RuntimeMismatchError: rank 1 was given torch.autocast on for cpu "
                                          r"\(bfloat16\) where rank 0 was given torch.autocast off"):
        spawn(_compile_under_autocast_on_rank1, 2, timeout=20, deadline=120)


def _compile_with_indivisible_batch(rank):
    import torch.nn.functional as F

    from ddlc.runtime import compile
    from ddlc.zoo import MLP
    compile(MLP(), (2,), (torch.randn(1, 32), torch.randn(1, 16)), F.mse_loss,
            placements={"input0": "(S0)"})


def test_a_batch_that_leaves_a_rank_empty_is_a_clear_error():
    # a batch of 5 on 2 ranks is split 3 + 2 (tests/test_uneven.py); of 1, a rank gets nothing
    with pytest.raises(WorkerError, match=r"cannot cut its shape \(1, 32\)"):
        spawn(_compile_with_indivisible_batch, 2, timeout=30, deadline=120)


def _die_before_collective(rank):
    import torch.distributed as dist
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_dead_rank_fails_fast_instead_of_hanging():
    with pytest.raises(WorkerError, match="died|failed|exited"):
        spawn(_die_before_collective, 2, timeout=20, deadline=60)


def _slow_to_plan(rank, slow_rank, where, seconds):
    """Compile an MLP on (3,) with ``ddlc.pipeline.<where>`` taking ``seconds`` longer on
    ``slow_rank``, then step once; the loss."""
    import time

    from torch import nn

    import ddlc
    from ddlc import pipeline
    original = getattr(pipeline, where)

    def slowed(*args, **kwargs):
        if rank == slow_rank:
            time.sleep(seconds)
        return original(*args, **kwargs)
    setattr(pipeline, where, slowed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    step = ddlc.compile(model, (3,), (x, y), loss_fn=nn.functional.mse_loss,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return float(step.step(x, y))


@pytest.mark.parametrize("slow_rank, where", [(0, "choose_plan"), (1, "plan_pinned")])
def test_ranks_wait_for_a_plan_longer_than_the_process_groups_timeout(slow_rank, where):
    """Rank 0 searching (ranks 1 and 2 wait for its plan; rank 1 would wait to send its
    data-parallel candidate) or rank 1 planning that candidate (rank 0 waits for it) for
    2.5 times the process group's 8 s timeout: every rank waits in the store while the
    slow one's heartbeat moves, and the step gives eager's loss."""
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    want = nn.functional.mse_loss(model(x), y).item()
    losses = spawn(_slow_to_plan, 3, slow_rank, where, 20.0, timeout=8, deadline=150)
    assert losses == pytest.approx([want] * 3, rel=1e-6)


def _wait_in_the_store(rank):
    """Rank 0 waits for keys that rank 1 sets: while rank 1 compiles (its heartbeat moves)
    and while it does not (it has stopped compiling): whether each came."""
    import time

    import torch.distributed as dist

    from ddlc import ranks
    ranks.STALE_SECONDS = 2.0
    if rank == 1:
        with ranks.compiling():
            time.sleep(5.0)  # longer than STALE_SECONDS: rank 0 sees the heartbeat move
            ranks._post("ddlc/test/compiled")
        dist.barrier()
        return None
    came = [ranks._await("ddlc/test/compiled", 1),
            ranks._await("ddlc/test/never", 1)]  # rank 1 no longer beats: given up, not hung
    dist.barrier()
    return came


def test_a_rank_waits_in_the_store_while_the_other_compiles_and_not_after():
    assert spawn(_wait_in_the_store, 2, timeout=30, deadline=90)[0] == [True, False]


def _state_dict_called_unlike(rank, case):
    """Three steps of an MLP on (2,), then ``step.state_dict()``: with ``case`` "rank 0
    alone", rank 0 also calls it after each step (the DDP habit of saving on rank 0), on a
    data-parallel plan; with "a step skipped", rank 1 skips the second step, on a plan
    without collectives (replicated: no collective would notice)."""
    from torch import nn

    import ddlc
    from ddlc.ir import collective_sequence
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    pins = {"input0": "(S0)", "input1": "(S0)"} if case == "rank 0 alone" else {}
    step = ddlc.compile(model, (2,), (x, y), loss_fn=nn.functional.mse_loss, placements=pins,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert bool(collective_sequence(step.program)) == bool(pins)
    for i in range(3):
        if case == "a step skipped" and rank == 1 and i == 1:
            continue
        step.step(x, y)
        if case == "rank 0 alone" and rank == 0:
            step.state_dict()
    return step.state_dict()


@pytest.mark.parametrize("case, refused", [
    ["rank 0 alone", r"rank 0 failed: RuntimeMismatchError: step.state_dict\(\) is a collective, which "
                     r"every rank must call .*but rank\(s\) \[1\] did not call it within 9 s"],
    ["a step skipped", r"RuntimeMismatchError: rank 1 called step.state_dict\(\) after 2 step\(s\) where "
                       r"rank 0 called step.state_dict\(\) after 3 step\(s\)"]])
def test_a_collective_method_called_unlike_on_the_ranks_is_refused_naming_it(case, refused):
    """A rank waiting for the others in a method every rank must call names the ranks that
    did not call it, before the process group's timeout (round AK: a gloo timeout that
    blamed rank 0); ranks that stepped a different number of times are refused, where the
    replicated plan's state_dict() silently returned the last rank's (round AK)."""
    with pytest.raises(WorkerError, match=refused):
        spawn(_state_dict_called_unlike, 2, case, timeout=10, deadline=90)


def _abort_on_exit(rank):
    os._exit = lambda code: os.abort()  # the worker ends through os._exit
    return rank * 10


def test_a_death_after_every_result_is_reported_not_a_failure():
    """A worker that dies exiting, after every rank has written its result, does not lose
    the job's results, but is reported with its stack (a rank dying earlier fails it)."""
    with pytest.warns(WorkerDiedAfterResults, match=r"rank \d died after every rank(?s:.*)in <lambda>"):
        assert spawn(_abort_on_exit, 2, timeout=20, deadline=60) == [0, 10]


def test_workers_with_progress_bars_leave_no_semaphore_behind(tmp_path):
    """tqdm's default lock holds a multiprocessing semaphore and a worker ends with
    ``os._exit``: without a lock of its own, the resource tracker warns of leaked
    semaphores when the job's process ends (``ddlc calibrate`` did, every run)."""
    script = tmp_path / "bars.py"
    script.write_text(textwrap.dedent("""
        import io

        from tqdm import tqdm
        from ddlc.launch import spawn

        def bars(rank):
            return sum(tqdm(range(3), disable=rank != 0, file=io.StringIO()))

        if __name__ == "__main__":
            print(spawn(bars, 2, timeout=30, deadline=90))
    """))
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110,
                         env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.returncode == 0 and "[3, 3]" in out.stdout, out.stderr
    assert "leaked semaphore" not in out.stderr


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.used(x)


def _optimizer_state_keys(rank):
    import torch.nn.functional as F

    import ddlc
    torch.manual_seed(0)
    model = _WithUnused()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    step = ddlc.compile(model, (2,), (x, y), F.mse_loss, opt)
    step.step(x, y)
    return sorted(step.optimizer_state())


def test_optimizer_state_holds_what_torch_optim_holds():
    """A parameter the loss does not read gets no gradient, so torch.optim keeps no state
    for it: the compiled step's optimizer_state() has none either (it had zeros)."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = _WithUnused()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    F.mse_loss(model(x), y).backward()
    opt.step()
    names = {p: k for k, p in model.named_parameters()}
    want = sorted(f"{names[p]}:{s}" for p, state in opt.state.items() for s in state)
    assert want and all(k.startswith("used.") for k in want)
    assert spawn(_optimizer_state_keys, 2) == [want, want]


def test_one_program_lowered_serves_every_rank():
    """Where the plan splits every tensor evenly, one rank lowers the program and the others
    make it theirs (passes/retarget.py): on a DeviceMesh laid out column by column (rank 1
    at mesh coordinate (1, 0)), with tensor-parallel pins (local slices, partial sums) and
    with a searched plan, the numbers, the gathered parameters and optimizer state among
    them, are the single device's, and ranks 2 and 3 lower nothing; nor do they trace or
    receive a graph to plan: they receive the program alone."""
    from distributed_cases import compiled_on_a_device_mesh
    cases = [("gpt", "sgd", "train", MIXED_GPT), ("gpt", "adamw", "train", None, GPU)]
    per_rank = spawn(compiled_on_a_device_mesh, 4, [[0, 2], [1, 3]], cases, timeout=120, deadline=360)
    lowered = [results[0].pop("lowered") for results in per_rank]
    assert lowered[0] > 0 and lowered[2:] == [0, 0], lowered
    passes = [results[0].pop("passes") for results in per_rank]
    assert "trace" in passes[0] and "trace" in passes[1], passes
    assert passes[2] == passes[3] == ["receive program", "retarget", "waits"], passes
    for (model, opt, mode, placements, *_), got in zip(cases, per_rank[0]):
        for key in ("collectives", "most_in_flight"):
            got.pop(key)
        assert_matches_reference(got, reference(model, opt, mode), f"{model}/{opt}/{placements}",
                                 **GLOO_TOLERANCES)


def test_a_device_mesh_whose_groups_rank_otherwise_is_refused():
    """torch ranks a process group's members by number; a DeviceMesh that lays ranks out in
    decreasing order along an axis would have collectives assemble pieces in the reverse
    of the plan's order (it trained silently wrong): every rank refuses it."""
    from distributed_cases import compiled_on_a_device_mesh
    with pytest.raises(WorkerError, match="MeshError.*increasing rank order"):
        spawn(compiled_on_a_device_mesh, 4, [[3, 2], [1, 0]], [("mlp", "sgd", "train", None)],
              timeout=120, deadline=240)


def test_sync_batchnorm_trains_as_the_batchnorm_it_converts():
    """A model converted with ``nn.SyncBatchNorm.convert_sync_batchnorm`` (as for DDP),
    compiled in a process group (where SyncBatchNorm's own forward would refuse CPU
    tensors and call collectives of its own), trains as the BatchNorm model it came from
    on one device: ddlc's BatchNorm already normalizes over the global batch. Every other
    layer is a cumulative average (``momentum=None``), whose factor each step reads from
    the count of batches it has reached."""
    import torch.nn.functional as F
    from distributed_cases import cumulative_every_other_batch_norm, sync_batchnorm_steps
    from ddlc import zoo
    losses, state = spawn(sync_batchnorm_steps, 4, 2, timeout=120, deadline=300)[0]
    torch.manual_seed(0)
    model = cumulative_every_other_batch_norm(zoo.resnet18(num_classes=10, width=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        want.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=1e-4, atol=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)
