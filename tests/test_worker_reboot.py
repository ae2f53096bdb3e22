"""Worker reboot (ARF) on real multi-process jobs under `tft-run`, with real faults.

With `--enable-worker-reboot`, a killed (or hung) worker is restarted alone by its launcher;
the survivors keep running (same PIDs), abandon their collectives, rebuild every process
group with the new process, which receives its model params and optimizer shard from a
replica holder; everyone rolls back to the lock step and training continues. Every loss of
the job equals the fault-free run's, bit for bit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mindspeed_tft.goodput import goodput, incidents
from tests.jobs import (
    HA_ARGS,
    STANDARD,
    free_port,
    read_events_if_any,
    run_tiny_job,
    start_tiny_job,
    tiny_job_env,
    wait_event,
    wait_for,
)
from tests.test_timeline import check_timeline

pytestmark = pytest.mark.multiproc

ARF_ARGS = f"{HA_ARGS} --enable-worker-reboot"
LAYOUTS = {
    "dp4": {"layout": "dp4", **STANDARD},
    # d = 2: the bf16 optimizer is its own replica (N = d)
    "tp2dp2": {"layout": "tp2dp2", "dist_opt": False, "train_iters": 10, "save_interval": 5},
}


def _assert_repaired(job, reference, restarted: dict[int, int]) -> None:
    """The job finished with the reference's losses; exactly `restarted` ranks (rank ->
    restarts) got new processes and every other rank kept its one process."""
    assert job.returncode == 0, job.describe()
    job.assert_logged_once(reference, max(reference.losses()))
    assert all(e["match"] for e in job.named("replica_check"))
    pids = job.pids()
    assert sorted(pids) == [0, 1, 2, 3]
    for rank, processes in pids.items():
        assert len(processes) == 1 + restarted.get(rank, 0), (rank, processes)
    restarts = job.named("worker_restarted")
    assert sorted(e["rank"] for e in restarts) == sorted(
        r for r, n in restarted.items() for _ in range(n))


# (layout, phase, the lock step minus the killed step, the rank killed, launcher, data-loader
# workers): a kill inside the update of step s leaves the survivors' update done, so the lock
# step is s + 1; there the killed rank is the logging rank (the last), which never logs
# iteration s + 1: its replacement does. The dp4 case (rank 3 killed in its update of step 7,
# under tft-run) is the job of tests/test_flood.py's hostile-peer tests, which assert all of
# this too (`assert_killed_worker_repaired`): one job for both. On dp4 the kills in the
# forward and the backward pass are the two faults of `test_two_faults_...` below;
# Megatron-LM's loop repeats DP4 and PP2xDP2 under tft-run (tests/test_megatron_lm.py); all
# within CI's time budget. The tp2dp2 case is a cell of the launch matrix (docs/design.md,
# "Launch matrix"): under torchrun with the guide's hook (`scripts/patch_torchrun.sh`), with
# Megatron-LM's default data loader (2 worker processes per rank; the survivors' loaders are
# built again at the lock step).
CASES = [("tp2dp2", "backward", 0, 1, "hooked torchrun", 2)]
#: the dp4 case, run by tests/test_flood.py: (rank, step, phase) of the kill, its lock step
DP4_KILL = (3, 7, "optimizer", 8)


@pytest.mark.parametrize(("layout", "phase", "behind", "rank", "launcher", "workers"), CASES)
def test_killed_worker_is_replaced_and_training_is_bit_exact(
    layout, phase, behind, rank, launcher, workers, reference_job, hooked_torchrun, tmp_path
):
    config = LAYOUTS[layout]
    step = 7 if layout == "dp4" else 3
    reference = reference_job(ha_args=HA_ARGS, **config)
    job = run_tiny_job(tmp_path, inject=f"kill:rank={rank},step={step},phase={phase}",
                       ha_args=ARF_ARGS, env={"NUM_WORKERS": str(workers)},
                       launcher=hooked_torchrun if launcher == "hooked torchrun" else launcher,
                       **config)
    assert_killed_worker_repaired(job, reference, config, rank, step + behind, phase, launcher)


def assert_killed_worker_repaired(job, reference, config: dict, rank: int, lock_step: int,
                                  phase: str, launcher: str) -> None:
    """A job whose `rank` was killed once (in `phase`) and repaired at `lock_step` by worker
    reboot: bit-exact, the new process got its shard, and under tft-run the controller ran
    in node 0's launcher and ended the job."""
    _assert_repaired(job, reference, {rank: 1})
    assert [e["strategy"] for e in job.named("strategy")] == ["recover"]
    _assert_shard_and_params(job, config, [(rank, lock_step, phase)])
    if launcher == "tft-run":
        assert "[tft-run] controller for 4 ranks listening on" in job.output
        assert job.named("state")[-1]["state"] == "FINAL"
        assert [e["code"] for e in job.named("exit") if e["rank"] == -1] == [0]


