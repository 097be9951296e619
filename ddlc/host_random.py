"""Draws from Python's or NumPy's random generators while the step is traced.

A forward or loss that draws from ``random`` or ``numpy.random`` (mixup's coefficient,
wav2vec2's SpecAugment masks, a LayerDrop decision) is traced with the numbers it drew
that once: the graph holds them as constants, and every step would reuse them where eager
draws anew at each call. Such a step is refused, also where the draw does not change the
program (LayerDrop at probability 0): eager's draws still move the generator, which the
compiled step would not (a data order shuffled with ``random`` would then differ), and
whether a draw can change the program cannot be told from a few traces (a LayerDrop at
probability 0.1 changes it in one trace of ten). A forward that seeds the generator with
a constant before it draws (BigBird's random attention) draws the same numbers at every
call and leaves the generator as it would at every call: it is taken.

Algorithm: :class:`HostGenerators` snapshots the states of every host generator of the
process (Python's ``random.Random`` instances and NumPy's bit generators, which every
``RandomState`` and ``Generator`` draws from, found through the garbage collector: about
0.1 s with transformers loaded) before the trace. If the trace moved any,
:meth:`HostGenerators.refuse_unless_seeded` seeds those afresh and traces the step once
more under a line tracer: one that trace leaves as seeded was moved by something else
(another thread); where it leaves the others in the same states as the first and gives
the same program (code and constant tensors), the step seeds them itself, and
the generators are given back the states the first trace left, as eager's one call
would; otherwise it is refused, naming the line of the first draw, and the generators
are given back the states they had before.
"""
from __future__ import annotations

import gc
import linecache
import pickle
import random
import sys
import tempfile
import traceback
from typing import Callable

import torch
from torch import fx

from . import sources
from .errors import UnsupportedInputError

__all__ = ["HostGenerators"]

#: the seed of the moved generators for the trace that checks whether the step seeds them
_OTHER_SEED = 271828


def _numpy_random():
    """``numpy.random`` if NumPy is loaded (a model that draws from it has imported it)."""
    return sys.modules.get("numpy.random")


def _generators() -> list:
    """Every host generator alive in the process, each once: Python's ``random.Random``
    instances (not ``SystemRandom``, which draws from the system's entropy and has no
    state; not the tools' own, :func:`_tools_own`) and NumPy's bit generators (every ``RandomState`` and ``Generator`` draws from
    one), found among the objects the garbage collector tracks (by exact type: an
    ``isinstance`` would call ``__class__`` properties, which some objects warn on). Python's
    and NumPy's global ones come first."""
    np_random = _numpy_random()
    kinds = (random.Random,) + ((np_random.BitGenerator,) if np_random is not None else ())
    found = [random._inst] + ([np_random.mtrand._rand._bit_generator] if np_random is not None else [])
    known = {id(g) for g in found} | {id(g) for g in _tools_own()}
    for value in gc.get_objects():
        kind = type(value)
        if issubclass(kind, kinds) and not issubclass(kind, random.SystemRandom) and id(value) not in known:
            known.add(id(value))
            found.append(value)
    return found


#: modules whose generators are their own business, not the model's: sympy's assumptions
#: shuffle theirs while torch reasons about symbolic sizes; tempfile names files with its
#: own (torch's compile workers, in their threads)
_TOOLS = ("sympy", "torch", "tempfile")


def _tools_own() -> list:
    """The generators the modules of :data:`_TOOLS` hold as globals (or, for tempfile,
    its name sequence's)."""
    own = [getattr(getattr(tempfile, "_name_sequence", None), "_rng", None)]
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in _TOOLS and module is not None:
            own += [v for v in vars(module).values() if type(v) is random.Random]
    return [g for g in own if g is not None]


def _state(generator):
    """``generator``'s state; for a ``random.Random`` its attributes too (a subclass may
    keep its own state there)."""
    if isinstance(generator, random.Random):
        return generator.getstate(), dict(vars(generator))
    return generator.state


def _set_state(generator, state) -> None:
    if isinstance(generator, random.Random):
        generator.setstate(state[0])
        vars(generator).update(state[1])
    else:
        generator.state = state


def _seed(generator, seed: int) -> None:
    if isinstance(generator, random.Random):
        generator.seed(seed)
    else:
        generator.state = type(generator)(seed).state


def _describe(generator) -> str:
    if generator is random._inst:
        return "Python's global random generator (random)"
    np_random = _numpy_random()
    if np_random is not None and generator is np_random.mtrand._rand._bit_generator:
        return "NumPy's global random generator (numpy.random)"
    if isinstance(generator, random.Random):
        return f"a {type(generator).__module__}.{type(generator).__name__} (Python's random)"
    return f"a NumPy random generator (its bit generator {type(generator).__name__})"


