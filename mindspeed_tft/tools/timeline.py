"""The recovery timeline of a job as a picture, from its events file.

    tft-report events.jsonl --plot timeline.png [--compare fault-free.jsonl]

`build_timeline` draws one matplotlib `Figure` (Agg, no pyplot state) in three parts:

- one panel per incident (at most `MAX_ZOOMS`), in seconds from the fault: the interrupted
  step, the detection and each controller phase (`mindspeed_tft.goodput.phases`) as a bar
  labelled with its duration, and below them what each rank did: fault injected (x),
  detected (v; hollow when withdrawn), process restarted (^), dump written (s), rolled back
  (|), left the job (>);
- the whole run, one lane per rank (control-plane ranks, which a shrink does not renumber):
  the job's iteration over wall time in the lane, a gap while the rank's process was gone
  (from the fault to the end of the repair), the lane's end where the rank left the job, the
  phases as shaded bands, each fault as a red line and a mark on its rank, restarts (^);
- the loss over wall time, with a fault-free run's loss (`compare`) aligned at iteration 1.

Training is synchronous: every rank takes every step, and the last rank logs it (`iteration`
event), so each lane shows the job's iterations while that rank was in it. The analysis (the
incidents, their phases and costs) comes from `mindspeed_tft.goodput`; this module only
draws it. matplotlib is an optional dependency: `pip install mindspeed-tft[plot]`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.text import Text

#: the events of a completed step: its first run, or its recompute after a rollback
_STEP_EVENTS = ("iteration", "iteration_recomputed")

Events = list[dict[str, Any]]

#: incidents drawn in their own panel (the overview shows them all)
MAX_ZOOMS = 4
#: with more ranks, an incident panel shows only the ranks something happened on
MAX_ZOOM_RANKS = 16
DPI = 100
WIDTH_IN = 11.0
FORMATS = ("png", "svg")
PHASE_COLORS = {
    "interrupted step": "#9e9e9e", "detect": "#e57373", "restart": "#e57373",
    "hold": "#ffe0b2", "stop": "#ffb74d", "clean": "#fff176", "repair": "#81c784", "rollback": "#4fc3f7",
    "dump": "#ba68c8", "rename": "#f48fb1", "scale_in": "#a1887f", "scale_out": "#8d6e63",
    "exit": "#616161",
}
FAULT_COLOR = "#c62828"
# rank events in the incident panels: event -> (marker, color, legend label)
RANK_MARKS = {
    "fault_injected": ("X", FAULT_COLOR, "fault injected"),
    "fault_detected": ("v", "#8e0000", "fault detected"),
    "worker_restarted": ("^", "#2e7d32", "process restarted"),
    "dump_written": ("s", "#6a1b9a", "dump written"),
    "rolled_back": ("|", "#01579b", "rolled back"),
    "left": (">", "#000000", "left the job"),
}
PLOT_HINT = "the timeline needs matplotlib: pip install mindspeed-tft[plot]"


class PhaseLike(Protocol):
    """A phase of an incident (`mindspeed_tft.goodput.Phase`)."""

    @property
    def name(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


class IncidentLike(Protocol):
    """What an incident cost (`mindspeed_tft.goodput.IncidentCost`)."""

    @property
    def number(self) -> int: ...
    @property
    def fault(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def phases(self) -> Sequence[PhaseLike]: ...
    @property
    def parts(self) -> Mapping[str, float]: ...
    @property
    def total(self) -> float: ...
    @property
    def discarded_steps(self) -> int: ...


class RunLike(Protocol):
    """A run's goodput (`mindspeed_tft.goodput.Goodput`)."""

    @property
    def start(self) -> float: ...
    @property
    def startup(self) -> float: ...
    @property
    def wall(self) -> float: ...
    @property
    def productive(self) -> float: ...
    @property
    def ratio(self) -> float: ...
    @property
    def incidents(self) -> Sequence[IncidentLike]: ...


