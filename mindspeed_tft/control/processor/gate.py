"""The gate: where a rank's training thread is held, stopped and handed work (SPEC 3, 6).

The training-side half of the processor (`processor.Processor` composes it with the
`channel` to the controller). One condition variable guards everything here; it is shared
by the training thread (trainer hooks, fault handler) and the threads that run the
controller's orders (`orders`):

- before an optimizer update (`before_update`) the training thread passes, is held while
  paused, or raises `ForceStop` once the rank is stopped;
- an order holds the gate (`hold` answers at once; `stop` and `pause` let an update in
  progress finish; after a `hold`, the `stop` lets a rank behind the lock step catch up)
  and waits, bounded, for the training thread to park in the fault handler;
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
from .watchdog import ProgressWatchdog

log = logging.getLogger("mindspeed_tft.control.processor")

#: an order's callback, bound to its payload
Callback = Callable[[], "dict[str, Any] | None"]

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


@dataclass(frozen=True)
class Decision:
    """What the controller decided for a rank waiting after an error."""

    action: str                 # "resume" (re-enter training) or "exit"
    code: int = 0               # exit code (exit)
    step: int | None = None     # step to resume at (resume)
    strategy: str = ""
    reason: str = ""
    payload: dict[str, Any] = field(default_factory=dict)


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
        self._watching = False
        self._cond = threading.Condition()
        self._step = 0
        self._status = "updated"
        self._updating_step: int | None = None
        self._progress = 0
        self._stopped = False
        self._paused = False
        #: the training thread waits at a hold point because the rank is paused
        self._held = False
        self._in_handler = False
        self._training = False
        self._training_thread_id: int | None = None
        self._catch_up: int | None = None
        self._pending: Decision | None = None
        self._tasks: deque[_Task] = deque()
        self._last_report: dict[str, Any] | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def step(self) -> int:
        return self._step

    # -- what the channel reports ---------------------------------------------------------
    def position(self) -> tuple[int, str, int]:
        """Step, data status and progress (for heartbeats and registration)."""
        with self._cond:
            return self._step, self._status, self._progress

    def hang(self, now: float) -> tuple[float, float] | None:
        """(idle seconds, limit) once the watchdog finds the training thread hung."""
        return self.watchdog.check(now) if self._watching else None

    def unanswered_report(self) -> dict[str, Any] | None:
        """The error report no decision answered yet (a new controller never saw it)."""
        with self._cond:
            return self._last_report if self._pending is None else None

    # -- trainer hooks ------------------------------------------------------------------
    def before_update(self, step: int, timeout: float | None = None) -> None:
        """Hold point before optimizer update `step` (see `processor`)."""
        with self._cond:
            self._wait_unheld_locked(step, timeout)
            if self._status == "updating" and self._updating_step == step:
                return
            self._status = "updating"
            self._updating_step = step

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
                if self._pending is not None or (self._stopped and not (
                        self._catch_up is not None and step <= self._catch_up)):
                    raise ForceStop(f"rank {self.rank} stopped by the controller before "
                                    f"update {step}")
                if not self._paused:
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
                if self._watching:
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
                if (remaining <= 0 or not self._paused or self._parked()
                        or not self._training):
                    return False
                self._cond.wait(min(remaining, 0.5))
            return True

    def report_update_end(self, step: int) -> None:
        """Optimizer update `step` completed: the data is Updated at `step`."""
        with self._cond:
            self._step = step
            self._status = "updated"
            self._updating_step = None
            self._cond.notify_all()

    def report_progress(self, step: int) -> None:
        """The training thread completed `step` (feeds the hang watchdog)."""
        self._progress = step
        if not self._watching and not self._stopped:
            self._watching = True
            self.watchdog.resume()
        self.watchdog.progress(step)

    def mark_training(self, active: bool) -> None:
        """The handler says whether the training thread is inside the training function."""
        with self._cond:
            self._training = active
            if active:
                self._training_thread_id = threading.get_ident()
            self._cond.notify_all()

    # -- errors and decisions -------------------------------------------------------------
    def record_error(self, kind: FaultKind, message: str,
                     detail: dict[str, Any] | None) -> dict[str, Any]:
        """The training thread failed: remember the report (it is what holds the rank)."""
        self.watchdog.pause()
        with self._cond:
            report: dict[str, Any] = {"kind": kind.value, "message": message[:4000],
                                      "step": self._step, "status": self._status}
            if detail:
                report["detail"] = dict(detail)
            self._last_report = report
            self._cond.notify_all()
        return report

    def wait_decision(self, timeout: float | None = None) -> Decision:
        """Wait for the controller's decision, running handed-over work meanwhile."""
        limit = self.config.effective_decision_timeout() if timeout is None else timeout
        deadline = time.monotonic() + limit
        waiting = WaitLog(self.rank, "the controller's decision after an error", limit)
        with self._cond:
            self._in_handler = True
            self._cond.notify_all()
            try:
                while self._pending is None:
                    if self._tasks:
                        self._run_task_locked()
                        continue
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return Decision("exit", self.config.failure_exit_code,
                                        reason=f"no decision from the controller within {limit:g}s")
                    self._cond.wait(min(remaining, 1.0))
                    waiting.tick()
                decision = self._pending
                if decision.action == "resume":
                    self._pending = None
                    self._last_report = None
                return decision
            finally:
                self._in_handler = False

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
                if self._pending is not None and self._pending.action == "exit":
                    raise ProcessorError(f"rank {self.rank}: ordered to exit while joining: "
                                         f"{self._pending.reason}")
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
    def hold(self) -> dict[str, Any]:
        """The first round of a stop: hold the rank before its next update and say at once
        where it is. Nothing is abandoned and nothing raises, and nothing is waited for: a
        rank `updated` at step s stays there, one `updating` at s ends its update at s + 1
        (the controller counts it so), until the stop lets it catch up to the lock step that
        all the ranks' answers give. Not waiting matters for a rank hung inside its update."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            return {"step": self._step, "status": self._status}

    def stop(self, lock_step: int | None, callback: Callback) -> dict[str, Any]:
        """Stop the rank: hold, run the stop callback, wait for the training thread to park;
        the result always carries `step`, `status` and `parked`."""
        self._hold(stop=True, lock_step=lock_step)
        result = callback() or {}
        parked = self._wait_parked()
        with self._cond:
            return {**result, "step": self._step, "status": self._status, "parked": parked}

    def pause(self, callback: Callback | None) -> dict[str, Any]:
        """Hold the rank before its next update (operator pause)."""
        # the whole job is held: a rank blocked in a collective behind a held peer makes no
        # progress either, and is not hung (`resume` watches again)
        self.watchdog.pause()
        held = self._hold(stop=False)
        if callback is not None:
            return {**(callback() or {}), **held}
        return held

    def resume(self, decision: Decision, *, owed: bool = False) -> None:
        """Clear the stop or pause; a held training thread gets `decision`. `owed`: the
        training thread gets it even if it does not wait yet (a restarted process joining a
        recovery: its first resume is for it)."""
        with self._cond:
            was_held = (owed or self._stopped or self._in_handler
                        or self._last_report is not None)
            self._stopped = False
            self._paused = False
            if was_held:
                self._pending = decision
            self._cond.notify_all()
        if self._watching:
            self.watchdog.resume()

    def halt(self) -> None:
        """An exit is coming: no further update, no hang watching."""
        self.watchdog.pause()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def decide(self, decision: Decision) -> None:
        """Hand `decision` to the training thread (an exit)."""
        with self._cond:
            self._pending = decision
            self._cond.notify_all()

    def _hold(self, *, stop: bool, lock_step: int | None = None) -> dict[str, Any]:
        """Hold the training thread before its next update (SPEC 3).

        An update in progress finishes. With a lock step, a rank behind it may still run the
        updates up to it (it already has their gradients): we wait, bounded, until it is
        there, parked in the handler, or out of the training function.
        """
        wait = min(self.config.park_timeout, self.config.action_time_limit / 2)
        deadline = time.monotonic() + wait
        # the watchdog keeps watching: a training thread that never comes back is hung
        with self._cond:
            if stop:  # a stop ends a hold or pause: a rank behind the lock step catches up
                self._stopped = True
                self._catch_up = lock_step
                self._paused = False
            else:
                self._paused = True
            self._cond.notify_all()
            while (remaining := deadline - time.monotonic()) > 0:
                parked = self._parked()
                behind = (lock_step is not None and self._step < lock_step and self._training
                          and not parked)
                # a parked rank's update failed half-way: it will not finish
                if (self._status != "updating" or parked) and not behind:
                    break
                self._cond.wait(min(remaining, 0.5))
            self._catch_up = None
            return {"step": self._step, "status": self._status}

    def _parked(self) -> bool:
        return self._in_handler or self._last_report is not None

    def _wait_parked(self) -> bool | None:
        """After a stop: wait (bounded) until the training thread is held in the handler.

        True: it came back, so it is not hung (even if its watchdog fired while it was
        blocked in a collective with a rank that really hung). False: it is inside the
        training function and did not come back: it is hung. None: no training function
        runs under `run_with_fault_tolerance`, so nothing can be said.
        """
        limit = min(self.config.park_timeout, self.config.action_time_limit / 2)
        deadline = time.monotonic() + limit
        with self._cond:
            while not self._parked():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._training:
                    break
                self._cond.wait(min(remaining, 0.5))
            if self._parked():
                return True
            if self._training:
                self._log_training_stack("did not come back to the fault handler when stopped")
            return False if self._training else None

    def _log_training_stack(self, why: str) -> None:
        """Where the training thread is stuck (for the operator; logged, not sent)."""
        frame = sys._current_frames().get(self._training_thread_id or -1)
        if frame is not None:
            stack = "".join(traceback.format_stack(frame))
            log.error("rank %d: training thread %s; it is at:\n%s", self.rank, why, stack)
