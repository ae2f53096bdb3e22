"""What happened in a job, read from its events file: the fault incidents, phase by phase.

    tft-report runs/demo/faulty/events.jsonl
    tft-report FAULTY.jsonl --compare FAULT_FREE.jsonl

    tft-report FAULTY.jsonl --plot timeline.png [--compare FAULT_FREE.jsonl]

For every incident it prints what failed (injected fault, detected faults with their ranks
and kinds), what the controller decided (strategy, lock step), every phase it went through
with its duration (hold, stop, clean, repair, rollback, dump, rename, scale_in, scale_out, exit; `phases`),
the shard copies, and where training resumed; then the iterations and the goodput
(`mindspeed_tft.goodput`): the productive step time over the wall time, and what each incident cost,
phase by phase. With `--compare`, it checks that every logged loss equals the other job's
(bit for bit) and exits 1 if one does not. `--plot` draws the timeline (mindspeed_tft/
tools/timeline.py; needs matplotlib: `pip install mindspeed-tft[plot]`), with the other job's
loss curve when `--compare` is given. ``python -m mindspeed_tft.report`` is the same command.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from mindspeed_tft.events import read_events
from mindspeed_tft.goodput import (
    Goodput,
    Incident,
    goodput,
    incidents,
    losses,
    phases,
    starts_phase,
)

if TYPE_CHECKING:
    from mindspeed_tft.tools.timeline import Timeline


def describe_goodput(result: Goodput) -> list[str]:
    """Lines for the goodput of a run and what each incident cost, phase by phase."""
    lines = [f"goodput {result.ratio:.3f}: {result.productive:.2f} s of productive step time "
             f"in {result.wall:.2f} s of wall time ({result.training_ratio:.3f} from the "
             "first step on)"]
    guessed = any(not s.measured for s in result.steps)
    lines.append(f"  productive: {result.counted} steps whose results count (each iteration's "
                 "last run, not undone by a rollback), each from the previous step, "
                 "checkpoint save or resume to its iteration event"
                 + (f" (a job's first step, which no event starts: the median step, "
                    f"{result.median_step:.2f} s)" if guessed else ""))
    lost = sum(c.total for c in result.incidents)
    lines.append(f"  the rest: startup {result.startup:.2f} s (the job's start to its first "
                 f"step), checkpoint saves {result.checkpoints:.2f} s, incidents {lost:.2f} s, "
                 f"other {result.other:.2f} s (e.g. shutdown)")
    for cost in result.incidents:
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in cost.parts.items())
        redone = f" ({cost.discarded_steps} steps)" if cost.discarded_steps else ""
        lines.append(f"  incident {cost.number} cost {cost.total:.2f} s: {parts}{redone}")
    return lines


def timeline(events: list[dict[str, Any]],
             compare: list[dict[str, Any]] | None = None) -> Timeline:
    """The timeline picture of a run (mindspeed_tft/tools/timeline.py; needs matplotlib), with the
    loss curve of `compare` (a fault-free run's events) when given."""
    from mindspeed_tft.tools.timeline import build_timeline

    return build_timeline(events, goodput(events), compare)


def _describe(event: dict[str, Any]) -> str | None:
    name = event["event"]
    if name == "fault_injected":
        where = f"rank {event['rank']}, step {event['step']}, phase {event['phase']}"
        target = f" ({event['target']})" if event.get("target") else ""
        return f"fault injected: {event['kind']}{target} at {where}"
    if name == "fault_detected":
        return f"fault detected: {event['kind']} on rank(s) {event['ranks']}: {event['message'][:90]}"
    if name == "fault_withdrawn":
        return f"fault withdrawn: {event['kind']} on rank(s) {event['ranks']}: {event['message'][:90]}"
    if name == "strategy":
        return f"decision: {event['strategy']} at lock step {event['lock_step']}"
    if name == "state":
        return f"controller state {event.get('prev')} -> {event['state']}"
    if name == "action":
        return f"phase {event['action']} ({event['targets']} ranks)"
    if name == "worker_restarted":
        how = "a warm spare" if event.get("spare") else "a new process"
        return (f"launcher restarted rank {event['rank']} (pid {event['pid']} -> "
                f"{event['new_pid']}, {how})")
    if name == "shard_received":
        return (f"rank {event['rank']} received {event['optimizer']} shard {event['shard']} "
                f"of iteration {event['iteration']} from rank {event['source']}")
    if name == "dump_saved":
        return f"dying-gasp checkpoint of iteration {event['iteration']} saved in {event['path']}"
    if name == "dump_not_published":
        return (f"rank {event['rank']}: iteration {event['iteration']}'s checkpoint was "
                f"published by {event['published_by']} (the other side of a partition): "
                "not written again")
    if name == "node_silent":
        then = {"wait": f"waits up to {event.get('wait_s')}s for a replacement launcher",
                "dump": "no replacement: the dump", "shrink": "no replacement: the shrink"}
        return (f"node {event['node']}'s launcher silent for {event['silent_s']}s (ranks "
                f"{event['ranks']}): {then.get(event['decision'], event['decision'])}")
    if name == "node_back":
        return f"node {event['node']}'s launcher heard again (ranks {event['ranks']})"
    if name == "checkpoint_failed":
        return (f"rank {event['rank']}: {event['what']} of iteration {event['iteration']} not "
                f"written: {event['path']}: {event['reason']} ({event['free']} bytes free of "
                f"{event['total']})")
    if name == "repaired":
        return f"repaired ({event['strategy']}): training resumes at iteration {event['step']}"
    if name == "scale_in":
        return (f"elastic training: the job shrank to {event['world_size']} ranks (DP "
                f"{event['dp_size']}, ranks {event['ranks']}) without ranks {event['left']}; "
                f"training resumes at iteration {event['step']}")
    if name == "scale_out_started":
        return (f"elastic training: ranks {event['joining']} came back; the job grows to "
                f"{event['world_size']} ranks (DP {event['dp_size']})")
    if name == "scale_out":
        return (f"elastic training: the job grew to {event['world_size']} ranks (DP "
                f"{event['dp_size']}, ranks {event['ranks']}) with ranks {event['joined']}; "
                f"training resumes at iteration {event['step']}")
    if name == "exit":
        return f"job exits with code {event['code']}: {event['reason']}"
    return None


def describe_incident(incident: Incident) -> list[str]:
    """Lines for one incident: each step with the time since the fault, and each phase's
    duration (`phases`)."""
    events = incident.events
    start = events[0]["time"]
    lines = [f"incident {incident.number}:"]
    rollbacks = [e for e in events if e["event"] == "rolled_back"]
    starts = [e for e in events if starts_phase(e)]
    took_s = {id(e): p.seconds for e, p in zip(starts, phases(incident), strict=True)}
    for event in (e for e in events if _describe(e) is not None):
        took = f" ({took_s[id(event)]:.2f} s)" if event["event"] == "action" else ""
        lines.append(f"  +{event['time'] - start:7.2f} s  {_describe(event)}{took}")
        if event["event"] == "action" and event["action"] == "rollback" and rollbacks:
            ranks = sorted(e["rank"] for e in rollbacks)
            lines.append(f"  {'':11}  ranks {ranks} rolled back to iteration "
                         f"{rollbacks[0]['iteration']}")
    end = events[-1]["time"]
    lines.append(f"  total {end - start:.2f} s from the fault to the end of its handling")
    return lines


#: a repair's work per rank as reports give it (`repair_work`): name -> the `events.
#: WorkCounts` names summed into it (a name ending in '.' sums every counter it begins)
WORK_COUNTS = {
    "connections": ("connections.",),
    "conn_groups": ("connections.groups",),
    "store_ops": ("store_ops.",),
    "store_bytes": ("store_bytes",),
    "control_msgs": ("control_sent.", "control_received."),
    "control_bytes": ("control_sent_bytes.", "control_received_bytes."),
    "groups_created": ("groups_created",),
    "group_calls": ("group_calls",),
    "state_bytes": ("state_bytes_sent", "state_bytes_received"),
}
#: control messages that come every heartbeat interval, as many as the repair lasts: left
#: out of `control_msgs` and `control_bytes`, counted as `heartbeats`
PERIODIC_MESSAGES = ("hb", "ack")


def _periodic(name: str) -> bool:
    return name.startswith("control_") and name.rsplit(".", 1)[-1] in PERIODIC_MESSAGES


def work_summary(delta: dict[str, int]) -> dict[str, int]:
    """`WORK_COUNTS` (and `heartbeats`) of one rank from its raw counter differences."""
    row = {}
    for name, prefixes in WORK_COUNTS.items():
        row[name] = sum(value for key, value in delta.items() if not _periodic(key) and any(
            key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes))
    row["heartbeats"] = sum(value for key, value in delta.items()
                            if _periodic(key) and "_bytes." not in key)
    return row


def repair_work(events: list[dict[str, Any]],
                incident: int | None = None) -> dict[int, dict[str, int]]:
    """Each rank's work in the repair of `incident` (default: the first repair with a
    `resumed` mark), summarized (`work_summary`): the difference of its process's `work`
    counts between the `stop` mark and the `resumed` mark (the end of the first step after
    the repair), or from the process's start for a process that was not stopped (a
    worker reboot's replacement)."""
    marks = [e for e in events if e["event"] == "work"]
    resumed = [e for e in marks if e["mark"] == "resumed"]
    if not resumed:
        return {}
    incident = resumed[0]["incident"] if incident is None else incident
    rows = {}
    for end in (e for e in resumed if e["incident"] == incident):
        start = next((e for e in marks if e["mark"] == "stop" and e["incident"] == incident
                      and e["pid"] == end["pid"]), None)
        before = {} if start is None else start["counts"]
        rows[end["rank"]] = work_summary(
            {key: value - before.get(key, 0) for key, value in end["counts"].items()})
    return rows


def _plot_suffix(path: str) -> str:
    suffix = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if suffix not in ("png", "svg"):
        raise argparse.ArgumentTypeError(f"{path}: the picture is written as .png or .svg")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tft-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("events", help="the job's events file (--tft-events-file)")
    parser.add_argument("--compare", metavar="EVENTS",
                        help="another job's events file whose losses must be equal")
    parser.add_argument("--plot", metavar="OUT", type=_plot_suffix,
                        help="draw the timeline into OUT (.png or .svg; needs matplotlib)")
    args = parser.parse_args(argv)
    events = read_events(args.events)
    for incident in incidents(events):
        print("\n".join(describe_incident(incident)))
    mine = losses(events)
    if mine:
        last = max(mine)
        print(f"iterations logged: {len(mine)}, last {last}, final loss {mine[last]!r}")
    print("\n".join(describe_goodput(goodput(events))))
    other_events = read_events(args.compare) if args.compare else None
    if args.plot:
        try:
            timeline(events, other_events).save(args.plot)
        except ImportError as e:
            print(f"--plot: {e}", file=sys.stderr)
            return 2
        print(f"timeline: {args.plot}")
    if other_events is not None:
        other = losses(other_events)
        differ = sorted(i for i in set(mine) | set(other) if mine.get(i) != other.get(i))
        if differ:
            print(f"losses differ from {args.compare} at iterations {differ}")
            return 1
        print(f"every loss equals {args.compare}'s, bit for bit ({len(mine)} iterations; "
              f"final {mine[max(mine)]!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
