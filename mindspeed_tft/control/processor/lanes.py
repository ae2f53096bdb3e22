"""The lane policy without I/O: which lane runs an order, and when an order starts.

An order (`action` message) runs a callback that may take long or never return, so orders
run on two lanes, each a FIFO served one order at a time:

- `work`: pause, stop, clean, repair, rollback, dump, rename, in the order they arrive;
- `release`: exit and resume. They end a hold, so they must not queue behind the order
  they end (a stop waiting for the training thread to park, a stuck callback).

(A hold runs on no lane: the core answers it at once, `core.ProcessorCore`.)

An order past its time limit (the deadline it was received with) no longer holds its lane
up once another order waits behind it: the controller gave up on it and moved on, so the
next order starts and the overdue one is abandoned, left to run to its end on its own.
Its late result is still sent (the controller ignores it); it starts nothing.

`LanePolicy` is one lane's state machine: `submit`, `check` (on every turn of the shell's
loop) and `finish` return the orders to `Start`. No thread, lock or clock: the processor's
worker threads (`orders.Lane`) and the simulator's virtual ones (`sim.rank`) both drive it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..wire.order_types import TypedOrder

#: orders that end a hold: they run on a lane of their own
RELEASE_ORDERS = frozenset({"exit", "resume"})
#: the lanes, in the order a shell looks at them
LANES = ("work", "release")


@dataclass(frozen=True)
class Received:
    """An order as received: its id, name, deadline (arrival + its time limit) and the typed
    order (None: its payload did not match; `error` says why)."""

    id: int
    name: str
    deadline: float
    order: TypedOrder | None
    error: str = ""


def lane_for(name: str) -> str:
    """The lane an order named `name` runs on."""
    return "release" if name in RELEASE_ORDERS else "work"


@dataclass(frozen=True)
class Start:
    """Start running `order` now. `abandon`: the overdue order whose runner is left to finish
    on its own (None: the lane was free); the shell needs a fresh runner then."""

    order: Received
    abandon: Received | None = None


class LanePolicy:
    """One lane: a FIFO, one order at a time, an overdue order abandoned once another waits."""

    def __init__(self) -> None:
        self.queue: deque[Received] = deque()
        #: the order the lane's runner runs (None: the lane is free)
        self.current: Received | None = None
        #: orders abandoned past their time limit
        self.abandoned = 0

    def submit(self, order: Received, now: float) -> list[Start]:
        """`order` arrived at `now`: queue it; what starts."""
        self.queue.append(order)
        return self._staff(now)

    def check(self, now: float) -> list[Start]:
        """A turn of the shell's loop at `now`: an overdue order gives way to a waiting one."""
        return self._staff(now) if self.queue else []

    def finish(self, order: Received, now: float) -> list[Start]:
        """`order` ended (its result is sent, late or not): what starts next. An abandoned
        order's end starts nothing: its lane went on without it."""
        if order is not self.current:
            return []
        self.current = None
        return self._staff(now)

    def _staff(self, now: float) -> list[Start]:
        if not self.queue:
            return []
        current = self.current
        if current is not None and now <= current.deadline:
            return []
        self.current = self.queue.popleft()
        if current is not None:
            self.abandoned += 1
        return [Start(self.current, current)]
