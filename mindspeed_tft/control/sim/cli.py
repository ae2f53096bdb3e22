"""`tft-sim`: run the control plane's simulator over many seeds, or replay one schedule.

    tft-sim --seeds 20000 --world 8            # seeds 0..19999 at W = 8
    tft-sim --seed 1234 --world 8              # one seed (its events with -v)
    tft-sim --replay '<schedule json>'         # exactly the schedule a failure printed

For each failing seed it prints the failure (correctness, liveness or crash: see
`invariants`), then the shortest schedule that still fails
(`schedule.shrink`) and the command that replays it. The last line is one JSON object:
schedules, failures, per_minute (schedules a minute on this process's one core), seconds,
world, failing (the first failing seeds). Exit status 0 when nothing failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from collections.abc import Iterable

from .job import Outcome, SimJob
from .schedule import Schedule, generate, shrink

#: failing seeds whose schedule is shrunk and printed (the rest are only counted)
SHRUNK_SHOWN = 3


def run_schedule(schedule: Schedule) -> Outcome:
    return SimJob(schedule).run()


def replay_command(schedule: Schedule) -> str:
    return f"tft-sim --replay {shlex.quote(schedule.to_text())}"


def _report(seed: int, schedule: Schedule, outcome: Outcome, show: bool) -> None:
    print(f"seed {seed}: FAILED: {outcome.failure}", flush=True)
    if not show:
        return
    small = shrink(schedule, lambda s: run_schedule(s).failure is not None)
    print(f"  shortest failing schedule: {small.to_text()}")
    print(f"  replay: {replay_command(small)}", flush=True)


def _verbose(schedule: Schedule) -> Outcome:
    job = SimJob(schedule)
    outcome = job.run()
    print(schedule.to_text())
    for e in job.events:
        fields = {k: v for k, v in e.items() if k not in ("time", "event", "rank")}
        print(f"{e['time']:9.3f} {e['event']:<16} {json.dumps(fields, default=str)[:160]}")
    print(f"outcome: {outcome}")
    return outcome


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tft-sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1000, help="how many seeds (default 1000)")
    ap.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    ap.add_argument("--world", type=int, default=8, help="world size W (default 8)")
    ap.add_argument("--seed", type=int, default=None, help="run this one seed only")
    ap.add_argument("--replay", default=None, help="a schedule as a failure printed it")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the run's events")
    args = ap.parse_args(argv)
    if args.seeds < 0 or args.world < 1:
        ap.error(f"--seeds {args.seeds} / --world {args.world}: need seeds >= 0, world >= 1")
    logging.disable(logging.CRITICAL)  # the controller's log lines: thousands per second
    schedules: Iterable[Schedule]
    if args.replay is not None:
        try:
            schedules = [Schedule.from_text(args.replay)]
        except (ValueError, KeyError, TypeError) as e:
            ap.error(f"--replay: not a schedule ({e})")
    elif args.seed is not None:
        schedules = [generate(args.seed, args.world)]
    else:
        schedules = (generate(s, args.world) for s in range(args.start, args.start + args.seeds))
    return _run_all(schedules, args.world, args.verbose or args.replay is not None
                    or args.seed is not None)


def _run_all(schedules: Iterable[Schedule], world: int, verbose: bool) -> int:
    start = time.process_time()
    wall = time.monotonic()
    count = 0
    failing: list[int] = []
    for schedule in schedules:
        count += 1
        outcome = _verbose(schedule) if verbose else run_schedule(schedule)
        if outcome.failure is not None:
            failing.append(schedule.seed)
            _report(schedule.seed, schedule, outcome, len(failing) <= SHRUNK_SHOWN)
    cpu = max(time.process_time() - start, 1e-9)
    print(json.dumps({"schedules": count, "failures": len(failing),
                      "per_minute": round(count / cpu * 60), "seconds": round(cpu, 2),
                      "wall_seconds": round(time.monotonic() - wall, 2), "world": world,
                      "failing": failing[:20]}), flush=True)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
