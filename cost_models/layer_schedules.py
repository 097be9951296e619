"""Gradient-communication schedules for data-parallel training, priced on a per-layer profile.

A profile (:class:`LayerProfile`) gives, per layer in forward order, its parameter count and
its forward and backward times, plus an all-reduce fit: ``n`` elements take ``a + b*n``;
a reduce-scatter (RS) or an all-gather (AG) takes half of that (PipeDAP's model).

**Collectives.** A schedule is an ordered list of :class:`Collective` messages on one FIFO
channel. A message carries parts (``("rs", layer)``, ``("ag", layer)``, ``("ar", layer)``)
sent together: it costs one start-up and every element of every part once::

    duration = a/2 * max(START_UPS[kind]) + b/2 * sum(ELEMENT_PASSES[kind] * params[layer])

so a fused or merged message saves start-ups, never bytes.

**Iteration.** The simulated window runs the backward pass (last layer first) with the
collectives it triggers, then the next forward pass, each layer's forward waiting for the
message that delivers its AG (or all-reduce); its length is the iteration time. This is the
steady state: every collective issued in a backward pass is a predecessor of some layer's
next forward, so when a forward pass ends the channel is idle and nothing carries over; the
window repeats exactly (``iterations=k`` builds k chained windows, k times as long), and one
forward+backward iteration is the same period shifted. The optimizer update runs on the
shard between a layer's RS and AG and is not in the profile (taken as 0 s).

**ddlc's search** (:func:`search_schedule`) works on runs of consecutive layers
(:class:`Run`): each run's RS and AG go merged in one backward message, split (RS in
backward, AG deferred to the forward, alone or with other runs' AGs), piggy-backed on the
next RS message, or *held*: RS and AG together in one message of the forward phase, so a
huge early-ready layer does not block the link ahead of later gradients. Runs may share one
backward message. A dynamic programme over runs with dominance and branch and bound finds
the optimum of that space on tens of layers and a beam of it beyond; a local search with
compound moves polishes the result. Its space contains DeAR's, PipeDAP's and the per-layer
choices of :func:`descent`.

Strategies: :func:`no_overlap`, :func:`wfbp`, :func:`dear`, :func:`pipedap`, :func:`descent`,
:func:`search_schedule` (ddlc's); :func:`lower_bound`; :func:`compare` runs them all.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from .timeline import COMPUTE, Timeline, TimelineResult

__all__ = ["Layer", "LayerProfile", "Collective", "Schedule", "Window", "Choice", "PLACEMENTS",
           "START_UPS", "ELEMENT_PASSES", "CHANNEL", "simulate", "no_overlap", "wfbp", "dear",
           "pipedap", "descent", "Run", "RUN_MODES", "run_collectives", "search_schedule",
           "exact_schedule", "lower_bound", "STRATEGIES", "schedules", "compare"]

CHANNEL = "dp"
START_UPS = {"rs": 1, "ag": 1, "ar": 2}        # start-ups of a/2 when the kind is sent alone
ELEMENT_PASSES = {"rs": 1, "ag": 1, "ar": 2}   # times each element is charged b/2
KIND_NAMES = {"rs": "RS", "ag": "AG", "ar": "AR"}
GRADIENT_BYTES_PER_ELEMENT = 4                 # fp32 gradient buffers, for peak memory
_PROFILE_FIELDS = ("allreduce", "layers")
_ALLREDUCE_FIELDS = ("a", "b")
_LAYER_FIELDS = ("name", "params", "forward", "backward")


# -- profile ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    name: str
    params: int
    forward: float
    backward: float


@dataclass(frozen=True)
class LayerProfile:
    """All-reduce fit ``a + b*n`` (seconds, seconds per element) and layers in forward order."""

    a: float
    b: float
    layers: tuple[Layer, ...]

    @staticmethod
    def load(path) -> "LayerProfile":
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        return LayerProfile.from_dict(data)

    @staticmethod
    def from_dict(data) -> "LayerProfile":
        """Validate ``{"allreduce": {"a", "b"}, "layers": [{name, params, forward, backward}]}``."""
        _check_fields(data, "profile", _PROFILE_FIELDS)
        _check_fields(data["allreduce"], "allreduce", _ALLREDUCE_FIELDS)
        a = _seconds(data["allreduce"], "a", "allreduce.a")
        b = _seconds(data["allreduce"], "b", "allreduce.b")
        raw = data["layers"]
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"layers: must be a non-empty list, got {raw!r}")
        layers, seen = [], {}
        for i, item in enumerate(raw):
            where = f"layers[{i}]"
            _check_fields(item, where, _LAYER_FIELDS)
            name, params = item["name"], item["params"]
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}.name: must be a non-empty string, got {name!r}")
            if name in seen:
                raise ValueError(f"{where}.name: {name!r} repeats layers[{seen[name]}]")
            if isinstance(params, bool) or not isinstance(params, int) or params < 0:
                raise ValueError(f"{where}.params: must be an integer >= 0, got {params!r}")
            seen[name] = i
            layers.append(Layer(name, params, _seconds(item, "forward", f"{where}.forward"),
                                _seconds(item, "backward", f"{where}.backward")))
        return LayerProfile(a, b, tuple(layers))

    @functools.cached_property
    def param_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose gradients need communication, in forward order."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.params > 0)

    @functools.cached_property
    def backward_parts(self) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
        """The RS parts and the AG parts of :attr:`param_layers` in backward order, which
        :func:`run_collectives` slices."""
        order = self.param_layers[::-1]
        return tuple(("rs", l) for l in order), tuple(("ag", l) for l in order)

    @property
    def compute_time(self) -> float:
        return sum(layer.forward + layer.backward for layer in self.layers)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)


def _check_fields(data, where: str, expected: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be an object with fields {', '.join(expected)}")
    for key in expected:
        if key not in data:
            raise ValueError(f"{where}: missing field {key!r}")
    for key in data:
        if key not in expected:
            raise ValueError(f"{where}: unknown field {key!r} (expected {', '.join(expected)})")


def _seconds(data: dict, key: str, where: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: must be a finite number >= 0, got {value!r}")
    return float(value)


# -- collectives and their simulation ---------------------------------------------------------

class Collective(NamedTuple):
    """One message on the channel: its parts are sent together, after the gradients they reduce.

    ``after_full_backward`` holds the message until the whole backward pass has ended.
    (A named tuple, as the search builds and hashes thousands of them.)
    """

    parts: tuple[tuple[str, int], ...]
    after_full_backward: bool = False

    def elements(self, profile: LayerProfile) -> int:
        """Elements charged on the link, each counted once per pass (an all-reduce makes two)."""
        return sum(ELEMENT_PASSES[k] * profile.layers[l].params for k, l in self.parts)

    def duration(self, profile: LayerProfile) -> float:
        start_ups = max(START_UPS[k] for k, _ in self.parts)
        return profile.a / 2 * start_ups + profile.b / 2 * self.elements(profile)

    def reduced_layers(self) -> list[int]:
        """Layers whose gradients this message reduces (RS or all-reduce parts)."""
        return [l for k, l in self.parts if k in ("rs", "ar")]

    def label(self, profile: LayerProfile) -> str:
        groups = itertools.groupby(self.parts, key=lambda part: part[0])
        return " + ".join(f"{KIND_NAMES[k]} " + ",".join(profile.layers[l].name for _, l in g)
                          for k, g in groups)

    def placement(self, layer: int) -> str:
        """Where ``layer``'s part sits: in backward, or (for an AG) deferred, merged, piggy-backed."""
        reduced = self.reduced_layers()
        if ("ag", layer) not in self.parts:
            return "after backward" if self.after_full_backward else "backward"
        if not reduced:
            return "deferred"
        return "merged" if layer in reduced else "piggy-backed"