def _assert_shard_and_params(job, config: dict, kills: list[tuple[int, int, str]]) -> None:
    """Per kill (rank, lock step, phase), in order: the killed rank received its shard of
    the lock step, every rank rolled back to it, the params came as below, and the launcher
    reported the rank lost."""
    received = job.named("shard_received")
    assert [(e["rank"], e["iteration"]) for e in received] == [(r, s) for r, s, _ in kills]
    rolled = job.named("rolled_back")
    assert sorted({e["iteration"] for e in rolled}) == sorted(s for _, s, _ in kills)
    lost = [e for e in job.named("fault_detected") if e["kind"] == "lost"]
    assert [e["ranks"] for e in lost] == [[r] for r, _, _ in kills]
    for got, (killed, step, phase), detected in zip(received, kills, lost, strict=True):
        # The new process has no params. With the distributed optimizer its replica peer
        # sends its complete params with the shard, and nothing is all-gathered; unless the
        # kill came inside the update: then rank 2's param all-gather with the killed rank 3
        # was cut off, and every rank all-gathers in the rollback. Without it, every rank
        # derives its params locally.
        gathered = {e["params_gathered"] for e in rolled if e["iteration"] == step}
        if not config.get("dist_opt", True):
            assert got["param_bytes"] == 0 and gathered == {False}
        elif phase != "optimizer":
            assert got["param_bytes"] > 0 and gathered == {False}
        else:
            assert gathered == {True}
        assert "reported by its launcher" in detected["message"]
        # every survivor lets its old process groups go at the end of its rollback, after
        # the shard copy (the rollback starts once every rank's repair is done)
        rolled_at = {e["rank"]: e["time"] for e in rolled if e["iteration"] == step}
        released = [e for e in job.named("groups_released")
                    if e["incident"] == detected["incident"]]
        assert sorted(e["rank"] for e in released) == sorted(set(rolled_at) - {killed})
        assert len({e["groups"] for e in released}) == 1
        assert all(e["time"] >= rolled_at[e["rank"]] >= got["time"] for e in released)


def test_hung_worker_is_detected_killed_and_replaced(reference_job, tmp_path):
    """Rank 2 hangs as its update of step 7 begins; the others complete theirs and wait for
    it in the parameter all-gather that follows, so the stop lands on the logging rank
    between its update and its log line: iteration 8 is logged after the repair, once."""
    config = LAYOUTS["dp4"]
    reference = reference_job(ha_args=HA_ARGS, **config)
    job = run_tiny_job(
        tmp_path, inject="hang:rank=2,step=7,phase=optimizer", ha_args=ARF_ARGS,
        launcher="tft-run", env={"TTP_HANG_TIMEOUT_MIN": "3", "TTP_PARK_TIMEOUT": "3", "TTP_EXIT_GRACE": "1",
             "TFT_INJECT_HANG_SECONDS": "600"},
        **config,
    )
    _assert_repaired(job, reference, {2: 1})
    # the survivors, blocked in collectives behind rank 2, may be reported too; their reports
    # are withdrawn when their training threads come back on stop, so the decision names rank 2
    # (and a survivor whose collective fails because a stopped peer shut its connections
    # reports a comm error: withdrawn as a consequence of the stop)
    def ranks(name: str, kind: str) -> set[int]:
        return {r for e in job.named(name) if e["kind"] == kind for r in e["ranks"]}

    hangs, withdrawn = ranks("fault_detected", "hang"), ranks("fault_withdrawn", "hang")
    assert 2 in hangs and 2 not in withdrawn and hangs - {2} == withdrawn
    assert ranks("fault_detected", "comm") == ranks("fault_withdrawn", "comm")
    (strategy,) = job.named("strategy")
    assert strategy["strategy"] == "recover" and strategy["faults"] == {"2": "hang"}
    (restart,) = job.named("worker_restarted")
    assert restart["returncode"] == 76  # the controller's reboot order ended the hung process
    assert [e["lock_step"] for e in job.named("repaired")] == [8]
    (repaired,) = job.named("repaired")
    filled = [e["iteration"] for e in job.named("iteration") if e["time"] > repaired["time"]]
    assert filled[0] == 8 and "logged after the repair" in job.output