@dataclass
class Timeline:
    """The figure and the artists drawn for each part (for tests and callers)."""

    figure: Figure
    #: control-plane rank -> its lane's iteration line
    rank_lines: dict[int, Line2D] = field(default_factory=dict)
    #: part name (detect, stop, clean, ...) -> its bands and bars, every incident and panel
    bands: dict[str, list[Artist]] = field(default_factory=dict)
    #: part name -> the duration labels of its bars
    labels: dict[str, list[Text]] = field(default_factory=dict)
    #: the fault lines and the fault marks on ranks
    fault_marks: list[Artist] = field(default_factory=list)
    #: rank -> the marks of its process restarts (overview and incident panels)
    restart_marks: dict[int, list[Artist]] = field(default_factory=dict)
    #: "loss", "loss by iteration", and "fault-free", "fault-free by iteration" with `compare`
    loss_lines: dict[str, Line2D] = field(default_factory=dict)
    #: "incident N" (the first `MAX_ZOOMS`), "lanes", "loss", "loss by iteration", "key"
    panels: dict[str, Axes] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Write the picture; the format follows the extension (.png or .svg)."""
        path = Path(path)
        suffix = path.suffix.lower().lstrip(".")
        if suffix not in FORMATS:
            raise ValueError(f"{path}: the timeline is written as .png or .svg")
        self.figure.savefig(path, format=suffix, dpi=DPI)
        return path


def _matplotlib() -> tuple[Any, Any]:
    """The Figure class and the Agg canvas, imported on first use (an optional extra)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(PLOT_HINT) from e
    return Figure, FigureCanvasAgg


def build_timeline(events: Events, run: RunLike, compare: Events | None = None) -> Timeline:
    """Draw the timeline of `events`, analysed as `run` (`mindspeed_tft.goodput.goodput`);
    `compare`: a fault-free run's events, whose loss curve is overlaid."""
    figure_class, canvas_class = _matplotlib()
    ranks = _ranks(events)
    zooms = list(run.incidents[:MAX_ZOOMS])
    zoom_ranks = ranks if len(ranks) <= MAX_ZOOM_RANKS else sorted(
        {r for c in zooms for _, _, r, _ in _rank_events(events, c)})
    zoom_rows = max((len(_rows(c)) for c in zooms), default=0) + len(zoom_ranks)
    heights = ([0.32 * zoom_rows + 0.9] if zooms else []) + [0.42 * len(ranks) + 0.7, 2.0]
    figure = figure_class(figsize=(WIDTH_IN, sum(heights) + 0.5), dpi=DPI, layout="constrained")
    canvas_class(figure)
    grid = figure.add_gridspec(len(heights), 2, height_ratios=heights, width_ratios=[4.2, 1])
    timeline = Timeline(figure)
    if zooms:
        row = grid[0, :].subgridspec(1, len(zooms))
        for column, cost in enumerate(zooms):
            zoom = timeline.panels[f"incident {cost.number}"] = figure.add_subplot(row[0, column])
            _draw_zoom(timeline, zoom, events, cost, zoom_ranks)
    lanes = timeline.panels["lanes"] = figure.add_subplot(grid[-2, 0])
    loss = timeline.panels["loss"] = figure.add_subplot(grid[-1, 0], sharex=lanes)
    _draw_lanes(timeline, lanes, events, run, ranks)
    _draw_loss(timeline, loss, events, run, compare)
    for ax in (lanes, loss):
        _draw_bands(timeline, ax, run)
    timeline.panels["key"] = figure.add_subplot(grid[-2, 1])
    _draw_key(timeline.panels["key"], run, {k for c in zooms for k, *_ in _rank_events(events, c)})
    timeline.panels["loss by iteration"] = figure.add_subplot(grid[-1, 1])
    _draw_loss_by_iteration(timeline, timeline.panels["loss by iteration"], events, compare)
    figure.suptitle(_title(run), fontsize=11)
    return timeline


