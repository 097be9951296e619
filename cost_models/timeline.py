"""A small discrete-event timeline: one compute stream and one FIFO channel per process group.

Tasks are issued in order with :meth:`Timeline.add`. Each stream (``"compute"``, or a
channel named after its process group) runs its tasks one at a time in issue order;
a task starts when its stream is free and every task it depends on has ended. A task
can only depend on tasks issued before it, so issue order is a topological order and
one pass over it yields exactly the times an event-driven simulation would, with no
ties left to break and no possibility of deadlock. The pass runs as tasks are added, so
a builder (the scheduler) can ask when a stream becomes free before deciding what to add.

:meth:`Timeline.run` returns a :class:`TimelineResult`: makespan, exposed
communication, peak memory, a lower bound and a Chrome trace (open it in Perfetto).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

__all__ = ["COMPUTE", "Task", "Timeline", "TimelineResult"]

COMPUTE = "compute"


@dataclass(frozen=True)
class Task:
    """One unit of work on one stream.

    ``alloc`` bytes are allocated when the task starts, ``free`` bytes released when it ends.
    """

    label: str
    stream: str
    duration: float
    deps: tuple[int, ...] = ()
    alloc: int = 0
    free: int = 0
    category: str = ""
    communication: bool = False   # a collective (on a channel, or on the compute stream)


@dataclass
class Timeline:
    """An ordered list of tasks; build it with :meth:`add`, simulate it with :meth:`run`."""

    tasks: list[Task] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    _free: dict[str, float] = field(default_factory=dict, repr=False)

    def add(self, label: str, stream: str, duration: float, deps=(), *,
            alloc: int = 0, free: int = 0, category: str = "", communication: bool | None = None) -> int:
        """Issue a task after all previously issued ones; returns its id for later ``deps``.
        It starts at max(end of its stream's previous task, end of its dependencies).
        ``communication``: whether it is a collective (default: whether it is on a channel)."""
        task_id = len(self.tasks)
        if not (math.isfinite(duration) and duration >= 0):
            raise ValueError(f"task {label!r}: duration must be a finite number >= 0, got {duration}")
        if alloc < 0 or free < 0:
            raise ValueError(f"task {label!r}: alloc and free must be >= 0, got {alloc}, {free}")
        deps = tuple(deps)
        for d in deps:
            if not 0 <= d < task_id:
                raise ValueError(f"task {label!r}: dependency {d} is not an earlier task id")
        if communication is None:
            communication = stream != COMPUTE
        self.tasks.append(Task(label, stream, float(duration), deps, alloc, free, category, communication))
        t = max([self.free_at(stream)] + [self.end[d] for d in deps])
        self.start.append(t)
        self.end.append(t + float(duration))
        self._free[stream] = self.end[-1]
        return task_id

    def free_at(self, stream: str) -> float:
        """When ``stream``'s last task so far ends (0 if it has none)."""
        return self._free.get(stream, 0.0)

    def run(self) -> "TimelineResult":
        """The start and end times of every task (computed as they were added)."""
        return TimelineResult(tuple(self.tasks), tuple(self.start), tuple(self.end))


@dataclass(frozen=True)
class TimelineResult:
    """Start and end time of every task, and the summaries derived from them."""

    tasks: tuple[Task, ...]
    start: tuple[float, ...]
    end: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    @property
    def streams(self) -> list[str]:
        """Stream names in order of first use."""
        return list(dict.fromkeys(t.stream for t in self.tasks))

    def busy(self, stream: str) -> float:
        """Total duration of the tasks on ``stream``."""
        return sum(t.duration for t in self.tasks if t.stream == stream)

    @property
    def compute_time(self) -> float:
        """Total duration of the tasks that are not communication."""
        return sum(t.duration for t in self.tasks if not t.communication)

    @property
    def communication_time(self) -> float:
        """Total duration of the communication tasks, on whatever stream they ran."""
        return sum(t.duration for t in self.tasks if t.communication)

    @property
    def exposed_communication(self) -> float:
        """Time within the makespan that is not compute: waiting on channels, or running
        collectives on the compute stream."""
        return self.makespan - self.compute_time

    @property
    def lower_bound(self) -> float:
        """No schedule of these tasks is shorter than the busiest stream's total work."""
        return max((self.busy(s) for s in self.streams), default=0.0)

    @property
    def peak_memory(self) -> int:
        """Largest sum of allocated bytes; at equal times, releases happen before allocations."""
        events = sorted([(self.end[i], 0, i, -t.free) for i, t in enumerate(self.tasks) if t.free]
                        + [(self.start[i], 1, i, t.alloc) for i, t in enumerate(self.tasks) if t.alloc])
        live = peak = 0
        for *_, delta in events:
            live += delta
            peak = max(peak, live)
        return peak

    def chrome_trace(self) -> dict:
        """The schedule as Chrome trace events (``ph: "X"``, microseconds, one tid per stream)."""
        tids = {s: i for i, s in enumerate(self.streams)}
        names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": s}}
                 for s, tid in tids.items()]
        spans = [{"name": t.label, "cat": t.category or t.stream, "ph": "X", "pid": 0,
                  "tid": tids[t.stream], "ts": self.start[i] * 1e6, "dur": t.duration * 1e6}
                 for i, t in enumerate(self.tasks)]
        return {"traceEvents": names + spans, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
