"""Registration of 8 real ranks and loss detection of a SIGKILLed one, over IPv4 and IPv6."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.control.ctl_harness import Job, wait_for


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_eight_ranks_register_and_a_killed_one_is_lost(tmp_path: Path, addr: str) -> None:
    interval, misses = 0.3, 3
    job = Job(tmp_path, 8, interval=interval, misses=misses, action_limit=5.0, addr=addr)
    try:
        job.start_controller(snapshot=tmp_path / "snap.json")
        for r in range(8):
            job.start_worker(r, steps=100000, step_time=0.02)
        job.wait_state("NORMAL", 20)
        snap = wait_for(lambda: (s := job.snapshot(tmp_path / "snap.json"))
                        and len(s["ranks"]) == 8 and s, 5, what="8 rows")
        assert sorted(int(r) for r in snap["ranks"]) == list(range(8))
        assert all(row["health"] == "alive" for row in snap["ranks"].values())
        assert snap["dropped_total"] == 0
        # let a few heartbeats and steps go by, then kill rank 3 for real
        wait_for(lambda: any(r["event"] == "registered" for r in job.records(3)), 5)
        time.sleep(2 * interval)
        killed_at = time.time()
        job.workers[3].send_signal(signal.SIGKILL)
        fault = job.wait_event(lambda e: e["event"] == "fault_detected", 10,
                               what="fault_detected")
        assert fault["ranks"] == [3] and fault["kind"] == "lost"
        assert fault["time"] - killed_at <= interval * (misses + 1), fault
        # default features: dump; rank 7 holds rank 3's shard (N = 2), so the dump succeeds
        job.wait_state("FINAL", 20)
        assert job.states() == ["INIT", "NORMAL", "ABNORMAL", "DUMP", "EXIT", "FINAL"]
        assert job.strategies() == ["dump"]
        assert job.controllers[0].wait(10) == 75  # the dump exit code
        codes = {r: job.workers[r].wait(15) for r in range(8)}
        assert codes == {**{r: 75 for r in range(8)}, 3: -signal.SIGKILL}
        writers = sorted(r for r in range(8) if any(
            rec["event"] == "callback" and rec["name"] == "dump" and rec["payload"]["shards"]
            for rec in job.records(r)))
        # SPEC 7: shard s is held by ranks s and s + 4; the first healthy holder writes it
        assert writers == [0, 1, 2, 7]
        lock = [e["lock_step"] for e in job.events() if e["event"] == "strategy"][0]
        assert lock > 0
    finally:
        job.cleanup()