class Window(NamedTuple):
    """Task ids of one simulated window: backward (by layer), collectives, forward (by layer)."""

    backward: list[int]
    collectives: list[int]
    forward: list[int]


def simulate(profile: LayerProfile, collectives, iterations: int = 1, labelled: bool = True):
    """Build and run ``iterations`` chained windows (backward, collectives, next forward).

    Returns ``(TimelineResult, [Window, ...])``. Each gradient buffer is live from its layer's
    backward until the message that reduces it ends (the peak memory reported). The search
    passes ``labelled=False`` to skip building task names.
    """
    collectives = tuple(collectives)
    delivery = _check_collectives(profile, collectives)
    timeline, windows = Timeline(), []
    for _ in range(iterations):
        windows.append(_add_window(timeline, profile, collectives, delivery, labelled))
    return timeline.run(), windows


def _add_window(timeline: Timeline, profile: LayerProfile, collectives, delivery,
                labelled: bool) -> Window:
    layers = profile.layers
    name = (lambda prefix, l: f"{prefix} {layers[l].name}") if labelled else (lambda prefix, l: "")
    backward = [0] * len(layers)
    for l in reversed(range(len(layers))):
        backward[l] = timeline.add(name("bwd", l), COMPUTE, layers[l].backward, category="backward",
                                   alloc=layers[l].params * GRADIENT_BYTES_PER_ELEMENT)
    sent = []
    for c in collectives:
        reduced = c.reduced_layers()
        ready = [backward[0]] if c.after_full_backward else [backward[l] for l in reduced]
        sent.append(timeline.add(c.label(profile) if labelled else "", CHANNEL, c.duration(profile),
                                 ready, category="collective",
                                 free=sum(layers[l].params for l in reduced) * GRADIENT_BYTES_PER_ELEMENT))
    forward = [timeline.add(name("fwd", l), COMPUTE, layers[l].forward,
                            [sent[delivery[l]]] if l in delivery else [], category="forward")
               for l in range(len(layers))]
    return Window(backward, sent, forward)


def _check_collectives(profile: LayerProfile, collectives) -> dict[int, int]:
    """Check every layer with parameters is reduced and gathered exactly once, RS before AG.

    Returns, per such layer, the index of the message that delivers its parameters.
    """
    seen: dict[tuple[str, int], int] = {}
    for i, c in enumerate(collectives):
        if not c.parts:
            raise ValueError(f"collective {i} has no parts")
        for part in c.parts:
            kind, layer = part
            if kind not in START_UPS or not 0 <= layer < len(profile.layers):
                raise ValueError(f"collective {i}: bad part {part!r}")
            if part in seen:
                raise ValueError(f"collective {i}: {part!r} already sent in collective {seen[part]}")
            seen[part] = i
    kinds_of: dict[int, set[str]] = {}
    for kind, layer in seen:
        kinds_of.setdefault(layer, set()).add(kind)
    delivery = {}
    for l, layer in enumerate(profile.layers):
        kinds = kinds_of.get(l, set())
        expected = set() if layer.params == 0 else ({"ar"} if "ar" in kinds else {"rs", "ag"})
        if kinds != expected:
            raise ValueError(f"layer {layer.name!r} needs parts {sorted(expected)}, got {sorted(kinds)}")
        if "rs" in kinds and seen["ag", l] < seen["rs", l]:
            raise ValueError(f"layer {layer.name!r}: AG is sent before its RS")
        if kinds:
            delivery[l] = seen["ar" if "ar" in kinds else "ag", l]
    return delivery


