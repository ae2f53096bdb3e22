"""Elastic training on real multi-process jobs under `tft-run`: a killed worker that gets no
replacement (`TFT_MAX_WORKER_RESTARTS=0`) makes the job shrink by its data-parallel replica
and finish every iteration on the others, from the dying-gasp checkpoint of the lock step.

The global batch, the samples of every iteration and the learning rate stay those of the
fault-free run (asserted exactly). The losses after the shrink are not bit-identical: the
fp32 gradients are summed over 3 or 2 ranks instead of 4, in another order, which rounds
differently (2^-24 relative per addition). Observed over the 13 iterations after a shrink: at
most one fp32 ulp of the loss (9.5e-7 at a loss of 8), the first iteration after the shrink
included (its reported loss is summed over fewer ranks). Asserted: four such ulps (3.8e-6).
Other samples could not stay that close: consecutive iterations (other samples, nearly the
same params) differ by 2e-2 to 5e-2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from mindspeed_tft.goodput import incidents
from mindspeed_tft.tools.report import describe_incident
from tests.jobs import (
    HA_ARGS,
    STANDARD,
    JobResult,
    free_port,
    read_events_if_any,
    run_tiny_job,
    start_tiny_job,
    tiny_job_env,
)

pytestmark = pytest.mark.multiproc

ELASTIC_ARGS = f"{HA_ARGS} --enable-worker-reboot --enable-elastic-training"
NO_RESTARTS = {"TFT_MAX_WORKER_RESTARTS": "0"}
#: long enough for a replacement launcher to start while the shrunk job still trains
GROW = {**STANDARD, "train_iters": 60}
#: iterations the dump of an interrupted grow is resumed for (its loading, samples and
#: learning rate are what is checked; the rest of the schedule adds nothing)
RESUMED_STEPS = 6
#: |loss - fault-free loss| after a shrink (see the module docstring)
LOSS_TOLERANCE = 4 * 2.0**-20  # four fp32 ulps at a loss of 8


def assert_the_fault_free_stream(job, reference, fault_step: int, since: int = 0,
                                  until: int | None = None) -> None:
    """Every iteration after `since` (up to `until`, default the last) logged once, with the
    fault-free run's samples and learning rate; its loss bit-identical before the fault,
    within `LOSS_TOLERANCE` after it."""
    logged = job.named("iteration")
    expected = {e["iteration"]: e for e in reference.named("iteration")}
    last = max(expected) if until is None else until
    assert [e["iteration"] for e in logged] == [i for i in sorted(expected) if since < i <= last]
    for event in logged:
        want = expected[event["iteration"]]
        assert (event["consumed_samples"], event["lr"]) == (want["consumed_samples"], want["lr"])
        if event["iteration"] <= fault_step:
            assert event["loss"] == want["loss"], event
        assert abs(event["loss"] - want["loss"]) <= LOSS_TOLERANCE, event


def assert_shrank_dp4_to_dp2(job: JobResult, reference: JobResult) -> None:
    """A DP4 job whose rank 1 was killed in step 4 with no replacement: it shrank to ranks 0
    and 2 (DP2; rank 3 left with it), trained every iteration as the fault-free run did, and
    its replicas agree after the shrink. Both Megatron-LM versions' elastic jobs check this."""
    assert job.returncode == 0, job.describe()
    (shrink,) = job.named("scale_in")
    assert (shrink["ranks"], shrink["dp_size"], shrink["left"], shrink["step"]) == (
        [0, 2], 2, [1, 3], 4)
    assert_the_fault_free_stream(job, reference, fault_step=4)
    checks = [e for e in job.named("replica_check") if e["iteration"] > 4]
    assert checks and all(e["match"] for e in checks)


