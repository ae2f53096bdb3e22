"""How a processor runs the controller's orders: two lanes, each one long-lived worker thread.

An order (`action` message) runs a callback that may take long or never return: a stop
waits for the training thread to park, a repair waits for the training thread to run its
work, a framework callback can hang. Orders therefore do not run on the I/O thread (one
exception below). Each runs on one of two lanes, a FIFO served by one long-lived worker
thread:

- `work`: pause, stop, clean, repair, rollback, dump, rename, in the order they arrive (the
  controller sends one phase after the other, so they hardly ever overlap);
- `release`: exit and resume. They end a hold, so they must not queue behind the order
  they end: an exit or resume that arrives while a stop still waits for the training
  thread to park, or while a callback is stuck, is handled at once. That is why a single
  worker is not enough, and why the second lane is only for these two.

One order runs on no lane: `hold`, the first round of a stop, is answered at once by the
core (its `core.Action` input) in the thread that received it (the I/O thread). It sets a
flag under the gate's lock (which the I/O thread takes for every heartbeat anyway) and returns where the rank is; it never waits.
Handing it to a lane worker cost that worker's wake-up: a worker runs in the normal
scheduling class (below), and on a loaded 2-core machine the hold round took 0.13-0.61 s
instead of 0.01-0.04 s in 3 of 12 60 M UCE jobs. Answering it at once also means a hold is
never queued behind a stuck order.

Which lane an order goes to, and when an order starts (FIFO, one at a time, an order past
its time limit no longer holding its lane up once another waits) is the lane policy
(`lanes.LanePolicy`, no I/O; the simulator drives the same one). This module is its shell
of threads: a `Lane` runs what the policy starts on its long-lived worker, and on a fresh
worker when the policy abandons the order the worker is stuck in (the controller gave up on
it; without that, one callback that never returns would block every later order of its
lane: a stuck repair would keep the dump that follows it from running). The abandoned
worker finishes on its own; its late result is sent like any other. `check` is called on
every turn of the I/O loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..wire.priority import leave_realtime
from .core import Run
from .lanes import LanePolicy, Received, Start

log = logging.getLogger("mindspeed_tft.control.processor")


@dataclass(eq=False)
class _Worker:
    #: the order the policy started on this worker, not yet taken up
    next: Received | None = None
    current: Received | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


class Lane:
    """One lane: the policy's FIFO, served by one long-lived worker (replaced only when
    stuck)."""

    def __init__(self, name: str, run: Callable[[Received], None]) -> None:
        self.name = name
        self._run = run
        self._cond = threading.Condition()
        self.policy = LanePolicy()
        self._worker: _Worker | None = None
        self._closed = False

    @property
    def abandoned(self) -> int:
        """Workers left behind in an order past its time limit."""
        return self.policy.abandoned

    def submit(self, order: Received, now: float) -> None:
        with self._cond:
            self._start(self.policy.submit(order, now))

    def check(self, now: float) -> None:
        """Replace a stuck worker if an order waits behind it."""
        with self._cond:
            self._start(self.policy.check(now))

    def close(self) -> None:
        """The idle worker ends once nothing is left to run."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _start(self, starts: list[Start]) -> None:
        """Hand what the policy started to the lane's worker; a fresh one when the policy
        abandoned the order the worker is stuck in (lock held)."""
        for start in starts:
            if start.abandon is not None:
                log.warning("%s overran its time limit; its lane goes on with a new worker "
                            "(%d queued)", start.abandon.name, len(self.policy.queue))
            if self._worker is None or start.abandon is not None:
                fresh = _Worker()
                fresh.thread = threading.Thread(target=self._serve, args=(fresh,),
                                                name=self.name, daemon=True)
                self._worker = fresh
                fresh.thread.start()
            self._worker.next = start.order
            self._cond.notify_all()

    def _serve(self, me: _Worker) -> None:
        leave_realtime()  # a callback can run long: it must not hold a core ahead of training
        while True:
            with self._cond:
                while me.next is None and self._worker is me and not self._closed:
                    self._cond.wait()
                if me.next is None:
                    return  # replaced while it was stuck, or closed with nothing left
                order, me.next = me.next, None
                me.current = order
            try:
                self._run(order)
            except BaseException:  # `run` reports failures itself: this is a bug
                log.exception("order %s failed outside its handler", order.name)
            finally:
                with self._cond:
                    me.current = None
                    self._start(self.policy.finish(order, time.monotonic()))


class Orders:
    """The two lanes of one processor (see the module docstring)."""

    def __init__(self, rank: int, run: Callable[[Received], None]) -> None:
        self._run = run
        self.work = Lane(f"tft-orders-{rank}", run)
        self.release = Lane(f"tft-release-{rank}", run)

    def submit(self, run: Run, now: float | None = None) -> None:
        """Queue `run.order` on the lane the core chose for it."""
        lane = self.release if run.lane == "release" else self.work
        lane.submit(run.order, time.monotonic() if now is None else now)

    def check(self, now: float) -> None:
        self.work.check(now)
        self.release.check(now)

    def close(self) -> None:
        self.work.close()
        self.release.close()