# -- what the events say ----------------------------------------------------------------
def _ranks(events: Events) -> list[int]:
    """The job's control-plane ranks, 0..N-1 (N from the highest rank any event names before
    a shrink renumbers the process groups)."""
    seen = {0}
    for event in events:
        if event["event"] == "scale_in":
            seen.update(event["ranks"] + event["left"])
            break
        if event["rank"] >= 0:
            seen.add(event["rank"])
        seen.update(event.get("ranks") or [])
    return list(range(max(seen) + 1))


def _within(events: Events, start: float, end: float, *names: str) -> Events:
    return [e for e in events if e["event"] in names and start <= e["time"] <= end]


def _down(events: Events, cost: IncidentLike) -> set[int]:
    """Ranks whose process was gone during the incident (killed, lost, restarted)."""
    down = {e["rank"] for e in _within(events, cost.fault, cost.end, "worker_restarted")}
    down |= {e["rank"] for e in _within(events, cost.fault, cost.end, "fault_injected")
             if e["kind"] in ("kill", "hang")}
    for event in _within(events, cost.fault, cost.end, "fault_detected"):
        if event["kind"] in ("lost", "hang"):
            down.update(event["ranks"])
    return down


def _left(events: Events, cost: IncidentLike) -> set[int]:
    return {r for e in _within(events, cost.fault, cost.end, "scale_in") for r in e["left"]}


def _resumed_at(events: Events, cost: IncidentLike) -> int | None:
    """The step training resumed from after the incident: its repair's or shrink's, or else
    (a job restarted without a controller) the one before the next logged iteration; None if
    training did not resume."""
    found = _within(events, cost.fault, cost.end, "repaired", "scale_in")
    if found:
        return found[-1]["step"]
    if "restart" not in cost.parts:
        return None
    after = [i for t, i in _iterations(events) if t > cost.end]
    return after[0] - 1 if after else None


def _iterations(events: Events) -> list[tuple[float, int]]:
    return sorted((e["time"], e["iteration"]) for e in events if e["event"] in _STEP_EVENTS)


def _describe(events: Events, cost: IncidentLike) -> str:
    window = _within(events, cost.fault, cost.end, "fault_injected", "fault_detected")
    fault = "a fault"
    if window and window[0]["event"] == "fault_injected":
        fault = f"{window[0]['kind']} on rank {window[0]['rank']}"
    elif window:
        fault = f"{window[0]['kind']} on rank(s) {window[0]['ranks']}"
    strategy = _within(events, cost.fault, cost.end, "strategy")
    decided = f" -> {strategy[-1]['strategy']}" if strategy else ""
    resumed = _resumed_at(events, cost)
    then = f", resumed at iteration {resumed}" if resumed is not None else ""
    redone = cost.parts.get("discarded steps")
    steps = (f" with {cost.discarded_steps} discarded steps ({redone:.2f} s)"
             if redone is not None else "")
    return f"incident {cost.number}: {fault}{decided}{then}; cost {cost.total:.2f} s{steps}"


def _title(run: RunLike) -> str:
    lost = ", ".join(f"incident {c.number} {c.total:.2f} s" for c in run.incidents[:6])
    more = f" (+{len(run.incidents) - 6} more)" if len(run.incidents) > 6 else ""
    cost = f"; cost: {lost}{more}" if lost else ""
    return (f"goodput {run.ratio:.3f}: {run.productive:.1f} s of productive steps in "
            f"{run.wall:.1f} s{cost}")


# -- incident panels ----------------------------------------------------------------------
def _rows(cost: IncidentLike) -> list[tuple[str, float, float]]:
    """(part, start, end) of the bars of an incident panel: interrupted step, detection (or
    restart), then each phase."""
    rows = [("interrupted step", cost.fault - cost.parts.get("interrupted step", 0.0),
             cost.fault)]
    first = cost.phases[0].start if cost.phases else cost.end
    rows.append(("detect" if "detect" in cost.parts else "restart", cost.fault, first))
    return rows + [(p.name, p.start, p.end) for p in cost.phases]