def test_a_worker_exit_its_launcher_does_not_restart_dumps_at_once(tmp_path):
    """Rank 1 exits with code 1 (an error that escaped it), which tft-run does not restart:
    its launcher says so, and the controller decides a dump at once, the `strategy` event
    naming the refusal; no recover, no clean, no wait for a restart that will not come (the
    replacement wait, 60 s here, never runs out)."""
    job = run_tiny_job(
        tmp_path, inject="exit:rank=1,step=6,phase=backward", launcher="tft-run",
        ha_args=ARF_ARGS, env={"TFT_REPLACEMENT_WAIT": "60"}, **STANDARD)
    assert "not restarting it (only a worker killed by a signal or exiting with 76 is " \
           "restarted)" in job.output, job.describe()
    (strategy,) = job.named("strategy")
    assert strategy["strategy"] == "dump", strategy
    assert strategy["faults"]["1"] == "lost"
    assert strategy["reason"] == ("no replacement: rank 1: exited with code 1: its launcher "
                                  "restarts only a worker killed by a signal or exiting with 76")
    assert job.named("repair_failed") == []
    assert [e["action"] for e in job.named("action")] == ["hold", "stop", "dump", "rename"]
    (end,) = job.named("exit")
    assert (end["code"], end["reason"]) == (75, "dying-gasp checkpoint saved at iteration 6 in "
                                            f"{job.checkpoint_dir / 'iter_0000006'}")
    assert job.named("worker_restarted") == []
    assert [len(p) for _, p in sorted(job.pids().items())] == [1, 1, 1, 1]


def test_two_faults_at_different_steps_are_both_repaired(reference_job, tmp_path):
    """A kill in the backward pass, then one in the forward pass (the dp4 cases of the test
    above). With a warm spare (`--tft-spares-per-node 1`): the first killed rank is taken
    over by the spare, which imported everything its set-up needs before it was ready; the
    second kill comes before the next spare is ready (it starts with the first takeover and
    needs seconds of imports): a cold restart. Both repairs are bit-exact."""
    config = LAYOUTS["dp4"]
    reference = reference_job(ha_args=HA_ARGS, **config)
    job = run_tiny_job(
        tmp_path, inject="kill:rank=1,step=5,phase=backward;kill:rank=2,step=13,phase=forward",
        ha_args=ARF_ARGS, launcher="tft-run --tft-spares-per-node 1", **config,
    )
    _assert_repaired(job, reference, {1: 1, 2: 1})
    assert [e["strategy"] for e in job.named("strategy")] == ["recover", "recover"]
    assert [e["lock_step"] for e in job.named("repaired")] == [5, 13]
    _assert_shard_and_params(job, config, [(1, 5, "backward"), (2, 13, "forward")])
    spare, late = job.spare_handover(1)
    ready = re.search(rf"warm spare pid {spare} is ready", job.output)
    first_iteration = re.search(r" iteration +1/", job.output)
    # a spare does the workers' imports and less: it is ready before their first step
    assert ready and first_iteration and ready.start() < first_iteration.start(), \
        job.describe()
    assert job.pids()[1][1] == spare
    assert "restarting it as rank 2" in job.output  # a cold restart
    assert late == "none"  # SETUP_IMPORTS and SETUP_MODULES cover the set-up


def test_no_replica_reloads_the_periodic_checkpoint(reference_job, tmp_path):
    """N = 1: the restarted worker's shard has no other holder; every rank (survivors in
    place) reloads the last periodic checkpoint and recomputes from there."""
    reference = reference_job("dp4", **STANDARD)  # the native optimizer, HA off
    job = run_tiny_job(
        tmp_path, inject="kill:rank=3,step=8,phase=forward", launcher="tft-run",
        ha_args="--enable-high-availability --enable-worker-reboot "
                "--distributed-optimizer-no-replica",
        **STANDARD,
    )
    assert job.returncode == 0, job.describe()
    (strategy,) = job.named("strategy")
    assert (strategy["strategy"], strategy["source"]) == ("recover", "checkpoint")
    assert {e["iteration"] for e in job.named("rolled_back")} == {5}
    # every iteration logged once; 6-8, computed again after the rollback, only as events
    job.assert_logged_once(reference, STANDARD["train_iters"])
    assert [e["iteration"] for e in job.named("iteration_recomputed")] == [6, 7, 8]
    pids = job.pids()
    assert [len(pids[r]) for r in range(4)] == [1, 1, 1, 2]
    # goodput counts each iteration once: the first runs of 6-8 are the incident's cost
    run = goodput(job.events)
    assert 0 < run.ratio <= 1 and run.counted == STANDARD["train_iters"]
    assert [c.discarded_steps for c in run.incidents] == [3]
    timeline = check_timeline(job.events, tmp_path / "timeline.png", reference.events)
    assert set(timeline.bands) >= {e["action"] for e in job.named("action")}


