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
core (`core.ProcessorCore.on_action`) in the thread that received it (the I/O thread). It sets a flag under the gate's lock (which the I/O
thread takes for every heartbeat anyway) and returns where the rank is; it never waits.
Handing it to a lane worker cost that worker's wake-up: a worker runs in the normal
scheduling class (below), and on a loaded 2-core machine the hold round took 0.13-0.61 s
instead of 0.01-0.04 s in 3 of 12 60 M UCE jobs. Answering it at once also means a hold is
never queued behind a stuck order.

An order that overran its time limit (the `timeout` the controller sent with it) no longer
holds up its lane: the controller gave up on it and moved on, so as soon as another order
waits behind it, the lane leaves the stuck worker to finish on its own (its late result is
ignored by the controller) and a fresh worker serves the queue. Without that, one callback
that never returns would block every later order of its lane (a stuck repair would keep
the dump that follows it from running). `check` is called on every turn of the I/O loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..wire.priority import leave_realtime
from .core import Received, Run

log = logging.getLogger("mindspeed_tft.control.processor")

@dataclass(eq=False)
class _Worker:
    current: Received | None = None
    thread: threading.Thread | None = field(default=None, repr=False)

    def overdue(self, now: float) -> bool:
        return self.current is not None and now > self.current.deadline


class Lane:
    """A FIFO of orders served by one long-lived worker (replaced only when stuck)."""

    def __init__(self, name: str, run: Callable[[Received], None]) -> None:
        self.name = name
        self._run = run
        self._cond = threading.Condition()
        self._queue: deque[Received] = deque()
        self._worker: _Worker | None = None
        self._closed = False
        #: workers left behind in an order past its time limit
        self.abandoned = 0

    def submit(self, order: Received, now: float) -> None:
        with self._cond:
            self._queue.append(order)
            self._staff(now)
            self._cond.notify()

    def check(self, now: float) -> None:
        """Replace a stuck worker if an order waits behind it."""
        with self._cond:
            if self._queue:
                self._staff(now)

    def close(self) -> None:
        """The idle worker ends once the queue is empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _staff(self, now: float) -> None:
        """Make sure a worker that is not stuck serves the queue (lock held)."""
        worker = self._worker
        if worker is not None and not worker.overdue(now):
            return
        if worker is not None and worker.current is not None:
            self.abandoned += 1
            log.warning("%s overran its time limit; its lane goes on with a new worker "
                        "(%d queued)", worker.current.name, len(self._queue))
        fresh = _Worker()
        fresh.thread = threading.Thread(target=self._serve, args=(fresh,), name=self.name,
                                        daemon=True)
        self._worker = fresh
        fresh.thread.start()

    def _serve(self, me: _Worker) -> None:
        leave_realtime()  # a callback can run long: it must not hold a core ahead of training
        while True:
            with self._cond:
                while not self._queue and self._worker is me and not self._closed:
                    self._cond.wait()
                if self._worker is not me or not self._queue:
                    return  # replaced while it was stuck, or closed with nothing left
                order = me.current = self._queue.popleft()
            try:
                self._run(order)
            except BaseException:  # `run` reports failures itself: this is a bug
                log.exception("order %s failed outside its handler", order.name)
            finally:
                with self._cond:
                    me.current = None


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
