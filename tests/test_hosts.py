"""The multi-node cells of the reference trainer on a test bed of hosts (`tests/bed.py`):
two (or three) hosts with network stacks of their own, 2 ranks each (DP4 with 2 optimizer
replicas: every host holds a complete copy of the optimizer state), one `tft-run` per host
with the guide's settings (node 0's address as `TTP_ADDR`, `GLOO_SOCKET_IFNAME`, one job
token, CURVE). Losses are checked against the fault-free run as in every fault test
(bit-identical; within four fp32 ulps after a shrink).

- repairs across hosts: a rank killed on host 1 (restarted by its launcher), a UCE on host
  1 (repaired in place), host 1's link down for 2 s (shorter than the loss time, 5 s here:
  the job rides through, nothing is declared lost), then host 1's link slowed to 10 Mbit/s
  and a rank killed again (its shard comes over the slow link): one job, bit-identical;
- a whole host lost (its processes killed, its link down) and a replacement host with the
  same address started later, as Kubernetes restarts a pod (`TFT_NODE_REPLACEMENT_WAIT`):
  the job rejoins, bit-identical;
- the same loss without a replacement under elastic training: the job shrinks to host 0;
- a host cut off for good while its processes live (host 1, or node 0 with the controller
  and the job's store): decided within the loss time plus seconds (the silent launcher
  gets no wait), each side handles it as the contract says, one checkpoint of the lock
  step is published whatever both sides do, the cut-off side's processes are gone when the
  link returns, and the checkpoint resumes bit-exact.
"""

from __future__ import annotations

import time

import pytest

from tests.bed import Cluster, make_bed
from tests.jobs import HA_ARGS, STANDARD, read_events_if_any, run_tiny_job, wait_event

pytestmark = pytest.mark.multiproc

DUMP_EXIT_CODE = 75
REBOOT = f"{HA_ARGS} --enable-worker-reboot"
#: the loss time of these jobs (tests/jobs.py: 0.5 s x 10 heartbeats)
LOST_AFTER = 5.0
#: seconds from a cut to both sides' launchers ending: the loss time, the minority backup's
#: failover (3 x 5 s + waits), the dumps, on 2 shared cores
DECIDED_WITHIN = 90.0
LOSS_TOLERANCE = 4 * 2.0**-20  # four fp32 ulps at a loss of 8 (tests/test_elastic.py)


def _events(cluster: Cluster) -> list[dict]:
    return read_events_if_any(cluster.events)


def _named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


def _at_iteration(cluster: Cluster, iteration: int, timeout: float = 240) -> None:
    wait_event(cluster.events, lambda e: e["event"] == "iteration"
               and e["iteration"] >= iteration, timeout)


def _lost(events: list[dict]) -> list[list[int]]:
    return [e["ranks"] for e in _named(events, "fault_detected") if e["kind"] == "lost"]


def test_repairs_across_hosts_are_bit_exact(reference_job, tmp_path):
    reference = reference_job(layout="dp4", ha_args=HA_ARGS, **STANDARD)
    inject = ("kill:rank=2,step=3,phase=backward;"
              "uce:rank=3,step=6,phase=backward,target=optimizer;"
              "kill:rank=3,step=12,phase=forward")
    with make_bed(2) as bed:
        cluster = Cluster(bed, tmp_path, nnodes=2, layout="dp4", inject=inject,
                          ha_args=f"{REBOOT} --enable-hbmfault-repair", **STANDARD)
        try:
            cluster.start(0)
            cluster.start(1)
            _at_iteration(cluster, 8)
            bed.cut(1)  # a partition shorter than the loss time
            time.sleep(2.0)
            bed.restore(1)
            _at_iteration(cluster, 10)
            bed.slow(1, "10mbit")  # the last kill's repair sends over it
            assert cluster.wait(0, 300) == 0, cluster.outputs[0][-4000:]
            assert cluster.wait(1, 60) == 0, cluster.outputs[1][-4000:]
        finally:
            cluster.end()
    events = _events(cluster)
    assert [e["strategy"] for e in _named(events, "strategy")] == ["recover", "retry",
                                                                   "recover"]
    assert _lost(events) == [[2], [3]]  # the 2 s cut cost nothing, nothing lost twice
    assert [e["rank"] for e in _named(events, "worker_restarted")] == [2, 3]
    assert not _named(events, "node_silent")
    assert len(_named(events, "repaired")) == 3
    losses = {e["iteration"]: e["loss"] for e in _named(events, "iteration")}
    assert losses == reference.losses()
    last = _named(events, "shard_received")[-1]
    (detected,) = [e for e in _named(events, "fault_detected") if e["ranks"] == [3]
                   and e["kind"] == "lost"]
    repaired = _named(events, "repaired")[-1]
    print(f"\nthe repair over host 1's 10 Mbit/s link: {last['bytes']} bytes to rank 3, "
          f"{repaired['time'] - detected['time']:.1f}s from the loss to the resume")