def _iteration_time(profile: LayerProfile, collectives) -> float:
    return simulate(profile, collectives, labelled=False)[0].makespan


@dataclass(frozen=True)
class Schedule:
    """A strategy's ordered collectives and the iteration time the timeline gives them."""

    strategy: str
    profile: LayerProfile
    collectives: tuple[Collective, ...]
    iteration_time: float

    def simulate(self, iterations: int = 1) -> TimelineResult:
        return simulate(self.profile, self.collectives, iterations)[0]

    @property
    def peak_memory(self) -> int:
        """Peak bytes of live gradient buffers (fp32, from backward until reduced)."""
        return self.simulate().peak_memory

    def rows(self) -> list[dict]:
        """One row per collective: order, label, elements, seconds, placement of each AG."""
        return [{"order": i, "collective": c.label(self.profile),
                 "elements": c.elements(self.profile), "seconds": c.duration(self.profile),
                 "placement": ", ".join(f"AG {self.profile.layers[l].name}: {c.placement(l)}"
                                        for k, l in c.parts if k == "ag")}
                for i, c in enumerate(self.collectives)]


def _schedule(strategy: str, profile: LayerProfile, collectives) -> Schedule:
    collectives = tuple(collectives)
    return Schedule(strategy, profile, collectives, _iteration_time(profile, collectives))


# -- baselines --------------------------------------------------------------------------------

def no_overlap(profile: LayerProfile) -> Schedule:
    """All compute, then one all-reduce per layer once the whole backward pass has ended."""
    return _schedule("no_overlap", profile, [Collective((("ar", l),), after_full_backward=True)
                                             for l in reversed(profile.param_layers)])


def wfbp(profile: LayerProfile) -> Schedule:
    """One all-reduce per layer, issued as its gradient is ready; the forward waits for each
    (DDP without bucketing)."""
    return _schedule("wfbp", profile, [Collective((("ar", l),)) for l in reversed(profile.param_layers)])


# -- decoupled schedules: one choice per layer with parameters ----------------------------------

PLACEMENTS = ("deferred", "merged", "piggy-backed")


class Choice(NamedTuple):
    """How one layer's RS and AG are sent.

    ``rs_join``: its RS is fused into the message of the RS before it (the next layer up);
    ``ag``: its AG is deferred to the next forward, merged into its own RS's message, or
    piggy-backed on the next RS message; ``ag_join``: a deferred AG is fused into the
    previous deferred AG's message (forward order).
    """

    rs_join: bool
    ag: str
    ag_join: bool


DEAR_CHOICE = Choice(False, "deferred", False)
ALL_CHOICES = tuple(Choice(*c) for c in itertools.product((False, True), PLACEMENTS, (False, True)))


def _collectives_of(profile: LayerProfile, choices) -> tuple[Collective, ...] | None:
    """RS messages in backward order (with the AGs placed in them), then deferred AG messages
    in forward order; None if an AG is piggy-backed on a message that does not exist."""
    layers = profile.param_layers
    buckets: list[list] = []
    bucket_of = {}
    for l, choice in reversed(list(zip(layers, choices))):
        if not (choice.rs_join and buckets):
            buckets.append([])
        buckets[-1].append(("rs", l))
        bucket_of[l] = len(buckets) - 1
    deferred: list[list] = []
    for l, choice in zip(layers, choices):
        if choice.ag == "deferred":
            if not (choice.ag_join and deferred):
                deferred.append([])
            deferred[-1].append(("ag", l))
            continue
        target = bucket_of[l] + (choice.ag == "piggy-backed")
        if target == len(buckets):
            return None
        buckets[target].append(("ag", l))
    return tuple(Collective(tuple(parts)) for parts in buckets + deferred)


def dear(profile: LayerProfile) -> Schedule:
    """DeAR: RS(L-1) ... RS(0) in backward as gradients become ready, then AG(0) ... AG(L-1)
    back to back; each forward layer waits for its AG. The simulator reproduces the
    recurrences of METHODS.md exactly (one FIFO channel, forward in layer order)."""
    return _schedule("dear", profile, _collectives_of(profile, [DEAR_CHOICE] * len(profile.param_layers)))


def pipedap(profile: LayerProfile) -> Schedule:
    """PipeDAP's greedy pass, or DeAR's order if that is faster (see :func:`_pipedap_choices`)."""
    greedy = _schedule("pipedap", profile, _collectives_of(profile, _pipedap_choices(profile)))
    base = dear(profile)
    return greedy if greedy.iteration_time < base.iteration_time else \
        Schedule("pipedap", profile, base.collectives, base.iteration_time)


