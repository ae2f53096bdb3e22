"""What happened in a job, read from its events file: the fault incidents, phase by phase.

    python -m mindspeed_tft.report runs/demo/faulty/events.jsonl
    python -m mindspeed_tft.report FAULTY.jsonl --compare FAULT_FREE.jsonl

For every incident it prints what failed (injected fault, detected faults with their ranks
and kinds), what the controller decided (strategy, lock step), every phase it went through
with its duration (stop, clean, waiting for restarted workers, repair, rollback, dump,
rename, exit), the shard copies, and where training resumed; then the iterations. With
`--compare`, it checks that every logged loss equals the other job's (bit for bit) and
exits 1 if one does not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mindspeed_tft.events import read_events


@dataclass
class Incident:
    """The events of one fault incident, in order."""

    number: int
    events: list[dict[str, Any]] = field(default_factory=list)


def losses(events: Iterable[dict[str, Any]]) -> dict[int, float]:
    """Iteration -> loss (the last logged wins: recomputed iterations replace earlier ones)."""
    return {e["iteration"]: e["loss"] for e in events if e["event"] == "iteration"}


def incidents(events: list[dict[str, Any]]) -> list[Incident]:
    """Group the events from each fault to the controller's return to NORMAL (or its end)."""
    found: list[Incident] = []
    current: Incident | None = None
    for event in events:
        name = event["event"]
        if current is None and name in ("fault_injected", "fault_detected"):
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
    if name == "repaired":
        return f"repaired ({event['strategy']}): training resumes at iteration {event['step']}"
    if name == "scale_in":
        return (f"elastic training: the job shrank to {event['world_size']} ranks (DP "
                f"{event['dp_size']}, ranks {event['ranks']}) without ranks {event['left']}; "
                f"training resumes at iteration {event['step']}")
    if name == "exit":
        return f"job exits with code {event['code']}: {event['reason']}"
    return None


def describe_incident(incident: Incident) -> list[str]:
    """Lines for one incident: each step with the time since the fault and its duration."""
    events = incident.events
    start = events[0]["time"]
    lines = [f"incident {incident.number}:"]
    rollbacks = [e for e in events if e["event"] == "rolled_back"]
    shown = [e for e in events if _describe(e) is not None]
    for index, event in enumerate(shown):
        following = shown[index + 1]["time"] if index + 1 < len(shown) else event["time"]
        took = f" ({following - event['time']:.2f} s)" if event["event"] == "action" else ""
        lines.append(f"  +{event['time'] - start:7.2f} s  {_describe(event)}{took}")
        if event["event"] == "action" and event["action"] == "rollback" and rollbacks:
            ranks = sorted(e["rank"] for e in rollbacks)
            lines.append(f"  {'':11}  ranks {ranks} rolled back to iteration "
                         f"{rollbacks[0]['iteration']}")
    end = events[-1]["time"]
    lines.append(f"  total {end - start:.2f} s from the fault to the end of its handling")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("events", help="the job's events file (--tft-events-file)")
    parser.add_argument("--compare", metavar="EVENTS",
                        help="another job's events file whose losses must be equal")
    args = parser.parse_args(argv)
    events = read_events(args.events)
    for incident in incidents(events):
        print("\n".join(describe_incident(incident)))
    mine = losses(events)
    if mine:
        last = max(mine)
        print(f"iterations logged: {len(mine)}, last {last}, final loss {mine[last]!r}")
    if args.compare:
        other = losses(read_events(args.compare))
        differ = sorted(i for i in set(mine) | set(other) if mine.get(i) != other.get(i))
        if differ:
            print(f"losses differ from {args.compare} at iterations {differ}")
            return 1
        print(f"every loss equals {args.compare}'s, bit for bit ({len(mine)} iterations; "
              f"final {mine[max(mine)]!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
