"""Every row of SPEC 6 with real processes, under the two feature combinations that reach every
strategy (retry, recover and dump with replicas; load_checkpoint, recover from the checkpoint
and dump without). All eight combinations are checked under simulation
(test_sim_protocol.py::test_spec6_rows).

For each combination, five jobs run side by side (controller + 2 ranks each, one job per
SPEC 6 row); rank 1 suffers the row's fault at iteration 5. We check the exact state
sequence, the strategy, the callbacks each rank ran, and the exit codes (what each row must
end in: `test_sim_protocol.expected`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.control.ctl_harness import Job
from tests.control.test_sim_protocol import ROWS, expected

#: the two feature combinations run here (all eight: test_sim_protocol.py)
COMBOS = ["dump,retry,recover", "dump,retry,recover,no_replica"]


def run_case(tmp: Path, row: str, features: str) -> str | None:
    """Run one job; returns a description of what went wrong, or None."""
    exp = expected(row, features)
    job = Job(tmp, 2, features=features, interval=0.2, misses=5, action_limit=8.0)
    try:
        job.start_controller()
        replicas = "1" if "no_replica" in features else "2"
        job.start_worker(0, steps=20, replicas=replicas)
        job.start_worker(1, steps=20, replicas=replicas, fault=f"{row}@5")
        if row == "kill" and exp["strategy"] == "recover":
            job.workers[1].wait(20)
            job.restart(1)
        rc = job.controllers[0].wait(40)
        codes = {r: job.workers[r].wait(20) for r in (0, 1)}
        problems = []
        if job.states() != exp["states"]:
            problems.append(f"states {job.states()} != {exp['states']}")
        want_strategies = [exp["strategy"]] if exp["strategy"] else []
        if job.strategies() != want_strategies:
            problems.append(f"strategies {job.strategies()} != {want_strategies}")
        exits = [e["code"] for e in job.events() if e["event"] == "exit"]
        if exits != [exp["code"]] or rc != exp["code"]:
            problems.append(f"exit events {exits} / controller rc {rc}, want {exp['code']}")
        calls0 = [r["name"] for r in job.records(0) if r["event"] == "callback"]
        if calls0 != exp["rank0"]:
            problems.append(f"rank 0 callbacks {calls0} != {exp['rank0']}")
        if row == "kill" and exp["strategy"] != "recover":
            want_codes = {0: exp["code"], 1: -9}
        else:
            want_codes = {0: exp["code"], 1: exp["code"]}
        if codes != want_codes:
            problems.append(f"worker exit codes {codes} != {want_codes}")
        faults = [(e["ranks"], e["kind"]) for e in job.events() if e["event"] == "fault_detected"]
        kind = {"kill": "lost"}.get(row, row)
        if row != "normal" and faults[:1] != [([1], kind)]:
            problems.append(f"fault_detected {faults} != rank 1 {kind}")
        if exp["strategy"] in ("retry", "load_checkpoint", "recover"):
            repair1 = [r["payload"] for r in job.records(1, job.incarnation[1])
                       if r["event"] == "callback" and r["name"] == "repair"]
            if len(repair1) != 1 or repair1[0]["source"] != exp["source"]:
                problems.append(f"rank 1 repair payloads {repair1}")
            elif exp["source"] == "replica" and row != "comm" and repair1[0]["receive"] != [
                    {"optimizer": "dense", "shard": 0, "from": 0}]:
                problems.append(f"rank 1 should receive its shard from rank 0: {repair1[0]}")
            done = [r for rank in (0, 1) for r in job.records(rank, job.incarnation[rank])
                    if r["event"] == "done"]
            if [d["iteration"] for d in done] != [20, 20]:
                problems.append(f"training did not finish on both ranks: {done}")
        return "; ".join(problems) or None
    finally:
        job.cleanup()


@pytest.mark.parametrize("features", COMBOS)
def test_spec6_rows(tmp_path: Path, features: str) -> None:
    with ThreadPoolExecutor(len(ROWS)) as pool:
        futures = {row: pool.submit(run_case, tmp_path / row, row, features) for row in ROWS}
        problems = {row: f.result() for row, f in futures.items()}
    bad = {row: p for row, p in problems.items() if p}
    assert not bad, f"features {features}: " + " | ".join(f"{r}: {p}" for r, p in bad.items())
