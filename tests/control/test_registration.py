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
        # the controller runs on this host: it sees the death in /proc, before interval x
        # misses of silence (the signal, or, once the forkserver reaped the process, its
        # absence 0.2 s later)
        assert fault["message"] in (
            "process killed by signal 9 (seen by the controller in /proc)",
            "process ended (seen by the controller in /proc)"), fault
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


def test_a_rank_that_ends_without_a_bye_is_lost_before_its_silence_would_say_so(
        tmp_path: Path) -> None:
    """Rank 1 ends with exit code 3 and no bye (no signal to see): the controller, on this
    host, finds its process ended in /proc and declares it lost 0.2 s later (the grace for a
    bye still on its way), long before 4 s of silence (1.0 s x 4) would."""
    interval, misses = 1.0, 4
    job = Job(tmp_path, 4, interval=interval, misses=misses, action_limit=5.0)
    try:
        job.start_controller()
        for r in range(4):
            job.start_worker(r, steps=100000, step_time=0.02,
                             **({"fault": "exit@20"} if r == 1 else {}))
        job.wait_state("NORMAL", 20)
        fault = job.wait_event(lambda e: e["event"] == "fault_detected", 30,
                               what="fault_detected")
        assert (fault["ranks"], fault["kind"], fault["message"]) == (
            [1], "lost", "process ended (seen by the controller in /proc)")
        (fired,) = [r for r in job.records(1) if r["event"] == "fault"]
        assert fired["kind"] == "exit"
        assert fault["time"] - fired["t"] < interval * misses / 2, (fault, fired)
        assert job.workers[1].wait(10) == 3
        job.wait_state("FINAL", 20)
        assert job.strategies() == ["dump"]
    finally:
        job.cleanup()