# DP4 -> DP3 (one copy at DP3) and DP2 (a healthy replica stands down too) are in the
# two-shrink test below and in Megatron-LM's loop (tests/test_megatron_lm.py)
@pytest.mark.parametrize(("layout", "gbs", "ranks", "dp_size", "left"), [
    # the lost rank's whole DP replica (its tensor-parallel peer 0 too) leaves: TP2 x DP1
    ("tp2dp2", 16, [2, 3], 1, [0, 1]),
])
def test_kill_without_replacement_shrinks_and_finishes_every_iteration(
    layout, gbs, ranks, dp_size, left, reference_job, tmp_path
):
    config = {"layout": layout, **STANDARD}
    if gbs != 16:  # the preset's global batch: the reference other tests share
        config["env"] = {"GBS": str(gbs)}
    reference = reference_job(ha_args=HA_ARGS, **config)
    env = {**config.get("env", {}), **NO_RESTARTS}
    job = run_tiny_job(tmp_path, inject="kill:rank=1,step=7,phase=forward",
                       ha_args=ELASTIC_ARGS, launcher="tft-run",
                       **{**config, "env": env})
    assert job.returncode == 0, job.describe()
    (shrink,) = job.named("scale_in")
    assert (shrink["ranks"], shrink["dp_size"], shrink["left"], shrink["step"]) == (
        ranks, dp_size, left, 7)
    assert [e["strategy"] for e in job.named("strategy")] == ["recover"]
    assert [e["iteration"] for e in job.named("dump_saved")] == [7]
    assert not job.named("worker_restarted")
    assert "rank 1 (exit code -9) left the job: elastic training continues" in job.output
    assert_the_fault_free_stream(job, reference, fault_step=7)
    # replicas re-formed where N = 2 still divides the DP size (DP2), else one copy (DP3)
    checks = [e for e in job.named("replica_check") if e["iteration"] > 7]
    assert checks and all(e["match"] for e in checks)
    assert {len(e["holders"]) for e in checks} == {2 if dp_size == 2 else 1}
    for rank in set(left) - {1}:  # healthy ranks that left exit 0 and say why
        assert f"rank {rank} exits with code 0: left the job" in job.output
    (incident,) = incidents(job.events)
    assert any(f"the job shrank to {len(ranks)} ranks (DP {dp_size}, ranks {ranks})" in line
               for line in describe_incident(incident))


def test_a_shrunk_job_repairs_a_uce_in_place(reference_job, tmp_path):
    """DP4, two optimizer copies: rank 2 is killed at step 3 with no replacement (the job
    shrinks to DP2, ranks 0 and 1); then a UCE corrupts rank 0's optimizer shard at step 8.
    The ranks that left in the shrink are no part of that repair: it is done in place from
    rank 1's copy and the job finishes every iteration (before the fix it ended in a dump,
    "ranks [2, 3] are gone")."""
    config = {"layout": "dp4", **STANDARD}
    reference = reference_job(ha_args=HA_ARGS, **config)
    job = run_tiny_job(tmp_path, inject="kill:rank=2,step=3,phase=forward;"
                                        "uce:rank=0,step=8,phase=backward,target=optimizer",
                       ha_args=f"{ELASTIC_ARGS} --enable-hbmfault-repair "
                               "--optimizer-replica-num 2",
                       launcher="tft-run", **{**config, "env": NO_RESTARTS})
    assert job.returncode == 0, job.describe()
    assert [(e["strategy"], e["lock_step"]) for e in job.named("strategy")] == [
        ("recover", 3), ("retry", 8)]
    assert [(e["ranks"], e["dp_size"]) for e in job.named("scale_in")] == [([0, 1], 2)]
    assert not job.named("repair_failed")
    assert [e["iteration"] for e in job.named("dump_saved")] == [3]
    assert_the_fault_free_stream(job, reference, fault_step=3)


def _start_node(run_dir, node_rank: int, ports: tuple[int, int], config: dict, inject: str,
                extra_env: dict[str, str] | None = None):
    """One of two launchers (`--nnodes 2`, 2 ranks each) of the job in `run_dir`."""
    master_port, ttp_port = ports
    env = {**config.get("env", {}), **NO_RESTARTS, "NPROC": "2", "MASTER_PORT": str(master_port),
           "TTP_PORT": str(ttp_port), "TTP_LOG_PATH": str(run_dir / f"logs{node_rank}"),
           "TFT_REPLACEMENT_WAIT": "2", **(extra_env or {})}
    return start_tiny_job(tiny_job_env(
        run_dir, **{**config, "env": env}, inject=inject,
        ha_args=f"{ELASTIC_ARGS} --optimizer-replica-num 4",
        launcher=f"tft-run --nnodes 2 --node-rank {node_rank} --master-addr 127.0.0.1"))


