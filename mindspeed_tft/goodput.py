"""A job's goodput, read from its events (SPEC 11): the fault incidents, the phases of their
handling, every step as a span of wall time, and what each incident cost.

`goodput(events)` is the productive step time over the wall time. The control plane's
metrics endpoint (`control.controller.metrics`) and the user tools (`tools.report`, `tools.drill`,
`tools.timeline`) read it from here; it depends on the events module only.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mindspeed_tft.events import CONTROLLER_RANK

#: the events that end a step: a first run, or a recompute after a rollback (SPEC 11)
STEP_EVENTS = ("iteration", "iteration_recomputed")


@dataclass
class Incident:
    """The events of one fault incident, in order."""

    number: int
    events: list[dict[str, Any]] = field(default_factory=list)


def losses(events: Iterable[dict[str, Any]]) -> dict[int, float]:
    """Iteration -> loss (the last logged wins: recomputed iterations replace earlier ones)."""
    return {e["iteration"]: e["loss"] for e in events if e["event"] == "iteration"}


def incidents(events: list[dict[str, Any]]) -> list[Incident]:
    """Group the events from each fault (or scale-out, which is handled like one) to the
    controller's return to NORMAL (or its end)."""
    found: list[Incident] = []
    current: Incident | None = None
    for event in events:
        name = event["event"]
        if current is None and name in ("fault_injected", "fault_detected", "scale_out_started"):
            current = Incident(len(found) + 1)
            found.append(current)
        if current is None:
            continue
        current.events.append(event)
        if name == "state" and event["state"] in ("NORMAL", "FINAL") and any(
            e["event"] == "state" and e["state"] == "ABNORMAL" for e in current.events
        ):
            current = None
    return found


@dataclass
class Phase:
    """One phase of an incident's handling, in wall-clock (unix) seconds."""

    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def starts_phase(event: dict[str, Any]) -> bool:
    """Whether `event` starts a phase of an incident's handling (`phases`)."""
    return event["event"] in ("action", "exit")


def phases(incident: Incident) -> list[Phase]:
    """The controller's phases of one incident, in order. Each `action` event (hold, stop, clean,
    repair, rollback, dump, rename, scale_in, scale_out) and the `exit` event starts one, named after it,
    which lasts until the next one starts or the incident ends. `clean` includes waiting for
    restarted workers to register again (rejoin): that wait writes no event of its own."""
    starts = [e for e in incident.events if starts_phase(e)]
    ends = [e["time"] for e in starts[1:]] + [incident.events[-1]["time"]] if starts else []
    return [Phase(e.get("action", "exit"), e["time"], end)
            for e, end in zip(starts, ends, strict=True)]


@dataclass
class Step:
    """One logged iteration (`iteration` event) as a span of wall time."""

    iteration: int
    start: float
    end: float
    #: False: no event marks its start (the first step of a job): timed as the median step
    measured: bool
    #: its result counts: the last run of this iteration, not undone by a later rollback
    counts: bool
    #: the incident whose rollback discarded it (it was recomputed, or lost)
    undone_by: int | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _incident_numbers(found: list[Incident]) -> dict[int, int]:
    return {id(e): incident.number for incident in found for e in incident.events}


def _verdicts(events: list[dict[str, Any]], found: list[Incident]) -> dict[int, int | None]:
    """id(iteration event) -> None if its result counts, else the number of the incident
    whose rollback discarded it: the first later repair or shrink to a step below it, or
    else, for an iteration logged again later (e.g. a job restarted from an older checkpoint
    without a controller), the next incident (0: none)."""
    number = _incident_numbers(found)
    first_events = {id(incident.events[0]): incident.number for incident in found}
    later: list[tuple[int, int]] = []  # (step, incident) of rollbacks after, nearest first
    next_incident = 0
    seen: set[int] = set()
    verdicts: dict[int, int | None] = {}
    for event in reversed(events):
        next_incident = first_events.get(id(event), next_incident)
        if event["event"] in ("repaired", "scale_in", "scale_out"):
            later.insert(0, (event["step"], number.get(id(event), 0)))
        elif event["event"] in STEP_EVENTS:
            i = event["iteration"]
            undone = next((n for step, n in later if step < i), None)
            verdicts[id(event)] = (undone if undone is not None
                                   else next_incident if i in seen else None)
            seen.add(i)
    return verdicts


def _handled(incident: Incident) -> bool:
    """Whether a controller handled the incident (without one, e.g. high availability off,
    the job dies and is started again: the incident has no end event)."""
    return any(e["rank"] == CONTROLLER_RANK for e in incident.events)


def _marks(events: list[dict[str, Any]], found: list[Incident]) -> list[tuple[float, bool]]:
    """Where a step may start, sorted: (time, True) after an iteration event, a checkpoint
    save or the end of a handled incident; (time, False) where a job (its controller) starts
    or an unhandled fault ends it (what follows is a new start, with no event of its own)."""
    marks = [(e["time"], e["event"] != "state") for e in events
             if e["event"] in (*STEP_EVENTS, "checkpoint_saved")
             or (e["event"] == "state" and e.get("prev") is None)]
    marks += [(i.events[-1]["time"], True) if _handled(i) else (i.events[0]["time"], False)
              for i in found]
    return sorted(marks)


def _last_mark(marks: list[tuple[float, bool]], t: float) -> tuple[float, bool] | None:
    index = bisect.bisect_left(marks, (t, False))
    return marks[index - 1] if index else None


