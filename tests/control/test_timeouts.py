"""A callback that overruns its time limit leads to dump or exit, never to a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.control.ctl_harness import Job

LIMIT = 1.5  # TTP_NORMAL_ACTION_TIME_LIMIT for these jobs (the constructor allows < 30 s)

CASES = {
    # a stuck repair: the repair fails, falls back to the dump (rank 0 holds the shard)
    "repair": ("retry", "uce@5", ["INIT", "NORMAL", "ABNORMAL", "ENV_CLEAR", "REPAIR", "DUMP",
                                  "EXIT", "FINAL"], 75),
    # a stuck dump: the dump fails, everyone exits with the failure code
    "dump": ("dump", "unknown@5", ["INIT", "NORMAL", "ABNORMAL", "DUMP", "EXIT", "FINAL"], 1),
    # a stuck stop: rank 0 cannot be held, so it is not trusted; no holder left: exit
    "stop": ("retry", "uce@5", ["INIT", "NORMAL", "ABNORMAL", "DUMP", "EXIT", "FINAL"], 1),
}


@pytest.mark.parametrize("callback", sorted(CASES))
def test_overrunning_callback(tmp_path: Path, callback: str) -> None:
    features, fault, states, code = CASES[callback]
    job = Job(tmp_path, 2, features=features, interval=0.2, misses=5, action_limit=LIMIT)
    try:
        job.start_controller()
        job.start_worker(0, steps=40, slow=f"{callback}=600")  # rank 0's callback never returns
        job.start_worker(1, steps=40, fault=fault)
        t0 = time.monotonic()
        assert job.controllers[0].wait(30) == code
        took = time.monotonic() - t0
        assert job.states() == states
        exits = [e for e in job.events() if e["event"] == "exit"]
        assert [e["code"] for e in exits] == [code]
        if callback == "repair":
            failed = [e for e in job.events() if e["event"] == "repair_failed"]
            assert len(failed) == 1 and "repair" in failed[0]["reason"]
            assert f"within {LIMIT:g}s" in failed[0]["reason"]
        if callback == "dump":
            assert "dump failed" in exits[0]["reason"] and "rank 0" in exits[0]["reason"]
        if callback == "stop":
            kinds = {(tuple(e["ranks"]), e["kind"]) for e in job.events()
                     if e["event"] == "fault_detected"}
            assert ((0,), "hang") in kinds
            assert "dump impossible" in exits[0]["reason"]
        # both ranks end with the decided code although rank 0's callback is still stuck
        assert job.workers[0].wait(15) == code
        assert job.workers[1].wait(15) == code
        assert took < 6 * LIMIT + 10
    finally:
        job.cleanup()
