"""The processor's sans-I/O core (`control.processor.core`): exact outputs for given inputs,
on a virtual clock (no sockets, threads or sleeps)."""

from __future__ import annotations

from typing import Any

from mindspeed_tft.control.processor.core import (
    Call,
    Decision,
    Done,
    ProcessorCore,
    Received,
    Run,
    Send,
    Verdict,
    Wait,
)
from mindspeed_tft.control.processor.watchdog import ProgressWatchdog
from mindspeed_tft.control.wire.classify import FaultKind
from mindspeed_tft.control.wire.messages import ActionMessage
from mindspeed_tft.control.wire.order_types import (
    ExitOrder,
    HoldOrder,
    PauseOrder,
    ResumeOrder,
    RollbackOrder,
    StopOrder,
)
from mindspeed_tft.control.wire.results import (
    EmptyResult,
    HoldResult,
    PauseResult,
    ReportMessage,
    ResultMessage,
    RollbackResult,
    StopResult,
)

PARK = 2.0
GRACE = 5.0
FAIL = 70


def _core() -> ProcessorCore:
    return ProcessorCore(3, park_wait=PARK, failure_exit_code=FAIL, exit_grace=GRACE,
                         watchdog=ProgressWatchdog(10.0, 3.0, 30.0))


def _action(aid: int, name: str, payload: Any, timeout: float = 60.0) -> ActionMessage:
    return ActionMessage(aid, name, timeout, payload)


def _run(core: ProcessorCore, aid: int, order: Any, now: float) -> Received:
    [out] = core.on_action(_action(aid, type(order).KIND, order.to_wire()), now)
    assert isinstance(out, Run)
    return out.order


def _result(aid: int, name: str, result: Any) -> Done:
    return Done(Send("result", ResultMessage(aid, name, result)))


def test_a_hold_is_answered_at_once_with_where_the_rank_is_and_a_repeat_is_dropped() -> None:
    core = _core()
    core.update_end(4)
    core.update_start(5)
    hold = _action(1, "hold", {"incident": 1})
    assert core.on_action(hold, 0.0) == [
        Send("result", ResultMessage(1, "hold", HoldResult(4, "updating")))]
    assert core.on_action(hold, 0.1) == []
    assert core.may_update(6) is Verdict.WAIT  # held before its next update


def test_a_hold_run_directly_is_answered_the_same() -> None:
    core = _core()
    core.update_end(2)
    _, step = core.begin(Received(4, "hold", 9.0, HoldOrder(1)), 0.0)
    assert step == _result(4, "hold", HoldResult(2, "updated"))
    assert core.may_update(3) is Verdict.WAIT


def test_orders_go_to_their_lanes() -> None:
    core = _core()
    outs = [core.on_action(_action(i, o.KIND, o.to_wire(), 10.0), 1.0)
            for i, o in enumerate((RollbackOrder(1, 4, "retry"), ExitOrder(0, "done"),
                                   ResumeOrder(1, 4, "retry", False)), 1)]
    assert [(o.lane, o.order.name, o.order.deadline) for [o] in outs  # type: ignore[union-attr]
            ] == [("work", "rollback", 11.0), ("release", "exit", 11.0),
                  ("release", "resume", 11.0)]


def test_a_stop_lets_the_update_in_progress_end_then_waits_for_the_rank_to_park() -> None:
    core = _core()
    core.set_training(True)
    core.update_end(4)
    core.update_start(5)  # updating towards 5 when the stop comes
    order = StopOrder(1, 5, {0: "uce"})
    run, step = core.begin(_run(core, 1, order, 0.0), 0.0)
    assert step == Wait(PARK)
    assert core.may_update(5) is Verdict.PASS  # it may catch up to the lock step
    assert core.may_update(6) is Verdict.STOP
    assert core.advance(run, 1.0) == Wait(PARK)  # still updating
    core.update_end(5)
    assert core.advance(run, 1.2) == Call(order)
    assert core.may_update(5) is Verdict.STOP  # the catch-up ended with the wait
    assert core.called(run, 1.5, StopResult(connections_closed=2)) == Wait(1.5 + PARK)
    report = core.error(FaultKind.NORMAL, "ForceStop: stopped")
    assert report == Send("report", ReportMessage("normal", "ForceStop: stopped", 5, "updated"))
    assert core.advance(run, 1.6) == _result(1, "stop", StopResult(5, "updated", True, 2))