def steps(events: list[dict[str, Any]], found: list[Incident] | None = None) -> list[Step]:
    """Every logged iteration as a `Step`, in file order. A step runs from the previous
    iteration event, checkpoint save or end of an incident (training resumes there) to its
    own `iteration` event (or `iteration_recomputed`: a step recomputed after a rollback, whose
    earlier run is the discarded one, ends like any other). Its result counts unless the same iteration is logged again later
    or a later repair or scale change (`repaired`, `scale_in`, `scale_out`) sets training back below it."""
    found = incidents(events) if found is None else found
    verdicts, marks = _verdicts(events, found), _marks(events, found)
    timed: list[tuple[dict[str, Any], float | None]] = []
    for event in (e for e in events if e["event"] in STEP_EVENTS):
        mark = _last_mark(marks, event["time"])
        timed.append((event, mark[0] if mark is not None and mark[1] else None))
    median = statistics.median(
        [e["time"] - start for e, start in timed if start is not None] or [0.0])
    first = events[0]["time"] if events else 0.0
    return [Step(e["iteration"], start if start is not None else max(first, e["time"] - median),
                 e["time"], start is not None, verdicts[id(e)] is None, verdicts[id(e)] or None)
            for e, start in timed]


def _overlap(start: float, end: float, windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, w_end) - max(start, w_start)) for w_start, w_end in windows)


@dataclass
class IncidentCost:
    """The wall time one incident cost, by part (seconds, in order): `interrupted step` (from
    the last step, checkpoint save or resume before the fault to the fault: work lost; the
    fault is its `fault_injected` event, or else its first detection, which then includes the
    detection delay), `detect` (the fault to the controller's first action), each phase
    (`phases`), and `discarded steps` when its rollback discarded steps already done (their
    first runs, recomputed after it unless the job ended). Without a controller
    (`_handled`), `restart` replaces `detect` and the phases: from the fault to the first
    step of the restarted job."""

    number: int
    fault: float
    end: float
    phases: list[Phase]
    parts: dict[str, float]
    discarded_steps: int = 0

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _window(incident: Incident, all_steps: list[Step]) -> tuple[float, float]:
    """From the fault to the end of its handling; for an unhandled incident (`_handled`), to
    the start of the first step after the fault."""
    fault, end = incident.events[0]["time"], incident.events[-1]["time"]
    if not _handled(incident):
        end = min([s.start for s in all_steps if s.end > fault] + [end])
    return fault, max(fault, end)


def _incident_cost(incident: Incident, all_steps: list[Step],
                   marks: list[tuple[float, bool]]) -> IncidentCost:
    fault, end = _window(incident, all_steps)
    found = phases(incident)
    mark = _last_mark(marks, fault)
    running = any(s.start < fault < s.end for s in all_steps)  # that step completed anyway
    parts = {"interrupted step": fault - mark[0] if mark and mark[1] and not running else 0.0,
             "detect" if _handled(incident) else "restart": (found[0].start if found else end)
             - fault}
    for phase in found:
        parts[phase.name] = parts.get(phase.name, 0.0) + phase.seconds
    undone = [s for s in all_steps if s.undone_by == incident.number]
    if undone:
        parts["discarded steps"] = sum(s.seconds for s in undone)
    return IncidentCost(incident.number, fault, end, found, parts, len(undone))


@dataclass
class Goodput:
    """Productive step time over wall time, and where the rest went (seconds).

    Wall time runs from the first event of the file (the controller's start) to its last.
    Productive step time is the time of the steps whose results count (`Step.counts`: not
    the first runs of iterations recomputed after a rollback), without any part of them that
    overlaps an incident. The rest: `startup` (the job's start to its first step, or to the
    first fault), checkpoint saves (the previous step's end to a `checkpoint_saved` event),
    each incident (`IncidentCost`), and `other` (e.g. the shutdown after the last step)."""

    start: float
    end: float
    productive: float
    steps: list[Step]
    startup: float
    checkpoints: float
    incidents: list[IncidentCost]

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def ratio(self) -> float:
        """Productive step time / wall time (0 for an empty run)."""
        return self.productive / self.wall if self.wall > 0 else 0.0

    @property
    def training_ratio(self) -> float:
        """The same from the first step on (without the start-up)."""
        rest = self.wall - self.startup
        return self.productive / rest if rest > 0 else 0.0

    @property
    def counted(self) -> int:
        return sum(1 for s in self.steps if s.counts)

    @property
    def median_step(self) -> float:
        """The median of the measured steps (what a step no event starts is timed as)."""
        return statistics.median([s.seconds for s in self.steps if s.measured] or [0.0])

    @property
    def other(self) -> float:
        accounted = self.productive + self.startup + self.checkpoints
        return self.wall - accounted - sum(c.total for c in self.incidents)


def goodput(events: list[dict[str, Any]]) -> Goodput:
    """The goodput of a run from its events (see `Goodput`, `Step`, `IncidentCost`)."""
    if not events:
        return Goodput(0.0, 0.0, 0.0, [], 0.0, 0.0, [])
    found = incidents(events)
    marks = _marks(events, found)
    all_steps = steps(events, found)
    windows = [_window(incident, all_steps) for incident in found]
    start, end = events[0]["time"], max(e["time"] for e in events)
    productive = sum(s.seconds - _overlap(s.start, s.end, windows) for s in all_steps if s.counts)
    checkpoints = 0.0
    for event in (e for e in events if e["event"] == "checkpoint_saved"):
        mark = _last_mark(marks, event["time"])
        if mark is not None and mark[1]:
            checkpoints += event["time"] - mark[0] - _overlap(mark[0], event["time"], windows)
    first = min([s.start for s in all_steps] + [w[0] for w in windows] + [end])
    costs = [_incident_cost(incident, all_steps, marks) for incident in found]
    return Goodput(start, end, productive, all_steps, first - start, checkpoints, costs)
