"""Process-group rebuild (`mindspeed_tft.recovery.rebuild`) in real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.jobs import free_port

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "tests" / "programs" / "retired_group_exit.py"


def test_exit_while_a_retired_group_is_released_does_not_abort(tmp_path):
    """Training ended while a repair's old group still waited on its stuck work: the process
    exits with 0 (no SIGABRT from a daemon thread unwound in a C++ destructor)."""
    port = str(free_port())
    peer = subprocess.Popen([sys.executable, str(PROGRAM), "1", port, str(tmp_path)],
                            cwd=REPO)
    try:
        rank0 = subprocess.run([sys.executable, str(PROGRAM), "0", port, str(tmp_path)],
                               cwd=REPO,
                               capture_output=True, text=True, timeout=60)
    finally:
        peer.wait(timeout=30)
    assert rank0.returncode == 0, rank0.stdout + rank0.stderr
    assert "rank 0 returns from main" in rank0.stdout
    assert "exiting without interpreter teardown" in rank0.stderr
    assert "terminate called" not in rank0.stderr
    assert peer.returncode == 0
