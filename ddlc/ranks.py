"""What the ranks of a process group tell each other while compiling and stepping: one
rank decides and every rank receives the decision (:func:`on_rank0`, a failure raised on
every rank instead of leaving the others waiting), rank 1's one message to rank 0
(:func:`send_to_rank0`), rank 0's model and optimizer state given to every rank (as
``DistributedDataParallel`` gives its parameters), and a fingerprint that tells tensors
apart without sending them.

Waiting for a decision. Planning can take longer than the process group's timeout (a
search on a 3-D mesh: one to two minutes; ``ddlc.spawn``'s timeout is 60 s), and a rank
waiting in a collective for it would time out. So while compiling (:func:`compiling`)
every rank counts a heartbeat in the process group's store, and a rank waiting for
another's decision first waits in the store, as long as the other's heartbeat moves,
for the key the other sets once it has decided (:func:`_await`); only then does it enter
the collective that carries the decision, which the other is about to enter too. A rank
whose heartbeat stops (it died, or it is not compiling) is waited for no longer: the
collective's own timeout then applies, as before. Rank 1's message to rank 0 goes
through the store as well, so neither waits for the other in a point-to-point send.
"""
from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from .errors import RuntimeMismatchError, as_shared

__all__ = ["broadcast_from_rank0", "compiling", "every_rank_calls", "from_rank0", "on_rank", "on_rank0", "receive_from",
           "receive_from_rank1", "send_to_rank0", "take_rank0_hyperparameters", "take_rank0_optimizer_state",
           "take_rank0_state", "tensor_fingerprint"]

#: seconds between two heartbeats of a compiling rank
BEAT_SECONDS = 1.0
#: a rank whose heartbeat has not moved for this long is waited for no longer in the store
STALE_SECONDS = 10.0
#: this process's :func:`on_rank` calls and rank 1's messages so far: every rank makes the
#: same calls in the same order (each matches a collective or a message), so the n-th of
#: each names the same decision or message on every rank
_decisions = itertools.count()
_letters = itertools.count()
#: this process's calls of a compiled step's collective methods so far (:func:`every_rank_calls`)
_calls = itertools.count()
#: ddlc's store operations, one at a time (the heartbeat's thread and the main thread)
_store_lock = threading.Lock()


def _store():
    """The default process group's store."""
    return dist.distributed_c10d._get_default_store()


def _beat_key(rank: int) -> str:
    return f"ddlc/heartbeat/{rank}"