def _end_all(procs, events) -> None:
    """Kill launchers still running and every worker the events file names (bounded)."""
    pids = {e["pid"] for e in read_events_if_any(events) if e["event"] == "replica_layout"}
    for proc in procs:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        if proc is not None:
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def test_a_replacement_that_comes_after_the_end_is_stopped_and_the_job_succeeds(
        reference_job, tmp_path):
    """DP4 under `tft-run`, elastic, 1 s of replacement wait: rank 3 is killed in the forward
    pass of step 12 of 14. Its launcher restarts it at once, but its start-up (imports) takes
    longer than the wait and the two steps left: the job shrinks, trains to the end, and the
    controller is final before the new process registers. That late process is stopped by
    its launcher, which is no failure of the job: `tft-run` exits 0."""
    config = {"layout": "dp4", **STANDARD}
    reference = reference_job(ha_args=HA_ARGS, **config)
    job = run_tiny_job(tmp_path, inject="kill:rank=3,step=12,phase=forward",
                       ha_args=ELASTIC_ARGS, launcher="tft-run",
                       **{**config, "env": {"TFT_REPLACEMENT_WAIT": "1"}})
    assert job.returncode == 0, job.describe()
    assert [(e["ranks"], e["step"]) for e in job.named("scale_in")] == [([0, 1], 12)]
    (restart,) = job.named("worker_restarted")
    assert restart["rank"] == 3
    assert job.named("state")[-1]["state"] == "FINAL"
    assert [e["code"] for e in job.named("exit") if e["rank"] == -1] == [0]
    assert "still run after the job ended" in job.output
    assert "rank 3 (exit code -15) left the job: the job trained to its end without it" in (
        job.output)
    assert_the_fault_free_stream(job, reference, fault_step=12)


def test_two_shrinks_then_the_node_comes_back_and_the_job_grows(reference_job, tmp_path):
    """DP4 over two launchers, 24 micro-batches per step, full optimizer replicas (N = 4,
    re-formed as N = 3 at DP3 and N = 2 at DP2: a second shrink needs a surviving copy).
    Node 1 loses rank 2 at step 3 and rank 3 at step 6 (no restarts allowed, nobody reports
    it: the controller waits TFT_REPLACEMENT_WAIT) -> DP3 -> DP2. A replacement launcher for node 1 brings ranks 2
    and 3 back: the job grows to DP4 at the next step boundary (`scale_out`, from a dump of
    the lock step) and finishes every iteration with the fault-free samples and learning
    rate, its losses within the tolerance."""
    config = {"layout": "dp4", **GROW, "env": {"GBS": "48"}}
    reference = reference_job(ha_args=HA_ARGS, **config)
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    events = run_dir / "events.jsonl"
    ports = (free_port(), free_port())
    inject = "kill:rank=2,step=3,phase=forward;kill:rank=3,step=6,phase=forward"
    node0 = _start_node(run_dir, 0, ports, config, inject)
    node1 = _start_node(run_dir, 1, ports, config, inject)
    replacement = None
    try:
        # its workers are gone: it ends. The replacement's ranks register while the job is
        # shrunk (before or after the second shrink) and wait until it grows by them
        node1.communicate(timeout=120)
        replacement = _start_node(run_dir, 1, ports, config, inject)
        output0, _ = node0.communicate(timeout=300)
        finished = time.time()  # the events clock
        output1, _ = replacement.communicate(timeout=60)
    finally:
        _end_all((node0, node1, replacement), events)
    job = JobResult(node0.returncode, output0, run_dir, read_events_if_any(events))
    assert node0.returncode == 0, job.describe()
    (done,) = job.named("exit")
    assert finished - done["time"] < 60, output0[-4000:]  # node 0's launcher lingered
    assert replacement.returncode == 0, output1[-3000:]
    shrinks = [(e["ranks"], e["dp_size"], e["left"], e["step"]) for e in job.named("scale_in")]
    assert shrinks == [([0, 1, 3], 3, [2], 3), ([0, 1], 2, [3], 6)]
    # one grow by both ranks, or (24 micro-batches split over 3 as well) one per rank, as
    # their processes register
    grows = job.named("scale_out")
    grow = grows[-1]
    assert (grow["ranks"], grow["dp_size"]) == ([0, 1, 2, 3], 4)
    assert sorted(r for e in grows for r in e["joined"]) == [2, 3]
    assert len(grows) == 1 or (grows[0]["ranks"], grows[0]["dp_size"]) in (
        ([0, 1, 2], 3), ([0, 1, 3], 3))
    # (ranks that register before the second shrink is done wait for it: the grow then
    # starts from its lock step at once)
    assert all(6 <= e["step"] < GROW["train_iters"] for e in grows)
    dumps = [e["iteration"] for e in job.named("dump_saved")]
    assert dumps == [3, 6, *(e["step"] for e in grows)]
    # node 0's launcher, which hosts the controller, logs each scale change
    assert "controller DUMP -> REPAIR: scale-in without ranks [2]" in output0
    assert "controller DUMP -> REPAIR: scale-out to DP 4 with ranks" in output0
    assert_the_fault_free_stream(job, reference, fault_step=3)
    # after the grow: N = 4 again, the one shard on all four ranks, identical
    checks = [e for e in job.named("replica_check") if e["iteration"] > grow["step"]]
    assert checks and all(e["match"] for e in checks)
    assert {len(e["holders"]) for e in checks} == {4}
    assert {e["rank"] for e in checks} == {0, 1, 2, 3}


