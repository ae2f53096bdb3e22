"""Helpers of `bench/recovery.py` and `bench/dump.py`: one fault-injected tiny-CPU job (the
reference trainer, or Megatron-LM's own loop with `host`), and
the timeline of what happened after the fault, read from the job's own records:

- the events file (SPEC 11; unix `time` on every event);
- the TTP log (`TTP_LOG_PATH/ttp_log.log`, lines stamped `YYYY-mm-dd HH:MM:SS,mmm`, local
  time): registration of a restarted rank, process-group rebuild, shard sends;
- torchrun's own log lines in the job output (`W1129 22:52:51.889000 PID file:line] ...`,
  local time): when the agent noticed a failed worker and stopped the others.

All stamps come from the same machine clock, so they are comparable to each other.
"""

from __future__ import annotations

import re
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from _jobs import Host, bench_env, free_port, run_job, tail

from mindspeed_tft.events import read_events_if_any

_TTP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ \[pid \d+ [^\]]*\] [\w.]+: (.*)$")
_TORCHRUN_LINE = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) +\d+ \S+\] (.*)$")
_LOG_STEP = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
)
#: Knobs of the script (and the heartbeat) that a benchmark job never inherits from the shell.
_INHERITED_KNOBS = (
    "LOAD_DIR", "GBS", "EXTRA_ARGS", "DIST_OPT_ARGS", "DATA_ARGS", "TOKENIZER_ARGS",
    "TINY_NUM_LAYERS", "TINY_HIDDEN_SIZE", "TINY_FFN_HIDDEN_SIZE", "TINY_SEQ_LENGTH",
    "TTP_HEARTBEAT_INTERVAL", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "MEGATRON_LM", "ENTRY", "SCRIPT",
)
#: the reference trainer's and Megatron-LM's "loaded checkpoint ... at iteration N" lines
_LOADED = re.compile(r"loaded checkpoint (?:from )?\S+ (?:\[[^\]]*\] )?at iteration (\d+)")


@dataclass
class Job:
    """A finished job and what it left behind."""

    name: str
    run_dir: Path
    returncode: int
    output: str
    seconds: float
    events: list[dict[str, Any]] = field(default_factory=list)
    ttp: list[tuple[float, str]] = field(default_factory=list)

    # -- events -----------------------------------------------------------------------------
    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]

    def first(self, name: str, after: float = float("-inf"), **match: Any) -> dict[str, Any] | None:
        """The first event `name` at or after `after` whose fields equal `match`."""
        for e in self.events:
            if e.get("event") == name and e["time"] >= after and all(
                e.get(k) == v for k, v in match.items()
            ):
                return e
        return None

    def losses(self) -> dict[int, float]:
        """Iteration -> loss (the last one logged for an iteration wins)."""
        return {e["iteration"]: e["loss"] for e in self.named("iteration")}

    def relogged(self) -> list[int]:
        """Iterations computed again after a rollback (their `iteration_recomputed` events;
        each iteration is logged once), or logged twice (a restart from a checkpoint
        without a controller)."""
        seen: dict[int, int] = {}
        for e in self.named("iteration"):
            seen[e["iteration"]] = seen.get(e["iteration"], 0) + 1
        again = {e["iteration"] for e in self.named("iteration_recomputed")}
        return sorted(again | {it for it, n in seen.items() if n > 1})

    def steps_done(self) -> list[dict[str, Any]]:
        """The `iteration` and `iteration_recomputed` events (every completed step), in order."""
        return [e for e in self.events
                if e.get("event") in ("iteration", "iteration_recomputed")]

    def fault(self) -> dict[str, Any]:
        fault = self.first("fault_injected")
        if fault is None:
            raise RuntimeError(f"{self.name}: no fault_injected event\n{self.describe()}")
        return fault

    def first_iteration_after_fault(self) -> dict[str, Any] | None:
        """The first `iteration` event after the fault of an iteration beyond the fault's
        step: the step the fault interrupted, completed (or the first step after it, when the
        survivors completed that update before the repair)."""
        fault = self.fault()
        for e in self.steps_done():
            if e["time"] > fault["time"] and e["iteration"] > fault["step"]:
                return e
        return None

    # -- logs -------------------------------------------------------------------------------
    def ttp_first(self, pattern: str, after: float = float("-inf")) -> float | None:
        """Time of the first TTP log line at or after `after` matching regex `pattern`."""
        rx = re.compile(pattern)
        return next((t for t, msg in self.ttp if t >= after and rx.search(msg)), None)

    def ttp_last(self, pattern: str, after: float = float("-inf")) -> float | None:
        rx = re.compile(pattern)
        times = [t for t, msg in self.ttp if t >= after and rx.search(msg)]
        return max(times) if times else None

    def torchrun_lines(self) -> list[tuple[float, str]]:
        """torchrun's stamped log lines (its stamps carry no year: the fault's is used)."""
        year = datetime.fromtimestamp(self.fault()["time"]).year
        lines = []
        for line in self.output.splitlines():
            m = _TORCHRUN_LINE.match(line)
            if m:
                month, day, clock, msg = m.groups()
                stamp = datetime.strptime(f"{year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f")
                lines.append((stamp.timestamp(), msg))
        return lines

    def step_times_s(self, warmup: int = 3) -> list[float]:
        """The trainer's "elapsed time per iteration" (s) of every logged iteration after the
        first `warmup` (restarted workers' lines included)."""
        return [float(ms) / 1000.0 for it, ms in _LOG_STEP.findall(self.output)
                if int(it) > warmup]

    def step_s(self, warmup: int = 3) -> float:
        times = self.step_times_s(warmup)
        return statistics.median(times) if times else float("nan")

    def loaded_iterations(self) -> list[int]:
        return [int(it) for it in _LOADED.findall(self.output)]

    def describe(self, lines: int = 40) -> str:
        return f"job {self.name} in {self.run_dir} exited {self.returncode}:\n" + tail(
            self.output, lines)


