"""The processor's protocol side without I/O: what a rank answers and reports.

`ProcessorCore` is a state machine over one rank's training state (its step, whether its
data is `updated` or `updating`, whether it is held, stopped, parked in the fault handler,
what it reported) and the orders it is running. It takes inputs and returns outputs; it has
no socket, thread, lock or clock (every time is an argument `now`, in seconds of any
monotonic clock), so the same code runs inside a training process (`processor.Processor`,
its shell of sockets, threads and the real clock, calls it under one lock) and inside a
simulator with a virtual clock.

One entry point: `handle(input, now) -> outputs`, the inputs and outputs typed values:
- from the controller: `Action` (an `action` message) returns what to do with it: a `Send`
  of the answer (a hold is answered at once; a repeated id is dropped) or a `Run` of the
  order on one of two lanes (`lanes`); `OwnOrder` (the processor's own exit) the same;
- the run of an order, step by step: `Begin` (when its lane starts it), then `Advance`
  while it waits and `Called` once its callback ran; each returns the next step: `Call`
  (run the host's callback: `callbacks.run_callback`), `Wait` (until the training state
  changes or the deadline passes), or `Done` (the `result` message to send, and for an
  exit the deadline of the hard exit);
- the training thread: `HoldPoint` (returns a `Verdict`: pass, wait, or stop), `UpdateStart`,
  `UpdateEnd`, `Progress`, `Training`, `Failed` (returns the `report` to send),
  `InHandler`, `TakeDecision` (returns the `Decision`, if any);
- the shell's loop: `CheckHang` (returns the `hang` report once the watchdog fires; its
  decision part, `watchdog.ProgressWatchdog`, is the core's own).
What the link tells its controller about the rank it reads from `state()` (no input).

The order flows (what the processor did before the core existed, unchanged):
- hold: held before the next update, answered at once with where the rank is;
- stop: held and stopped (a rank behind the lock step may catch up to it); waits, bounded by
  `park_wait`, until an update in progress ended (or the rank caught up, or parked); the
  callback; then waits, bounded again, until the training thread parked; the result carries
  `step`, `status` and `parked` (True: came back, False: hung, None: no training function);
- pause: held, the same bounded wait, the callback; the result says where the rank is;
- resume: the callback, then the stop or pause is cleared and a held training thread gets
  the decision (a restarted rank's first resume is owed to it even before it waits);
- exit: the rank halts, the hard exit is armed, the callback, then the training thread gets
  the exit decision (even when the callback failed);
- every other order: the callback, its result.
An order whose payload does not match its type fails without running (its error names the
field), except an exit, which is obeyed with the failure exit code.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ..wire.classify import FaultKind
from ..wire.order_types import (
    ExitOrder,
    HoldOrder,
    OrderError,
    PauseOrder,
    ResumeOrder,
    StopOrder,
    TypedOrder,
    from_wire,
)
from ..wire.results import (
    RESULT_TYPES,
    ActionResult,
    EmptyResult,
    HoldResult,
    PauseResult,
    ReportMessage,
    ResultMessage,
    StopResult,
)
from .lanes import Received, lane_for
from .watchdog import ProgressWatchdog

log = logging.getLogger("mindspeed_tft.control.processor")

#: how many order ids a rank remembers to drop a repeated order
SEEN_ORDERS = 256


@dataclass(frozen=True)
class Decision:
    """What the controller decided for a rank waiting after an error."""

    action: str                 # "resume" (re-enter training) or "exit"
    code: int = 0               # exit code (exit)
    step: int | None = None     # step to resume at (resume)
    strategy: str = ""
    reason: str = ""
    #: the order that decided (None: the rank decided itself, e.g. no decision in time)
    order: ResumeOrder | ExitOrder | None = None


# -- inputs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """An `action` message from the controller (its payload checked by `protocol`)."""

    id: int
    name: str
    wire: Any           # the order's payload, as sent
    timeout: float      # its time limit in seconds from its arrival



@dataclass(frozen=True)
class OwnOrder:
    """An order of the processor's own (a lost controller's exit): not checked for repeats."""

    id: int
    name: str
    wire: Any
    deadline: float


@dataclass(frozen=True)
class Begin:
    """Its lane starts `order`. `rejoining`: the process is a restarted one joining a
    recovery (its registration's answer said so)."""

    order: Received
    rejoining: bool = False


@dataclass(frozen=True)
class Advance:
    """A waiting order (`Wait`) looks again: the training state changed or its deadline
    passed."""

    run: OrderRun


@dataclass(frozen=True)
class Called:
    """The host's callback for the order returned `result` or raised `error`."""

    run: OrderRun
    result: ActionResult | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class HoldPoint:
    """The training thread is at the hold point before update `step` (again after a wait)."""

    step: int


@dataclass(frozen=True)
class UpdateStart:
    """The update producing `step` begins: the data is Updating."""

    step: int


@dataclass(frozen=True)
class UpdateEnd:
    """Update `step` completed: the data is Updated at `step`."""

    step: int


@dataclass(frozen=True)
class Progress:
    """The training thread completed `step` (the first one arms the hang watchdog)."""

    step: int


@dataclass(frozen=True)
class Training:
    """Whether the training thread is inside the training function."""

    active: bool


@dataclass(frozen=True)
class Failed:
    """The training thread failed with `kind` (as it is to be reported: `reported_kind`)."""

    kind: FaultKind
    message: str
    detail: dict[str, Any] | None = None


@dataclass(frozen=True)
class InHandler:
    """The training thread waits for a decision in the fault handler (or left it)."""

    inside: bool


@dataclass(frozen=True)
class TakeDecision:
    """The waiting training thread asks for its decision (a resume is consumed)."""


@dataclass(frozen=True)
class CheckHang:
    """The shell's loop asks whether the training thread is hung (reported once)."""


Input = (Action | OwnOrder | Begin | Advance | Called | HoldPoint | UpdateStart | UpdateEnd
         | Progress | Training | Failed | InHandler | TakeDecision | CheckHang)


# -- outputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """A message to send to the controller: `mtype` (`protocol.MsgType`) and its payload."""

    mtype: str
    message: ResultMessage | ReportMessage


@dataclass(frozen=True)
class Run:
    """Queue `order` on lane `lane` ("work" or "release", `lanes`)."""

    order: Received
    lane: str


@dataclass(frozen=True)
class Call:
    """Run the host's callback for the order (`callbacks.run_callback`), then `Called`.
    `hard_exit`: an exit order's (code, deadline): if the process still lives then (a hung
    training thread, a stuck callback), the shell ends it."""

    run: OrderRun
    order: TypedOrder
    hard_exit: tuple[int, float] | None = None


@dataclass(frozen=True)
class Wait:
    """Wait until the training state changes or `deadline` passes, then `Advance`."""

    run: OrderRun
    deadline: float


@dataclass(frozen=True)
class Done:
    """The order ended: send `result`."""

    run: OrderRun
    result: Send
    #: the training thread did not come back when stopped (the shell logs where it is)
    unparked: bool = False


Step = Call | Wait | Done


class Verdict(Enum):
    """What the training thread does at a hold point (`HoldPoint`)."""

    PASS = "pass"
    WAIT = "wait"
    STOP = "stop"


Output = Send | Run | Call | Wait | Done | Verdict | Decision


@dataclass(frozen=True)
class RankState:
    """What the link tells a controller about the rank: step, data status, progress, and
    the error report no decision answered yet (a new controller never saw it)."""

    step: int
    status: str
    progress: int
    unanswered: ReportMessage | None = None


class Phase(Enum):
    START = "start"
    HOLD_WAIT = "hold_wait"       # stop, pause: an update in progress ends
    CALLBACK = "callback"         # the host's callback runs
    PARK_WAIT = "park_wait"       # stop: the training thread parks
    DONE = "done"


@dataclass(eq=False)
class OrderRun:
    """One order being run: where it is in its flow."""

    received: Received
    phase: Phase = Phase.START
    deadline: float = 0.0
    held: HoldResult | None = None
    result: ActionResult | None = None


class ProcessorCore:
    """The protocol state of one rank (see the module docstring)."""

    def __init__(self, rank: int, *, park_wait: float, failure_exit_code: int,
                 exit_grace: float, watchdog: ProgressWatchdog) -> None:
        self.rank = rank
        self.park_wait = park_wait
        self.failure_exit_code = failure_exit_code
        self.exit_grace = exit_grace
        #: the hang watchdog's decision part (fed and asked only through `handle`)
        self.watchdog = watchdog
        self.watching = False
        # the training state
        self.step = 0
        self.status = "updated"
        self.updating_step: int | None = None
        self.progress_step = 0
        self.stopped = False
        self.paused = False
        self.in_handler = False
        self.training = False
        #: the training thread waits at a hold point (the watchdog is paused meanwhile)
        self.held = False
        self.catch_up: int | None = None
        self.pending: Decision | None = None
        self.last_report: ReportMessage | None = None
        # the orders
        self.seen: deque[int] = deque(maxlen=SEEN_ORDERS)
        #: the code of the exit ordered (None: none yet)
        self.exit_ordered: int | None = None
        #: a restarted process joining a recovery (the registration said so)
        self.rejoining = False
        #: whether the resume that ends the rejoin came yet
        self.join_resumed = False

    # -- the entry point --------------------------------------------------------------------
    def handle(self, event: Input, now: float) -> list[Output]:
        """The one entry point: an input at `now` (seconds of any monotonic clock); the
        outputs, in order. (One method per kind of input, `_INPUTS`.)"""
        return _INPUTS[type(event)](self, event, now)

    # orders
    def _on_action(self, event: Action, now: float) -> list[Output]:
        if event.id in self.seen:
            return []
        self.seen.append(event.id)
        return [self._receive(event.id, event.name, event.wire, now + event.timeout)]

    def _on_own_order(self, event: OwnOrder, now: float) -> list[Output]:
        return [self._receive(event.id, event.name, event.wire, event.deadline)]

    def _on_begin(self, event: Begin, now: float) -> list[Output]:
        self.rejoining = event.rejoining
        return [self._begin(event.order, now)]

    def _on_advance(self, event: Advance, now: float) -> list[Output]:
        return [self._advance(event.run, now)]

    def _on_called(self, event: Called, now: float) -> list[Output]:
        return [self._called(event.run, now, event.result, event.error)]

    # the training thread, and the shell's loop
    def _on_hold_point(self, event: HoldPoint, now: float) -> list[Output]:
        return [self._hold_point(event.step, now)]

    def _on_update_start(self, event: UpdateStart, now: float) -> list[Output]:
        self.status, self.updating_step = "updating", event.step
        return []

    def _on_update_end(self, event: UpdateEnd, now: float) -> list[Output]:
        self.step, self.status, self.updating_step = event.step, "updated", None
        return []

    def _on_progress(self, event: Progress, now: float) -> list[Output]:
        self._progress(event.step, now)
        return []

    def _on_training(self, event: Training, now: float) -> list[Output]:
        self.training = event.active
        return []

    def _on_failed(self, event: Failed, now: float) -> list[Output]:
        return [self._error(event)]

    def _on_in_handler(self, event: InHandler, now: float) -> list[Output]:
        self.in_handler = event.inside
        return []

    def _on_take_decision(self, event: TakeDecision, now: float) -> list[Output]:
        decision = self._take_decision()
        return [] if decision is None else [decision]

    def _on_check_hang(self, event: CheckHang, now: float) -> list[Output]:
        return self._check_hang(now)

    # -- what the link says about the rank (reads) ---------------------------------------
    def state(self) -> RankState:
        """Step, data status, progress and the unanswered error report."""
        return RankState(self.step, self.status, self.progress_step,
                         self.last_report if self.pending is None else None)

    @property
    def parked(self) -> bool:
        return self.in_handler or self.last_report is not None

    def reported_kind(self, kind: FaultKind) -> FaultKind:
        """What a failure of the training thread (classified `kind`) is reported as: once
        the controller stopped the rank, an error (an aborted communicator, a ForceStop) is
        a consequence of the stop, reported as normal; a UCE never is (the stop damages no
        memory: the repair must know which, found by the simulator's oracle:
        tft-sim --seed 1983 --world 8)."""
        return FaultKind.NORMAL if self.stopped and kind is not FaultKind.UCE else kind

    # -- orders from the controller ---------------------------------------------------------
    def _receive(self, aid: int, name: str, wire: Any, deadline: float) -> Send | Run:
        """An order to run (from the controller, or the processor's own exit)."""
        try:
            received = Received(aid, name, deadline, from_wire(name, wire))
        except OrderError as e:
            if name != "exit":
                received = Received(aid, name, deadline, None, f"OrderError: {e}")
            else:
                log.error("rank %d: %s; exiting with the failure code", self.rank, e)
                received = Received(aid, name, deadline, ExitOrder(
                    self.failure_exit_code, f"a bad exit order ({e})"))
        if isinstance(received.order, HoldOrder):
            return self._result(OrderRun(received, Phase.DONE), self._hold()).result
        return Run(received, lane_for(name))

    def _hold(self) -> HoldResult:
        """The first round of a stop: hold the rank before its next update and say at once
        where it is. Nothing is waited for (a rank hung inside its update answers too): a
        rank `updated` at s stays there, one `updating` at s ends its update at s + 1 (the
        controller counts it so) until the stop lets it catch up to the lock step."""
        self.paused = True
        return HoldResult(self.step, self.status)

    def _begin(self, received: Received, now: float) -> Step:
        """Start running an order (on its lane); its first step."""
        run = OrderRun(received)
        order = received.order
        if order is None:
            log.error("rank %d: %s", self.rank, received.error)
            return self._finish(run, error=received.error)
        if isinstance(order, HoldOrder):  # (`_receive` answers it at once)
            run.phase = Phase.DONE
            return self._result(run, self._hold())
        if isinstance(order, StopOrder):
            self.stopped, self.catch_up, self.paused = True, order.lock_step, False
            return self._hold_wait(run, now)
        if isinstance(order, PauseOrder):
            # the whole job is held: a rank blocked in a collective behind a held peer
            # makes no progress either, and is not hung (`resume` watches again)
            self.watchdog.pause()
            self.paused = True
            return self._hold_wait(run, now)
        if isinstance(order, ExitOrder):
            if self.exit_ordered is None:
                self.exit_ordered = order.code
            log.warning("rank %d ordered to exit with code %d: %s", self.rank, order.code,
                        order.reason)
            self.watchdog.pause()  # no further update, no hang watching
            self.stopped = True
            run.phase = Phase.CALLBACK
            return Call(run, order, (order.code, now + self.exit_grace))
        run.phase = Phase.CALLBACK
        return Call(run, order)

    def _advance(self, run: OrderRun, now: float) -> Step:
        """The next step of an order that waits (after a change or at its deadline)."""
        if run.phase is Phase.HOLD_WAIT:
            return self._hold_wait(run, now)
        if run.phase is Phase.PARK_WAIT:
            return self._park_wait(run, now)
        raise RuntimeError(f"{run.received.name} is not waiting ({run.phase.value})")

    def _called(self, run: OrderRun, now: float, result: ActionResult | None,
                error: BaseException | None) -> Step:
        """The host's callback for the order returned `result` or raised `error`."""
        order = run.received.order
        name = run.received.name
        if error is None and result is not None and not isinstance(result, RESULT_TYPES[name]):
            error = TypeError(f"the {name} callback returned {type(result).__name__}, not a "
                              f"{RESULT_TYPES[name].__name__}")
        if isinstance(order, ExitOrder):  # the training thread is let go, whatever happened
            self.pending = Decision("exit", order.code, reason=order.reason, order=order)
            return self._finish(run, result=EmptyResult(),
                                error=None if error is None else _text(error))
        if error is not None:
            return self._finish(run, error=_text(error))
        if isinstance(order, StopOrder):
            run.result = result
            run.phase, run.deadline = Phase.PARK_WAIT, now + self.park_wait
            return self._park_wait(run, now)
        if isinstance(order, PauseOrder):
            assert run.held is not None
            return self._finish(run, result=PauseResult(run.held.step, run.held.status))
        if isinstance(order, ResumeOrder):
            self._resume(order, now)
            return self._finish(run, result=EmptyResult())
        if result is None:
            return self._finish(run, error=f"TypeError: the {name} callback returned None")
        return self._finish(run, result=result)

    def _hold_wait(self, run: OrderRun, now: float) -> Step:
        """Stop, pause: an update in progress finishes; with a lock step, a rank behind it
        may still run the updates up to it (it has their gradients). Bounded."""
        if run.phase is Phase.START:
            run.phase, run.deadline = Phase.HOLD_WAIT, now + self.park_wait
        order = run.received.order
        lock_step = order.lock_step if isinstance(order, StopOrder) else None
        parked = self.parked
        behind = (lock_step is not None and self.step < lock_step and self.training
                  and not parked)
        # a parked rank's update failed half-way: it will not finish
        if ((self.status != "updating" or parked) and not behind) or now >= run.deadline:
            self.catch_up = None
            run.held = HoldResult(self.step, self.status)
            run.phase = Phase.CALLBACK
            assert order is not None
            return Call(run, order)
        return Wait(run, run.deadline)

    def _park_wait(self, run: OrderRun, now: float) -> Step:
        """After a stop: until the training thread is held in the fault handler (bounded).
        True: it came back (not hung, even if its watchdog fired while it was blocked
        behind a rank that really hung); False: it is inside the training function and did
        not come back (hung); None: no training function runs under the handler."""
        if not self.parked and self.training and now < run.deadline:
            return Wait(run, run.deadline)
        parked = True if self.parked else False if self.training else None
        result = run.result if isinstance(run.result, StopResult) else StopResult()
        done = self._finish(run, result=replace(result, step=self.step, status=self.status,
                                                parked=parked))
        return replace(done, unparked=parked is False)

    def _resume(self, order: ResumeOrder, now: float) -> None:
        """Clear the stop or pause; a held training thread gets the decision. The first
        resume after joining a recovery is the one the training thread waits for, even if
        it comes before that thread asked (the repair needed nothing of it)."""
        owed = self.rejoining and not self.join_resumed
        self.join_resumed = self.join_resumed or owed
        held = owed or self.stopped or self.in_handler or self.last_report is not None
        self.stopped = self.paused = False
        if held:
            self.pending = Decision("resume", step=order.step, strategy=order.strategy,
                                    order=order)
        if self.watching:
            self.watchdog.resume(now)

    def _finish(self, run: OrderRun, result: ActionResult | None = None,
                error: str | None = None) -> Done:
        run.phase = Phase.DONE
        if error is not None:
            return Done(run, Send("result", ResultMessage(run.received.id, run.received.name,
                                                          error=error[:4000])))
        assert result is not None
        return self._result(run, result)

    def _result(self, run: OrderRun, result: ActionResult) -> Done:
        received = run.received
        return Done(run, Send("result", ResultMessage(received.id, received.name, result)))

    # -- the training thread ---------------------------------------------------------------
    def _hold_point(self, step: int, now: float) -> Verdict:
        """Before update `step`: pass, wait (paused: the watchdog pauses too, a hold on
        purpose is no hang), or stop. A wait that ends in a pass watches again from `now`."""
        if self.pending is not None or (self.stopped and not (
                self.catch_up is not None and step <= self.catch_up)):
            self.held = False
            return Verdict.STOP
        if self.paused:
            if not self.held:
                self.held = True
                self.watchdog.pause()
            return Verdict.WAIT
        if self.held and self.watching:
            self.watchdog.resume(now)
        self.held = False
        return Verdict.PASS

    def _progress(self, step: int, now: float) -> None:
        self.progress_step = step
        if not self.watching and not self.stopped:
            self.watching = True
            self.watchdog.resume(now)
        self.watchdog.progress(step, now)

    def _error(self, event: Failed) -> Send:
        """The training thread failed: the report to send (it is what holds the rank)."""
        self.watchdog.pause()
        self.held = False  # raised at its hold point (a pause that lasted too long)
        report = ReportMessage(event.kind.value, event.message[:4000], self.step, self.status,
                               dict(event.detail) if event.detail else None)
        self.last_report = report
        return Send("report", report)

    def _take_decision(self) -> Decision | None:
        decision = self.pending
        if decision is not None and decision.action == "resume":
            self.pending = None
            self.last_report = None
        return decision

    def _check_hang(self, now: float) -> list[Output]:
        """The `hang` report, once the watchdog finds the training thread hung."""
        hung = self.watchdog.check(now) if self.watching else None
        if hung is None:
            return []
        idle, limit = hung
        return [Send("report", ReportMessage(
            FaultKind.HANG.value,
            f"rank {self.rank}: no training progress for {idle:.1f}s "
            f"(timeout {limit:.1f}s) after step {self.progress_step}", self.step,
            self.status))]


#: the method of `ProcessorCore` that takes each kind of input
_INPUTS: dict[type, Callable[[ProcessorCore, Any, float], list[Output]]] = {
    Action: ProcessorCore._on_action, OwnOrder: ProcessorCore._on_own_order,
    Begin: ProcessorCore._on_begin, Advance: ProcessorCore._on_advance,
    Called: ProcessorCore._on_called, HoldPoint: ProcessorCore._on_hold_point,
    UpdateStart: ProcessorCore._on_update_start, UpdateEnd: ProcessorCore._on_update_end,
    Progress: ProcessorCore._on_progress, Training: ProcessorCore._on_training,
    Failed: ProcessorCore._on_failed, InHandler: ProcessorCore._on_in_handler,
    TakeDecision: ProcessorCore._on_take_decision, CheckHang: ProcessorCore._on_check_hang,
}


def step_of(outputs: list[Output]) -> Step:
    """The step an order's input (`Begin`, `Advance`, `Called`) returns."""
    [out] = outputs
    if not isinstance(out, (Call, Wait, Done)):
        raise TypeError(f"not a step: {out!r}")
    return out


def verdict_of(outputs: list[Output]) -> Verdict:
    """The verdict a `HoldPoint` returns."""
    [out] = outputs
    if not isinstance(out, Verdict):
        raise TypeError(f"not a verdict: {out!r}")
    return out


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
