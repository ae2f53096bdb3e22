"""Megatron-LM core_v0.12.1's unchanged `pretrain_gpt.py` on two hosts of the test bed
(`tests/bed.py`: network namespaces on a bridge, one `tft-run` launcher per host with the
guide's multi-node settings: node 0's address as `TTP_ADDR` and `--master-addr`,
`GLOO_SOCKET_IFNAME=eth0`, one job token, CURVE keys).

One faulty job, 2 hosts x 2 ranks, DP=4 with the distributed optimizer and 2 replicas,
`--enable-high-availability --enable-hbmfault-repair --enable-worker-reboot`: rank 3, on
host 1, is killed (node 1's launcher reports it to node 0's controller over the network and
restarts it; the new process receives its shard from rank 1, on host 0), later the new rank
3 has a UCE in its optimizer state (retried in place, the shard again from host 0, over
host 1's link slowed to 10 Mbit/s), then host 1's link is down for 2 s (less than the loss
time: nothing is declared lost). The other cells: a host lost under elastic training (the
shrink), node 0 cut off for good (one checkpoint, resumed by Megatron-LM's own load). Every
loss equals the fault-free run's bit for bit: the reference fixture's run of the same
configuration (one launcher on loopback: the network carries the same sums, and the repair
and reboot switches change no arithmetic).
"""

from __future__ import annotations

import time

import pytest

from mindspeed_tft.events import read_events_if_any
from tests.bed import Cluster, make_bed
from tests.jobs import JobResult, wait_event

pytestmark = pytest.mark.multiproc

HA = "--enable-high-availability --tft-check-replicas-interval 1"
#: the reference fixture's configuration (tests/test_megatron_lm.py: ITERS, the dp4 route)
CONFIG = {"layout": "dp4", "train_iters": 8, "save_interval": 4, "precision": "fp32"}
#: a kill in rank 3's backward pass of step 2, then a UCE in the new rank 3's optimizer state
#: in its backward pass of step 5 (rank 3, the last, is Megatron-LM's logging rank)
KILL = (3, 2)
UCE = (3, 5)
INJECT = (f"kill:rank={KILL[0]},step={KILL[1]},phase=backward;"
          f"uce:rank={UCE[0]},step={UCE[1]},phase=backward,target=optimizer")
#: seconds from the kill to the rank lost by its launcher's report (heartbeats: 5 s)
REPORT_SECONDS = 2.5
DUMP_EXIT_CODE = 75
#: each launcher's bound: start-up, two repairs and 8 steps on 2 shared cores
TIMEOUT = 300.0