def _draw_zoom(timeline: Timeline, ax: Axes, events: Events, cost: IncidentLike,
               ranks: list[int]) -> None:
    rows = _rows(cost)
    span = max(cost.end - rows[0][1], 1e-3)
    for y, (name, start, end) in enumerate(rows):
        color = PHASE_COLORS.get(name, "#bdbdbd")
        bar = ax.barh(y, end - start, left=start - cost.fault, height=0.62, color=color,
                      edgecolor="#424242", linewidth=0.5)
        timeline.bands.setdefault(name, []).extend(bar.patches)
        label = ax.text(end - cost.fault + span * 0.01, y, f"{end - start:.2f} s",
                        va="center", fontsize=7)
        timeline.labels.setdefault(name, []).append(label)
    names = [r[0] for r in rows] + [f"rank {r}" for r in ranks]
    _draw_rank_marks(timeline, ax, events, cost, {r: len(rows) + i for i, r in enumerate(ranks)})
    timeline.fault_marks.append(ax.axvline(0.0, color=FAULT_COLOR, linewidth=1.2))
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_ylim(len(names) - 0.5, -0.7)
    ax.set_xlim(rows[0][1] - cost.fault - span * 0.03, cost.end - cost.fault + span * 0.22)
    ax.set_xlabel("seconds from the fault", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(_describe(events, cost), fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def _rank_events(events: Events, cost: IncidentLike) -> list[tuple[str, float, int, bool]]:
    """(kind, time, rank, withdrawn) of what happened on ranks during the incident."""
    found: list[tuple[str, float, int, bool]] = []
    withdrawn = {(r, e["kind"]) for e in _within(events, cost.fault, cost.end, "fault_withdrawn")
                 for r in e["ranks"]}
    for event in _within(events, cost.fault, cost.end, *RANK_MARKS):
        if event["event"] == "fault_detected":
            found += [("fault_detected", event["time"], r, (r, event["kind"]) in withdrawn)
                      for r in event["ranks"]]
        else:
            found.append((event["event"], event["time"], event["rank"], False))
    found += [("left", e["time"], r, False)
              for e in _within(events, cost.fault, cost.end, "scale_in") for r in e["left"]]
    return found


def _draw_rank_marks(timeline: Timeline, ax: Axes, events: Events, cost: IncidentLike,
                     rows: dict[int, int]) -> None:
    for kind, time, rank, withdrawn in _rank_events(events, cost):
        if rank not in rows:
            continue
        marker, color, _ = RANK_MARKS[kind]
        (mark,) = ax.plot([time - cost.fault], [rows[rank]], marker=marker, linestyle="",
                          markersize=7, color=color, markerfacecolor="none" if withdrawn else color)
        if kind == "worker_restarted":
            timeline.restart_marks.setdefault(rank, []).append(mark)
        elif kind == "fault_injected":
            timeline.fault_marks.append(mark)


def _draw_key(ax: Axes, run: RunLike, kinds: set[str]) -> None:
    """The colours of the parts and the marks of the rank events drawn."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.axis("off")
    names = list(dict.fromkeys(name for c in run.incidents for name, _, _ in _rows(c)))
    parts = [Patch(color=PHASE_COLORS.get(n, "#bdbdbd"), label=n) for n in names]
    marks = [Line2D([], [], marker=m, color=c, linestyle="", label=label)
             for kind, (m, c, label) in RANK_MARKS.items() if kind in kinds | {"fault_injected"}]
    if parts:
        ax.add_artist(ax.legend(handles=parts, fontsize=7, loc="upper left", frameon=False,
                                title="incident parts", title_fontsize=7))
    ax.legend(handles=marks, fontsize=7, loc="lower left", frameon=False, title="on ranks",
              title_fontsize=7)


# -- the whole run ------------------------------------------------------------------------
def _lane_points(events: Events, run: RunLike, rank: int) -> list[tuple[float, float]]:
    """(seconds since the start, iteration) of one rank's lane: the job's iterations, held
    flat through each incident, then dropping to the step training resumed from; a gap (NaN)
    while the rank's process was gone; ending where the rank left the job or the job ended."""
    logged = [(t - run.start, float(i)) for t, i in _iterations(events)]
    points: list[tuple[float, float]] = []
    level, done = 0.0, 0
    for cost in sorted(run.incidents, key=lambda c: c.fault):
        fault, end = cost.fault - run.start, cost.end - run.start
        while done < len(logged) and logged[done][0] <= fault:
            points.append(logged[done])
            level, done = logged[done][1], done + 1
        points.append((fault, level))
        resumed = _resumed_at(events, cost)
        if resumed is None or rank in _left(events, cost):
            return points
        gone = rank in _down(events, cost) or "restart" in cost.parts  # unhandled: all restart
        points += [(fault, math.nan), (end, float(resumed))] if gone else [
            (end, level), (end, float(resumed))]
        level = float(resumed)
        while done < len(logged) and logged[done][0] <= end:  # logged while it was handled
            done += 1
    return points + logged[done:]


def _draw_lanes(timeline: Timeline, ax: Axes, events: Events, run: RunLike,
                ranks: list[int]) -> None:
    top = max([i for _, i in _iterations(events)] + [1])
    lane = {r: len(ranks) - 1 - r for r in ranks}  # rank 0 at the top
    for rank in ranks:
        points = _lane_points(events, run, rank)
        ys = [lane[rank] + 0.12 + 0.76 * i / top for _, i in points]
        (line,) = ax.plot([t for t, _ in points], ys, color="#1565c0", linewidth=1.3)
        timeline.rank_lines[rank] = line
        ax.axhline(lane[rank], color="#e0e0e0", linewidth=0.6)
    for event in (e for e in events if e["event"] in ("fault_injected", "worker_restarted")):
        if event["rank"] in lane:
            _lane_mark(timeline, ax, event, run.start, lane[event["rank"]])
    for cost in run.incidents:
        if _resumed_at(events, cost) is not None:
            gone = set(ranks) if "restart" in cost.parts else _down(events, cost) & set(ranks)
            for rank in gone:
                ax.fill_between([cost.fault - run.start, cost.end - run.start], lane[rank],
                                lane[rank] + 1, color=FAULT_COLOR, alpha=0.15, linewidth=0)
    if run.startup > 0:
        ax.text(run.startup / 2, len(ranks) / 2, f"start-up\n{run.startup:.1f} s",
                ha="center", va="center", fontsize=8, color="#616161")
    for cost in run.incidents:
        timeline.fault_marks.append(ax.axvline(cost.fault - run.start, color=FAULT_COLOR,
                                               linewidth=0.9, linestyle="--"))
    ax.set_yticks([lane[r] + 0.5 for r in ranks], [f"rank {r}" for r in ranks], fontsize=8)
    ax.set_ylim(-0.05, len(ranks) + 0.05)
    ax.set_ylabel(f"iteration 0-{top:g}\nin each lane", fontsize=8)
    ax.tick_params(axis="x", labelbottom=False)
    ax.set_xlim(left=0.0)
    ax.set_title("each rank: the job's iteration over time (shaded red: its process was gone; "
                 "the line ends where the rank left the job)", fontsize=8, loc="left")


def _lane_mark(timeline: Timeline, ax: Axes, event: dict[str, Any], start: float,
               lane: int) -> None:
    marker, color, _ = RANK_MARKS[event["event"]]
    (mark,) = ax.plot([event["time"] - start], [lane + 0.5], marker=marker, color=color,
                      linestyle="", markersize=8)
    if event["event"] == "fault_injected":
        timeline.fault_marks.append(mark)
    else:
        timeline.restart_marks.setdefault(event["rank"], []).append(mark)


def _draw_loss(timeline: Timeline, ax: Axes, events: Events, run: RunLike,
               compare: Events | None) -> None:
    logged = sorted((e["time"], e["loss"], e["iteration"]) for e in events
                    if e["event"] in _STEP_EVENTS)
    breaks = [(c.fault, math.nan, 0) for c in run.incidents]  # no line across an incident
    points = sorted(logged + breaks, key=lambda p: p[0])
    (line,) = ax.plot([t - run.start for t, _, _ in points], [v for _, v, _ in points],
                      color="#1565c0", marker=".", markersize=4, linewidth=1.2, label="loss")
    timeline.loss_lines["loss"] = line
    if compare:
        timeline.loss_lines["fault-free"] = _draw_compare(ax, logged, compare, run.start)
    for cost in run.incidents:
        timeline.fault_marks.append(ax.axvline(cost.fault - run.start, color=FAULT_COLOR,
                                               linewidth=0.9, linestyle="--"))
    ax.set_xlabel("seconds since the job started", fontsize=8)
    ax.set_ylabel("loss", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="lower left")


def _draw_compare(ax: Axes, logged: list[tuple[float, float, int]], compare: Events,
                  start: float) -> Line2D:
    """The fault-free run's loss, its iteration 1 put where this run's iteration 1 is."""
    other = sorted((e["time"], e["loss"], e["iteration"]) for e in compare
                   if e["event"] == "iteration")
    mine = next((t for t, _, i in logged if i == 1), logged[0][0] if logged else start)
    theirs = next((t for t, _, i in other if i == 1), other[0][0] if other else 0.0)
    shift = mine - theirs - start
    (line,) = ax.plot([t + shift for t, _, _ in other], [v for _, v, _ in other],
                      color="#757575", linestyle="--", linewidth=1.0,
                      label="fault-free run (aligned at iteration 1)")
    return line


def _draw_loss_by_iteration(timeline: Timeline, ax: Axes, events: Events,
                            compare: Events | None) -> None:
    """Every logged loss by iteration (first runs of rolled-back iterations hollow), and the
    fault-free run's: equal losses lie on each other."""
    logged = [(e["iteration"], e["loss"]) for e in events if e["event"] in _STEP_EVENTS]
    last = {i: loss for i, loss in logged}
    first_runs = [(i, v) for n, (i, v) in enumerate(logged)
                  if any(j == i for j, _ in logged[n + 1:])]
    (line,) = ax.plot(sorted(last), [last[i] for i in sorted(last)], color="#1565c0",
                      marker=".", markersize=4, linewidth=1.2)
    timeline.loss_lines["loss by iteration"] = line
    if first_runs:
        ax.plot([i for i, _ in first_runs], [v for _, v in first_runs], linestyle="",
                marker="o", markersize=5, markerfacecolor="none", color="#1565c0")
    title = "loss by iteration"
    if compare:
        other = {e["iteration"]: e["loss"] for e in compare if e["event"] == "iteration"}
        (line,) = ax.plot(sorted(other), [other[i] for i in sorted(other)], color="#757575",
                          linestyle="--", linewidth=1.0)
        timeline.loss_lines["fault-free by iteration"] = line
        equal = sum(1 for i in last if other.get(i) == last[i])
        title = f"equal to the fault-free run's\nat {equal} of {len(set(last) | set(other))}"
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("iteration", fontsize=8)
    ax.tick_params(labelsize=7)


def _draw_bands(timeline: Timeline, ax: Axes, run: RunLike) -> None:
    """The start-up and each incident's parts as shaded bands over the whole-run panels."""
    if run.startup > 0:
        _band(ax, 0.0, run.startup, color="#eeeeee", linewidth=0)
    for cost in run.incidents:
        for name, start, end in _rows(cost):
            if end > start:
                band = _band(ax, start - run.start, end - run.start, alpha=0.45, linewidth=0,
                                  color=PHASE_COLORS.get(name, "#bdbdbd"))
                timeline.bands.setdefault(name, []).append(band)


def _band(ax: Axes, start: float, end: float, **style: Any) -> Artist:
    """A full-height band from `start` to `end` (a Rectangle, as `axvspan` draws since
    matplotlib 3.9, on every supported version)."""
    from matplotlib.patches import Rectangle

    return ax.add_patch(Rectangle((start, 0.0), end - start, 1.0,
                                  transform=ax.get_xaxis_transform(), **style))
