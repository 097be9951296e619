"""Start local worker processes with a gloo process group (examples and tests).

``spawn(fn, world_size, *args)`` runs ``fn(rank, *args)`` on ``world_size``
fresh processes that have joined one gloo group, returns their results in rank
order, re-raises the first worker failure with its traceback, and never hangs:
collectives time out after ``timeout`` seconds and the whole job is killed at
``deadline`` seconds.

Workers are forked from a fork server that has imported torch, ddlc and the caller's script
once (about 3 s of CPU a process otherwise), where the platform has one, else started fresh ("spawn"). Either
way a worker starts from a clean interpreter state with the parent's ``sys.path``, main
module and environment as they are at the call: it imports ``fn``'s module itself, and
takes ``os.environ`` from the parent, not from the fork server.

A worker ends by writing its result, passing a barrier with the others (so nobody
exits while a peer still communicates) and ``os._exit(0)``: neither
``destroy_process_group`` nor interpreter teardown runs, since gloo's C++ destructors
(its pairs' and threads') could abort there. A worker that still dies after every rank
has written its result does not fail the job (its work is done), but is reported with
its stack as a :class:`WorkerDiedAfterResults` warning.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import re
import signal
import socket
import tempfile
import threading
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from .errors import RuntimeMismatchError

__all__ = ["spawn", "run", "WorkerError", "WorkerDiedAfterResults"]


class WorkerError(RuntimeMismatchError):
    """A worker process raised; the message carries its rank and traceback."""


class WorkerDiedAfterResults(RuntimeWarning):
    """A worker died after every rank had written its result: the job's numbers stand."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What every worker imports: the fork server imports it once, before forking any.
#: "__main__": the caller's script, where it was run as a file (as every spawned worker
#: imports it anyway), with what it imports (say, transformers). ``torch._dynamo``: every
#: rank's compile imports it (tracing, and the first ``FakeTensorMode``), 0.4-1.1 s each.
PRELOAD = ["__main__", "torch", "torch.distributed", "torch._dynamo", "ddlc"]


def _start_method() -> str:
    """"forkserver" (preloading :data:`PRELOAD`) where the platform has it, else "spawn"."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(PRELOAD)
    return "forkserver"


def _worker(rank, fn, world_size, port, timeout, outdir, args, environ):
    os.environ.clear()  # the parent's environment now, not the fork server's from its start
    os.environ.update(environ)
    result_path = os.path.join(outdir, f"rank{rank}.pkl")
    # a crash (SIGSEGV, SIGABRT) writes every thread's Python stack here, and so does
    # SIGUSR1, which the parent sends to a rank that stopped answering
    faults = open(_faults_path(outdir, rank), "w")
    faulthandler.enable(file=faults, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=faults, all_threads=True)
    # tqdm's default lock holds a multiprocessing semaphore, which os._exit below leaves to
    # the resource tracker, whose warning then ends every run; a worker's bars are its own
    tqdm.set_lock(threading.RLock())
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        value = ("ok", fn(rank, *args))
    except BaseException as e:  # report every failure, with its traceback, to the parent
        value = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(result_path + ".tmp", result_path)
    if value[0] == "ok" and dist.is_initialized():
        dist.barrier()  # nobody exits while a peer still communicates
    os._exit(0)  # no process-group or interpreter teardown: gloo's destructors can abort there


def run(fn, world_size: int, *args, timeout: float = 60.0, deadline: float = 300.0):
    """``fn(rank, *args)`` on every rank; rank 0's result where rank 0 runs, else None.

    Under ``torchrun`` (``RANK`` set) this process is one rank: it joins the job's
    process group (NCCL when CUDA is available, otherwise gloo; ``world_size`` is then
    the launcher's) and calls ``fn`` once. Otherwise :func:`spawn` starts ``world_size``
    local gloo workers and this process gets rank 0's result. So one script runs on a
    laptop, on one node, or on several nodes::

        python script.py
        torchrun --nproc-per-node=4 script.py
        torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 script.py
    """
    if "RANK" not in os.environ:
        return spawn(fn, world_size, *args, timeout=timeout, deadline=deadline)[0]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        result = fn(dist.get_rank(), *args)
        dist.barrier()
        return result if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout: float = 60.0, deadline: float = 300.0) -> list:
    """Run ``fn(rank, *args)`` on ``world_size`` local gloo processes; results by rank.

    The first worker to fail stops the job: the others are killed and its
    traceback is raised as :class:`WorkerError`.
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(fn, world_size, _free_port(), timeout, outdir, args,
                                                dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=_start_method())
        start = time.monotonic()
        try:
            while True:
                try:
                    if ctx.join(timeout=0.2):
                        break
                except mp.ProcessExitedException as e:
                    if _all_ok(outdir, world_size):  # died exiting, its work done
                        warnings.warn(f"rank {e.error_index} died after every rank had written "
                                      f"its result ({e}); the results stand. Its stack:\n"
                                      f"{_stacks(outdir, [e.error_index])}", WorkerDiedAfterResults)
                        break
                    died = f"a worker died: {e}\n{_stacks(outdir, [e.error_index])}"
                    raise WorkerError(_first_error(outdir, world_size) or died) from None
                except mp.ProcessRaisedException as e:
                    # a rank raised outside its function, in the barrier before exiting: a
                    # peer left first (having failed, or having passed the barrier and
                    # closed its connections while this rank still finished it)
                    time.sleep(0.2)
                    if _all_ok(outdir, world_size):
                        warnings.warn(f"rank {e.error_index} failed in the closing barrier after every "
                                      f"rank had written its result ({str(e).strip().splitlines()[-1]}); "
                                      "the results stand", WorkerDiedAfterResults)
                        break
                    missing = [r for r in range(world_size) if _load(outdir, r) is None]
                    raise WorkerError(_first_error(outdir, world_size) or (
                        f"rank {e.error_index} failed in the closing barrier, and rank(s) {missing} "
                        f"left without a result (a crash?): {str(e).strip().splitlines()[-1]}\n"
                        f"{_stacks(outdir, missing)}")) from None
                error = _first_error(outdir, world_size)
                if error:
                    raise WorkerError(_blame_silent_ranks(error, ctx, outdir, world_size))
                if time.monotonic() - start > deadline:
                    silent = _silent_ranks(ctx, outdir, world_size)
                    raise WorkerError(f"the {world_size} workers did not finish within {deadline} s; "
                                      f"rank(s) {silent} were still running, where:\n"
                                      f"{_dump_stacks(ctx, outdir, silent)}")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        error = _first_error(outdir, world_size)
        if error:
            raise WorkerError(error)
        results = [_load(outdir, rank) for rank in range(world_size)]
        missing = [r for r, v in enumerate(results) if v is None]
        if missing:
            raise WorkerError(f"rank(s) {missing} exited without a result")
        return [v[1] for v in results]


def _faults_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"rank{rank}.faults")