@contextlib.contextmanager
def compiling():
    """Within, a thread of this rank adds one to its heartbeat count in the store every
    :data:`BEAT_SECONDS` (nothing on a process group of one rank)."""
    if dist.get_world_size() == 1:
        yield
        return
    store, key, stop = _store(), _beat_key(dist.get_rank()), threading.Event()

    def beat() -> None:
        while not stop.wait(BEAT_SECONDS):
            with _store_lock:
                try:
                    store.add(key, 1)
                except RuntimeError:  # the store is gone (its host ended): the collectives say so
                    return

    thread = threading.Thread(target=beat, name="ddlc-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _poll(keys: list[str], give_up) -> list[int]:
    """Check the store until every one of ``keys`` is there, or ``give_up()`` (asked between
    checks) is true; the indices of the keys still missing (none: all came). Pauses double
    from 1 ms to 20 ms (a check costs about 10 us; ``store.wait`` with a short timeout
    would wake at once, but TCPStore logs a warning at each timeout)."""
    store, pause = _store(), 0.001
    while True:
        with _store_lock:
            missing = [i for i, key in enumerate(keys) if not store.check([key])]
        if not missing or give_up():
            return missing
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


class _Heartbeat:
    """Rank ``source``'s heartbeat count as this rank sees it in the store."""

    def __init__(self, source: int):
        self.key = _beat_key(source)
        self.count, self.since = self._read(), time.monotonic()

    def _read(self) -> int:
        with _store_lock:
            return _store().add(self.key, 0)

    def stopped(self) -> bool:
        """Whether the count has not moved for :data:`STALE_SECONDS` (read at most that often)."""
        if time.monotonic() - self.since < STALE_SECONDS:
            return False
        count = self._read()
        if count == self.count:
            return True
        self.count, self.since = count, time.monotonic()
        return False


def _await(key: str, source: int) -> bool:
    """Wait until ``key`` is in the store, as long as rank ``source``'s heartbeat moves;
    whether the key came."""
    return not _poll([key], _Heartbeat(source).stopped)


def _post(key: str, value: bytes = b"") -> None:
    with _store_lock:
        _store().set(key, value)


def _timeout_seconds() -> float:
    """The default process group's timeout (torch's default where its backend does not tell)."""
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(device)
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()


def every_rank_calls(call: str, steps: int) -> None:
    """Before a collective method of a compiled step (``call``, e.g. ``"step.state_dict()"``,
    here after ``steps`` steps): every rank writes what it calls into the store, under
    this process's count of such calls, and waits for the others' (for 90% of the process
    group's timeout, so that this error comes before the timeout of a rank that went on to
    ``step()``). Refused, on the ranks that wait, naming the ranks that did not call it (the
    DDP habit of ``model.state_dict()`` on rank 0 alone: ddlc's gathers pieces from every
    rank); refused on every rank where the ranks call different methods, or after different
    numbers of steps (a rank that skipped a step trained otherwise, and a replicated plan
    would not notice)."""
    world = dist.get_world_size()
    if world == 1:
        return
    n = next(_calls)
    keys = [f"ddlc/call/{n}/{rank}" for rank in range(world)]
    _post(keys[dist.get_rank()], f"{call} after {steps} step(s)".encode())
    timeout = 0.9 * _timeout_seconds()
    deadline = time.monotonic() + timeout
    missing = _poll(keys, lambda: time.monotonic() > deadline)
    if missing:
        raise RuntimeMismatchError(
            f"{call} is a collective, which every rank must call (it gathers the pieces every "
            f"rank holds; unlike DDP's model.state_dict(), not on rank 0 alone: call it on every "
            f"rank, then save on one), but rank(s) {missing} did not call it within {timeout:.0f} s "
            "(a rank that calls step() more often than this one waits in it)")
    with _store_lock:
        calls = [_store().get(key).decode() for key in keys]
    for rank, theirs in enumerate(calls):
        if theirs != calls[0]:
            raise RuntimeMismatchError(
                f"rank {rank} called {theirs} where rank 0 called {calls[0]}: every rank must call "
                "a compiled step's methods alike, and step() as often (else its training differs)")


def on_rank0(what: str, decide):
    """``decide()`` on rank 0 (the others pass None), broadcast to every rank: one decision
    for all, whatever a solver's time limit or a timed search would give elsewhere, and
    the others need not repeat the work. Rank 0's failure is raised on every rank (as
    itself where it is a ``ddlc.errors`` error) instead of leaving the others waiting."""
    return on_rank(0, what, decide)


def on_rank(source: int, what: str, decide):
    """:func:`on_rank0` with rank ``source`` deciding. The others wait for the decision in
    the store first (see the module's docstring)."""
    decided, failure = f"ddlc/decided/{next(_decisions)}", None
    if dist.get_rank() == source:
        try:
            message = [decide()]
        except Exception as error:
            failure, message = error, [as_shared(error, f"rank {source} failed while {what}")]
        _post(decided)
    else:
        message = [None]
        _await(decided, source)
    dist.broadcast_object_list(message, src=source)
    if failure is not None:
        raise failure
    if isinstance(message[0], Exception):
        raise message[0]
    return message[0]


def from_rank0(value):
    """Rank 0's ``value``, on every rank."""
    message = [value]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def broadcast_from_rank0(tensor: torch.Tensor) -> None:
    """Rank 0's values into ``tensor`` on every rank, in place (collective)."""
    if tensor.is_contiguous():
        dist.broadcast(tensor, src=0)
    else:
        dense = tensor.contiguous()
        dist.broadcast(dense, src=0)
        tensor.copy_(dense)


def receive_from(source: int):
    """The one object ``source`` sends this rank (pickled once by the sender where it goes
    to several ranks)."""
    message = [None]
    dist.recv_object_list(message, src=source)
    return pickle.loads(message[0]) if isinstance(message[0], bytes) else message[0]


def send_to_rank0(message) -> None:
    """Rank 1's one message to rank 0 during ``compile`` (its data-parallel
    :class:`ddlc.pipeline.Candidate` as sent, or ``NoCandidate``, None, or its failure),
    left in the store, pickled, for :func:`receive_from_rank1`: rank 0 takes it when its
    own planning needs it, which may be minutes later."""
    _post(f"ddlc/letter/{next(_letters)}", pickle.dumps(message))


def receive_from_rank1():
    """On rank 0: rank 1's message of :func:`send_to_rank0`, waited for in the store while
    rank 1's heartbeat moves (then the store's own timeout applies), and removed from it."""
    key = f"ddlc/letter/{next(_letters)}"
    _await(key, 1)
    with _store_lock:
        store = _store()
        letter = store.get(key)
        store.delete_key(key)
    return pickle.loads(letter)


def take_rank0_state(model: nn.Module) -> None:
    """Overwrite every rank's parameters and buffers with rank 0's, in place (as
    ``DistributedDataParallel`` does): ranks that initialised their models differently (no
    common seed) would otherwise each shard their own values, and replicated parameters
    would differ between ranks."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            broadcast_from_rank0(tensor)


def take_rank0_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Give every rank's ``optimizer`` rank 0's state (``optimizer.state``), as
    :func:`take_rank0_state` gives it rank 0's parameters: the program continues from the
    optimizer's state where it has one (a loaded checkpoint, eager steps before compile),
    and ranks whose optimizers stepped on other data, or only rank 0's loaded a checkpoint,
    would otherwise each continue from their own. Rank 0 broadcasts what its state holds per
    parameter (in ``param_groups`` order): scalars (a step count) by value, other tensors
    by shape, dtype and device type, each then broadcast; every other rank's state is made
    to hold exactly that (what rank 0's lacks is dropped)."""
    if optimizer is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def held(value):
        if not isinstance(value, torch.Tensor):
            return ("value", value)
        if value.dim() == 0:
            return ("scalar", value.item(), value.dtype, value.device.type)
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)

    message = [[{name: held(v) for name, v in optimizer.state.get(p, {}).items()} for p in params]
               if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(message, src=0)
    with torch.no_grad():
        for param, wanted in zip(params, message[0]):
            if not wanted:
                optimizer.state.pop(param, None)
                continue
            state = optimizer.state[param]
            for name in [k for k in state if k not in wanted]:
                del state[name]
            for name, (kind, *what) in wanted.items():
                if kind == "value":
                    state[name] = what[0]
                    continue
                device = param.device if what[-1] == param.device.type else torch.device(what[-1])
                if kind == "scalar":
                    state[name] = torch.tensor(what[0], dtype=what[1], device=device)
                    continue
                shape, dtype = what[0], what[1]
                mine = state.get(name)  # rank 0's own always fits (a strided one too: Adagrad's
                # sum of a transposed weight, kept in its layout; replacing it lost its values)
                if not (isinstance(mine, torch.Tensor) and tuple(mine.shape) == shape and mine.dtype == dtype
                        and mine.device == device):
                    mine = state[name] = torch.empty(shape, dtype=dtype, device=device)
                broadcast_from_rank0(mine)


def take_rank0_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """Give every rank's ``optimizer`` rank 0's param-group settings (learning rate,
    betas, ...: every entry but the parameters), as an ``optimizer.load_state_dict`` on rank
    0 alone sets them there."""
    message = [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
               if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(message, src=0)
    for group, settings in zip(optimizer.param_groups, message[0]):
        group.update(settings)


#: integer dtypes by element size, to read a tensor's bits as (:func:`tensor_fingerprint`)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: the moduli of the position classes a fingerprint sums over: two primes, so that values
#: swapped between positions show unless the positions are a multiple of their product apart
_MODULI = (997, 1009)


def tensor_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Int64 numbers that tell tensors of one shape and dtype apart: the sums of their
    elements' bits read as integers (wrapping on overflow) over the positions of each class
    modulo 997 and modulo 1009. A change of any element's bits changes a sum (NaNs,
    infinities and the sign of zero are bits like any other), and so do values moved to
    positions of another class. One read of the tensor per modulus, no copy of it (a 124
    M-parameter model's weights: about half a second on a CPU core). A complex tensor is
    read as its real and imaginary parts."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    x = t.reshape(-1).view(_BITS[t.element_size()])
    return torch.cat([_class_sums(x, k) for k in _MODULI])


def _class_sums(x: torch.Tensor, k: int) -> torch.Tensor:
    """The sums of the flat integer tensor ``x`` over its positions ``i`` of each class ``i % k``."""
    whole = x.numel() - x.numel() % k
    sums = x[:whole].view(-1, k).sum(0, dtype=torch.int64)
    tail = x[whole:].to(torch.int64)
    sums[:tail.numel()] += tail
    return sums
