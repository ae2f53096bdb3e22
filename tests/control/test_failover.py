"""Backup controllers over real sockets: without a majority a backup only orders the dump.

A backup that takes charge and lets training go on is checked under simulation
(test_sim_protocol.py::test_backup_takes_charge_when_active_dies)."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from tests.control.ctl_harness import Job, wait_for

INTERVAL, MISSES = 0.2, 4
LOST_AFTER = INTERVAL * MISSES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pair(job: Job, tmp: Path, world: int, steps: int) -> tuple[Path, Path]:
    """Active controller + one backup + `world` ranks; returns the backup's events/snapshot."""
    backup_port = free_port()
    backups = f"127.0.0.1:{backup_port}"
    active = job.start_controller(backups=backups)
    backup_events, backup_snap = tmp / "backup-events.jsonl", tmp / "backup-snap.json"
    job.start_controller(role="backup", port=backup_port, backups=backups, active_port=active,
                         events=backup_events, snapshot=backup_snap)
    for r in range(world):
        job.start_worker(r, steps=steps, step_time=0.01, backups=backups)
    job.wait_state("NORMAL", 20)
    # the backup has the rank table from the active controller
    wait_for(lambda: (s := job.snapshot(backup_snap)) and s["state"] == "NORMAL"
             and len(s["ranks"]) == world, 10, what="backup in sync")
    return backup_events, backup_snap


def test_with_half_the_ranks_gone_a_backup_only_dumps(tmp_path: Path) -> None:
    """Half the ranks and the active controller die: the backup may not resume training
    (split brain), but it takes charge dump-only once every survivor had time to fail over:
    the survivors hold a complete copy (shards 0 and 1), write the dump and exit 75."""
    job = Job(tmp_path, 4, interval=INTERVAL, misses=MISSES, action_limit=5.0)
    try:
        backup_events, backup_snap = start_pair(job, tmp_path, 4, steps=100000)
        killed = time.time()
        for p in (job.controllers[0], job.workers[2], job.workers[3]):
            p.send_signal(signal.SIGKILL)
        take = job.wait_event(lambda e: e["event"] == "controller_takeover", 15, backup_events,
                              what="takeover")
        assert take["live"] == 2 and take["dump_only"] is True
        # not before the survivors had the time to come: silence + timeout + interval
        assert take["time"] - killed >= 2 * LOST_AFTER
        assert {r: job.workers[r].wait(30) for r in (0, 1)} == {0: 75, 1: 75}
        events = job.events(backup_events)
        assert [e["strategy"] for e in events if e["event"] == "strategy"] == ["dump"]
        assert sorted(r for e in events if e["event"] == "fault_detected"
                      and e["kind"] == "lost" for r in e["ranks"]) == [2, 3]
        assert [e["code"] for e in events if e["event"] == "exit"] == [75]
        assert not [e for e in events if e["event"] == "state" and e["state"] == "NORMAL"
                    and e["time"] > take["time"] + 0.5]  # never back to training
    finally:
        job.cleanup()