def _pipedap_choices(profile: LayerProfile) -> list[Choice]:
    """One pass over layers n = L-1 .. 1 (backward order; the first layer's AG stays deferred).

    From the current timeline (recomputed after every move: :meth:`_Clock.window`) take the
    budget = idle link time in backward after RS(n) + forward stall of layers >= n, and the
    cost = b/2 * params(n) (the AG's bytes; its start-up is saved). Then *(derived reading of
    PipeDAP's two rules)*:
    1. if the link idles more than one start-up (a/2) between RS(n) and the next RS and the
       cost fits the budget, merge AG(n) into RS(n)'s message;
    2. otherwise, if the cost fits the budget, piggy-back AG(n) on the next RS (RS(n-1)).
    """
    layers = profile.param_layers
    clock = _Clock.of(profile)
    choices = [DEAR_CHOICE] * len(layers)
    for i in reversed(range(1, len(layers))):
        collectives = _collectives_of(profile, choices)
        start, end, waits = clock.window(profile, collectives)
        rs_messages = [j for j, c in enumerate(collectives) if c.reduced_layers()]
        own = next(j for j in rs_messages if ("rs", layers[i]) in collectives[j].parts)
        later = [j for j in rs_messages if j > own]
        gaps = [start[j] - end[k] for k, j in zip([own] + later, later)]
        stall = sum(waits[layers[i]:])
        fits = profile.b / 2 * profile.layers[layers[i]].params <= sum(gaps) + stall
        if fits and gaps[0] > profile.a / 2:
            choices[i] = choices[i]._replace(ag="merged")
        elif fits:
            choices[i] = choices[i]._replace(ag="piggy-backed")
    return choices


def descent(profile: LayerProfile, max_sweeps: int = 50) -> Schedule:
    """Coordinate descent over per-layer :class:`Choice` s (ddlc's search before the run
    search; kept as a baseline).

    From three starts: DeAR's choices, PipeDAP's, and the fastest size-capped fusion
    (:func:`_bucketed_seeds`), sweep the layers in forward order and for each try every
    other choice (RS fused with the previous RS or not; AG deferred, merged or
    piggy-backed; a deferred AG fused with the previous one or not), keeping a change when
    it shortens the iteration. Stop after a sweep without improvement (or ``max_sweeps``);
    keep the best run, the earlier start on ties.
    """
    clock = _Clock.of(profile)
    cache: dict = {}

    def time_of(choices) -> float:
        collectives = _collectives_of(profile, choices)
        if collectives is None:
            return math.inf
        if collectives not in cache:
            cache[collectives] = clock.price(profile, collectives)[0]
        return cache[collectives]

    starts = [[DEAR_CHOICE] * len(profile.param_layers), _pipedap_choices(profile),
              min(_bucketed_seeds(profile), key=time_of)]
    starts = [start for i, start in enumerate(starts) if start not in starts[:i]]
    best = min((_improve(start, time_of, max_sweeps) for start in starts), key=lambda r: r[0])
    return _schedule("descent", profile, _collectives_of(profile, best[1]))


def _bucketed_seeds(profile: LayerProfile) -> list[list[Choice]]:
    """Size-capped fusion: RS messages filled in backward order and deferred AG messages in
    forward order until they hold ``cap`` elements, for caps N, N/2, N/4, ... down to the
    smallest layer; each with the first layer's AG deferred or merged into the last RS."""
    sizes = [profile.layers[l].params for l in profile.param_layers]
    caps = [float(sum(sizes))]
    while sizes and caps[-1] / 2 >= min(sizes):
        caps.append(caps[-1] / 2)
    seeds = []
    for cap in caps:
        rs_join = _fill(sizes[::-1], cap)[::-1]
        ag_join = _fill(sizes, cap)
        for first in ("deferred", "merged"):
            seeds.append([Choice(r, first if i == 0 else "deferred", g)
                          for i, (r, g) in enumerate(zip(rs_join, ag_join))])
    return seeds


def _fill(sizes: list[int], cap: float) -> list[bool]:
    """Per item, whether it joins the open bucket: a bucket closes once it holds >= cap."""
    joins, held = [], cap
    for size in sizes:
        joins.append(held < cap)
        held = held + size if held < cap else size
    return joins


def _improve(choices: list[Choice], time_of, max_sweeps: int) -> tuple[float, list[Choice]]:
    """First-improvement coordinate descent over per-layer choices."""
    choices, best = list(choices), time_of(choices)
    for _ in range(max_sweeps):
        improved = False
        for i in range(len(choices)):
            for candidate in ALL_CHOICES:
                if candidate == choices[i]:
                    continue
                trial = choices[:i] + [candidate] + choices[i + 1:]
                t = time_of(trial)
                if t < best * (1 - 1e-12):
                    choices, best, improved = trial, t, True
        if not improved:
            break
    return best, choices