def _read_ttp(path: Path) -> list[tuple[float, str]]:
    if not path.exists():
        return []
    lines = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = _TTP_LINE.match(line)
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            lines.append((stamp, m.group(2)))
    return lines


@dataclass
class JobSpec:
    """One run of `scripts/pretrain_tiny_cpu.sh` or `scripts/pretrain_megatron_lm_cpu.sh`
    (environment knobs of their headers)."""

    name: str
    train_iters: int
    save_interval: int
    ha_args: str = " "  # blank: high availability off (the script's default turns it on)
    launcher: str = "torchrun"  # "torchrun", "tft-run", or a full command line
    inject: str | None = None
    load: bool = False  # LOAD_DIR = CKPT_DIR (a restarted job resumes from its checkpoint)
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)


def launcher_command(launcher: str) -> str:
    if launcher == "torchrun":
        return f"{sys.executable} -m torch.distributed.run"
    return launcher


def run_spec(spec: JobSpec, work: Path, timeout_s: float, host: Host | None = None) -> Job:
    """Run `spec` in `work/<name>` in `host`'s training loop (default: the reference trainer)
    and read back its events and logs."""
    host = host or Host()
    run_dir = work / spec.name
    if run_dir.exists():  # events files are appended to: never mix two runs
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    ckpt = run_dir / "ckpt"
    env = bench_env(
        run_dir / "ttp_logs",
        NPROC="4", TP="1", PP="1",
        TRAIN_ITERS=str(spec.train_iters),
        SAVE_INTERVAL=str(spec.save_interval),
        RUN_DIR=str(run_dir),
        CKPT_DIR=str(ckpt),
        EVENTS=str(run_dir / "events.jsonl"),
        HA_ARGS=spec.ha_args,
        LAUNCHER=launcher_command(spec.launcher),
        MASTER_PORT=str(free_port()),
        TFT_INJECT_STATE_DIR=str(run_dir / "inject-state"),
        PYTHONUNBUFFERED="1",
    )
    for name in _INHERITED_KNOBS:  # the job is what the spec says, whatever the shell has
        env.pop(name, None)
    env.update(host.job_env(launcher_command(spec.launcher)))
    if spec.load:
        env["LOAD_DIR"] = str(ckpt)
    if spec.inject:
        env["TFT_INJECT"] = spec.inject
    env.update(spec.env)
    out = run_job(["bash", str(host.script), *host.script_args, *spec.extra_args], env,
                  timeout_s, run_dir / "output.log")
    events = read_events_if_any(run_dir / "events.jsonl")
    return Job(spec.name, run_dir, out.returncode, out.output, out.seconds, events,
               _read_ttp(run_dir / "ttp_logs" / "ttp_log.log"))


def since(t0: float, t: float | None) -> float | None:
    return None if t is None else t - t0


def fmt_s(value: float | None, width: int = 7) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.3f}"


def print_breakdown(title: str, t0: float, marks: list[tuple[str, float | None]]) -> None:
    """Print the marks (label, absolute time) of a timeline in time order: time since the
    fault and since the previous mark; marks never seen last."""
    print(title)
    prev = t0
    for label, t in sorted(marks, key=lambda m: float("inf") if m[1] is None else m[1]):
        if t is None:
            print(f"  {'-':>7} {'':>9}  {label} (not seen)")
            continue
        print(f"  {t - t0:7.3f} s (+{t - prev:6.3f})  {label}")
        prev = t