def test_a_stopped_rank_whose_training_thread_never_comes_back_is_reported_unparked() -> None:
    core = _core()
    core.set_training(True)
    core.update_start(1)
    order = StopOrder(1, 0, {})
    run, step = core.begin(_run(core, 1, order, 0.0), 0.0)
    assert step == Wait(PARK) and core.advance(run, PARK) == Call(order)
    assert core.called(run, PARK, StopResult()) == Wait(2 * PARK)
    done = core.advance(run, 2 * PARK)
    assert done == Done(Send("result", ResultMessage(1, "stop", StopResult(0, "updating",
                                                                           False))),
                        unparked=True)


def test_a_stop_outside_the_training_function_cannot_say_whether_it_parked() -> None:
    core = _core()
    order = StopOrder(2, 0, {})
    run, step = core.begin(_run(core, 1, order, 0.0), 0.0)
    assert step == Call(order)
    assert core.called(run, 0.0, StopResult()) == _result(1, "stop", StopResult(0, "updated",
                                                                                None))


def test_an_error_then_a_resume_hands_the_decision_to_the_training_thread() -> None:
    core = _core()
    core.update_end(7)
    core.set_training(True)
    assert core.error(FaultKind.UCE, "RuntimeError: UCE", {"target": "activation"}) == Send(
        "report", ReportMessage("uce", "RuntimeError: UCE", 7, "updated",
                                {"target": "activation"}))
    core.enter_handler(True)
    assert core.take_decision() is None
    assert core.unanswered_report() is not None
    order = ResumeOrder(1, 6, "retry", False)
    run, step = core.begin(_run(core, 9, order, 0.0), 0.0)
    assert step == Call(order)
    assert core.called(run, 0.1, None) == _result(9, "resume", EmptyResult())
    assert core.take_decision() == Decision("resume", step=6, strategy="retry",
                                            order=order)
    assert core.take_decision() is None and core.unanswered_report() is None


def test_a_restarted_rank_is_owed_its_first_resume_before_it_waits() -> None:
    core = _core()
    core.rejoining = True
    order = ResumeOrder(1, 6, "recover", False)
    run, _ = core.begin(_run(core, 1, order, 0.0), 0.0)
    core.called(run, 0.0)
    assert core.take_decision() == Decision("resume", step=6, strategy="recover",
                                            order=order)
    run, _ = core.begin(_run(core, 2, order, 0.0), 0.0)  # a later one is not owed
    core.called(run, 0.0)
    assert core.take_decision() is None


def test_an_exit_arms_the_hard_exit_before_its_callback_and_lets_the_thread_go() -> None:
    core = _core()
    order = ExitOrder(3, "dumped")
    run, step = core.begin(_run(core, 1, order, 10.0), 10.0)
    assert step == Call(order, (3, 10.0 + GRACE))
    assert core.stopped and core.exit_ordered == 3 and core.may_update(1) is Verdict.STOP
    assert core.called(run, 10.5, error=RuntimeError("handler")) == Done(Send(
        "result", ResultMessage(1, "exit", error="RuntimeError: handler")))
    assert core.take_decision() == Decision("exit", 3, reason="dumped",
                                            order=order)


