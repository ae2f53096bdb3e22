"""The processor's sans-I/O core (`control.processor.core`): exact outputs for given inputs
through its one entry point (`handle(input, now)`), on a virtual clock (no sockets, threads or
sleeps)."""

from __future__ import annotations

from typing import Any

from mindspeed_tft.control.processor.core import (
    Action,
    Advance,
    Begin,
    Call,
    Called,
    CheckHang,
    Decision,
    Done,
    Failed,
    HoldPoint,
    InHandler,
    OrderRun,
    ProcessorCore,
    Progress,
    RankState,
    Received,
    Run,
    Send,
    Step,
    TakeDecision,
    Training,
    UpdateEnd,
    UpdateStart,
    Verdict,
    Wait,
    step_of,
    verdict_of,
)
from mindspeed_tft.control.processor.watchdog import ProgressWatchdog
from mindspeed_tft.control.wire.classify import FaultKind
from mindspeed_tft.control.wire.order_types import (
    ExitOrder,
    HoldOrder,
    PauseOrder,
    ResumeOrder,
    RollbackOrder,
    StopOrder,
)
from mindspeed_tft.control.wire.results import (
    ActionResult,
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


def _action(aid: int, name: str, payload: Any, timeout: float = 60.0) -> Action:
    return Action(aid, name, payload, timeout)


def _run(core: ProcessorCore, aid: int, order: Any, now: float) -> Received:
    [out] = core.handle(_action(aid, type(order).KIND, order.to_wire()), now)
    assert isinstance(out, Run)
    return out.order


def _begin(core: ProcessorCore, received: Received, now: float,
           rejoining: bool = False) -> tuple[OrderRun, Step]:
    step = step_of(core.handle(Begin(received, rejoining), now))
    return step.run, step


def _advance(core: ProcessorCore, run: OrderRun, now: float) -> Step:
    return step_of(core.handle(Advance(run), now))


def _called(core: ProcessorCore, run: OrderRun, now: float, result: ActionResult | None = None,
            error: BaseException | None = None) -> Step:
    return step_of(core.handle(Called(run, result, error), now))


def _hold_point(core: ProcessorCore, step: int, now: float = 0.0) -> Verdict:
    return verdict_of(core.handle(HoldPoint(step), now))


def _decision(core: ProcessorCore) -> Decision | None:
    taken = core.handle(TakeDecision(), 0.0)
    assert all(isinstance(d, Decision) for d in taken) and len(taken) <= 1
    return taken[0] if taken else None  # type: ignore[return-value]


def _do(core: ProcessorCore, *events: Any, now: float = 0.0) -> None:
    for event in events:
        assert core.handle(event, now) == []


def _result(run: OrderRun, aid: int, name: str, result: Any) -> Done:
    return Done(run, Send("result", ResultMessage(aid, name, result)))


def test_a_hold_is_answered_at_once_with_where_the_rank_is_and_a_repeat_is_dropped() -> None:
    core = _core()
    _do(core, UpdateEnd(4), UpdateStart(5))
    hold = _action(1, "hold", {"incident": 1})
    assert core.handle(hold, 0.0) == [
        Send("result", ResultMessage(1, "hold", HoldResult(4, "updating")))]
    assert core.handle(hold, 0.1) == []
    assert _hold_point(core, 6) is Verdict.WAIT  # held before its next update


def test_a_hold_run_directly_is_answered_the_same() -> None:
    core = _core()
    _do(core, UpdateEnd(2))
    run, step = _begin(core, Received(4, "hold", 9.0, HoldOrder(1)), 0.0)
    assert step == _result(run, 4, "hold", HoldResult(2, "updated"))
    assert _hold_point(core, 3) is Verdict.WAIT


def test_orders_go_to_their_lanes() -> None:
    core = _core()
    outs = [core.handle(_action(i, o.KIND, o.to_wire(), 10.0), 1.0)
            for i, o in enumerate((RollbackOrder(1, 4, "retry"), ExitOrder(0, "done"),
                                   ResumeOrder(1, 4, "retry", False)), 1)]
    assert [(o.lane, o.order.name, o.order.deadline) for [o] in outs  # type: ignore[union-attr]
            ] == [("work", "rollback", 11.0), ("release", "exit", 11.0),
                  ("release", "resume", 11.0)]


def test_a_stop_lets_the_update_in_progress_end_then_waits_for_the_rank_to_park() -> None:
    core = _core()
    # updating towards 5 when the stop comes
    _do(core, Training(True), UpdateEnd(4), UpdateStart(5))
    order = StopOrder(1, 5, {0: "uce"})
    run, step = _begin(core, _run(core, 1, order, 0.0), 0.0)
    assert step == Wait(run, PARK)
    assert _hold_point(core, 5) is Verdict.PASS  # it may catch up to the lock step
    assert _hold_point(core, 6) is Verdict.STOP
    assert _advance(core, run, 1.0) == Wait(run, PARK)  # still updating
    _do(core, UpdateEnd(5))
    assert _advance(core, run, 1.2) == Call(run, order)
    assert _hold_point(core, 5) is Verdict.STOP  # the catch-up ended with the wait
    assert _called(core, run, 1.5, StopResult(connections_closed=2)) == Wait(run, 1.5 + PARK)
    report = core.handle(Failed(FaultKind.NORMAL, "ForceStop: stopped"), 1.5)
    assert report == [
        Send("report", ReportMessage("normal", "ForceStop: stopped", 5, "updated"))]
    assert _advance(core, run, 1.6) == _result(run, 1, "stop",
                                               StopResult(5, "updated", True, 2))


def test_a_stopped_rank_whose_training_thread_never_comes_back_is_reported_unparked() -> None:
    core = _core()
    _do(core, Training(True), UpdateStart(1))
    order = StopOrder(1, 0, {})
    run, step = _begin(core, _run(core, 1, order, 0.0), 0.0)
    assert step == Wait(run, PARK) and _advance(core, run, PARK) == Call(run, order)
    assert _called(core, run, PARK, StopResult()) == Wait(run, 2 * PARK)
    done = _advance(core, run, 2 * PARK)
    assert done == Done(run, Send("result", ResultMessage(1, "stop", StopResult(
        0, "updating", False))), unparked=True)


def test_a_stop_outside_the_training_function_cannot_say_whether_it_parked() -> None:
    core = _core()
    order = StopOrder(2, 0, {})
    run, step = _begin(core, _run(core, 1, order, 0.0), 0.0)
    assert step == Call(run, order)
    assert _called(core, run, 0.0, StopResult()) == _result(run, 1, "stop",
                                                            StopResult(0, "updated", None))


def test_an_error_then_a_resume_hands_the_decision_to_the_training_thread() -> None:
    core = _core()
    _do(core, UpdateEnd(7), Training(True))
    assert core.handle(Failed(FaultKind.UCE, "RuntimeError: UCE", {"target": "activation"}),
                       0.0) == [Send("report", ReportMessage(
                           "uce", "RuntimeError: UCE", 7, "updated", {"target": "activation"}))]
    _do(core, InHandler(True))
    assert _decision(core) is None
    assert core.state().unanswered is not None
    order = ResumeOrder(1, 6, "retry", False)
    run, step = _begin(core, _run(core, 9, order, 0.0), 0.0)
    assert step == Call(run, order)
    assert _called(core, run, 0.1, None) == _result(run, 9, "resume", EmptyResult())
    assert _decision(core) == Decision("resume", step=6, strategy="retry", order=order)
    assert _decision(core) is None and core.state() == RankState(7, "updated", 0, None)


def test_a_restarted_rank_is_owed_its_first_resume_before_it_waits() -> None:
    core = _core()
    order = ResumeOrder(1, 6, "recover", False)
    run, _ = _begin(core, _run(core, 1, order, 0.0), 0.0, rejoining=True)
    _called(core, run, 0.0)
    assert _decision(core) == Decision("resume", step=6, strategy="recover", order=order)
    run, _ = _begin(core, _run(core, 2, order, 0.0), 0.0, rejoining=True)  # not owed again
    _called(core, run, 0.0)
    assert _decision(core) is None


def test_an_exit_arms_the_hard_exit_before_its_callback_and_lets_the_thread_go() -> None:
    core = _core()
    order = ExitOrder(3, "dumped")
    run, step = _begin(core, _run(core, 1, order, 10.0), 10.0)
    assert step == Call(run, order, (3, 10.0 + GRACE))
    assert core.stopped and core.exit_ordered == 3 and _hold_point(core, 1) is Verdict.STOP
    assert _called(core, run, 10.5, error=RuntimeError("handler")) == Done(run, Send(
        "result", ResultMessage(1, "exit", error="RuntimeError: handler")))
    assert _decision(core) == Decision("exit", 3, reason="dumped", order=order)


def test_a_bad_order_fails_naming_the_field_and_a_bad_exit_exits_with_the_failure_code(
        ) -> None:
    core = _core()
    [run] = core.handle(_action(1, "rollback", {"incident": 1, "step": "9",
                                                "strategy": "retry",
                                                "params_damaged": []}), 0.0)
    assert isinstance(run, Run) and run.order.order is None
    order_run, step = _begin(core, run.order, 0.0)
    assert step == Done(order_run, Send("result", ResultMessage(
        1, "rollback", error="OrderError: rollback order: bad 'step': '9' (allowed: a step: "
        "an integer in [0, 2**62])")))
    [run] = core.handle(_action(2, "exit", {"code": "now"}), 0.0)
    assert isinstance(run, Run) and isinstance(run.order.order, ExitOrder)
    assert run.order.order.code == FAIL


def test_a_callback_that_returns_the_wrong_result_fails_the_order() -> None:
    core = _core()
    order = RollbackOrder(1, 4, "retry")
    run, step = _begin(core, _run(core, 1, order, 0.0), 0.0)
    assert step == Call(run, order)
    assert _called(core, run, 0.0, StopResult()) == Done(run, Send("result", ResultMessage(
        1, "rollback", error="TypeError: the rollback callback returned StopResult, not a "
        "RollbackResult")))
    run, _ = _begin(core, _run(core, 2, order, 0.0), 0.0)
    assert _called(core, run, 0.0, RollbackResult(4)) == _result(run, 2, "rollback",
                                                                 RollbackResult(4))


def test_a_pause_holds_the_rank_and_a_resume_lets_it_go_without_a_decision() -> None:
    core = _core()
    _do(core, Training(True), UpdateEnd(2))
    order = PauseOrder("operator pause")
    run, step = _begin(core, _run(core, 1, order, 0.0), 0.0)
    assert step == Call(run, order)
    assert _called(core, run, 0.0) == _result(run, 1, "pause", PauseResult(2, "updated"))
    assert _hold_point(core, 3) is Verdict.WAIT
    resume = ResumeOrder(0, None, "none", True)
    run, _ = _begin(core, _run(core, 2, resume, 0.0), 0.0)
    assert _called(core, run, 0.0) == _result(run, 2, "resume", EmptyResult())
    assert _hold_point(core, 3) is Verdict.PASS and _decision(core) is None


def test_an_error_after_the_stop_is_reported_as_normal() -> None:
    core = _core()
    assert core.reported_kind(FaultKind.COMM) is FaultKind.COMM
    run, _ = _begin(core, _run(core, 1, StopOrder(1, 0, {}), 0.0), 0.0)
    assert core.reported_kind(FaultKind.COMM) is FaultKind.NORMAL
    _called(core, run, 0.0, StopResult())
    resume = ResumeOrder(1, 0, "retry", False)
    run, _ = _begin(core, _run(core, 2, resume, 0.0), 0.0)
    _called(core, run, 0.0)
    assert core.reported_kind(FaultKind.UCE) is FaultKind.UCE


def _hang(step: int, idle: float, limit: float) -> list[Send]:
    return [Send("report", ReportMessage(
        "hang", f"rank 3: no training progress for {idle:.1f}s (timeout {limit:.1f}s) after "
        f"step {step}", 0, "updated"))]


def test_the_hang_watchdog_runs_on_the_callers_clock() -> None:
    core = _core()
    assert core.handle(CheckHang(), 1000.0) == []  # not armed before the first step
    _do(core, Progress(1), now=100.0)
    assert core.handle(CheckHang(), 129.0) == []
    assert core.handle(CheckHang(), 131.0) == _hang(1, 31.0, 30.0)
    assert core.handle(CheckHang(), 200.0) == []  # reported once


def test_a_resume_rearms_the_hang_watchdog_on_the_callers_clock() -> None:
    """The watchdog watches again from the resume's `now`, not from the process's monotonic
    clock (it did: on a simulator's virtual clock a resumed rank then looked hung at once,
    or never)."""
    core = _core()
    t = 1e9  # far from any monotonic clock
    _do(core, Training(True))
    _do(core, Progress(1), now=t)
    _do(core, Progress(2), now=t + 1.0)
    run, _ = _begin(core, _run(core, 1, PauseOrder("operator pause"), t + 2.0), t + 2.0)
    _called(core, run, t + 2.0)
    resume = ResumeOrder(0, None, "none", True)
    run, _ = _begin(core, _run(core, 2, resume, t + 50.0), t + 50.0)
    _called(core, run, t + 50.0)
    assert core.handle(CheckHang(), t + 79.0) == []  # the initial timeout (30 s) from the resume
    assert core.handle(CheckHang(), t + 81.0) == _hang(2, 31.0, 30.0)


def test_a_rank_held_at_its_hold_point_is_not_hung_and_is_watched_again_once_let_go() -> None:
    """Held on purpose (a hold, then the pass once the hold ends): the watchdog pauses while
    the training thread waits and watches again from the pass, with the initial timeout."""
    core = _core()
    _do(core, Training(True))
    _do(core, Progress(1), now=0.0)
    _do(core, Progress(2), now=1.0)
    core.handle(_action(1, "hold", {"incident": 1}), 2.0)
    assert _hold_point(core, 3, 2.0) is Verdict.WAIT
    assert core.handle(CheckHang(), 500.0) == []  # waited long: not a hang
    assert _hold_point(core, 3, 500.0) is Verdict.WAIT
    resume = ResumeOrder(0, None, "none", True)
    run, _ = _begin(core, _run(core, 2, resume, 600.0), 600.0)
    _called(core, run, 600.0)
    assert _hold_point(core, 3, 610.0) is Verdict.PASS
    assert core.handle(CheckHang(), 639.0) == []
    assert core.handle(CheckHang(), 641.0) == _hang(2, 31.0, 30.0)
