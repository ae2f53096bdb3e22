"""A second fault during a repair is a cascading fault: dump if the data is complete."""

from __future__ import annotations

from pathlib import Path

from tests.control.ctl_harness import Job


def test_rank_lost_during_repair_falls_back_to_dump(tmp_path: Path) -> None:
    # 4 ranks, 2 replicas: shard 0 on ranks 0 and 2, shard 1 on ranks 1 and 3
    job = Job(tmp_path, 4, features="dump,retry", interval=0.2, misses=5)
    try:
        job.start_controller()
        for r in range(4):
            job.start_worker(r, steps=30, fault="uce@5" if r == 1 else "",
                             die_in="repair" if r == 2 else "")
        assert job.controllers[0].wait(30) == 75  # the dump exit code
        assert job.states() == ["INIT", "NORMAL", "ABNORMAL", "ENV_CLEAR", "REPAIR", "DUMP",
                                "EXIT", "FINAL"]
        assert job.strategies() == ["retry"]
        faults = [(e["ranks"], e["kind"]) for e in job.events() if e["event"] == "fault_detected"]
        assert faults == [([1], "uce"), ([2], "lost")]
        (failed,) = [e for e in job.events() if e["event"] == "repair_failed"]
        assert "rank 2" in failed["reason"]
        # rank 1's data is bad and rank 2 is gone, but ranks 0 and 3 hold both shards
        writers = {r: [s["shard"] for rec in job.records(r) if rec["event"] == "callback"
                       and rec["name"] == "dump" for s in rec["payload"]["shards"]]
                   for r in (0, 3)}
        assert writers == {0: [0], 3: [1]}
        (exit_event,) = [e for e in job.events() if e["event"] == "exit"]
        assert exit_event["code"] == 75 and "saved at iteration 4" in exit_event["reason"]
        assert {r: job.workers[r].wait(10) for r in range(4)} == {0: 75, 1: 75, 2: -9, 3: 75}
    finally:
        job.cleanup()
