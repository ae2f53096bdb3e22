"""Megatron-LM core_v0.12.1's unchanged `pretrain_gpt.py` on two hosts of the test bed
(`tests/bed.py`: network namespaces on a bridge, one `tft-run` launcher per host with the
guide's multi-node settings: node 0's address as `TTP_ADDR` and `--master-addr`,
`GLOO_SOCKET_IFNAME=eth0`, one job token, CURVE keys).

One faulty job, 2 hosts x 2 ranks, DP=4 with the distributed optimizer and 2 replicas,
`--enable-high-availability --enable-hbmfault-repair --enable-worker-reboot`: rank 3, on
host 1, is killed (node 1's launcher reports it to node 0's controller over the network and
restarts it; the new process receives its shard from rank 1, on host 0), later the new rank
3 has a UCE in its optimizer state (retried in place, the shard again from host 0). Every
loss equals the fault-free run's bit for bit: the reference fixture's run of the same
configuration (one launcher on loopback: the network carries the same sums, and the repair
and reboot switches change no arithmetic).
"""

from __future__ import annotations

import time

import pytest

from mindspeed_tft.events import read_events_if_any
from tests.bed import Cluster, make_bed
from tests.jobs import JobResult

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
            codes = {node: cluster.wait(node, TIMEOUT) for node in (0, 1)}
        finally:
            cluster.end()
    print(f"\n2 hosts x 2 ranks in Megatron-LM's loop: {time.monotonic() - started:.1f}s")
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