class HostGenerators:
    """The host generators of the process, and their states now."""

    def __init__(self) -> None:
        self.generators, self.before = [], []
        for generator in _generators():
            try:
                self.before.append(pickle.dumps(_state(generator)))
            except Exception:  # a subclass holding what does not pickle: its draws go unseen
                continue
            self.generators.append(generator)

    def moved(self) -> list:
        """The generators whose state moved since the snapshot."""
        return [g for g, s in zip(self.generators, self.before) if pickle.dumps(_state(g)) != s]

    def refuse_unless_seeded(self, gm: fx.GraphModule, retrace: Callable[[], fx.GraphModule]) -> None:
        """Refuse the step traced as ``gm`` if the trace drew from a host generator that
        the step does not seed itself: ``retrace()`` traces the step again."""
        moved = self.moved()
        if not moved:
            return
        after = [_state(g) for g in self.generators]
        first_draw: list[tuple[object, str | None]] = []
        refused = False
        try:
            for g in moved:
                _seed(g, _OTHER_SEED)
            seeded = [pickle.dumps(_state(g)) for g in moved]
            with _first_draw_recorded(moved, first_draw):
                other = retrace()
            # a generator the second trace did not move was not moved by the step (another
            # thread drew from it meanwhile)
            drawn = [g for g, s in zip(moved, seeded) if pickle.dumps(_state(g)) != s]
            if not drawn or (all(pickle.dumps(_state(g)) == pickle.dumps(s)
                                 for g, s in zip(self.generators, after) if any(g is d for d in drawn))
                             and _same_program(gm, other)):
                return  # nothing drawn by the step, or it seeds them with constants before it draws
            generator, line = first_draw[0] if first_draw else (drawn[0], None)
            refused = True
            raise UnsupportedInputError(
                f"the step draws from {_describe(generator)} while it is traced: the trace records "
                "the numbers drawn as constants, so every step would reuse that one draw where eager "
                "draws anew at each call (a mixup coefficient, a SpecAugment mask, a LayerDrop "
                "decision), and would not move that generator as eager's calls do (a draw that "
                "changes nothing, LayerDrop at probability 0, moves it too). Draw with torch "
                "instead (torch.rand, torch.randn, torch.randint: the step draws those anew at "
                "every step from its own generator), or draw outside the model and pass the "
                "number in as an example input", where=line)
        finally:  # as one eager call leaves them, or, refused, as they were
            states = [pickle.loads(b) for b in self.before] if refused else after
            for g, state in zip(self.generators, states):
                _set_state(g, state)


class _first_draw_recorded:
    """Within, the first line of the user's or a model library's code (not torch's, not
    the standard library's) during which one of ``generators`` moves appends
    ``(generator, that line)`` to ``found``: a line tracer compares the generators' states
    at each such line (NumPy's draws are Cython calls, which a profile hook does not see)."""

    def __init__(self, generators, found: list) -> None:
        self.generators = generators
        self.found = found
        self.states = [pickle.dumps(_state(g)) for g in generators]
        self.running: tuple | None = None  # (frame, line number) of the line running

    def _moved(self):
        return next((g for g, s in zip(self.generators, self.states) if pickle.dumps(_state(g)) != s), None)

    def _local(self, frame, event, arg):
        if self.found:
            return None
        if event in ("line", "return") and self.running is not None:
            generator = self._moved()
            if generator is not None:
                self.found.append((generator, _cite_at(*self.running)))
                return None
        if event == "line":
            self.running = (frame, frame.f_lineno)
        return self._local

    def _call(self, frame, event, arg):
        name = frame.f_code.co_filename
        if self.found or not (sources.is_user_file(name) or sources.is_library_file(name)):
            return None
        return self._local

    def __enter__(self):
        self.previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self.previous)


def _cite_at(frame, lineno: int) -> str | None:
    """:func:`sources.cite` of the stack of ``frame`` running its line ``lineno``."""
    entries = [(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_stack(frame)]
    filename, _, name, _ = entries[-1]
    entries[-1] = (filename, lineno, name, linecache.getline(filename, lineno))
    return sources.cite(entries)


def _same_program(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether two traces of the step are one program: the same code and constants."""
    if a.code != b.code:
        return False
    for node in a.graph.nodes:
        if node.op == "get_attr":
            x, y = _attribute(a, node.target), _attribute(b, node.target)
            if isinstance(x, torch.Tensor) and not (
                    isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
                    and torch.equal(x, y)):
                return False
    return True


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for name in target.split("."):
        value = getattr(value, name, None)
    return value
