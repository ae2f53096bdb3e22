"""A launcher's stop and a training process's data-loader workers (`launcher.lifetime`, the
``data-loader-workers`` patch moment), on real processes: `tests/programs/data_worker_stop.py`
is a training process's data loader (2 forked workers) in a session of its own, as torchrun
starts a worker, and the test stops it as torchrun does (SIGTERM to the process group).

Without the moment, torch's own behaviour: the workers die of the SIGTERM and the training
process raises "DataLoader worker (pid N) is killed by signal: Terminated" from its SIGCHLD
handler (or "... exited unexpectedly" from its next batch, when that sees it first): the
failure that lost the dump under plain torchrun. With it: the workers ignore a SIGTERM that
is not their training process's, every batch comes, the training process's own exit still
ends them, and a training process killed outright takes them with it at once. The same on
whole training jobs: the launch matrix (docs/design.md, "Launch matrix").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import REPO, wait_for

PROGRAM = REPO / "tests" / "programs" / "data_worker_stop.py"
EXPECTED = [[[i, i * i] for i in range(b, b + 4)] for b in range(0, 40, 4)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _start(out: Path, mode: str) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(PROGRAM), str(out), mode], env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    ready = out / "ready.json"
    wait_for(lambda: ready.exists() or proc.poll() is not None, 60, "the loader's first batch")
    assert ready.exists(), proc.communicate(timeout=10)[1]
    return proc, json.loads(ready.read_text())


@pytest.mark.parametrize("mode", ["torch", "tft"])
def test_a_launchers_stop_is_the_training_processs_not_its_data_loaders(mode, tmp_path):
    proc, ready = _start(tmp_path, mode)
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun's stop: the worker's whole process group
    try:
        _, err = proc.communicate(timeout=30)  # its own exit ends the workers (no hang)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["sigterm"], "the training process saw the stop"
    if mode == "torch":  # torch's SIGCHLD handler, or its next batch if that ran first
        error = result["error"]
        assert error is not None and error.startswith("DataLoader worker (pid"), error
        assert "is killed by signal: Terminated" in error or "exited unexpectedly" in error
    else:
        assert result["error"] is None, result["error"]
        assert result["batches"] == EXPECTED
    wait_for(lambda: not any(alive(pid) for pid in ready["workers"]), 5, "the workers' end")


def test_data_loader_workers_die_with_their_training_process(tmp_path):
    """Killed outright, the training process takes its workers with it at once (the
    parent-death signal), not after torch's own watchdog (up to 5 s)."""
    proc, ready = _start(tmp_path, "tft")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not any(alive(pid) for pid in ready["workers"]), 5, "the workers' end")
        assert time.monotonic() - killed < 1.0
    finally:
        proc.communicate(timeout=10)
        for pid in ready["workers"]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