def test_kill_then_uce_on_host_1_in_megatron_lms_loop_is_bit_exact(
    megatron_lm, megatron_reference, tmp_path
):
    reference = megatron_reference(ha_args=HA, **CONFIG)
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    started = time.monotonic()
    with make_bed(2) as bed:
        cluster = Cluster(bed, run_dir, nnodes=2, megatron_lm=megatron_lm, inject=INJECT,
                          ha_args=f"{HA} --enable-hbmfault-repair --enable-worker-reboot",
                          **CONFIG)
        try:
            for node in (0, 1):
                cluster.start(node)
            _iteration(cluster, 3)
            bed.slow(1, "10mbit")  # the UCE's shard copy to host 1 goes over it
            _iteration(cluster, 6)
            bed.cut(1)  # shorter than the loss time (5 s): nothing is declared lost
            time.sleep(2.0)
            bed.restore(1)
            codes = {node: cluster.wait(node, TIMEOUT) for node in (0, 1)}
        finally:
            cluster.end()
    print(f"\n2 hosts x 2 ranks in Megatron-LM's loop: {time.monotonic() - started:.1f}s")
    assert not [e for e in read_events_if_any(cluster.events) if e["event"] == "node_silent"]
    output = cluster.outputs[0] + cluster.outputs[1]
    job = JobResult(codes[0] or codes[1], output, run_dir,
                    read_events_if_any(cluster.events))
    assert codes == {0: 0, 1: 0}, job.describe()

    # the controller ran in node 0's launcher, at node 0's address, and ended the job
    assert f"[tft-run] controller for 4 ranks listening on {bed.address(0)}" in output
    assert "is a Megatron-LM training script: its workers run it through" in output
    assert job.named("state")[-1]["state"] == "FINAL"
    assert [e["code"] for e in job.named("exit") if e["rank"] == -1] == [0]

    # the kill: rank 3 lost, restarted by node 1's launcher; then the UCE: retried in place
    assert [e["strategy"] for e in job.named("strategy")] == ["recover", "retry"]
    lost = [e for e in job.named("fault_detected") if e["kind"] == "lost"]
    assert [e["ranks"] for e in lost] == [[KILL[0]]]
    # node 1's launcher told node 0's controller over the network (`exited`), at once: not
    # its heartbeats, silent for 0.5 s x 10 first
    assert lost[0]["message"] == "process killed by signal 9 (reported by its launcher)"
    (killed,) = [e for e in job.named("fault_injected") if e["kind"] == "kill"]
    assert lost[0]["time"] - killed["time"] < REPORT_SECONDS, (killed, lost)
    assert [(e["rank"], e["node"]) for e in job.named("worker_restarted")] == [(KILL[0], 1)]
    uce = [e for e in job.named("fault_detected") if e["kind"] == "uce"]
    assert [e["ranks"] for e in uce] == [[UCE[0]]]
    pids = job.pids()
    assert {r: len(p) for r, p in pids.items()} == {0: 1, 1: 1, 2: 1, 3: 2}
    received = [(e["rank"], e["iteration"], e["source"]) for e in job.named("shard_received")]
    assert received == [(KILL[0], KILL[1], 1), (UCE[0], UCE[1], 1)]  # from host 0

    # every iteration logged once (by the restarted logging rank after the kill), with the
    # fault-free run's loss, bit for bit; every replica check matched
    job.assert_logged_once(reference, CONFIG["train_iters"])
    assert job.named("replica_check") and all(e["match"] for e in job.named("replica_check"))


def _job(cluster: Cluster, codes: dict[int, int]) -> JobResult:
    output = "".join(cluster.outputs.get(node, "") for node in sorted(cluster.outputs))
    return JobResult(max(codes.values()), output, cluster.run_dir,
                     read_events_if_any(cluster.events))


def _iteration(cluster: Cluster, iteration: int) -> None:
    wait_event(cluster.events, lambda e: e["event"] == "iteration"
               and e["iteration"] >= iteration, TIMEOUT)


def test_a_lost_host_is_replaced_in_megatron_lms_loop(megatron_lm, megatron_reference,
                                                     tmp_path):
    """As Kubernetes recreates a pod: host 1 dies (processes killed, link down) at iteration
    3, and a replacement launcher with its node rank starts there once the controller said
    its launcher is silent; the controller waits for it (`TFT_NODE_REPLACEMENT_WAIT`), it
    takes the node's record, its ranks get their shards from host 0, and every loss is the
    fault-free run's."""
    reference = megatron_reference(ha_args=HA, **CONFIG)
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    with make_bed(2) as bed:
        cluster = Cluster(bed, run_dir, nnodes=2, megatron_lm=megatron_lm,
                          ha_args=f"{HA} --enable-worker-reboot",
                          env={"TFT_NODE_REPLACEMENT_WAIT": "120"}, **CONFIG)
        try:
            for node in (0, 1):
                cluster.start(node)
            _iteration(cluster, 3)
            cluster.replace_host(1)
            codes = {node: cluster.wait(node, TIMEOUT) for node in (0, 1)}
        finally:
            cluster.end()
    job = _job(cluster, codes)
    assert codes == {0: 0, 1: 0}, job.describe()
    (silent,) = job.named("node_silent")
    assert (silent["node"], silent["decision"]) == (1, "wait")
    assert [e["node"] for e in job.named("node_back")] == [1]
    assert [e["strategy"] for e in job.named("strategy")] == ["recover"]
    assert sorted(e["rank"] for e in job.named("shard_received")) == [2, 3]
    assert job.losses() == reference.losses()


