"""The exception handler around the training function (SPEC 6).

    result = run_with_fault_tolerance(train, processor)

runs `train()`. When it raises, the error is classified (`classify.classify_error`),
reported to the controller, and the training thread waits (with a timeout) for the
controller's decision: after a repair the processor's `resume` order re-enters `train()`
(the rollback callback has already put the training state back to the lock step; the
decision's `step` says which), otherwise the process exits with the decided code. Errors
raised after the controller stopped the rank (an aborted communicator, a ForceStop) are
consequences of the stop and are reported as `normal`. An exception may carry a
`tft_detail` dict (e.g. `{"target": "activation"}` for a UCE) that goes with the report.

A restarted worker joining a job under recovery (ARF) first waits for the repair that
brings it the training state, then enters `train()`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from ..wire import local
from ..wire.classify import FaultKind, classify_error
from .processor import Decision, Processor

log = logging.getLogger("mindspeed_tft.control.handler")

T = TypeVar("T")


def _leave(processor: Processor, decision: Decision, exit_fn: Callable[[int], Any],
           on_exit: Callable[[Decision], None] | None = None) -> None:
    if on_exit is not None:
        try:
            on_exit(decision)
        except Exception:  # the exit goes on whatever happens here
            log.exception("rank %d: before the exit", processor.rank)
    log.warning("rank %d exits with code %d: %s", processor.rank, decision.code, decision.reason)
    print(f"[mindspeed-tft] rank {processor.rank} exits with code {decision.code}: "
          f"{decision.reason}\n", end="", flush=True)  # one write (other ranks print too)
    processor.close()
    local.wait_local_controllers(10.0)  # a controller in this process sends its last orders
    exit_fn(decision.code)
    raise SystemExit(decision.code)


def run_with_fault_tolerance(train_fn: Callable[[], T], processor: Processor, *,
                             decision_timeout: float | None = None,
                             on_resume: Callable[[Decision], None] | None = None,
                             on_exit: Callable[[Decision], None] | None = None,
                             exit_fn: Callable[[int], Any] = sys.exit) -> T:
    """Run `train_fn` under the fault-tolerance protocol; returns what it returns.

    decision_timeout: seconds to wait for a decision (default from the config).
    on_resume: called with the resume decision before `train_fn` is entered again.
    on_exit: called with an exit decision before the process leaves (errors logged only).
    exit_fn: how the process exits with the decided code (default `sys.exit`).
    """
    if processor.rejoining:
        log.info("rank %d restarted into a recovery: waiting for the repair", processor.rank)
        decision = processor.wait_decision(decision_timeout)
        if decision.action != "resume":
            _leave(processor, decision, exit_fn, on_exit)
        if on_resume is not None:
            on_resume(decision)
    while True:
        processor.mark_training(True)
        try:
            return train_fn()
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:
            classified = classify_error(e)
            kind = processor.reported_kind(classified)
            if kind is not classified:
                log.info("rank %d: %s after the controller's stop: reported as normal",
                         processor.rank, type(e).__name__)
            detail = getattr(e, "tft_detail", None)
            # the report first: formatting and writing a traceback takes milliseconds
            processor.report_error(kind, f"{type(e).__name__}: {e}",
                                   detail if isinstance(detail, dict) else None)
            level = logging.INFO if kind is FaultKind.NORMAL else logging.ERROR
            log.log(level, "rank %d: training raised %s (%s): %s", processor.rank,
                    type(e).__name__, kind, e, exc_info=kind is not FaultKind.NORMAL)
            del e
        finally:
            processor.mark_training(False)
        decision = processor.wait_decision(decision_timeout)
        if decision.action != "resume":
            _leave(processor, decision, exit_fn, on_exit)
        log.info("rank %d resumes training at step %s (%s)", processor.rank, decision.step,
                 decision.strategy)
        if on_resume is not None:
            on_resume(decision)