def _stacks(outdir: str, ranks, limit: int = 4000) -> str:
    """The Python stacks faulthandler wrote for ``ranks`` (the end of each, if long)."""
    out = []
    for rank in ranks:
        try:
            with open(_faults_path(outdir, rank)) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text:
            out.append(f"rank {rank}:\n{text[-limit:]}")
    return "\n".join(out)


def _silent_ranks(ctx, outdir: str, world_size: int) -> list[int]:
    """Ranks still running that have written no result: the ones that stopped answering."""
    return [rank for rank, p in enumerate(ctx.processes)
            if p.is_alive() and _load(outdir, rank) is None]


def _dump_stacks(ctx, outdir: str, ranks: list[int]) -> str:
    for rank in ranks:
        try:
            os.kill(ctx.processes[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:  # it ended meanwhile
            pass
    time.sleep(0.5)
    return _stacks(outdir, ranks)


_TIMEOUT = re.compile(r"timed? ?out|timeout", re.I)


def _blame_silent_ranks(error: str, ctx, outdir: str, world_size: int) -> str:
    """A collective timeout blames the rank that timed out; name the ranks it was waiting
    for instead (still running, no result), with where they are stuck."""
    if not _TIMEOUT.search(error.split("\n", 1)[0]):  # the error's own message, not its traceback
        return error
    time.sleep(0.2)  # the other healthy ranks report their own timeouts meanwhile
    silent = [r for r in _silent_ranks(ctx, outdir, world_size) if f"rank {r} failed" not in error]
    if not silent:
        return error
    return (f"rank(s) {silent} stopped answering (still running, no result); the others timed "
            f"out waiting for them. Where they are:\n{_dump_stacks(ctx, outdir, silent)}\n"
            f"The first timeout: {error}")


def _load(outdir: str, rank: int):
    path = os.path.join(outdir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (EOFError, pickle.UnpicklingError):  # still being written
        return None


def _all_ok(outdir: str, world_size: int) -> bool:
    """Whether every rank has written a successful result (a worker writes it, and passes a
    barrier with the others, before it tears the process group down)."""
    return all((value := _load(outdir, rank)) is not None and value[0] == "ok"
               for rank in range(world_size))


def _first_error(outdir: str, world_size: int) -> str | None:
    for rank in range(world_size):
        value = _load(outdir, rank)
        if value is not None and value[0] == "error":
            return f"rank {rank} failed: {value[1]}"
    return None