def test_a_bad_order_fails_naming_the_field_and_a_bad_exit_exits_with_the_failure_code(
        ) -> None:
    core = _core()
    [run] = core.on_action(_action(1, "rollback", {"incident": 1, "step": "9",
                                                   "strategy": "retry",
                                                   "params_damaged": []}), 0.0)
    assert isinstance(run, Run) and run.order.order is None
    _, step = core.begin(run.order, 0.0)
    assert step == Done(Send("result", ResultMessage(
        1, "rollback", error="OrderError: rollback order: bad 'step': '9' (allowed: a step: "
        "an integer in [0, 2**62])")))
    [run] = core.on_action(_action(2, "exit", {"code": "now"}), 0.0)
    assert isinstance(run, Run) and isinstance(run.order.order, ExitOrder)
    assert run.order.order.code == FAIL


def test_a_callback_that_returns_the_wrong_result_fails_the_order() -> None:
    core = _core()
    order = RollbackOrder(1, 4, "retry")
    run, step = core.begin(_run(core, 1, order, 0.0), 0.0)
    assert step == Call(order)
    assert core.called(run, 0.0, StopResult()) == Done(Send("result", ResultMessage(
        1, "rollback", error="TypeError: the rollback callback returned StopResult, not a "
        "RollbackResult")))
    run, _ = core.begin(_run(core, 2, order, 0.0), 0.0)
    assert core.called(run, 0.0, RollbackResult(4)) == _result(2, "rollback",
                                                               RollbackResult(4))


def test_a_pause_holds_the_rank_and_a_resume_lets_it_go_without_a_decision() -> None:
    core = _core()
    core.set_training(True)
    core.update_end(2)
    order = PauseOrder("operator pause")
    run, step = core.begin(_run(core, 1, order, 0.0), 0.0)
    assert step == Call(order)
    assert core.called(run, 0.0) == _result(1, "pause", PauseResult(2, "updated"))
    assert core.may_update(3) is Verdict.WAIT
    resume = ResumeOrder(0, None, "none", True)
    run, _ = core.begin(_run(core, 2, resume, 0.0), 0.0)
    assert core.called(run, 0.0) == _result(2, "resume", EmptyResult())
    assert core.may_update(3) is Verdict.PASS and core.take_decision() is None


def test_an_error_after_the_stop_is_reported_as_normal() -> None:
    core = _core()
    assert core.reported_kind(FaultKind.COMM) is FaultKind.COMM
    run, _ = core.begin(_run(core, 1, StopOrder(1, 0, {}), 0.0), 0.0)
    assert core.reported_kind(FaultKind.COMM) is FaultKind.NORMAL
    core.called(run, 0.0, StopResult())
    resume = ResumeOrder(1, 0, "retry", False)
    run, _ = core.begin(_run(core, 2, resume, 0.0), 0.0)
    core.called(run, 0.0)
    assert core.reported_kind(FaultKind.UCE) is FaultKind.UCE


def test_the_hang_watchdog_runs_on_the_callers_clock() -> None:
    core = _core()
    assert core.hang(1000.0) is None  # not armed before the first step
    core.progress(1, 100.0)
    assert core.hang(129.0) is None
    assert core.hang(131.0) == (31.0, 30.0)
    assert core.hang(200.0) is None  # reported once


def test_a_resume_rearms_the_hang_watchdog_on_the_callers_clock() -> None:
    """The watchdog watches again from the resume's `now`, not from the process's monotonic
    clock (it did: on a simulator's virtual clock a resumed rank then looked hung at once,
    or never)."""
    core = _core()
    t = 1e9  # far from any monotonic clock
    core.set_training(True)
    core.progress(1, t)
    core.progress(2, t + 1.0)
    run, _ = core.begin(_run(core, 1, PauseOrder("operator pause"), t + 2.0), t + 2.0)
    core.called(run, t + 2.0)
    resume = ResumeOrder(0, None, "none", True)
    run, _ = core.begin(_run(core, 2, resume, t + 50.0), t + 50.0)
    core.called(run, t + 50.0)
    assert core.hang(t + 79.0) is None  # the initial timeout (30 s) from the resume
    assert core.hang(t + 81.0) == (31.0, 30.0)
