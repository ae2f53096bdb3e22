"""A rank whose training thread stops while its heartbeats go on is reported hung in time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.control.ctl_harness import Job, wait_for

FLOOR = 0.5  # the watchdog floor; steps take ~10 ms, so the derived timeout is usually the floor
INTERVAL = 0.2  # heartbeat interval: the I/O thread checks the watchdog at least this often


@pytest.mark.parametrize("features", ["dump", "dump,recover"])
def test_hung_training_thread_is_reported(tmp_path: Path, features: str) -> None:
    job = Job(tmp_path, 2, features=features, interval=INTERVAL, misses=5, action_limit=3.0)
    try:
        job.start_controller()
        job.start_worker(0, steps=40, hang_floor=FLOOR)
        job.start_worker(1, steps=40, hang_floor=FLOOR, fault="hang@8")
        hang = job.wait_event(lambda e: e["event"] == "fault_detected" and e["ranks"] == [1],
                              15, what="rank 1's fault")
        assert hang["kind"] == "hang", hang  # heartbeats kept flowing: not "lost"
        started = wait_for(lambda: next((r for r in job.records(1, 0) if r["event"] == "fault"),
                                        None), 5)
        # the limit the rank applied: the floor, or 5x its slowest recent step where a loaded
        # machine stretched one step past 0.1 s (derivation: test_units.py)
        idle, limit = (float(v) for v in re.search(
            r"no training progress for ([0-9.]+)s \(timeout ([0-9.]+)s\)", hang["message"]).groups())
        assert limit >= FLOOR, hang
        # the rank's own check fired once past the limit, not before, and promptly
        assert limit <= idle <= limit + 3 * INTERVAL, hang
        # within that limit, plus one watchdog check and delivery (three intervals)
        assert hang["time"] - started["t"] <= limit + 3 * INTERVAL, (hang, started)
        assert not [e for e in job.events() if e["event"] == "fault_detected"
                    and e["kind"] == "lost"]
        if features == "dump":
            # rank 0's own watchdog may fire too (it waits in a collective for rank 1), but its
            # training thread comes back when stopped, so it stays a healthy dump holder
            assert job.controllers[0].wait(20) == 75  # the dump exit code
            assert job.states() == ["INIT", "NORMAL", "ABNORMAL", "DUMP", "EXIT", "FINAL"]
            assert job.strategies() == ["dump"]
            assert job.workers[0].wait(10) == 75
            assert job.workers[1].wait(10) == 75  # the hung process was ended by the exit order
        else:
            # ARF: the hung rank is ordered to exit; we restart it, as its launcher would
            job.workers[1].wait(15)
            job.restart(1, hang_floor=FLOOR)
            assert job.controllers[0].wait(30) == 0
            assert job.states() == ["INIT", "NORMAL", "ABNORMAL", "ENV_CLEAR", "REPAIR",
                                    "NORMAL", "EXIT", "FINAL"]
            assert job.strategies() == ["recover"]
            assert job.workers[0].wait(10) == 0 and job.workers[1].wait(10) == 0
            rejoined = job.records(1, 1)
            assert [r["rejoin"] for r in rejoined if r["event"] == "registered"] == [True]
            assert [r["iteration"] for r in rejoined if r["event"] == "done"] == [40]
    finally:
        job.cleanup()
