"""On-chip memory fault repair (UCE) on real multi-process jobs with injected faults.

With `--enable-hbmfault-repair`, an injected UCE really corrupts the target memory of one
rank (optimizer state, model params, grads or a working activation) and raises the UCE
error; the rank whose optimizer state or params were hit gets its shard back from a replica
holder, every rank rolls back to the lock step and the step is recomputed, in the same
processes. A communication error takes the same retry path. Every loss of the job then
equals the fault-free run's, bit for bit.
"""

from __future__ import annotations

import pytest

from tests.jobs import BF16, HA_ARGS, STANDARD, run_tiny_job

pytestmark = pytest.mark.multiproc

RETRY_ARGS = f"{HA_ARGS} --enable-hbmfault-repair"
#: layout -> (job configuration, the steps of its faults: a job's second fault is repaired in a
#: job repaired once)
LAYOUTS = {
    "dp4-bf16": ({"layout": "dp4", **BF16}, (7,)),  # the bf16 flagship
    "dp4": ({"layout": "dp4", **STANDARD}, (3, 6, 9, 12)),
    "tp2dp2": ({"layout": "tp2dp2", "dist_opt": False, "train_iters": 10,
                "save_interval": 5}, (3, 7)),
}
COPIED = {"optimizer", "param"}  # the other targets hold nothing to copy back


# optimizer state in bf16 and every other target in fp32 (4x faster here) on dp4, one job
# for the four (each fault repaired in a job repaired before); two faults on tp2dp2
# (optimizer state, then a comm error: one tp2dp2 job, whose steps cost 3x dp4's here)
CASES = [("dp4-bf16", ("uce:optimizer",)),
         ("dp4", ("uce:param", "uce:grad", "uce:activation", "comm")),
         ("tp2dp2", ("uce:optimizer", "comm"))]


@pytest.mark.parametrize(("layout", "faults"), CASES,
                         ids=[f"{layout}-{'+'.join(faults)}" for layout, faults in CASES])
def test_repaired_in_place_and_bit_exact(layout, faults, reference_job, tmp_path):
    config, steps = LAYOUTS[layout]
    steps = steps[:len(faults)]
    reference = reference_job(ha_args=HA_ARGS, **config)
    specs = []
    for fault, at in zip(faults, steps, strict=True):
        kind, _, target = fault.partition(":")
        specs.append(f"{kind}:rank=2,step={at},phase=backward"
                     + (f",target={target}" if target else ""))
    job = run_tiny_job(tmp_path, inject=";".join(specs), ha_args=RETRY_ARGS, **config)
    assert job.returncode == 0, job.describe()

    assert [e["strategy"] for e in job.named("strategy")] == ["retry"] * len(faults)
    assert [e["state"] for e in job.named("state")] == [
        "INIT", "NORMAL", *["ABNORMAL", "ENV_CLEAR", "REPAIR", "NORMAL"] * len(faults),
        "EXIT", "FINAL"]
    incidents = sorted({e["incident"] for e in job.named("strategy")})
    copied = [(2, at) for fault, at in zip(faults, steps, strict=True)
              if fault.partition(":")[2] in COPIED]
    received = job.named("shard_received")
    assert [(e["rank"], e["iteration"]) for e in received] == copied
    # rank 2's replica peer in both layouts
    assert all(e["source"] == 0 for e in received)
    for fault, at, incident in zip(faults, steps, incidents, strict=True):
        kind, _, target = fault.partition(":")
        detected = [e for e in job.named("fault_detected")
                    if e["ranks"] == [2] and e.get("incident") == incident]
        assert detected[0]["kind"] == ("uce" if kind == "uce" else "comm")
        rolled = [e for e in job.named("rolled_back") if e["iteration"] == at]
        assert sorted(e["rank"] for e in rolled) == [0, 1, 2, 3]
        # every rank lets its old process groups go after its rollback, so after every
        # shard copy of the repair (the rollback starts once every rank's repair is done)
        released = {e["rank"]: e for e in job.named("groups_released")
                    if e["incident"] == incident}
        assert sorted(released) == [0, 1, 2, 3]
        assert all(released[e["rank"]]["time"] >= e["time"] for e in rolled)
        assert min(e["time"] for e in released.values()) >= max(
            (e["time"] for e in received if e["iteration"] == at), default=0.0)
        # A fault before the update leaves every rank's params those of the lock step: the
        # rollback all-gathers them only where a UCE hit them (the distributed optimizer;
        # without it every rank derives all its params from its own main params)
        gathered = target == "param" and config.get("dist_opt", True)
        assert {e["params_gathered"] for e in rolled} == {gathered}
    assert len(job.named("rolled_back")) == 4 * len(faults)

    # Same processes before and after the repairs: one pid per rank.
    pids = job.pids()
    assert sorted(pids) == [0, 1, 2, 3] and all(len(p) == 1 for p in pids.values())
    # Every iteration logged once with the fault-free run's loss; the replicas agree after
    # every step.
    job.assert_logged_once(reference, config["train_iters"])
    assert all(e["match"] for e in job.named("replica_check"))


