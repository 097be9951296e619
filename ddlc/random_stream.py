"""The random stream of compiled programs: one per device, as eager's default generator.

A program that draws random numbers (dropout) draws from its own generator
(``gm.rng``), which :func:`share_generator` seeds with rank 0's stream. The programs of a
process share one stream (:data:`STREAM`: the :class:`ProgramDraws` of the program that
drew, was seeded or loaded last; each goes on from it before it runs), and hand it to the
default generator at a write-back (:meth:`ProgramDraws.hand_back`), unless the user moved
the default generator since: the user's state then goes first.
"""
from __future__ import annotations

import hashlib

import torch
from torch import fx

from .ranks import from_rank0

__all__ = ["HANDED", "STREAM", "ProgramDraws", "default_rng_state", "marked_rng_state", "share_generator"]


def default_rng_state(device: torch.device) -> torch.Tensor:
    """The state of the default generator of ``device``'s type (CPU or that CUDA device)."""
    return torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)


def marked_rng_state(device: torch.device) -> torch.Tensor:
    """Reseed the default generator of ``device``'s type from a hash of its state, and
    return the new state: what a new program (seeded from the state before) records as the
    state the two agreed on. Left as it was, that state is the one ``torch.manual_seed`` of
    the same seed gives again (a sweep's second run in one process, a notebook cell run
    twice), which would then be taken for a generator nobody moved, and the earlier
    program's stream handed back over the user's seed; a state some draws away from it
    (one draw) is the one the user's own draws after that seed can reach. Only a
    ``manual_seed`` of the hash reaches this one."""
    digest = hashlib.blake2b(default_rng_state(device).cpu().numpy().tobytes(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") >> 1
    generator = torch.default_generator if device.type == "cpu" else \
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    generator.manual_seed(seed)
    return default_rng_state(device)


class ProgramDraws:
    """A program's ``generator``, the state of the default generator (CPU or CUDA, as the
    program's) when the two last agreed (``synced``: the step was made, or handed its own
    state back) and the generator's own state then (``handed``)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.handed = generator.get_state()
        self.synced = marked_rng_state(generator.device)
        #: whether this rank's last :meth:`hand_back` put the stream into the default generator
        self.handed_back = False

    def continue_from(self, other: "ProgramDraws | None") -> None:
        """Where another program drew since this one (a training step and an inference
        program drawing in turn, MC dropout; two models' steps), go on from its generator's
        state, as eager's one default generator would."""
        if other is not None and other is not self and other.generator.device == self.generator.device:
            self.generator.set_state(other.generator.get_state())
            self.synced, self.handed, self.handed_back = other.synced, other.handed, other.handed_back

    def hold(self) -> None:
        """Hold the random stream (:data:`STREAM`): this program draws next, or was seeded
        or loaded last (no longer handed back: :data:`HANDED`)."""
        STREAM[self.generator.device] = self
        HANDED.pop(self.generator.device, None)

    def take_stream(self) -> None:
        """Go on from the random stream's latest state (another program's draws since this
        one's, or, where the stream was handed back to the default generator and the user
        drew from it since, the default generator's: :meth:`take_users_draws`) and hold it."""
        self.continue_from(STREAM.get(self.generator.device))
        handed = HANDED.get(self.generator.device)
        if handed is not None:
            self.take_users_draws(handed)
        self.hold()

    def take_users_draws(self, handed: "ProgramDraws") -> None:
        """After ``handed`` gave the stream to the default generator (:meth:`hand_back`),
        the user's draws from it since (a sampled ``generate()``, a ``DataLoader``'s
        ``iter``) come before the program's next ones, as in eager: where rank 0's default
        generator moved since it took the stream, this program goes on from rank 0's state
        (one collective, on every rank alike: every rank handed back at the same calls)."""
        device = self.generator.device
        mine = default_rng_state(device)
        moved = handed.handed_back and not torch.equal(mine, handed.synced)
        moved, state = from_rank0((moved, mine.cpu() if moved else None))
        if moved:
            self.generator.set_state(state.to(self.generator.get_state().device))
            self.synced, self.handed = mine, self.generator.get_state()

    def agree(self) -> None:
        """Take the default generator's state as agreed with the program's stream, as a
        checkpoint's stream is loaded: the user's draws before the load are superseded (as
        eager's restored random state supersedes them), those after are not taken."""
        self.synced = default_rng_state(self.generator.device)

    def apart_from_default(self) -> bool:
        """Whether the default generator moved since the two last agreed: draws or a seed
        of the user's between compiled calls, which this program's stream goes on without
        (after :meth:`take_stream`, which takes them where a write-back handed the stream
        over)."""
        return not torch.equal(default_rng_state(self.generator.device), self.synced)

    def unmoved_stream(self) -> torch.Tensor | None:
        """The stream's latest state (this program generator's), where the default
        generator has not moved since the two agreed; else None (the user's state goes
        first)."""
        if torch.equal(default_rng_state(self.generator.device), self.synced):
            return self.generator.get_state()
        return None

    def hand_back(self) -> None:
        """The program generator's state into the default generator, where the steps after
        it, eager or compiled, continue the stream; unless the default generator moved
        since the two agreed (the user reseeded it with ``torch.manual_seed`` for a new
        phase, or eager steps drew from it): that state is the user's, and stays (this time
        and after); and unless the program has not drawn since they agreed (its state then
        is where a seed put it, which the same seed would give again: the marked default
        state stays, see :func:`marked_rng_state`)."""
        device = self.generator.device
        state = self.generator.get_state()
        HANDED[device] = self  # on every rank, handed back here or not: see take_users_draws
        if not torch.equal(default_rng_state(device), self.synced):
            self.handed_back = False  # the user's state, not the stream
            return
        if torch.equal(state, self.handed):  # no draw since: as the last hand-back left it
            return
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)
        self.synced, self.handed = default_rng_state(device), state
        self.handed_back = True


#: per device (the CPU, each GPU), the draws of the compiled program that holds the latest
#: state of the random stream: the one that drew last, or was seeded or loaded last. Every
#: program goes on from it before it runs, and compiling, ``write_back`` and
#: ``save_checkpoint`` take it (one stream, as eager's one default generator)
STREAM: "dict[torch.device, ProgramDraws]" = {}


#: per device, the draws of the program that last handed the stream to the default generator
#: (:meth:`ProgramDraws.hand_back`), until a program takes it again
HANDED: "dict[torch.device, ProgramDraws]" = {}


def share_generator(gm: fx.GraphModule, device: torch.device, cpu_state: torch.Tensor,
                     stream: torch.Tensor | None = None) -> None:
    """Give the program's generator (``gm.rng``, present when the step draws random
    numbers) rank 0's random stream: the state of the program that holds it
    (:data:`STREAM`) where the default generator has not moved since (``stream``), else
    the default generator's as ``compile`` found it: on the CPU its full state
    (``cpu_state``), so a single-device run seeded alike draws the same numbers; on a GPU,
    that of its default CUDA generator."""
    if not hasattr(gm, "rng"):
        return
    state = stream if stream is not None else cpu_state if device.type == "cpu" else torch.cuda.get_rng_state(device)
    gm.rng = torch.Generator(device=device)
    gm.rng.set_state(from_rank0(state))