# -- fast pricing -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Clock:
    """The compute side of one window, which communication never delays until the forward.

    Backward runs back to back, so layer l's gradient is ready at ``ready[l]`` and its
    buffer is allocated at ``ready[l] - backward(l)``; unrolling the forward recurrence, the
    iteration ends at ``max(compute, max over layers l of arrival(l) + tail[l])``, with
    ``tail[l]`` the forward time of layers >= l and arrival(l) the end of the message that
    delivers l's parameters. The arithmetic repeats :class:`Timeline`'s, operation by
    operation, for the link and the gradient buffers.
    """

    ready: tuple[float, ...]
    tail: tuple[float, ...]
    compute: float
    allocations: tuple[tuple[float, int], ...]  # (when, elements) of each gradient buffer, in time order
    #: per message priced: when its gradients are ready, its duration, the longest forward
    #: tail after a layer whose parameters it delivers (None: none), the elements it frees
    _facts: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(profile: LayerProfile) -> "_Clock":
        ready, t = [0.0] * len(profile.layers), 0.0
        for l in reversed(range(len(profile.layers))):
            t += profile.layers[l].backward
            ready[l] = t
        tail, t = [0.0] * len(profile.layers), 0.0
        for l in reversed(range(len(profile.layers))):
            t += profile.layers[l].forward
            tail[l] = t
        allocations = sorted((ready[l] - layer.backward, layer.params) for l, layer in enumerate(profile.layers))
        return _Clock(tuple(ready), tuple(tail), ready[0] + tail[0], tuple(allocations))

    def price(self, profile: LayerProfile, collectives) -> tuple[float, int]:
        """Iteration time and peak gradient bytes of ``collectives``, as :func:`simulate`
        gives them, without building a timeline: buffers are allocated as backward reaches
        their layer and freed when the message that reduces them ends, frees first at equal
        times."""
        link, end, frees = 0.0, self.compute, []
        for c in collectives:
            ready, duration, tail, freed = self._facts_of(profile, c)
            link = max(link, ready) + duration
            if tail is not None:  # max over parts of link + tail: the sum is monotone in the tail
                end = max(end, link + tail)
            frees.append((link, freed))
        live = peak = freed = 0
        for t, n in self.allocations:
            while freed < len(frees) and frees[freed][0] <= t:
                live -= frees[freed][1]
                freed += 1
            live += n
            peak = max(peak, live)
        return end, peak * GRADIENT_BYTES_PER_ELEMENT

    def window(self, profile: LayerProfile, collectives) -> tuple[list[float], list[float], list[float]]:
        """Per message of ``collectives``, when it starts and ends, and per layer, how long
        its forward waits after the compute task before it ended: what :func:`simulate`
        gives for one window, by the same arithmetic, without building a timeline."""
        delivery = _check_collectives(profile, collectives)
        starts, ends, link = [], [], 0.0
        for c in collectives:
            ready, duration, _, _ = self._facts_of(profile, c)
            link = max(link, ready)
            starts.append(link)
            link += duration
            ends.append(link)
        waits, free = [], self.ready[0]
        for l, layer in enumerate(profile.layers):
            begin = max(free, ends[delivery[l]]) if l in delivery else free
            waits.append(begin - free)
            free = begin + layer.forward
        return starts, ends, waits

    def _facts_of(self, profile: LayerProfile, c: Collective) -> tuple[float, float, float | None, int]:
        """What :meth:`price` needs of message ``c``, which depends on ``c`` alone, worked
        out once per message."""
        facts = self._facts.get(c)
        if facts is None:
            facts = self._facts[c] = self._of(profile, c)
        return facts

    def _of(self, profile: LayerProfile, c: Collective) -> tuple[float, float, float | None, int]:
        """What :meth:`price` needs of message ``c``, which depends on ``c`` alone."""
        reduced = c.reduced_layers()
        ready = self.ready[0] if c.after_full_backward else max((self.ready[l] for l in reduced), default=0.0)
        tails = [self.tail[l] for k, l in c.parts if k != "rs"]
        return (ready, c.duration(profile), max(tails) if tails else None,
                sum(profile.layers[l].params for l in reduced))


# -- ddlc's search: runs of consecutive layers --------------------------------------------------

RUN_MODES = ("merged", "deferred", "held", "piggy-backed", "fused")


class Run(NamedTuple):
    """Layers ``order[start:stop]`` (backward order) sent as one unit, with ``mode``:

    - ``merged``: one message with the run's RS and AG, in backward;
    - ``deferred``: the RS message in backward, the AG message in the next forward (DeAR);
    - ``held``: RS and AG together in one message in the next forward, after every
      backward message (the RS waits for the link there, not for its gradient);
    - ``piggy-backed``: the RS message in backward; the AG rides on the next RS message;
    - ``fused``: the RS message in backward; the AG rides on the next deferred or held run's
      forward message (so deferred AG messages may span several RS messages).

    ``joins``: the run's backward parts join the previous backward message instead of
    opening one (so one RS message may hold runs of different modes; a piggy-backed AG
    then rides on the next message opened).
    """

    start: int
    stop: int
    mode: str
    joins: bool = False


def run_collectives(profile: LayerProfile, runs) -> tuple[Collective, ...] | None:
    """The messages of ``runs`` (consecutive, covering the layers with parameters in backward
    order): the backward messages in order, then the forward messages in forward order;
    None if a piggy-backed or fused AG is left without a message to ride on, or a run joins
    where there is no backward message to join (or is held)."""
    rs_parts, ag_parts = profile.backward_parts
    backward, forward, piggy, fused = [], [], (), ()
    for start, stop, mode, joins in runs:
        rs, ag = rs_parts[start:stop], ag_parts[start:stop][::-1]
        if joins and (mode == "held" or not backward):
            return None
        if mode == "held":
            forward.append(rs + ag + fused)
            fused = ()
            continue
        riding = ag if mode == "piggy-backed" else ()
        if joins:
            backward[-1] += rs + (ag if mode == "merged" else ())
            piggy = riding + piggy
        else:
            backward.append(rs + (ag if mode == "merged" else ()) + piggy)
            piggy = riding
        if mode == "deferred":
            forward.append(ag + fused)
            fused = ()
        elif mode == "fused":
            fused = ag + fused
    if piggy or fused:
        return None
    return tuple(Collective(parts) for parts in backward + forward[::-1])