def test_a_fault_inside_the_update_rolls_back_with_the_params_all_gathered(
        reference_job, tmp_path):
    """A comm error as rank 2's update of step 7 begins (its update bracket has opened; its
    report says `updating`). The others may be inside their own update when the stop comes
    or held before it; the stop's lock step counts rank 2's update under way (8), so all of
    them run it: the lock step is 8 whatever the timing, rank 2 alone receives its shard, and
    some rank's params are not those of the lock step (rank 2's own update started), so every
    rank all-gathers in the rollback; the losses are exact. (With the stop's lock step at 7,
    rank 0 could be held at 7 while rank 1 finished 8: shard 0 had no holder at 8.)"""
    config, _ = LAYOUTS["dp4"]
    step = 7
    reference = reference_job(ha_args=HA_ARGS, **config)
    job = run_tiny_job(tmp_path, inject=f"comm:rank=2,step={step},phase=optimizer",
                       ha_args=RETRY_ARGS, **config)
    assert job.returncode == 0, job.describe()
    assert [e["strategy"] for e in job.named("strategy")] == ["retry"]
    (repaired,) = job.named("repaired")
    lock = repaired["lock_step"]
    assert lock == step + 1
    received = job.named("shard_received")
    assert [(e["rank"], e["iteration"]) for e in received] == [(2, lock)]
    rolled = job.named("rolled_back")
    assert sorted(e["rank"] for e in rolled) == [0, 1, 2, 3]
    assert {e["iteration"] for e in rolled} == {lock}
    assert [e["params_gathered"] for e in rolled] == [True] * 4
    job.assert_logged_once(reference, config["train_iters"])


def test_pipeline_uce_logs_every_iteration_once(reference_job, tmp_path):
    """TP1 PP2 DP2: a param UCE on rank 1 (first stage) in step 6; the stop may reach the
    last stage (ranks 2 and 3), which logs, between its update of iteration 6 and its log
    line: every iteration is still logged exactly once, with the fault-free run's loss."""
    config = {"layout": "pp2dp2", "train_iters": 9, "save_interval": 100, "precision": "fp32"}
    reference = reference_job(ha_args=HA_ARGS, **config)
    job = run_tiny_job(tmp_path, inject="uce:rank=1,step=6,phase=backward,target=param",
                       ha_args=RETRY_ARGS, **config)
    assert job.returncode == 0, job.describe()
    assert [e["strategy"] for e in job.named("strategy")] == ["retry"]
    assert [(e["rank"], e["iteration"]) for e in job.named("shard_received")] == [(1, 6)]
    job.assert_logged_once(reference, config["train_iters"])
    assert all(e["match"] for e in job.named("replica_check"))


def test_uce_without_hbmfault_repair_dumps(tmp_path):
    job = run_tiny_job(tmp_path, inject="uce:rank=1,step=7,phase=forward,target=optimizer",
                       ha_args=HA_ARGS, **STANDARD)
    assert job.returncode != 0
    assert [e["strategy"] for e in job.named("strategy")] == ["dump"]
    saved = job.named("dump_saved")
    assert [e["iteration"] for e in saved] == [7]
    # Rank 1's optimizer memory was hit: its shard is written by its replica holder, rank 3.
    written = {e["rank"]: e["shard"] for e in job.named("dump_written")}
    assert written == {0: "dense shard 0 of DP group 0", 3: "dense shard 1 of DP group 0"}


def test_uce_with_no_replica_reloads_the_checkpoint_and_continues(reference_job, tmp_path):
    """N = 1: nothing to copy from; every rank reloads the last periodic checkpoint
    (iteration 5) in place and recomputes from there. The native optimizer's reference
    is the job without high availability."""
    reference = reference_job("dp4", **STANDARD)
    job = run_tiny_job(
        tmp_path, inject="uce:rank=2,step=7,phase=backward,target=optimizer",
        ha_args="--enable-high-availability --enable-hbmfault-repair "
                "--distributed-optimizer-no-replica",
        **STANDARD,
    )
    assert job.returncode == 0, job.describe()
    (strategy,) = job.named("strategy")
    assert (strategy["strategy"], strategy["source"]) == ("load_checkpoint", "checkpoint")
    assert [(e["rank"], e["iteration"]) for e in job.named("rolled_back")] and all(
        e["iteration"] == 5 for e in job.named("rolled_back"))
    job.assert_logged_once(reference, STANDARD["train_iters"])
    assert [e["iteration"] for e in job.named("iteration_recomputed")] == [6, 7]  # not logged
    assert all(len(p) == 1 for p in job.pids().values())
