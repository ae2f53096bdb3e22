"""Runs the SDK's own minimal client, `example_proc.py` (../shared/peers/mindio_ttp, used
unchanged), as a standalone controller (`tft_init_controller(-1, K, False)`) plus K
processors against one `mindio_ttp`, reports a UCE on one rank and reads back what every
rank's handlers recorded.

`run(python, env, run_dir, ...)` starts the controller process and waits for its
`controller.ready`, calls `before_ranks(port)` (a test's stranger goes there), starts the
processors and waits until each reported its first update (`step1`), calls
`with_ranks(port)`, then writes `uce` to `cmd.<rank>` and sends that rank SIGUSR1 (the
client's way to report), waits (bounded) until every rank's stop handler ran, and ends every
process with SIGKILL (Huawei's SDK swallows SIGTERM). Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.sdk_compat.harness import end_all


@dataclass
class Event:
    rank: int
    name: str
    t: float
    extra: str


@dataclass
class Outcome:
    events: dict[int, list[Event]]
    output: dict[str, str] = field(default_factory=dict)
    codes: dict[str, int | None] = field(default_factory=dict)

    def first(self, rank: int, name: str) -> float | None:
        times = [e.t for e in self.events.get(rank, []) if e.name == name]
        return min(times) if times else None

    def names(self, rank: int) -> list[str]:
        return [e.name for e in self.events.get(rank, [])]

    def describe(self) -> str:
        lines = [f"rank {r}: {self.names(r)}" for r in sorted(self.events)]
        lines += [f"--- {who} (code {self.codes.get(who)}) ---\n{text[-2500:]}"
                  for who, text in self.output.items()]
        return "\n".join(lines)


def _events(run_dir: Path, world: int) -> dict[int, list[Event]]:
    events: dict[int, list[Event]] = {}
    for rank in range(world):
        path = run_dir / f"events.{rank}"
        rows = path.read_text().splitlines() if path.exists() else []
        for row in rows:
            parts = row.split(" ", 3)
            if len(parts) >= 3:
                events.setdefault(rank, []).append(
                    Event(int(parts[0]), parts[1], float(parts[2]),
                          parts[3] if len(parts) > 3 else ""))
    return events


def _wait(what: str, until: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g}s")
        time.sleep(0.02)


def run(python: str, env: dict[str, str], example: Path, run_dir: Path, *, port: int,
        world: int = 4, uce_rank: int = 1, dp_size: int = 2, settle: float = 3.0,
        before_ranks: Callable[[int], None] | None = None,
        with_ranks: Callable[[int], None] | None = None, timeout: float = 60.0,
        controller_delay: float | None = None) -> Outcome:
    """See the module docstring. `settle`: seconds after the last stop, for late ones.
    `controller_delay`: start the processors first and the controller that many seconds
    later (as torchrun starts every rank at once; `before_ranks` is then not called)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    logs = {}

    def start(who: str, args: list[str]) -> None:
        logs[who] = open(run_dir / f"out.{who}.txt", "w")
        procs[who] = subprocess.Popen(
            ["nice", "-n", "10", python, str(example), *args], env=env, stdout=logs[who],
            stderr=subprocess.STDOUT, start_new_session=True, cwd=run_dir)

    def start_controller() -> None:
        start("controller", ["controller", str(world), str(port), str(run_dir)])
        _wait("the controller's controller.ready",
              lambda: (run_dir / "controller.ready").exists() or
              procs["controller"].poll() is not None, timeout)

    try:
        if controller_delay is None:
            start_controller()
            if before_ranks is not None:
                before_ranks(port)
        for rank in range(world):
            start(f"rank{rank}", ["processor", str(rank), str(world), str(port), str(run_dir),
                                  str(dp_size)])
        if controller_delay is not None:
            time.sleep(controller_delay)
            start_controller()
        _wait("every rank's first update (step1)",
              lambda: all("step1" in [e.name for e in _events(run_dir, world).get(r, [])]
                          for r in range(world))
              or any(p.poll() is not None for p in procs.values()), timeout)
        if with_ranks is not None:
            with_ranks(port)
        (run_dir / f"cmd.{uce_rank}").write_text("uce")
        os.kill(procs[f"rank{uce_rank}"].pid, signal.SIGUSR1)
        try:
            _wait("a stop on every rank",
                  lambda: all("stop" in [e.name for e in _events(run_dir, world).get(r, [])]
                              for r in range(world)), timeout)
        except TimeoutError:
            pass  # the caller's assertions say what is missing
        time.sleep(settle)
    finally:
        end_all(procs, logs, port)
    return Outcome(events=_events(run_dir, world),
                   output={w: (run_dir / f"out.{w}.txt").read_text(errors="replace")
                           for w in procs},
                   codes={w: p.returncode for w, p in procs.items()})
