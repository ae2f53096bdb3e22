"""The gate: where a rank's training thread is held, stopped and handed work (SPEC 3, 6).

The shell of threads and clock around the processor's core (`core.ProcessorCore`, which
decides everything: what to answer, when a wait ends). `processor.Processor` composes it
with the `channel` to the controller. One condition variable guards the core; it is shared
by the training thread (trainer hooks, fault handler), the I/O thread and the threads that
run the controller's orders (`orders`):

- before an optimizer update (`before_update`) the training thread passes, is held while
  paused, or raises `ForceStop` once the rank is stopped;
- an order runs as the core says (`run_order`): its callback, its bounded waits (an update
  in progress finishing, the training thread parking in the fault handler);
- the parked training thread runs the work that recovery hands it
  (`run_in_training_thread`, `serve_training_thread`) until a decision (`resume`,
  `decide`) lets it go (`wait_decision`).

The gate also owns the hang watchdog: the training thread feeds it (`report_progress`), the
I/O thread checks it (`hang`). Nothing here touches the network.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..wire.classify import FaultKind, ForceStop
from ..wire.config import ControlConfig
from ..wire.messages import ActionMessage
from ..wire.order_types import TypedOrder
from ..wire.results import ActionResult, ReportMessage
from .core import Call, Decision, Done, OrderRun, ProcessorCore, Received, Run, Send, Verdict, Wait
from .watchdog import ProgressWatchdog

log = logging.getLogger("mindspeed_tft.control.processor")

#: how the shell runs an order's callback (`callbacks.run_callback` with the host's)
Callback = Callable[[TypedOrder], "ActionResult | None"]

#: seconds between two "still waiting" log lines of a long wait
WAIT_LOG_SECONDS = 60.0


class WaitLog:
    """Says every `WAIT_LOG_SECONDS` what a long wait still waits for (no wait is silent for
    longer)."""

    def __init__(self, rank: int, what: str, limit: float) -> None:
        self.rank = rank
        self.what = what
        self.limit = limit
        self.start = time.monotonic()
        self._next = self.start + WAIT_LOG_SECONDS

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + WAIT_LOG_SECONDS
            log.warning("rank %d: still waiting for %s (%.0fs of at most %gs)", self.rank,
                        self.what, now - self.start, self.limit)


class ProcessorError(RuntimeError):
    """The processor cannot do its job (e.g. no controller accepted its registration)."""


@dataclass
class _Task:
    """Work an action callback hands to the training thread."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Gate:
    """The training thread's side of one rank (see the module docstring)."""

    def __init__(self, rank: int, config: ControlConfig) -> None:
        self.rank = rank
        self.config = config
        self.watchdog = ProgressWatchdog(config.hang_timeout_min, config.hang_timeout_factor,
                                         config.hang_initial_timeout)
        self.core = ProcessorCore(
            rank, park_wait=min(config.park_timeout, config.action_time_limit / 2),
            failure_exit_code=config.failure_exit_code, exit_grace=config.exit_grace,
            watchdog=self.watchdog)
        self._cond = threading.Condition()
        #: the training thread waits at a hold point because the rank is paused
        self._held = False
        self._training_thread_id: int | None = None
        self._tasks: deque[_Task] = deque()

    @property
    def stopped(self) -> bool:
        return self.core.stopped

    @property
    def step(self) -> int:
        return self.core.step

    # -- what the channel reports ---------------------------------------------------------
    def position(self) -> tuple[int, str, int]:
        """Step, data status and progress (for heartbeats and registration)."""
        with self._cond:
            return self.core.position()

    def hang(self, now: float) -> tuple[float, float] | None:
        """(idle seconds, limit) once the watchdog finds the training thread hung."""
        return self.core.hang(now)

    def unanswered_report(self) -> ReportMessage | None:
        """The error report no decision answered yet (a new controller never saw it)."""
        with self._cond:
            return self.core.unanswered_report()

    def on_action(self, action: ActionMessage, now: float) -> list[Send | Run]:
        """An order arrived (I/O thread): its answer, or the lane that runs it."""
        with self._cond:
            out = self.core.on_action(action, now)
            self._cond.notify_all()
        return out

    def receive(self, aid: int, name: str, wire: Any, deadline: float) -> list[Send | Run]:
        """An order of the processor's own (a lost controller's exit)."""
        with self._cond:
            return self.core.receive(aid, name, wire, deadline)

    # -- trainer hooks ------------------------------------------------------------------
    def before_update(self, step: int, timeout: float | None = None) -> None:
        """Hold point before optimizer update `step` (see `processor`)."""
        with self._cond:
            self._wait_unheld_locked(step, timeout)
            core = self.core
            if core.status == "updating" and core.updating_step == step:
                return
            core.update_start(step)

    def wait_unheld(self, step: int, timeout: float | None = None) -> None:
        """The hold of `before_update(step)` without marking the data Updating."""
        with self._cond:
            self._wait_unheld_locked(step, timeout)

    def _wait_unheld_locked(self, step: int, timeout: float | None) -> None:
        limit = self.config.effective_decision_timeout() if timeout is None else timeout
        deadline = time.monotonic() + limit
        waiting = WaitLog(self.rank, f"the end of a pause before update {step}", limit)
        try:
            while True:
                verdict = self.core.may_update(step)
                if verdict is Verdict.STOP:
                    raise ForceStop(f"rank {self.rank} stopped by the controller before "
                                    f"update {step}")
                if verdict is Verdict.PASS:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ForceStop(f"rank {self.rank} paused for more than {limit:g}s")
                self.watchdog.pause()  # held on purpose: not a hang
                if not self._held:
                    self._held = True
                    self._cond.notify_all()
                self._cond.wait(min(remaining, 5.0))
                waiting.tick()
                if self.core.watching:
                    self.watchdog.resume()
        finally:
            self._held = False

    def wait_held(self, timeout: float) -> bool:
        """Wait, at most `timeout` seconds, until the training thread waits at a hold point
        of a pause; True if it does. False at once when there is nothing to wait for: the
        pause ended, or the training thread is in the fault handler or outside the training
        function (an order behind this one, a stop, must not wait)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._held:
                remaining = deadline - time.monotonic()
                core = self.core
                if remaining <= 0 or not core.paused or core.parked or not core.training:
                    return False
                self._cond.wait(min(remaining, 0.5))
            return True

    def report_update_end(self, step: int) -> None:
        """Optimizer update `step` completed: the data is Updated at `step`."""
        with self._cond:
            self.core.update_end(step)
            self._cond.notify_all()

    def report_progress(self, step: int) -> None:
        """The training thread completed `step` (feeds the hang watchdog)."""
        with self._cond:
            self.core.progress(step, time.monotonic())

    def mark_training(self, active: bool) -> None:
        """The handler says whether the training thread is inside the training function."""
        with self._cond:
            self.core.set_training(active)
            if active:
                self._training_thread_id = threading.get_ident()
            self._cond.notify_all()

    # -- errors and decisions -------------------------------------------------------------
    def record_error(self, kind: FaultKind, message: str,
                     detail: dict[str, Any] | None) -> ReportMessage:
        """The training thread failed: remember the report (it is what holds the rank)."""
        with self._cond:
            report = self.core.error(kind, message, detail).message
            self._cond.notify_all()
        assert isinstance(report, ReportMessage)
        return report

    def wait_decision(self, timeout: float | None = None) -> Decision:
        """Wait for the controller's decision, running handed-over work meanwhile."""
        limit = self.config.effective_decision_timeout() if timeout is None else timeout
        deadline = time.monotonic() + limit
        waiting = WaitLog(self.rank, "the controller's decision after an error", limit)
        with self._cond:
            self.core.enter_handler(True)
            self._cond.notify_all()
            try:
                while (decision := self.core.take_decision()) is None:
                    if self._tasks:
                        self._run_task_locked()
                        continue
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return Decision("exit", self.config.failure_exit_code,
                                        reason=f"no decision from the controller within {limit:g}s")
                    self._cond.wait(min(remaining, 1.0))
                    waiting.tick()
                return decision
            finally:
                self.core.enter_handler(False)

    def serve_training_thread(self, until: Callable[[], bool], timeout: float) -> None:
        """Run handed-over work in the calling (training) thread until `until()` is true."""
        deadline = time.monotonic() + timeout
        waiting = WaitLog(self.rank, "the repair that brings this process into the job",
                          timeout)
        with self._cond:
            self._training_thread_id = threading.get_ident()
            while not until():
                if self._tasks:
                    self._run_task_locked()
                    continue
                pending = self.core.pending
                if pending is not None and pending.action == "exit":
                    raise ProcessorError(f"rank {self.rank}: ordered to exit while joining: "
                                         f"{pending.reason}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ProcessorError(f"rank {self.rank}: the repair did not arrive within "
                                         f"{timeout:g}s")
                self._cond.wait(min(remaining, 0.5))
                waiting.tick()

    def run_in_training_thread(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` in the training thread; its result, or its exception raised here."""
        limit = self.config.action_time_limit if timeout is None else timeout
        task = _Task(fn)
        with self._cond:
            self._tasks.append(task)
            self._cond.notify_all()
        if not task.done.wait(limit):
            self._log_training_stack(f"did not finish a task within {limit:g}s")
            raise ProcessorError(f"rank {self.rank}: the training thread did not run the task "
                                 f"within {limit:g}s")
        if task.error is not None:
            raise task.error
        return task.result

    def _run_task_locked(self) -> None:
        task = self._tasks.popleft()
        self._cond.release()
        try:
            task.result = task.fn()
        except BaseException as e:  # handed back to the callback thread
            task.error = e
        finally:
            self._cond.acquire()
            task.done.set()

    # -- orders ---------------------------------------------------------------------------
    def run_order(self, received: Received, call: Callback,
                  arm_exit: Callable[[int, float], None]) -> Send:
        """Run one order as the core says (on an order thread): its callbacks through
        `call`, its waits on the condition, bounded; returns the result to send.
        `arm_exit(code, deadline)`: an exit order's hard exit, armed before its callback."""
        with self._cond:
            run, step = self.core.begin(received, time.monotonic())
            self._cond.notify_all()
        while True:
            if isinstance(step, Done):
                if step.unparked:
                    self._log_training_stack("did not come back to the fault handler when "
                                             "stopped")
                return step.result
            if isinstance(step, Call):
                if step.hard_exit is not None:
                    arm_exit(*step.hard_exit)
                result, error = None, None
                try:
                    result = call(step.order)
                except BaseException as e:  # reported as the order's failure
                    log.exception("action %s failed on rank %d", received.name, self.rank)
                    error = e
                with self._cond:
                    step = self.core.called(run, time.monotonic(), result, error)
                    self._cond.notify_all()
            else:
                step = self._wait(run, step)

    def _wait(self, run: OrderRun, step: Wait) -> Call | Wait | Done:
        with self._cond:
            remaining = step.deadline - time.monotonic()
            if remaining > 0:
                self._cond.wait(min(remaining, 0.5))
            return self.core.advance(run, time.monotonic())

    def _log_training_stack(self, why: str) -> None:
        """Where the training thread is stuck (for the operator; logged, not sent)."""
        frame = sys._current_frames().get(self._training_thread_id or -1)
        if frame is not None:
            stack = "".join(traceback.format_stack(frame))
            log.error("rank %d: training thread %s; it is at:\n%s", self.rank, why, stack)