def test_a_fault_during_the_grow_ends_with_a_dump_that_resumes_at_the_launch_size(
        reference_job, tmp_path):
    """The job of the test above loses its node 1 (ranks 2 and 3) at step 3 at once: DP4 ->
    DP2; once it shrank, a replacement launcher brings them back, and the first returning rank is killed as
    it joins the grow (`phase=scale`, at whatever lock step the grow takes: one item per
    possible step). The grow's dump of the lock step is written at DP2 before the scale
    change, so the job ends with it (exit 75, no hang: the returning launcher ends too, within
    its registration timeout where one of its ranks registered only after the end), and
    that dump (megatron-core's DP-zero optimizer format) resumes in a plain DP4 job with the
    fault-free samples and learning rate for RESUMED_STEPS iterations, its losses within the
    tolerance."""
    config = {"layout": "dp4", **GROW, "env": {"GBS": "48"}}
    reference = reference_job(ha_args=HA_ARGS, **config)
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    events = run_dir / "events.jsonl"
    ports = (free_port(), free_port())
    # a returning rank killed as it joins the grow, at whatever lock step the grow takes
    in_the_grow = ";".join(f"kill:rank={r},step={s},phase=scale"
                           for s in range(3, GROW["train_iters"]) for r in (2, 3))
    inject = f"kill:rank=2,step=3,phase=forward;kill:rank=3,step=3,phase=forward;{in_the_grow}"
    node0 = _start_node(run_dir, 0, ports, config, inject)
    node1 = _start_node(run_dir, 1, ports, config, inject)
    replacement = None
    try:
        node1.communicate(timeout=120)
        # the node comes back once the job shrank (earlier, within the replacement wait, its
        # ranks would be taken back by a worker reboot)
        deadline = time.monotonic() + 120
        while not any(e["event"] == "scale_in" for e in read_events_if_any(events)):
            assert node0.poll() is None and time.monotonic() < deadline, "no shrink"
            time.sleep(0.2)
        # a returning process that registers only after the job ended finds no controller:
        # it waits for one up to TTP_REGISTER_TIMEOUT (default 600 s), here 15 s
        replacement = _start_node(run_dir, 1, ports, config, inject,
                                  {"TTP_REGISTER_TIMEOUT": "15"})
        output0, _ = node0.communicate(timeout=300)
        output1, _ = replacement.communicate(timeout=90)  # it ends after the job, bounded
    finally:
        _end_all((node0, node1, replacement), events)
    faulty = JobResult(node0.returncode, output0, run_dir, read_events_if_any(events))
    assert node0.returncode != 0, faulty.describe()
    assert [(e["dp_size"], e["left"]) for e in faulty.named("scale_in")] == [(2, [2, 3])]
    assert faulty.named("scale_out_started") and not faulty.named("scale_out")
    dumps = [e["iteration"] for e in faulty.named("dump_saved")]
    grow = dumps[-1]
    assert dumps == [3, grow] and 3 <= grow < GROW["train_iters"], dumps
    (exit_event,) = faulty.named("exit")
    assert exit_event["code"] == 75, exit_event
    assert f"dying-gasp checkpoint saved at iteration {grow}" in exit_event["reason"]
    assert ("during the grow" in exit_event["reason"]
            or "scale-out failed" in exit_event["reason"]), exit_event
    assert (faulty.checkpoint_dir / "latest_checkpointed_iteration.txt").read_text() == str(grow)
    # the resumed job keeps the 60-iteration schedule and stops after RESUMED_STEPS of it
    # (--exit-interval: the first multiple of grow + RESUMED_STEPS after the grow is that one)
    until = grow + RESUMED_STEPS
    resumed = run_tiny_job(tmp_path / "resumed", load_dir=faulty.checkpoint_dir,
                           ha_args=HA_ARGS, extra_args=["--exit-interval", str(until)], **config)
    assert resumed.returncode == 0, resumed.describe()
    assert f"at iteration {grow}" in resumed.output
    assert_the_fault_free_stream(resumed, reference, fault_step=0, since=grow,
                                  until=min(until, GROW["train_iters"]))