class _State(NamedTuple):
    """A partial run schedule over a prefix of the layers (backward order).

    ``link``: when the backward messages so far end; ``late``: the latest
    arrival + tail so far; ``forward_span``: over the forward messages so far (a suffix of
    the forward order), max over m of (durations up to m + tail of m), so that they end the
    iteration at ``link_at_the_end + forward_span`` at the earliest; pending AGs that ride
    on the next RS message (``piggy`` elements, ``piggy_tail``) or on the next forward
    message (``fused`` elements); ``held`` gradient elements still live; the last backward
    message, which a run may join: when the link before it was free (``open_start``), its
    elements, the largest tail it delivers, and the elements freed before it. Every field of
    :meth:`key` is better smaller, which makes dominance exact.
    """

    link: float
    late: float
    forward_span: float
    piggy: int
    piggy_tail: float
    fused: int
    held: int
    open_start: float
    open_elements: int
    open_tail: float
    open_freed: int
    parent: "_State | None"
    run: Run | None

    def key(self) -> tuple:
        return self[:10] + (-self.open_freed,)

    def pattern(self) -> tuple[bool, bool, bool]:
        """Which pending parts exist; states compare only within a pattern."""
        return self.piggy > 0, self.fused > 0, self.open_elements > 0


class _RunSearch:
    """Dynamic programme over runs of consecutive layers (:class:`Run`).

    Layers are taken in backward order; a state after the first k layers keeps what the
    rest of the schedule can depend on (:class:`_State`), and from it every run k..k' in
    every mode, opening a backward message or joining the last one, leads to a state after
    k' layers. The iteration time of a complete state is ``max(compute, late, link +
    forward_span)``: a backward message starts at max(link before it, its last gradient
    ready); a forward message m, ``d`` long, ready at ``r`` (held) and delivering a run
    whose tail is ``q``, is prepended to the forward messages already placed (they run in
    forward order after every backward message): ``forward_span = d + max(q,
    forward_span)`` and, because it cannot start before r, ``late >= r + forward_span``.

    At every k, states dominated in all fields (within the same pending-AG pattern) are
    dropped, which loses no optimum; when more than ``beam`` remain, the ``beam`` with the
    smallest bound are kept and the result is no longer proven optimal (``exact`` is false).
    States and runs whose bound reaches the best schedule known are cut (branch and bound;
    the bound grows with the run's length, so a cut run ends the loop over lengths), and so
    are runs whose message would let the live gradient buffers exceed ``memory_cap``.
    """

    def __init__(self, profile: LayerProfile, memory_cap: float | None, beam: int):
        self.profile, self.memory_cap, self.beam = profile, memory_cap, beam
        self.clock = clock = _Clock.of(profile)
        self.order = order = profile.param_layers[::-1]
        self.elements = list(itertools.accumulate((profile.layers[l].params for l in order), initial=0))
        self.ready = [clock.ready[l] for l in order]
        self.tail = [clock.tail[l] for l in order]
        allocations = sorted((clock.ready[l] - layer.backward, layer.params)
                             for l, layer in enumerate(profile.layers))
        self.alloc_times = [t for t, _ in allocations]
        self.allocated = list(itertools.accumulate((n for _, n in allocations), initial=0))
        self.exact = True

    def duration(self, elements: int) -> float:
        return self.profile.a / 2 + self.profile.b / 2 * elements

    def fits(self, end: float, freed: int) -> bool:
        """Whether the buffers allocated before a message ending at ``end`` (frees happen
        first at equal times), less the ``freed`` elements, fit the cap."""
        if self.memory_cap is None:
            return True
        allocated = self.allocated[bisect.bisect_left(self.alloc_times, end)]
        return (allocated - freed) * GRADIENT_BYTES_PER_ELEMENT <= self.memory_cap

    def bound(self, s: _State, k: int) -> float:
        """No completion of ``s`` (after k layers) ends before this."""
        bound = max(self.clock.compute, s.late, s.link + s.forward_span)
        rest = self.elements[-1] - self.elements[k]
        if rest:                # all of it is sent before the forward messages placed so far
            work = self.duration(2 * rest + s.piggy + s.fused)
            bound = max(bound, max(s.link, self.ready[k]) + work + max(self.tail[k], s.forward_span))
        return bound

    def extend(self, s: _State, run: Run) -> _State | None:
        """The state after sending ``run`` from ``s``; None if its message breaks the memory
        cap."""
        start, stop, mode, joins = run
        n = self.elements[stop] - self.elements[start]
        ready, tail = self.ready[stop - 1], self.tail[stop - 1]
        if mode == "held":
            span = self.duration(2 * n + s.fused) + max(tail, s.forward_span)
            return s._replace(late=max(s.late, ready + span), forward_span=span, fused=0,
                              held=s.held + n, parent=s, run=run)
        merged_tail = tail if mode == "merged" else -math.inf
        if joins:
            base, elements, freed = s.open_start, s.open_elements, s.open_freed
            delivered = max(s.open_tail, merged_tail)
        else:
            base, elements, freed = s.link, s.piggy, self.elements[start] - s.held
            delivered = max(s.piggy_tail, merged_tail)
        elements += n * (1 + (mode == "merged"))
        link = max(base, ready) + self.duration(elements)
        if not self.fits(link, freed):
            return None
        span, fused = s.forward_span, s.fused
        if mode == "deferred":
            span, fused = self.duration(n + s.fused) + max(tail, s.forward_span), 0
        elif mode == "fused":
            fused += n
        piggy, piggy_tail = (s.piggy, s.piggy_tail) if joins else (0, -math.inf)
        if mode == "piggy-backed":
            piggy, piggy_tail = piggy + n, max(piggy_tail, tail)
        return _State(link, max(s.late, link + delivered), span, piggy, piggy_tail, fused, s.held,
                      base, elements, delivered, freed, s, run)

    def done(self, s: _State) -> bool:
        return not (s.piggy or s.fused) and (self.memory_cap is None or s.link > self.alloc_times[-1]
                                             or self.fits(math.inf, self.elements[-1] - s.held))

    def search(self, incumbent: float) -> _State | None:
        """The fastest complete state below ``incumbent`` (None if there is none)."""
        n = len(self.order)
        frontier: list[list[tuple[float, _State]]] = [[] for _ in range(n + 1)]  # (bound, state)
        start = _State(0.0, -math.inf, -math.inf, 0, -math.inf, 0, 0, 0.0, 0, -math.inf, 0, None, None)
        frontier[0] = [(self.bound(start, 0), start)]
        best, best_time = None, incumbent
        for k in range(n):
            for s in self.prune(frontier[k], best_time):
                for mode, joins in itertools.product(RUN_MODES, (False, True)):
                    if joins and (mode == "held" or not s.open_elements):
                        continue
                    for stop in range(k + 1, n + 1):
                        t = self.extend(s, Run(k, stop, mode, joins))
                        if t is None or max(t.late, t.link + t.forward_span) >= best_time:
                            break               # both only grow with the run's length
                        bound = self.bound(t, stop)
                        if bound >= best_time:
                            continue
                        if stop < n:
                            frontier[stop].append((bound, t))
                        elif self.done(t):
                            best, best_time = t, bound
        return best

    def prune(self, states: list[tuple[float, _State]], cutoff: float) -> list[_State]:
        """The first ``beam`` non-dominated states below ``cutoff`` of ``states`` ((bound,
        state) pairs), by smallest bound, then fields (deterministic; a dominating state
        always comes first, as the bound grows with every field)."""
        kept: list[_State] = []
        ranked = sorted(((bound, s.key(), s) for bound, s in states), key=lambda r: r[:2])
        for bound, key, s in ranked:
            if bound >= cutoff:
                break
            if any(all(x <= y for x, y in zip(other.key(), key)) for other in kept
                   if other.pattern() == s.pattern()):
                continue
            if len(kept) == self.beam:
                self.exact = False
                break
            kept.append(s)
        return kept