def test_a_lost_host_rejoins_through_a_replacement_host(reference_job, tmp_path):
    """As Kubernetes recreates a pod, with its route's addresses (`CONTROLLER_ADDR` each
    host's own, `PROCESSOR_ADDR` node 0's): the host dies (processes killed, link down), and
    a replacement with its address starts once the controller said its launcher is silent;
    the controller waits for it (`TFT_NODE_REPLACEMENT_WAIT`), its launcher takes the node's
    record, and the job ends bit-identical."""
    reference = reference_job(layout="dp4", ha_args=HA_ARGS, **STANDARD)
    wait = {"TFT_NODE_REPLACEMENT_WAIT": "120"}
    with make_bed(2) as bed:
        cluster = Cluster(bed, tmp_path, nnodes=2, layout="dp4", ha_args=REBOOT,
                          env=wait, kubernetes=True, **STANDARD)
        try:
            cluster.start(0)
            cluster.start(1)
            _at_iteration(cluster, 3)
            cluster.replace_host(1)
            assert cluster.wait(0, 300) == 0, cluster.outputs[0][-4000:]
            assert cluster.wait(1, 60) == 0, cluster.outputs[1][-4000:]
        finally:
            cluster.end()
    events = _events(cluster)
    (silent,) = _named(events, "node_silent")
    assert (silent["node"], silent["ranks"], silent["decision"], silent["wait_s"]) == (
        1, [2, 3], "wait", 120)
    assert [e["node"] for e in _named(events, "node_back")] == [1]
    assert [e["strategy"] for e in _named(events, "strategy")] == ["recover"]
    assert sorted(e["rank"] for e in _named(events, "shard_received")) == [2, 3]
    assert "rejoins a running job" in cluster.outputs[1]
    losses = {e["iteration"]: e["loss"] for e in _named(events, "iteration")}
    assert losses == reference.losses()


def test_a_lost_host_without_replacement_shrinks_the_job(reference_job, tmp_path):
    """Elastic training, no replacement: the silent launcher's ranks get none at once
    (`node_silent` decision `shrink`), and the job trains on with host 0's DP replica."""
    reference = reference_job(layout="dp4", ha_args=HA_ARGS, **STANDARD)
    with make_bed(2) as bed:
        cluster = Cluster(bed, tmp_path, nnodes=2, layout="dp4",
                          ha_args=f"{REBOOT} --enable-elastic-training", **STANDARD)
        try:
            cluster.start(0)
            cluster.start(1)
            _at_iteration(cluster, 4)
            lost_at = time.monotonic()
            bed.kill_host(1)
            cluster.wait(1, 30)
            assert cluster.wait(0, 300) == 0, cluster.outputs[0][-4000:]
        finally:
            cluster.end()
    events = _events(cluster)
    (silent,) = _named(events, "node_silent")
    assert (silent["node"], silent["ranks"], silent["decision"]) == (1, [2, 3], "shrink")
    (shrink,) = _named(events, "scale_in")
    assert (shrink["ranks"], shrink["dp_size"]) == ([0, 1], 2)
    step = shrink["step"]
    logged = _named(events, "iteration")
    expected = {e["iteration"]: e for e in reference.named("iteration")}
    assert [e["iteration"] for e in logged] == sorted(expected)
    for event in logged:
        want = expected[event["iteration"]]
        assert (event["consumed_samples"], event["lr"]) == (want["consumed_samples"],
                                                            want["lr"])
        if event["iteration"] <= step:
            assert event["loss"] == want["loss"], event
        assert abs(event["loss"] - want["loss"]) <= LOSS_TOLERANCE, event
    print(f"\nhost 1 lost: shrunk at step {step}, "
          f"{shrink['time'] - silent['time']:.1f}s after node_silent; "
          f"job ended {time.monotonic() - lost_at:.1f}s after the loss")


