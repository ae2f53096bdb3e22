"""The controller's decisions in scripted schedules, under deterministic simulation.

These replace socket tests whose only subject was the protocol's order of decisions (SPEC 6's
rows under every feature combination, a cascading fault during a repair, a backup taking
charge): the same assertions on the same events and orders, run by the real controller core
with simulated ranks (`mindspeed_tft.control.sim`) in milliseconds instead of seconds. What
needs real processes and sockets stays in test_spec6_matrix.py (two feature combinations),
test_failover.py (a dump-only takeover) and the jobs of tests/README.md.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest

from mindspeed_tft.control.controller.core import ControllerCore
from mindspeed_tft.control.sim.job import SimJob
from mindspeed_tft.control.sim.rank import SimRank
from mindspeed_tft.control.sim.schedule import Fault, Layout, Schedule

REPAIR_STATES = ["INIT", "NORMAL", "ABNORMAL", "ENV_CLEAR", "REPAIR", "NORMAL", "EXIT", "FINAL"]
DUMP_STATES = ["INIT", "NORMAL", "ABNORMAL", "DUMP", "EXIT", "FINAL"]
DUMP_CODE = 75  # exit code after a successful dying-gasp dump
ROWS = ("uce", "comm", "normal", "kill", "unknown")
COMBOS = [",".join(["dump", *[n for n, on in zip(("retry", "recover", "no_replica"), bits,
                                                 strict=True) if on]])
          for bits in itertools.product((False, True), repeat=3)]
#: the orders whose callbacks a processor runs (hold and resume are not callbacks)
CALLBACKS = {"stop", "clean", "repair", "rollback", "dump", "rename", "exit"}


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


class RecordingJob(SimJob):
    """A simulated run that keeps the orders each rank received and which controller
    (0: the active one, 1: the backup) wrote each event."""

    def __init__(self, schedule: Schedule) -> None:
        super().__init__(schedule)
        self.orders: dict[int, list[tuple[str, Any]]] = {}
        self.by_controller: list[tuple[int, dict[str, Any]]] = []

    def order_seen(self, proc: SimRank, name: str, wire: Any, action_id: int,
                   repeat: bool = False) -> None:
        self.orders.setdefault(proc.rank, []).append((name, wire))
        super().order_seen(proc, name, wire, action_id, repeat)

    def on_events(self, events: list[dict[str, Any]], core: ControllerCore) -> None:
        index = next(c.index for c in self.ctl.list if c.core is core)
        self.by_controller += [(index, e) for e in events]
        super().on_events(events, core)

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def states(self) -> list[str]:
        return [e["state"] for e in self.of("state")]

    def callbacks(self, rank: int) -> list[str]:
        return [n for n, _ in self.orders.get(rank, []) if n in CALLBACKS]


# -- SPEC 6: every row under every feature combination (was test_spec6_matrix's 8 x 5 jobs) --
def expected(row: str, features: str) -> dict[str, Any]:
    hbm, reboot, norep = ("retry" in features, "recover" in features, "no_replica" in features)
    if row == "normal":
        return {"strategy": None, "states": ["INIT", "NORMAL", "EXIT", "FINAL"], "code": 0,
                "rank0": []}
    if row in ("uce", "comm"):
        strategy = ("load_checkpoint" if norep else "retry") if hbm else "dump"
    elif row == "kill":
        strategy = "recover" if reboot else "dump"
    else:
        strategy = "dump"
    if strategy != "dump":
        return {"strategy": strategy, "states": REPAIR_STATES, "code": 0,
                "rank0": ["stop", "clean", "repair", "rollback"],
                "source": "checkpoint" if norep else "replica"}
    # rank 1's data is bad after uce/kill; without replicas its shard has no holder. After an
    # exception (comm, unknown) its data is intact and it dumps its own shard.
    possible = not norep or row in ("comm", "unknown")
    return {"strategy": "dump", "states": DUMP_STATES, "code": DUMP_CODE if possible else 1,
            "rank0": ["stop", "dump", "rename", "exit"] if possible else ["stop", "exit"]}


def run_row(row: str, features: str) -> str | None:
    """One row's job (2 ranks, rank 1's fault at step 5); what went wrong, or None."""
    exp = expected(row, features)
    layout = Layout(dp=2, replicas=1 if "no_replica" in features else 2, ranks_per_node=1,
                    hbm_repair="retry" in features, worker_reboot="recover" in features)
    # an exception strikes before the update (the state stays intact), memory inside it
    faults = {"normal": (), "comm": (Fault("comm", 1, "start", 5),),
              "unknown": (Fault("raise", 1, "start", 5),), "kill": (Fault("kill", 1, "update", 5),),
              "uce": (Fault("uce", 1, "update", 5, detail="optimizer"),)}[row]
    job = RecordingJob(Schedule(1, layout, faults, ("restart",), steps=20))
    outcome = job.run()
    problems = [f"invariant: {outcome.failure}"] if outcome.failure else []
    if job.states() != exp["states"]:
        problems.append(f"states {job.states()} != {exp['states']}")
    strategies = [e["strategy"] for e in job.of("strategy")]
    if strategies != ([exp["strategy"]] if exp["strategy"] else []):
        problems.append(f"strategies {strategies} != {exp['strategy']}")
    exits = [e["code"] for e in job.of("exit")]
    if exits != [exp["code"]] or outcome.exit_code != exp["code"]:
        problems.append(f"exit events {exits} / controller {outcome.exit_code}, "
                        f"want {exp['code']}")
    if job.callbacks(0) != exp["rank0"]:
        problems.append(f"rank 0 callbacks {job.callbacks(0)} != {exp['rank0']}")
    faults_seen = [(e["ranks"], e["kind"]) for e in job.of("fault_detected")]
    kind = {"kill": "lost"}.get(row, row)
    if row != "normal" and faults_seen[:1] != [([1], kind)]:
        problems.append(f"fault_detected {faults_seen} != rank 1 {kind}")
    if exp["strategy"] in ("retry", "load_checkpoint", "recover"):
        repair1 = [w for n, w in job.orders.get(1, []) if n == "repair"]
        if len(repair1) != 1 or repair1[0]["source"] != exp["source"]:
            problems.append(f"rank 1 repair orders {repair1}")
        elif exp["source"] == "replica" and row != "comm" and repair1[0]["receive"] != [
                {"optimizer": "dense", "shard": 0, "from": 0}]:
            problems.append(f"rank 1 should receive its shard from rank 0: {repair1[0]}")
        done = sorted(p.step for p in job.procs.values())
        if done != [20, 20]:
            problems.append(f"training did not finish on both ranks: {done}")
    return "; ".join(problems) or None


@pytest.mark.parametrize("features", COMBOS)
def test_spec6_rows(features: str) -> None:
    problems = {row: run_row(row, features) for row in ROWS}
    bad = {row: p for row, p in problems.items() if p}
    assert not bad, f"features {features}: " + " | ".join(f"{r}: {p}" for r, p in bad.items())


# -- a cascading fault (was test_cascade.py) ------------------------------------------------
def test_rank_lost_during_repair_falls_back_to_dump() -> None:
    """A second fault during a repair is a cascading fault: dump if the data is complete.
    4 ranks, 2 replicas: shard 0 on ranks 0 and 2, shard 1 on ranks 1 and 3; a UCE on rank 1
    at step 5, and rank 2 dies when the repair order reaches it."""
    job = RecordingJob(Schedule(1, Layout(dp=4, replicas=2, worker_reboot=False),
                                (Fault("uce", 1, "update", 5, detail="optimizer"),
                                 Fault("kill", 2, "repair", incident=1)),
                                ("restart",), steps=30))
    outcome = job.run()
    assert outcome.failure is None and outcome.exit_code == 75  # the dump exit code
    assert job.states() == ["INIT", "NORMAL", "ABNORMAL", "ENV_CLEAR", "REPAIR", "DUMP",
                            "EXIT", "FINAL"]
    assert [e["strategy"] for e in job.of("strategy")] == ["retry"]
    assert [(e["ranks"], e["kind"]) for e in job.of("fault_detected")] == [
        ([1], "uce"), ([2], "lost")]
    (failed,) = job.of("repair_failed")
    assert "rank 2" in failed["reason"]
    # rank 1's data is bad and rank 2 is gone, but ranks 0 and 3 hold both shards
    writers = {r: [s["shard"] for n, w in job.orders[r] if n == "dump" for s in w["shards"]]
               for r in (0, 3)}
    assert writers == {0: [0], 3: [1]}
    (exit_event,) = job.of("exit")
    assert exit_event["code"] == 75 and "saved at iteration 5" in exit_event["reason"]
    assert job.callbacks(2) == ["stop", "clean", "repair"]  # it died in the repair
    assert [job.callbacks(r)[-1] for r in (0, 1, 3)] == ["exit"] * 3


# -- controller failover (was test_failover.py's first test) --------------------------------
def test_backup_takes_charge_when_active_dies() -> None:
    """4 ranks on 2 nodes, a backup controller: the active controller alone dies at 2 s
    (virtual); the backup, silent until then, takes charge with every rank heartbeating to
    it, and the ranks go on training under it and finish normally."""
    job = RecordingJob(Schedule(1, Layout(dp=4, replicas=2, ranks_per_node=2, backup=True),
                                (), ("restart",), steps=80))
    killed = 2.0
    job.loop.at(killed, job.ctl.kill, 0)
    outcome = job.run()
    assert outcome.failure is None and outcome.exit_code == 0
    backup = [e for c, e in job.by_controller if c == 1]
    take = backup[0]  # silent until it takes charge
    assert take["event"] == "controller_takeover"
    assert take["live"] == 4 and take["dump_only"] is False and take["epoch"] == 1
    assert killed + job.config.lost_after <= take["time"] < killed + 4 * job.config.lost_after
    assert not [e for c, e in job.by_controller if c == 0 and e["time"] > killed]
    assert [e["state"] for e in backup if e["event"] == "state"] == ["NORMAL", "EXIT", "FINAL"]
    assert [e["code"] for e in backup if e["event"] == "exit"] == [0]
    assert {r: p.step for r, p in job.procs.items()} == {r: 80 for r in range(4)}
    assert not job.of("fault_detected") and not job.of("strategy")


# -- a second holder lost during a repair (was test_worker_reboot.py's
# test_kill_during_a_repair_ends_cleanly_never_hangs, a tft-run job) -------------------------
@pytest.mark.parametrize("replacement", ["restart", "late"])
def test_kill_during_a_repair_ends_cleanly_never_hangs(replacement: str) -> None:
    """DP4, 2 replicas, worker reboot: rank 1 is killed at step 7; while the job waits for
    its replacement (the strategy is decided, the clean is under way), rank 3, the other
    holder of rank 1's shard, is killed too: the data of that shard is gone, so the job ends
    with code 1 and a clear message, within the bounded virtual time, and publishes no dump."""
    job = RecordingJob(Schedule(1, Layout(dp=4, replicas=2), (
        Fault("kill", 1, "start", 7), Fault("kill", 3, "clean", incident=1)),
        (replacement,), steps=12))
    outcome = job.run()
    assert outcome.failure is None and outcome.state == "FINAL" and outcome.exit_code == 1
    assert [e["strategy"] for e in job.of("strategy")] == ["recover"]
    assert [(e["ranks"], e["kind"]) for e in job.of("fault_detected")] == [
        ([1], "lost"), ([3], "lost")]
    (exit_event,) = job.of("exit")
    assert exit_event["code"] == 1
    assert "no healthy holder for dense shard 1 at lock step 6" in exit_event["reason"]
    assert not job.checker.published and not job.of("repaired")
    assert not [r for r, orders in job.orders.items() for n, _ in orders if n == "dump"]


# -- a fault before the first update (was test_uce.py's
# test_uce_before_the_first_update_exits_with_a_clear_message, a 2-rank job, and
# test_lockstep_pause.py's test_fault_before_the_first_update_exits_with_a_clear_reason) ------
@pytest.mark.parametrize("features", ["dump", "dump,retry", "dump,retry,recover"])
@pytest.mark.parametrize(("kind", "rank", "detail"), [
    ("uce", 1, "param"), ("uce", 1, "optimizer"), ("raise", 1, ""), ("comm", 1, "")])
def test_fault_before_the_first_update_exits_with_a_clear_reason(
        features: str, kind: str, rank: int, detail: str) -> None:
    """2 ranks; a fault in step 1, before its update (every rank registered): lock step 0,
    nothing to repair or dump, whatever the features: the exit strategy, code 1."""
    layout = Layout(dp=2, replicas=2, hbm_repair="retry" in features,
                    worker_reboot="recover" in features)
    job = RecordingJob(Schedule(1, layout, (Fault(kind, rank, "allreduce", 1, detail=detail),),
                                ("restart",), steps=6))
    outcome = job.run()
    assert outcome.failure is None and outcome.exit_code == 1
    assert job.states() == ["INIT", "NORMAL", "ABNORMAL", "DUMP", "EXIT", "FINAL"]
    assert [(e["strategy"], e["lock_step"]) for e in job.of("strategy")] == [("exit", 0)]
    (exit_event,) = job.of("exit")
    assert exit_event["code"] == 1
    assert "no optimizer update completed yet (lock step 0): there is nothing to repair or " \
        "dump" in exit_event["reason"]
    assert {r: job.callbacks(r) for r in (0, 1)} == {0: ["stop", "exit"], 1: ["stop", "exit"]}
    assert not job.checker.published