def _runs_of(state: _State) -> list[Run]:
    runs = []
    while state.run is not None:
        runs.append(state.run)
        state = state.parent
    return runs[::-1]


def _polish(profile: LayerProfile, runs: list[Run], memory_cap: float | None) -> list[Run]:
    """Local search over run lists with compound moves (:func:`_moves`): visit the runs in
    order, apply the move around each that shortens the iteration most (keeping under
    ``memory_cap``) or, where none does, the one that lowers the peak of gradient buffers
    most without lengthening it; repeat until a pass changes nothing. Deterministic."""
    clock, cache = _Clock.of(profile), {}

    def cost_of(candidate) -> tuple[float, float]:
        """(iteration time, peak), (inf, inf) if invalid or over the cap."""
        key = tuple(candidate)
        if key not in cache:
            collectives = run_collectives(profile, candidate)
            time, peak = clock.price(profile, collectives) if collectives else (math.inf, math.inf)
            cache[key] = (time, peak) if memory_cap is None or peak <= memory_cap else (math.inf, math.inf)
        return cache[key]

    def better(candidates: list, time: float, peak: float):
        """The fastest candidate if it is faster, else the lowest-peak one as fast, or None."""
        fastest = min(candidates, key=lambda c: cost_of(c)[0], default=None)
        if fastest is not None and cost_of(fastest)[0] < time * (1 - 1e-12):
            return fastest
        as_fast = [c for c in candidates if cost_of(c)[0] <= time * (1 + 1e-12)]
        leanest = min(as_fast, key=lambda c: cost_of(c)[1], default=None)
        return leanest if leanest is not None and cost_of(leanest)[1] < peak * (1 - 1e-9) else None

    improved = True
    while improved:
        improved, i = False, 0
        while i < len(runs):
            candidate = better(list(_moves(runs, i)), *cost_of(runs))
            if candidate is not None:
                runs, improved = candidate, True
            i += 1
    return runs


def _moves(runs: list[Run], i: int):
    """Run lists one compound move from ``runs`` around run i: change its mode or whether it
    joins the previous message; split it at any layer; merge it with the next run (either
    mode); move the boundary with the next run by 1, 2, 4, ... layers either way (a group
    of layers changes run together); swap the two runs' modes. Invalid lists (a join with
    nothing to join) are priced as never faster."""
    start, stop, mode, joins = runs[i]
    before, after = runs[:i], runs[i + 1:]
    for other, other_joins in itertools.product(RUN_MODES, (False, True)):
        if (other, other_joins) != (mode, joins):
            yield before + [Run(start, stop, other, other_joins)] + after
    for cut in range(start + 1, stop):
        for second_joins in (False, True):
            yield before + [Run(start, cut, mode, joins), Run(cut, stop, mode, second_joins)] + after
    if not after:
        return
    nxt, rest = after[0], after[1:]
    for merged_mode in dict.fromkeys((mode, nxt.mode)):
        yield before + [Run(start, nxt.stop, merged_mode, joins)] + rest
    shift = 1
    while shift < nxt.stop - start:
        for cut in (stop - shift, stop + shift):
            if start < cut < nxt.stop:
                yield before + [Run(start, cut, mode, joins), nxt._replace(start=cut)] + rest
        shift *= 2
    if mode != nxt.mode:
        yield before + [Run(start, stop, nxt.mode, joins), nxt._replace(mode=mode)] + rest


