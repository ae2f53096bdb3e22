"""The lock step is exact even where the heartbeats are stale; an operator pause holds every
rank. (Lock step 0, no update ever completed, exits cleanly: test_sim_protocol.py.)

The pause test also runs the controller the way rank 0 hosts it under plain torchrun: a
background thread of another process (here, the test's), with the ranks in their own
processes.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

from mindspeed_tft.control import ControlConfig, Controller
from mindspeed_tft.control.controller.states import State
from mindspeed_tft.control.processor.core import Run, Send
from mindspeed_tft.control.processor.gate import Gate
from mindspeed_tft.control.wire.classify import ForceStop
from mindspeed_tft.control.wire.messages import ActionMessage
from mindspeed_tft.control.wire.order_types import ExitOrder, ResumeOrder, StopOrder, TypedOrder
from mindspeed_tft.control.wire.results import HoldResult, ResultMessage, StopResult
from tests.control.ctl_harness import Job, wait_for


def test_the_stop_lets_a_lagging_replica_catch_up_to_where_its_peers_are(tmp_path: Path) -> None:
    """The stop's lock step comes from every rank's answer, not from the heartbeats.

    4 ranks, 2 replicas: ranks 1 and 3 hold shard 1. After iteration 8's all-reduce rank 3
    lags (1.2 s, as a rank descheduled on a busy host) and rank 1 fails 0.3 s later with a
    UCE, before its update; ranks 0 and 2 complete update 8 meanwhile. Heartbeats every 10 s
    have not told the controller any of this. The lock step is 8; rank 3, the only healthy
    holder of shard 1, must be let through update 8. Had the stop carried the lock step the
    table knew (rank 1's report: 7), rank 3 would have been stopped at 7 and shard 1 would
    have no holder at 8: no repair, no dump, exit 1."""
    job = Job(tmp_path, 4, features="dump,retry", interval=10.0, misses=10)
    try:
        job.start_controller()
        lags = {1: "8=0.3", 3: "8=1.2"}
        for r in range(4):
            job.start_worker(r, steps=12, **({"lag": lags[r]} if r in lags else {}),
                             **({"fault": "uce@8:update"} if r == 1 else {}))
        for r in range(4):
            assert job.workers[r].wait(60) == 0, f"rank {r}: {job.records(r)[-3:]}"
        (strategy,) = [e for e in job.events() if e["event"] == "strategy"]
        assert (strategy["strategy"], strategy["lock_step"]) == ("retry", 8)
        stops = [r["payload"] for r in job.records(3)
                 if r["event"] == "callback" and r["name"] == "stop"]
        assert [p["lock_step"] for p in stops] == [8]
        actions = [e["action"] for e in job.events() if e["event"] == "action"]
        assert actions[:2] == ["hold", "stop"]
        rollbacks = [r["payload"]["step"] for r in job.records(3)
                     if r["event"] == "callback" and r["name"] == "rollback"]
        assert rollbacks == [8]
        last = [job.records(r)[-1] for r in range(4)]
        assert [(rec["event"], rec["iteration"]) for rec in last] == [("done", 12)] * 4
    finally:
        job.cleanup()


def coll_step(job: Job, rank: int) -> int:
    try:
        return int((job.coll / str(rank)).read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_operator_pause_holds_ranks_before_their_update(tmp_path: Path) -> None:
    config = ControlConfig(port=0, heartbeat_interval=0.2, heartbeat_misses=5,
                           action_time_limit=5, log_path=str(tmp_path / "logs"))
    ctrl = Controller(2, config)
    ctrl.start()
    job = Job(tmp_path, 2, interval=0.2, misses=5)
    job.ports.append(ctrl.port)
    try:
        for r in (0, 1):
            job.start_worker(r, steps=100000, step_time=0.01, hang_floor=0.3)
        wait_for(lambda: ctrl.state is State.NORMAL, 10, what="NORMAL")
        wait_for(lambda: coll_step(job, 0) > 5, 10, what="training steps")
        ctrl.pause()
        wait_for(lambda: ctrl.state is State.PAUSE, 5, what="PAUSE")
        time.sleep(0.3)
        held = (coll_step(job, 0), coll_step(job, 1))
        time.sleep(1.0)  # > 3x the hang floor: the held ranks must not be reported hung
        assert (coll_step(job, 0), coll_step(job, 1)) == held
        ctrl.resume()
        wait_for(lambda: coll_step(job, 0) > held[0] + 5, 10, what="training resumed")
        assert ctrl.sm.history == [State.INIT, State.NORMAL, State.PAUSE, State.NORMAL]
        snap = ctrl.snapshot()
        assert snap["incidents"] == 0 and snap["incident"] is None
        assert all(row["health"] == "alive" for row in snap["ranks"].values())
    finally:
        job.cleanup()
        ctrl.stop()


def test_the_hold_answers_at_once_and_holds_the_next_update() -> None:
    """`hold` waits for nothing (a rank hung inside its update must not delay the answer): a
    rank inside update 5 answers `updating` at 4 at once; after its update it is held before
    update 6, until the stop lets it through up to the lock step (6) and stops it after."""
    gate = Gate(0, ControlConfig(port=0, park_timeout=5, action_time_limit=30))
    gate.mark_training(True)
    gate.report_update_end(4)
    gate.before_update(5)  # the training thread is inside update 5
    t0 = time.monotonic()
    assert gate.on_action(ActionMessage(1, "hold", 30.0, {"incident": 1}), t0) == [
        Send("result", ResultMessage(1, "hold", HoldResult(4, "updating")))]
    assert time.monotonic() - t0 < 5  # it answered: it did not wait out the park timeout
    gate.report_update_end(5)
    outcomes: queue.Queue[str] = queue.Queue()

    def train() -> None:  # the training thread's next updates, and its fault handler
        for step in (6, 7):
            try:
                gate.before_update(step, timeout=10)
            except ForceStop:
                outcomes.put(f"stopped before {step}")
                outcomes.put(gate.wait_decision(timeout=10).action)
                return
            outcomes.put(f"update {step}")
            gate.report_update_end(step)

    thread = threading.Thread(target=train)
    thread.start()
    time.sleep(0.3)
    assert outcomes.empty()  # held before update 6
    # lock step 6: update 6 may run, then it is stopped
    sent = _run(gate, 2, StopOrder(1, 6, {}), lambda order: StopResult())
    assert sent == Send("result", ResultMessage(2, "stop", StopResult(6, "updated", True)))
    _run(gate, 3, ExitOrder(1), lambda order: None)
    thread.join(5)
    assert [outcomes.get_nowait() for _ in range(3)] == ["update 6", "stopped before 7", "exit"]


def test_a_resume_owed_to_a_joining_process_waits_for_its_training_thread() -> None:
    """A restarted process joins a recovery whose repair needs nothing of its training thread:
    the resume can come before that thread waits for it. Owed, it is kept for the thread;
    a resume that nothing held is not (the thread would otherwise take a stale one later)."""
    cfg = ControlConfig(port=0, park_timeout=5, action_time_limit=30)
    resume = ResumeOrder(1, 4, "recover", False)
    gate = Gate(0, cfg)
    gate.core.rejoining = True
    _run(gate, 1, resume, lambda order: None)
    decision = gate.wait_decision(timeout=0.5)
    assert (decision.action, decision.step, decision.strategy) == ("resume", 4, "recover")
    gate = Gate(0, cfg)
    _run(gate, 1, resume, lambda order: None)
    assert gate.wait_decision(timeout=0.3).action == "exit"  # nothing was held: not kept


def _run(gate: Gate, aid: int, order: TypedOrder, call: Any) -> Send:
    """Receive `order` and run it on this thread (as an order lane would)."""
    [run] = gate.receive(aid, type(order).KIND, order.to_wire(), 1e18)
    assert isinstance(run, Run)
    return gate.run_order(run.order, call, lambda code, deadline: None)