def _end(proc, events) -> None:
    """Kill a launcher still running and every worker process the events file names
    (workers run in sessions of their own, as under torchrun, and would keep the output pipe
    open); every wait is bounded."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGKILL)
    pids = {e["pid"] for e in read_events_if_any(events) if e["event"] == "replica_layout"}
    pids |= {e["new_pid"] for e in read_events_if_any(events) if e["event"] == "worker_restarted"}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _launch_node(run_dir, node_rank: int, master_port: int, ttp_port: int, extra: str = ""):
    return start_tiny_job(tiny_job_env(
        run_dir, **STANDARD, ha_args=ARF_ARGS + extra,
        launcher=f"tft-run --nnodes 2 --node-rank {node_rank} --master-addr 127.0.0.1",
        env={"NPROC": "2", "MASTER_PORT": str(master_port), "TTP_PORT": str(ttp_port),
             "TTP_LOG_PATH": str(run_dir / f"ttp_logs_node{node_rank}"),
             # the replacement launcher is coming: the controller waits for it
             "TFT_NODE_REPLACEMENT_WAIT": "120"}))


class _Scraper:
    """Scrapes a metrics endpoint every `interval` seconds in a background thread and keeps
    every scrape that answered: (time, {(name, labels): value}), parsed by prometheus_client."""

    def __init__(self, port: int, interval: float = 0.3) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval = interval
        self.scrapes: list[tuple[float, dict]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as reply:
                    text = reply.read().decode()
            except OSError:
                continue  # not up yet, or gone with the job
            self.scrapes.append((time.time(), {
                (s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)


def _named(samples: dict, name: str) -> dict:
    return {labels: value for (n, labels), value in samples.items() if n == name}


def test_a_lost_node_is_replaced_by_a_new_launcher(reference_job, tmp_path):
    """Two launchers (`--nnodes 2`, 2 ranks each). Node 1's launcher and its workers are
    killed; a replacement launcher with the same node rank brings ranks 2 and 3 back, they
    receive their shards from ranks 0 and 1, and the job finishes bit-exact. Node 0's
    controller serves its metrics (`--tft-metrics-port`), scraped all along: no incident
    before the kill, one repaired after it, its time to recover within the events file's."""
    reference = reference_job(ha_args=HA_ARGS, **LAYOUTS["dp4"])
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    events = run_dir / "events.jsonl"
    master_port, ttp_port, metrics_port = free_port(), free_port(), free_port()
    node0 = _launch_node(run_dir, 0, master_port, ttp_port,
                         f" --tft-metrics-port {metrics_port}")
    node1 = _launch_node(run_dir, 1, master_port, ttp_port)
    replacement = None
    scraper = _Scraper(metrics_port)
    try:
        wait_event(events, lambda e: e["event"] == "iteration" and e["iteration"] >= 2, 180)
        wait_for(lambda: scraper.scrapes, 10, "a scrape of node 0's metrics")
        killed = time.time()
        # the node dies: its launcher and its workers (they run in sessions of their own)
        workers = {e["rank"]: e["pid"] for e in read_events_if_any(events)
                   if e["event"] == "replica_layout" and e["rank"] in (2, 3)}
        os.killpg(node1.pid, signal.SIGKILL)
        for pid in workers.values():
            os.kill(pid, signal.SIGKILL)
        node1.communicate()
        wait_event(events, lambda e: e["event"] == "strategy", 60)
        replacement = _launch_node(run_dir, 1, master_port, ttp_port)
        output0, _ = node0.communicate(timeout=300)
        output1, _ = replacement.communicate(timeout=60)
    finally:
        scraper.stop()
        for proc in (node0, node1, replacement):
            _end(proc, events)
    assert node0.returncode == 0, output0[-3000:]
    assert replacement.returncode == 0, output1[-3000:]
    done = read_events_if_any(events)
    assert [e["strategy"] for e in done if e["event"] == "strategy"] == ["recover"]
    lost = sorted(r for e in done if e["event"] == "fault_detected" and e["kind"] == "lost"
                  for r in e["ranks"])
    assert lost == [2, 3]
    received = sorted(e["rank"] for e in done if e["event"] == "shard_received")
    assert received == [2, 3]
    losses = {e["iteration"]: e["loss"] for e in done if e["event"] == "iteration"}
    assert losses == reference.losses()

    before = [samples for t, samples in scraper.scrapes if t < killed]
    assert before and all(s[("tft_incidents_total", frozenset())] == 0 for s in before)
    assert all(not _named(s, "tft_incidents_ended_total") for s in before)
    last = scraper.scrapes[-1][1]
    assert last[("tft_incidents_total", frozenset())] == 1
    first_kind = next(e["kind"] for e in done if e["event"] == "fault_detected")
    assert _named(last, "tft_incidents_ended_total") == {frozenset(
        {"kind": first_kind, "strategy": "recover", "outcome": "repaired"}.items()): 1}
    (incident,) = incidents(done)
    repaired = next(e["time"] for e in incident.events if e["event"] == "repaired")
    recovered_in = last[("tft_recovery_last_seconds", frozenset())]
    assert 0 < recovered_in <= repaired - incident.events[0]["time"]
    assert 0 < last[("tft_goodput_ratio", frozenset())] <= 1