def test_a_lost_host_shrinks_megatron_lms_loop(megatron_lm, megatron_reference, tmp_path):
    """Elastic training, host 1 lost for good (its processes killed, its link down) and no
    replacement coming: its launcher's silence decides at once (`node_silent`, `shrink`),
    and Megatron-LM's own loop goes on at DP2 on host 0 from the dump, with the fault-free
    samples and learning rate (losses within tests/test_elastic.py's tolerance)."""
    from tests.test_elastic import assert_the_fault_free_stream

    reference = megatron_reference(ha_args=HA, **CONFIG)
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    with make_bed(2) as bed:
        cluster = Cluster(bed, run_dir, nnodes=2, megatron_lm=megatron_lm,
                          ha_args=f"{HA} --enable-worker-reboot --enable-elastic-training",
                          **CONFIG)
        try:
            for node in (0, 1):
                cluster.start(node)
            _iteration(cluster, 3)
            bed.kill_host(1)
            codes = {1: cluster.wait(1, 30), 0: cluster.wait(0, TIMEOUT)}
        finally:
            cluster.end()
    job = _job(cluster, codes)
    assert codes[0] == 0, job.describe()
    (silent,) = job.named("node_silent")
    assert (silent["node"], silent["ranks"], silent["decision"]) == (1, [2, 3], "shrink")
    (shrink,) = job.named("scale_in")
    assert (shrink["ranks"], shrink["dp_size"], shrink["left"]) == ([0, 1], 2, [2, 3])
    assert_the_fault_free_stream(job, reference, fault_step=shrink["step"])


def test_node_0_cut_off_in_megatron_lms_loop_publishes_one_checkpoint(
    megatron_lm, megatron_reference, tmp_path
):
    """Node 0 (the controller and the job's store) drops off the network for good at
    iteration 3, its processes alive: each side dumps the lock step as the contract says
    (node 0's controller at once: node 1's launcher is silent; node 1's backup dump-only
    after its failover), one publishes it, the other finds it published; both launchers
    exit 75, and Megatron-LM's own load resumes from it bit-exact."""
    from tests.jobs import run_megatron_job

    reference = megatron_reference(ha_args=HA, **CONFIG)
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    with make_bed(2) as bed:
        cluster = Cluster(bed, run_dir, nnodes=2, megatron_lm=megatron_lm,
                          ha_args=f"{HA} --enable-worker-reboot", **CONFIG)
        try:
            for node in (0, 1):
                cluster.start(node)
            _iteration(cluster, 3)
            bed.cut(0)
            codes = {node: cluster.wait(node, TIMEOUT) for node in (0, 1)}
            bed.restore(0)
            left = [pid for host in (0, 1) for pid in bed.pids(host)]
        finally:
            cluster.end()
    job = _job(cluster, codes)
    assert codes == {0: DUMP_EXIT_CODE, 1: DUMP_EXIT_CODE}, job.describe()
    assert left == []
    (takeover,) = job.named("controller_takeover")
    assert takeover["dump_only"] is True
    assert not job.named("repaired")
    lock_step = job.named("strategy")[0]["lock_step"]
    assert [e["iteration"] for e in job.named("dump_saved")] == [lock_step]
    assert [e["iteration"] for e in job.named("dump_not_published")] == [lock_step]
    ckpt = run_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(lock_step)

    resumed = run_megatron_job(tmp_path / "resumed", megatron_lm, ha_args=HA,
                               load_dir=ckpt, **CONFIG)
    assert resumed.returncode == 0, resumed.describe()
    losses, expected = resumed.losses(), reference.losses()
    assert sorted(losses) == list(range(lock_step + 1, CONFIG["train_iters"] + 1))
    assert all(losses[it] == expected[it] for it in losses), (losses, expected)