def test_a_fault_during_the_shrink_ends_with_the_dump(tmp_path):
    """A remaining rank killed while the job shrinks (`phase=scale`): no hang, no second
    dump from ranks tearing their state down; the job exits with the dump code, the dump of
    the lock step (written before the shrink began, at DP4) published."""
    faulty = run_tiny_job(
        tmp_path, inject="kill:rank=1,step=7,phase=forward;kill:rank=2,step=7,phase=scale",
        ha_args=ELASTIC_ARGS, launcher="tft-run",
        **{"layout": "dp4", **STANDARD, "env": {"GBS": "24", **NO_RESTARTS}})
    assert faulty.returncode != 0
    assert not faulty.named("scale_in")
    assert [e["iteration"] for e in faulty.named("dump_saved")] == [7]
    (exit_event,) = faulty.named("exit")
    assert exit_event["code"] == 75, exit_event
    assert "dying-gasp checkpoint saved at iteration 7" in exit_event["reason"]
    assert (faulty.checkpoint_dir / "latest_checkpointed_iteration.txt").read_text() == "7"


def test_rank_0_lost_then_rank_1_shrink_the_job_twice(reference_job, tmp_path):
    """The first rank positions, which no other shrink test loses: DP4 under `tft-run` (two
    optimizer copies), no restarts. Rank 0 is killed at step 3: ranks 1 and 2 go on at DP2
    (the global batch of 16 does not split over 3; rank 3 leaves). Rank 1, rank 0 of the
    shrunk world, is killed at step 7: rank 2 goes on alone. Every iteration trains with the
    fault-free samples and learning rate, its loss within the tolerance."""
    config = {"layout": "dp4", **STANDARD}
    reference = reference_job(ha_args=HA_ARGS, **config)
    job = run_tiny_job(tmp_path, inject="kill:rank=0,step=3,phase=forward;"
                       "kill:rank=1,step=7,phase=forward", ha_args=ELASTIC_ARGS,
                       launcher="tft-run", **{**config, "env": NO_RESTARTS})
    assert job.returncode == 0, job.describe()
    shrinks = [(e["ranks"], e["dp_size"], e["left"], e["step"]) for e in job.named("scale_in")]
    assert shrinks == [([1, 2], 2, [0, 3], 3), ([2], 1, [1], 7)]
    assert [e["iteration"] for e in job.named("dump_saved")] == [3, 7]
    assert_the_fault_free_stream(job, reference, fault_step=3)