@pytest.mark.parametrize("cut", [1, 0], ids=["host-1-cut-off", "node-0-cut-off"])
def test_a_host_cut_off_for_good_publishes_one_checkpoint(cut, reference_job, tmp_path):
    """Host `cut` drops off the network for good at iteration 4 while its processes live
    (no replacement is coming: the default). Node 0's controller hears neither node 1's
    ranks nor its launcher, and dumps at once (no wait for a restart nobody can make);
    node 1's backup, cut off from the controller with half of the ranks, takes charge
    dump-only. Whatever the order, the lock step is published once, by one side (the
    other finds it published and writes nothing); the link returns 30 s after the cut and
    no process of the job is left; the checkpoint resumes bit-exact."""
    config = {"layout": "dp4", "ha_args": HA_ARGS, **STANDARD}
    reference = reference_job(**config)
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    with make_bed(2) as bed:
        cluster = Cluster(bed, run_dir, nnodes=2, layout="dp4", ha_args=REBOOT, **STANDARD)
        try:
            cluster.start(0)
            cluster.start(1)
            _at_iteration(cluster, 4)
            cut_at = time.monotonic()
            bed.cut(cut)
            codes = {node: cluster.wait(node, DECIDED_WITHIN) for node in (0, 1)}
            ended = time.monotonic() - cut_at
            time.sleep(max(0.0, 30.0 - ended))
            bed.restore(cut)
            time.sleep(1.0)
            left = [pid for host in (0, 1) for pid in bed.pids(host)]
        finally:
            cluster.end()
    assert codes == {0: DUMP_EXIT_CODE, 1: DUMP_EXIT_CODE}, cluster.outputs
    assert left == []
    events = _events(cluster)
    (silent,) = _named(events, "node_silent")
    assert (silent["node"], silent["ranks"], silent["decision"]) == (1, [2, 3], "dump")
    (takeover,) = _named(events, "controller_takeover")
    assert takeover["dump_only"] is True and takeover["live"] == 2
    # node 0's side: a dump at once, or a recover whose rejoin fails at once (the ranks
    # were lost before their launcher's silence was): never a wait for a restart
    strategies = _named(events, "strategy")
    assert [e["strategy"] for e in strategies] in (["dump", "dump"], ["recover", "dump"])
    for failed in _named(events, "repair_failed"):
        assert "no replacement (node 1's launcher silent" in failed["reason"]
    lock_step = strategies[0]["lock_step"]
    assert [e["lock_step"] for e in strategies] == [lock_step, lock_step]
    assert [e["code"] for e in _named(events, "exit")] == [DUMP_EXIT_CODE] * 2
    assert not _named(events, "repaired")  # the side without a majority never trains on
    published = _named(events, "dump_saved")
    assert [e["iteration"] for e in published] == [lock_step]
    assert [e["iteration"] for e in _named(events, "dump_not_published")] == [lock_step]
    ckpt = run_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(lock_step)
    assert not (ckpt / f"iter_{lock_step:07d}_tmp").exists()
    assert not (ckpt / f"iter_{lock_step:07d}_old").exists()
    print(f"\nhost {cut} cut off: both sides ended {ended:.1f}s after the cut, "
          f"the lock step {lock_step} published once")

    resumed = run_tiny_job(tmp_path / "resumed", load_dir=ckpt, **config)
    assert resumed.returncode == 0, resumed.describe()
    losses, expected = resumed.losses(), reference.losses()
    assert sorted(losses) == list(range(lock_step + 1, STANDARD["train_iters"] + 1))
    for it, loss in losses.items():
        assert loss == expected[it], (it, loss, expected[it])
