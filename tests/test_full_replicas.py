"""N = d: every data-parallel rank holds the whole optimizer state (SPEC 2), on real jobs.

TP2 x DP2 (4 ranks) with the distributed optimizer and the default
``--optimizer-replica-num 2``: d = 2, so megatron-core's partial distributed optimizer runs
2 instances of one rank each (chunk size 1: every shard is the whole state of its DP group,
held by both of its ranks). A rank killed in its backward pass is restarted alone and gets
its shard from the other rank of its DP group. Every loss equals the fault-free run's, bit for
bit. (The dump assembled from one-rank chunks, N = d = 2 with the distributed optimizer, is
tested in Megatron-LM's loop: tests/test_megatron_lm.py, TP2xDP2.)
"""

from __future__ import annotations

import pytest

from tests.jobs import HA_ARGS, STANDARD, run_tiny_job

pytestmark = pytest.mark.multiproc

LAYOUT = "tp2dp2"
ARF_ARGS = f"{HA_ARGS} --enable-worker-reboot"
CONFIG = {"layout": LAYOUT, **STANDARD}
RANKS = list(range(4))


def _reference(reference_job):
    """The fault-free run with N = d (worker reboot changes no arithmetic: the plain high
    availability run, which tests/test_elastic.py shares)."""
    return reference_job(ha_args=HA_ARGS, **CONFIG)


def _assert_full_replica_layout(job) -> None:
    """Every rank is a one-rank optimizer instance holding its DP group's whole state."""
    layouts = {e["rank"]: e for e in job.named("replica_layout")}
    assert sorted(layouts) == RANKS
    for rank, event in layouts.items():
        assert (event["dp_size"], event["replica_num"], event["shard"]) == (2, 2, 0), event
        assert event["chunk_group"] == [rank], event
        assert event["holders"] == event["dp_group"] == event["replica_group"], event
        assert rank in event["holders"] and len(event["holders"]) == 2, event


def test_killed_worker_is_replaced_from_the_other_full_replica(reference_job, tmp_path):
    reference = _reference(reference_job)
    _assert_full_replica_layout(reference)
    assert reference.named("replica_check")
    assert all(e["match"] for e in reference.named("replica_check"))

    job = run_tiny_job(tmp_path, inject="kill:rank=3,step=4,phase=backward",
                       ha_args=ARF_ARGS, launcher="tft-run", **CONFIG)
    assert job.returncode == 0, job.describe()
    assert job.losses() == reference.losses()
    assert sorted(job.losses()) == list(range(1, CONFIG["train_iters"] + 1))
    assert all(e["match"] for e in job.named("replica_check"))
    _assert_full_replica_layout(job)
    # rank 3 got a new process, the 3 survivors kept theirs
    pids = job.pids()
    assert sorted(pids) == RANKS
    for rank, processes in pids.items():
        assert len(processes) == (2 if rank == 3 else 1), (rank, processes)
    (restart,) = job.named("worker_restarted")
    assert restart["rank"] == 3 and restart["returncode"] == -9
    assert [e["strategy"] for e in job.named("strategy")] == ["recover"]
    lost = [e for e in job.named("fault_detected") if e["kind"] == "lost"]
    assert [e["ranks"] for e in lost] == [[3]]
    # the whole state came from rank 1, the other rank of rank 3's DP group [1, 3]
    (received,) = job.named("shard_received")
    assert (received["rank"], received["source"], received["iteration"]) == (3, 1, 4)
    assert {e["iteration"] for e in job.named("rolled_back")} == {4}
    assert [e["lock_step"] for e in job.named("repaired")] == [4]
