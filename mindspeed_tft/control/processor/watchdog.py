"""Progress watchdog: notices a rank whose training thread stopped making progress (a hang).

Heartbeats come from the processor's background thread, so they keep flowing while the
training thread is stuck in a collective that never completes; heartbeats alone cannot see a
hang. The trainer reports every completed step; the watchdog keeps the durations of recent
steps and allows

    timeout = max(floor, factor x slowest recent step)

before declaring the rank hung (before the first step, and after every resume, the longer
`initial` timeout covers start-up and rebuilds). This follows the shape of NVRx's section
timeouts: limits derived from what was observed, with a configurable floor.

This is the decision part only, owned by the processor's core (`core.ProcessorCore`, which
feeds it and asks it on the `CheckHang` input): no clock (every time is an argument `now`)
and no lock (the core's shell calls the core under its own lock). The core reports `hang`
once; the controller treats that like a lost process.
"""

from __future__ import annotations

from collections import deque


class ProgressWatchdog:
    """Tracks step progress; `check(now)` says whether the rank looks hung."""

    def __init__(self, floor: float, factor: float, initial: float, window: int = 20) -> None:
        if floor <= 0 or factor < 1 or initial <= 0:
            raise ValueError(f"bad watchdog settings: floor={floor}, factor={factor}, "
                             f"initial={initial} (floor > 0, factor >= 1, initial > 0)")
        self.floor = floor
        self.factor = factor
        self.initial = initial
        self._durations: deque[float] = deque(maxlen=window)
        self._last_time = 0.0
        self._last_step: int | None = None
        self._armed = True
        self._fresh = True   # no step since start/resume: use the initial timeout
        self._fired = False

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def timeout(self) -> float:
        """The current limit in seconds."""
        if self._fresh or not self._durations:
            return max(self.initial, self.floor)
        return max(self.floor, self.factor * max(self._durations))

    def progress(self, step: int, now: float) -> None:
        """The training thread completed `step` at `now`."""
        if self._last_step is not None and step == self._last_step:
            return
        if not self._fresh:
            self._durations.append(now - self._last_time)
        self._fresh = False
        self._last_time = now
        self._last_step = step
        self._fired = False

    def pause(self) -> None:
        """Stop watching (the rank is stopped on purpose or waits for a decision)."""
        self._armed = False

    def resume(self, now: float) -> None:
        """Watch again from `now`, with the initial timeout until the next step."""
        self._armed = True
        self._fresh = True
        self._fired = False
        self._last_time = now

    def check(self, now: float) -> tuple[float, float] | None:
        """(idle seconds, timeout) the first time the limit is exceeded at `now`, else None."""
        if not self._armed or self._fired:
            return None
        idle = now - self._last_time
        limit = self.timeout()
        if idle <= limit:
            return None
        self._fired = True
        return idle, limit
