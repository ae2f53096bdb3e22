"""Runs `client.py` as a K-rank job against one `mindio_ttp` and reads back what it recorded.

`run_case(python, env, run_dir, case, ...)` starts one process per rank (rank 0 first: it
hosts the controller, as in MindSpeed-LLM), waits until every rank ended or said that it was
told to exit, ends what is left with SIGKILL (Huawei's SDK swallows SIGTERM) and returns a
`CaseResult`: per rank the handler calls in order, the exit codes and the output.
`calls_view` reduces the calls to what both implementations must agree on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLIENT = Path(__file__).resolve().parent / "client.py"
#: what the comparison looks at (the timing and the client's own markers are left out)
HANDLER_CALLS = ("stop", "clean", "repair", "rollback", "rebuild_group", "save_ckpt", "rename")


@dataclass
class CaseResult:
    case: str
    calls: dict[int, list[dict[str, Any]]]
    codes: dict[int, int | None]
    output: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0

    def named(self, rank: int, name: str) -> list[dict[str, Any]]:
        return [c for c in self.calls.get(rank, []) if c["call"] == name]

    def first(self, name: str) -> float | None:
        """The earliest time any rank made call `name`."""
        times = [c["t"] for calls in self.calls.values() for c in calls if c["call"] == name]
        return min(times) if times else None

    def describe(self) -> str:
        lines = [f"case {self.case}: codes {self.codes}"]
        for rank in sorted(self.calls):
            lines.append(f"rank {rank}: {[c['call'] for c in self.calls[rank]]}")
        for rank in sorted(self.output):
            lines.append(f"--- rank {rank} output (tail) ---\n{self.output[rank][-3000:]}")
        return "\n".join(lines)


def _read_calls(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    path = run_dir / f"calls.{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finished(calls: list[dict[str, Any]]) -> bool:
    return any(c["call"] in ("exit", "end") for c in calls)


def run_case(python: str, env: dict[str, str], run_dir: Path, case: str, *, world: int,
             port: int, dp_groups: list[list[int]], iterations: int, fault_rank: int = -1,
             fault_iter: int = -1, timeout: float = 90.0, linger: float = 1.0,
             **spec: Any) -> CaseResult:
    """Run one case; see the module docstring."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(
        {"iterations": iterations, "dp_groups": dp_groups, **spec}))
    env = {**env, "TTP_LOG_PATH": str(run_dir / "logs")}
    procs: dict[int, subprocess.Popen] = {}
    logs = {}
    start = time.monotonic()
    try:
        for rank in range(world):
            logs[rank] = open(run_dir / f"out.{rank}.txt", "w")
            procs[rank] = subprocess.Popen(
                [python, str(CLIENT), str(run_dir), str(rank), str(world), str(port), case,
                 str(fault_rank), str(fault_iter)],
                env=env, stdout=logs[rank], stderr=subprocess.STDOUT, start_new_session=True)
            if rank == 0:
                time.sleep(0.3)  # the controller binds first, as rank 0 does in MindSpeed-LLM
        deadline = start + timeout
        while time.monotonic() < deadline:
            done = [procs[r].poll() is not None or _finished(_read_calls(run_dir, r))
                    for r in procs]
            if all(done):
                break
            time.sleep(0.1)
        # ranks told to exit may still be on their way out (Huawei's SDK: 10 s, then exit 2)
        end = time.monotonic() + linger
        while time.monotonic() < end and any(p.poll() is None for p in procs.values()):
            time.sleep(0.05)
    finally:
        seconds = time.monotonic() - start
        end_all(procs, logs, port)
    return CaseResult(
        case=case, calls={r: _read_calls(run_dir, r) for r in range(world)},
        codes={r: p.returncode for r, p in procs.items()},
        output={r: (run_dir / f"out.{r}.txt").read_text(errors="replace") for r in range(world)},
        seconds=seconds)


def end_all(procs: dict[Any, subprocess.Popen], logs: dict[Any, Any], port: int) -> None:
    """SIGKILL what is left of the processes (their sessions), close their logs and delete
    the job token file a killed controller of this project left for `port`."""
    from mindio_ttp import _token

    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs.values():
        proc.wait(timeout=30)
    for f in logs.values():
        f.close()
    _token.withdraw(_token.token_path("127.0.0.1", port))


def calls_view(result: CaseResult) -> dict[int, list[tuple]]:
    """Per rank, the handler calls as comparable tuples, in the order they were made."""
    view: dict[int, list[tuple]] = {}
    for rank, calls in result.calls.items():
        rows = []
        for c in calls:
            name = c["call"]
            if name not in HANDLER_CALLS:
                continue
            if name == "clean":
                rows.append((name, c["is_uce_error"], c["repair_type"]))
            elif name == "repair":
                info = c["repair_info"]
                rows.append((name, c["step"], c["need_rebuild"], tuple(c["error_ranks"]),
                             info["repair_type"], tuple(info["src"]), tuple(info["dst"]),
                             tuple(info["type"]), tuple(info["rank_list"])))
            elif name in ("rollback", "rename"):
                rows.append((name, c["step"]))
            elif name == "save_ckpt":
                rows.append((name, c["step"], tuple((i["type"], tuple(i["ranks"]))
                                                    for i in c["save_info"])))
            elif name == "rebuild_group":
                rows.append((name, tuple(c["fault_ranks"])))
            else:
                rows.append((name,))
        view[rank] = rows
    return view
