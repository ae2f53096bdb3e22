"""Helpers shared by the benchmarks: free ports, the bench environment, running a job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Environment variables that would change what a benchmark job does behind its flags.
_SCRUBBED_ENV = ("HIGH_AVAILABILITY", "TFT_INJECT", "TFT_EVENTS_FILE", "TTP_PORT", "TTP_LOG_PATH")


if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.jobs import free_port  # noqa: E402  (one port policy for tests and benchmarks)


def bench_env(log_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a benchmark job: one OpenMP thread per rank, no injected faults,
    no HIGH_AVAILABILITY override, the repo importable, the high-availability controller on
    a free port and its log (TTP_LOG_PATH) in `log_dir` rather than ./logs."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env["OMP_NUM_THREADS"] = "1"
    env["TTP_PORT"] = str(free_port())
    env["TTP_LOG_PATH"] = str(log_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, script: Path, script_args: list[str]) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`) of `script` on `nproc` local ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()),
        str(script), *script_args,
    ]


@dataclass
class JobOutput:
    returncode: int
    output: str
    seconds: float


def run_job(cmd: list[str], env: dict[str, str], timeout_s: float, log: Path) -> JobOutput:
    """Run `cmd` in its own process group; on timeout kill the whole group. The combined
    output is written to `log` and returned."""
    import time

    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = -9
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return JobOutput(returncode, log.read_text(encoding="utf-8"), time.monotonic() - start)


def tail(text: str, lines: int = 40) -> str:
    """The last `lines` lines of a job's output, preceded by its first Python traceback (the
    root cause is usually there, not in torchrun's summary at the end)."""
    all_lines = text.splitlines()
    first = next((i for i, line in enumerate(all_lines) if "Traceback (most recent" in line), None)
    head = ""
    if first is not None and first < len(all_lines) - lines:
        head = "\n".join(all_lines[first:first + 30]) + "\n[...]\n"
    return head + "\n".join(all_lines[-lines:])
