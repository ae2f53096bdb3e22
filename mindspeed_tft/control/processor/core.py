"""The processor's protocol side without I/O: what a rank answers and reports.

`ProcessorCore` is a state machine over one rank's training state (its step, whether its
data is `updated` or `updating`, whether it is held, stopped, parked in the fault handler,
what it reported) and the orders it is running. It takes inputs and returns outputs; it has
no socket, thread, lock or clock (every time is an argument `now`, in seconds of any
monotonic clock), so the same code runs inside a training process (`processor.Processor`,
its shell of sockets, threads and the real clock, calls it under one lock) and inside a
simulator with a virtual clock.

Inputs:
- an order from the controller: `on_action(payload, now)` (the `action` message's checked
  payload) returns what to do with it: a `Send` of the answer (a hold is answered at once;
  a repeated id is dropped) or a `Run` of the order on one of two lanes (see `orders`);
- the run of an order, step by step: `begin(order, now)`, then `advance(run, now)` while it
  waits and `called(run, result)` once its callback ran; each returns the next `Step`:
  `Call` (run the host's callback: `callbacks.run_callback`), `Wait` (until the training
  state changes or the deadline passes), or `Done` (the `result` message to send, and for an
  exit the deadline of the hard exit);
- the training thread: `may_update(step)` (pass, wait, or stop), `update_start`,
  `update_end`, `progress`, `set_training`, `error` (returns the `report` to send),
  `enter_handler`, `take_decision`.

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
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ..wire.classify import FaultKind
from ..wire.messages import ActionMessage
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
from .watchdog import ProgressWatchdog

log = logging.getLogger("mindspeed_tft.control.processor")

#: orders that end a hold: they run on a lane of their own (see `orders`)
RELEASE_ORDERS = frozenset({"exit", "resume"})
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


@dataclass(frozen=True)
class Received:
    """An order as received: its id, name, deadline (`now` + its time limit) and the typed
    order (None: its payload did not match; `error` says why)."""

    id: int
    name: str
    deadline: float
    order: TypedOrder | None
    error: str = ""


# -- outputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """A message to send to the controller: `mtype` (`protocol.MsgType`) and its payload."""

    mtype: str
    message: ResultMessage | ReportMessage


@dataclass(frozen=True)
class Run:
    """Run `order` on lane `lane` ("work" or "release")."""

    order: Received
    lane: str


@dataclass(frozen=True)
class Call:
    """Run the host's callback for the order (`callbacks.run_callback`), then `called`.
    `hard_exit`: an exit order's (code, deadline): if the process still lives then (a hung
    training thread, a stuck callback), the shell ends it."""

    order: TypedOrder
    hard_exit: tuple[int, float] | None = None


@dataclass(frozen=True)
class Wait:
    """Wait until the training state changes or `deadline` passes, then `advance`."""

    deadline: float


@dataclass(frozen=True)
class Done:
    """The order ended: send `result`."""

    result: Send
    #: the training thread did not come back when stopped (the shell logs where it is)
    unparked: bool = False


Step = Call | Wait | Done


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


class Verdict(Enum):
    """What the training thread does at a hold point (`may_update`)."""

    PASS = "pass"
    WAIT = "wait"
    STOP = "stop"


class ProcessorCore:
    """The protocol state of one rank (see the module docstring)."""

    def __init__(self, rank: int, *, park_wait: float, failure_exit_code: int,
                 exit_grace: float, watchdog: ProgressWatchdog) -> None:
        self.rank = rank
        self.park_wait = park_wait
        self.failure_exit_code = failure_exit_code
        self.exit_grace = exit_grace
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

    # -- what a heartbeat or registration says ------------------------------------------------
    def position(self) -> tuple[int, str, int]:
        """Step, data status and progress."""
        return self.step, self.status, self.progress_step

    def hang(self, now: float) -> tuple[float, float] | None:
        """(idle seconds, limit) once the watchdog finds the training thread hung."""
        return self.watchdog.check(now) if self.watching else None

    def unanswered_report(self) -> ReportMessage | None:
        """The error report no decision answered yet (a new controller never saw it)."""
        return self.last_report if self.pending is None else None

    @property
    def parked(self) -> bool:
        return self.in_handler or self.last_report is not None

    # -- orders from the controller ---------------------------------------------------------
    def on_action(self, action: ActionMessage, now: float) -> list[Send | Run]:
        """An `action` message (checked by `protocol`): answer or run it."""
        aid = action.id
        if aid in self.seen:
            return []
        self.seen.append(aid)
        return self.receive(aid, action.name, action.payload, now + action.timeout)

    def receive(self, aid: int, name: str, wire: Any, deadline: float) -> list[Send | Run]:
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
            return [self._result(received, self.hold()).result]
        return [Run(received, "release" if name in RELEASE_ORDERS else "work")]

    def hold(self) -> HoldResult:
        """The first round of a stop: hold the rank before its next update and say at once
        where it is. Nothing is waited for (a rank hung inside its update answers too): a
        rank `updated` at s stays there, one `updating` at s ends its update at s + 1 (the
        controller counts it so) until the stop lets it catch up to the lock step."""
        self.paused = True
        return HoldResult(self.step, self.status)

    def begin(self, received: Received, now: float) -> tuple[OrderRun, Step]:
        """Start running an order (on its lane); its first step."""
        run = OrderRun(received)
        order = received.order
        if order is None:
            log.error("rank %d: %s", self.rank, received.error)
            return run, self._finish(run, error=received.error)
        if isinstance(order, HoldOrder):  # (`receive` answers it at once)
            run.phase = Phase.DONE
            return run, self._result(received, self.hold())
        if isinstance(order, StopOrder):
            self.stopped, self.catch_up, self.paused = True, order.lock_step, False
            return run, self._hold_wait(run, now)
        if isinstance(order, PauseOrder):
            # the whole job is held: a rank blocked in a collective behind a held peer
            # makes no progress either, and is not hung (`resume` watches again)
            self.watchdog.pause()
            self.paused = True
            return run, self._hold_wait(run, now)
        if isinstance(order, ExitOrder):
            if self.exit_ordered is None:
                self.exit_ordered = order.code
            log.warning("rank %d ordered to exit with code %d: %s", self.rank, order.code,
                        order.reason)
            self.watchdog.pause()  # no further update, no hang watching
            self.stopped = True
            run.phase = Phase.CALLBACK
            return run, Call(order, (order.code, now + self.exit_grace))
        run.phase = Phase.CALLBACK
        return run, Call(order)

    def advance(self, run: OrderRun, now: float) -> Step:
        """The next step of an order that waits (after a change or at its deadline)."""
        if run.phase is Phase.HOLD_WAIT:
            return self._hold_wait(run, now)
        if run.phase is Phase.PARK_WAIT:
            return self._park_wait(run, now)
        raise RuntimeError(f"{run.received.name} is not waiting ({run.phase.value})")

    def called(self, run: OrderRun, now: float, result: ActionResult | None = None,
               error: BaseException | None = None) -> Step:
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
            return Call(order)
        return Wait(run.deadline)

    def _park_wait(self, run: OrderRun, now: float) -> Step:
        """After a stop: until the training thread is held in the fault handler (bounded).
        True: it came back (not hung, even if its watchdog fired while it was blocked
        behind a rank that really hung); False: it is inside the training function and did
        not come back (hung); None: no training function runs under the handler."""
        if not self.parked and self.training and now < run.deadline:
            return Wait(run.deadline)
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
            self.watchdog.resume(now)  # the caller's clock (a simulator's is virtual)

    def _finish(self, run: OrderRun, result: ActionResult | None = None,
                error: str | None = None) -> Done:
        run.phase = Phase.DONE
        if error is not None:
            return Done(Send("result", ResultMessage(run.received.id, run.received.name,
                                                     error=error[:4000])))
        assert result is not None
        return self._result(run.received, result)

    def _result(self, received: Received, result: ActionResult) -> Done:
        return Done(Send("result", ResultMessage(received.id, received.name, result)))

    # -- the training thread ---------------------------------------------------------------
    def may_update(self, step: int) -> Verdict:
        """At a hold point before update `step`: pass, wait (paused), or stop."""
        if self.pending is not None or (self.stopped and not (
                self.catch_up is not None and step <= self.catch_up)):
            return Verdict.STOP
        return Verdict.WAIT if self.paused else Verdict.PASS

    def update_start(self, step: int) -> None:
        """The update producing `step` begins: the data is Updating."""
        self.status = "updating"
        self.updating_step = step

    def update_end(self, step: int) -> None:
        """Update `step` completed: the data is Updated at `step`."""
        self.step, self.status, self.updating_step = step, "updated", None

    def progress(self, step: int, now: float) -> None:
        """The training thread completed `step` (the first call arms the hang watchdog)."""
        self.progress_step = step
        if not self.watching and not self.stopped:
            self.watching = True
            self.watchdog.resume(now)
        self.watchdog.progress(step, now)

    def set_training(self, active: bool) -> None:
        """Whether the training thread is inside the training function."""
        self.training = active

    def reported_kind(self, kind: FaultKind) -> FaultKind:
        """What a failure of the training thread (classified `kind`) is reported as: once
        the controller stopped the rank, an error (an aborted communicator, a ForceStop) is
        a consequence of the stop, reported as normal."""
        return FaultKind.NORMAL if self.stopped else kind

    def error(self, kind: FaultKind, message: str,
              detail: dict[str, Any] | None = None) -> Send:
        """The training thread failed: the report to send (it is what holds the rank)."""
        self.watchdog.pause()
        report = ReportMessage(kind.value, message[:4000], self.step, self.status,
                               dict(detail) if detail else None)
        self.last_report = report
        return Send("report", report)

    def enter_handler(self, inside: bool) -> None:
        """The training thread waits for a decision in the fault handler (or left it)."""
        self.in_handler = inside

    def take_decision(self) -> Decision | None:
        """The decision for the waiting training thread; a resume is consumed."""
        decision = self.pending
        if decision is not None and decision.action == "resume":
            self.pending = None
            self.last_report = None
        return decision


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
