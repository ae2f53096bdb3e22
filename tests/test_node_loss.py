"""Losing node 0 (its launcher with the controller and the job's store, and its workers)
costs at most the step in flight.

Two `tft-run` launchers on loopback (`--nnodes 2`, 2 ranks each, DP=4 with 2 optimizer
replicas, worker reboot on, no `TTP_BACKUP_ADDRS`): node 1's launcher hosts a backup
controller by default. Node 0's launcher is SIGKILLed with its process group; its workers
die with it (parent-death signal). Ranks 2 and 3 hold a complete copy of the optimizer
state: the backup takes charge dump-only (half the ranks: it may not resume training), they
write the dying-gasp checkpoint at the lock step and exit 75, within `BOUND_SECONDS`.
Resuming from it gives the fault-free reference's losses, bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.jobs import (
    HA_ARGS,
    STANDARD,
    free_port,
    read_events_if_any,
    run_tiny_job,
    start_tiny_job,
    tiny_job_env,
    wait_event,
)

pytestmark = pytest.mark.multiproc

DUMP_EXIT_CODE = 75
#: seconds from node 0's death to node 1's launcher exiting 75: ranks fail over after
#: interval x (misses + 1) = 3.5 s, the minority backup waits 2 x 3 + 0.5 s, then stop, dump
#: and exit (a few seconds on 2 shared cores)
BOUND_SECONDS = 60.0


def _launch_node(run_dir, node_rank: int, master_port: int, ttp_port: int):
    return start_tiny_job(tiny_job_env(
        run_dir, ha_args=f"{HA_ARGS} --enable-worker-reboot",
        launcher=f"tft-run --nnodes 2 --node-rank {node_rank} --master-addr 127.0.0.1",
        env={"NPROC": "2", "MASTER_PORT": str(master_port), "TTP_PORT": str(ttp_port),
             "TTP_LOG_PATH": str(run_dir / f"ttp_logs_node{node_rank}")}, **STANDARD))


def _end(proc) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_losing_node_0_dumps_from_node_1_and_resumes_bit_exact(reference_job, tmp_path):
    config = {"layout": "dp4", "ha_args": HA_ARGS, **STANDARD}
    reference = reference_job(**config)
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    events = run_dir / "events.jsonl"
    master_port, ttp_port = free_port(), free_port()
    node0 = _launch_node(run_dir, 0, master_port, ttp_port)
    node1 = _launch_node(run_dir, 1, master_port, ttp_port)
    try:
        wait_event(events, lambda e: e["event"] == "iteration" and e["iteration"] >= 11, 240)
        node0_workers = [e["pid"] for e in read_events_if_any(events)
                         if e["event"] == "replica_layout" and e["rank"] in (0, 1)]
        killed = time.monotonic()
        os.killpg(node0.pid, signal.SIGKILL)  # node 0's launcher; its workers follow it
        node0.communicate()
        output1, _ = node1.communicate(timeout=BOUND_SECONDS + 60)
        elapsed = time.monotonic() - killed
    except subprocess.TimeoutExpired:
        _end(node1)
        raise AssertionError("node 1 did not end after node 0 was lost") from None
    finally:
        _end(node0)
        _end(node1)
    (run_dir / "node1.log").write_text(output1)
    for pid in node0_workers:
        assert not os.path.exists(f"/proc/{pid}"), f"node 0's worker {pid} outlived its launcher"
    assert node1.returncode == DUMP_EXIT_CODE, output1[-4000:]
    print(f"\nnode 0 killed: node 1 wrote the dump and exited 75 after {elapsed:.1f}s")
    assert elapsed < BOUND_SECONDS

    done = read_events_if_any(events)
    (takeover,) = [e for e in done if e["event"] == "controller_takeover"]
    assert takeover["dump_only"] is True and takeover["live"] == 2
    strategies = [e for e in done if e["event"] == "strategy"]
    assert [e["strategy"] for e in strategies] == ["dump"]
    lock_step = strategies[0]["lock_step"]
    assert lock_step >= 11
    (saved,) = [e for e in done if e["event"] == "dump_saved"]
    assert saved["iteration"] == lock_step
    ckpt = run_dir / "ckpt"
    assert saved["path"] == str(ckpt / f"iter_{lock_step:07d}")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(lock_step)
    assert not (ckpt / f"iter_{lock_step:07d}_tmp").exists()
    lost = sorted(r for e in done if e["event"] == "fault_detected" and e["kind"] == "lost"
                  for r in e["ranks"])
    assert lost == [0, 1]
    assert not [e for e in done if e["event"] == "worker_restarted"]
    codes = [e["code"] for e in done if e["event"] == "exit"]
    assert codes == [DUMP_EXIT_CODE]

    resumed = run_tiny_job(tmp_path / "resumed", load_dir=ckpt, **config)
    assert resumed.returncode == 0, resumed.describe()
    losses, expected = resumed.losses(), reference.losses()
    assert sorted(losses) == list(range(lock_step + 1, STANDARD["train_iters"] + 1))
    for it, loss in losses.items():
        assert loss == expected[it], (it, loss, expected[it])
