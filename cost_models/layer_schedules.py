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

Strategies: :func:`no_overlap`, :func:`wfbp`, :func:`dear`, :func:`pipedap`, :func:`search_schedule` (ddlc's);
:func:`lower_bound`; :func:`compare` runs them all.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import NamedTuple

from .timeline import COMPUTE, Timeline, TimelineResult

__all__ = ["Layer", "LayerProfile", "Collective", "Schedule", "Window", "Choice", "PLACEMENTS",
           "START_UPS", "ELEMENT_PASSES", "CHANNEL", "simulate", "no_overlap", "wfbp", "dear",
           "pipedap", "search_schedule", "lower_bound", "STRATEGIES", "schedules", "compare"]

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

    @property
    def param_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose gradients need communication, in forward order."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.params > 0)

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

@dataclass(frozen=True)
class Collective:
    """One message on the channel: its parts are sent together, after the gradients they reduce.

    ``after_full_backward`` holds the message until the whole backward pass has ended.
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

    From the current timeline (recomputed after every move) take the budget = idle link time
    in backward after RS(n) + forward stall of layers >= n, and the cost = b/2 * params(n)
    (the AG's bytes; its start-up is saved). Then *(derived reading of PipeDAP's two rules)*:
    1. if the link idles more than one start-up (a/2) between RS(n) and the next RS and the
       cost fits the budget, merge AG(n) into RS(n)'s message;
    2. otherwise, if the cost fits the budget, piggy-back AG(n) on the next RS (RS(n-1)).
    """
    layers = profile.param_layers
    choices = [DEAR_CHOICE] * len(layers)
    for i in reversed(range(1, len(layers))):
        collectives = _collectives_of(profile, choices)
        result, (window,) = simulate(profile, collectives)
        rs_messages = [j for j, c in enumerate(collectives) if c.reduced_layers()]
        own = next(j for j in rs_messages if ("rs", layers[i]) in collectives[j].parts)
        later = [j for j in rs_messages if j > own]
        gaps = [result.start[window.collectives[j]] - result.end[window.collectives[k]]
                for k, j in zip([own] + later, later)]
        stall = sum(_forward_waits(result, window)[layers[i]:])
        fits = profile.b / 2 * profile.layers[layers[i]].params <= sum(gaps) + stall
        if fits and gaps[0] > profile.a / 2:
            choices[i] = choices[i]._replace(ag="merged")
        elif fits:
            choices[i] = choices[i]._replace(ag="piggy-backed")
    return choices


def _forward_waits(result: TimelineResult, window: Window) -> list[float]:
    """Per layer, how long its forward waits after the previous compute task ended."""
    previous = [window.backward[0]] + window.forward[:-1]
    return [result.start[f] - result.end[p] for f, p in zip(window.forward, previous)]


def search_schedule(profile: LayerProfile, max_sweeps: int = 50) -> Schedule:
    """ddlc's search over AG placements and fusion buckets, priced by the timeline.

    Local search by coordinate descent from three starts: DeAR's choices, PipeDAP's, and the
    fastest size-capped fusion (:func:`_bucketed_seeds`). Sweep the layers in forward order
    and for each try every other :class:`Choice` (RS fused with the previous RS or not; AG
    deferred, merged or piggy-backed; a deferred AG fused with the previous one or not),
    keeping a change when it shortens the simulated iteration. Stop after a sweep without
    improvement (or ``max_sweeps``). Keep the best run, the earlier start on ties: never
    slower than DeAR or PipeDAP, and deterministic (no randomness, fixed visiting order).
    """
    cache: dict = {}

    def time_of(choices) -> float:
        collectives = _collectives_of(profile, choices)
        if collectives is None:
            return math.inf
        if collectives not in cache:
            cache[collectives] = _iteration_time(profile, collectives)
        return cache[collectives]

    starts = [[DEAR_CHOICE] * len(profile.param_layers), _pipedap_choices(profile),
              min(_bucketed_seeds(profile), key=time_of)]
    starts = [start for i, start in enumerate(starts) if start not in starts[:i]]
    best = min((_improve(start, time_of, max_sweeps) for start in starts), key=lambda r: r[0])
    return _schedule("ddlc", profile, _collectives_of(profile, best[1]))


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


# -- bound and comparison ---------------------------------------------------------------------

def lower_bound(profile: LayerProfile) -> float:
    """No schedule's iteration is shorter than all compute, nor, for any layer j with
    parameters, than ``B(>=j) + max(C(<j), a/2 + b*N(<=j)) + F(>=j)``.

    B(>=j): backward of layers >= j, which runs before layer j's gradient exists; F(>=j):
    forward of layers >= j. In between, the compute stream runs C(<j), the backward and
    forward of layers < j, and the channel carries every element of the RS and AG of layers
    <= j (b/2 per element each, none ready before layer j's gradient) with at least one
    start-up a/2; the last of those layers' parameters to arrive is needed before the
    forward of layer j. With j the last layer with parameters this is the link bound (all
    bytes, once), with j = 0 the cycle through the first layer's gradient.
    """
    layers = profile.layers
    bound = profile.compute_time
    for j in profile.param_layers:
        before = sum(layer.forward + layer.backward for layer in layers[:j])
        elements = sum(layer.params for layer in layers[:j + 1])
        bound = max(bound, profile.compute_time - before
                    + max(before, profile.a / 2 + profile.b * elements))
    return bound


STRATEGIES = {"no_overlap": no_overlap, "wfbp": wfbp, "dear": dear, "pipedap": pipedap, "ddlc": search_schedule}


def schedules(profile: LayerProfile) -> dict[str, Schedule]:
    return {name: strategy(profile) for name, strategy in STRATEGIES.items()}


def compare(profile: LayerProfile) -> dict[str, float]:
    """Iteration time (s) of every strategy, and the lower bound."""
    times = {name: s.iteration_time for name, s in schedules(profile).items()}
    return times | {"lower_bound": lower_bound(profile)}