def search_schedule(profile: LayerProfile, memory_cap: float | None = None,
                    beam: int | None = None) -> Schedule:
    """ddlc's schedule: a run schedule (:class:`Run`) found by the dynamic programme
    (:class:`_RunSearch`, at most ``beam`` states per layer; by default 4096 / layers², so
    exact or nearly on tens of layers and one state per layer on a hundred) and polished
    by local search (:func:`_polish`); DeAR's or PipeDAP's order where neither is faster.

    ``memory_cap`` (bytes) bounds the peak of live gradient buffers (the schedule's
    ``peak_memory``; the programme counts held runs' buffers live until the backward pass
    ends, which is safe). A beam can then dead-end on the cap, so DeAR's order is polished
    too. Raises ValueError when no schedule considered keeps under the cap.
    """
    layers = len(profile.param_layers)
    beam = beam or max(1, 4096 // max(layers, 1) ** 2)
    baselines = [s for s in (dear(profile), pipedap(profile))
                 if memory_cap is None or s.peak_memory <= memory_cap]
    incumbent = min((s.iteration_time for s in baselines), default=math.inf)
    found = _RunSearch(profile, memory_cap, beam).search(incumbent)
    starts = [_runs_of(found)] if found is not None else []
    if memory_cap is not None:          # the beam can dead-end on the cap: also start from DeAR
        starts.append([Run(i, i + 1, "deferred") for i in range(layers)])
    polished = [_schedule("ddlc", profile, run_collectives(profile, _polish(profile, runs, memory_cap)))
                for runs in starts]
    feasible = [s for s in polished if memory_cap is None or s.peak_memory <= memory_cap]
    if not feasible + baselines:
        raise ValueError(f"no schedule keeps the gradient buffers under {memory_cap:,.0f} bytes")
    fastest = min(feasible + baselines, key=lambda s: s.iteration_time)
    return Schedule("ddlc", profile, fastest.collectives, fastest.iteration_time)


def exact_schedule(profile: LayerProfile, beam: int = 1 << 16) -> Schedule | None:
    """The optimum of the run schedule space, proven: the dynamic programme with a beam that
    must never bind (every non-dominated state below the incumbent kept), or None where a
    frontier outgrew ``beam`` (no proof). DeAR's and PipeDAP's orders lie in the space, so
    where no run schedule beats the faster of them, that one is the optimum."""
    baseline = min((dear(profile), pipedap(profile)), key=lambda s: s.iteration_time)
    search = _RunSearch(profile, None, beam)
    found = search.search(baseline.iteration_time * (1 + 1e-12))
    if not search.exact:
        return None
    collectives = run_collectives(profile, _runs_of(found)) if found is not None else baseline.collectives
    return _schedule("exact", profile, collectives)


# -- bound and comparison ---------------------------------------------------------------------

def lower_bound(profile: LayerProfile) -> float:
    """No schedule's iteration is shorter: max(all compute, J + a/2).

    J is the optimum of a relaxation solved exactly by Jackson's preemptive rule: one job
    per layer with parameters, released when its gradient is ready, ``b * params`` of link
    work (its RS and AG, every element once each), and a tail of the forward of the layers
    from it on; the link may switch jobs at any instant, and J is the latest job end plus
    tail, with the jobs of longest tail run first. Any real schedule is a feasible
    relaxed schedule, its parts ending at least a/2 (the start-up of their message) earlier
    if each message sends its elements first, so it takes at least J + a/2. The bound holds
    the link's busy time from the first gradient, each layer's readiness, and the forward
    that must follow each all-gather.
    """
    clock = _Clock.of(profile)
    jobs = sorted((clock.ready[l], l) for l in profile.param_layers)
    work = {l: profile.b * profile.layers[l].params for l in profile.param_layers}
    running: list[tuple[float, int]] = []
    t, latest, i = 0.0, -math.inf, 0
    while i < len(jobs) or running:
        if not running:
            t = max(t, jobs[i][0])
        while i < len(jobs) and jobs[i][0] <= t:
            heapq.heappush(running, (-clock.tail[jobs[i][1]], jobs[i][1]))
            i += 1
        _, l = running[0]
        release = jobs[i][0] if i < len(jobs) else math.inf
        if t + work[l] <= release:
            t += work[l]
            heapq.heappop(running)
            latest = max(latest, t + clock.tail[l])
        else:
            work[l] -= release - t
            t = release
    return max(profile.compute_time, latest + profile.a / 2)


STRATEGIES = {"no_overlap": no_overlap, "wfbp": wfbp, "dear": dear, "pipedap": pipedap,
              "descent": descent, "ddlc": search_schedule}


def schedules(profile: LayerProfile) -> dict[str, Schedule]:
    return {name: strategy(profile) for name, strategy in STRATEGIES.items()}


def compare(profile: LayerProfile) -> dict[str, float]:
    """Iteration time (s) of every strategy, and the lower bound."""
    times = {name: s.iteration_time for name, s in schedules(profile).items()}
    return times | {"lower_bound": lower_bound(profile)}
