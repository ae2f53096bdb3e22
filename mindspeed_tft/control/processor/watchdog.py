"""Progress watchdog: notices a rank whose training thread stopped making progress (a hang).

Heartbeats come from the processor's background thread, so they keep flowing while the
training thread is stuck in a collective that never completes; heartbeats alone cannot see a
hang. The trainer calls `report_progress(step)` once per step; the watchdog keeps the
durations of recent steps and allows

    timeout = max(floor, factor x slowest recent step)

before declaring the rank hung (before the first step, and after every resume, the longer
`initial` timeout covers start-up and rebuilds). This follows the shape of NVRx's section
timeouts: limits derived from what was observed, with a configurable floor. The processor
checks it from its I/O thread and reports `hang` once; the controller treats that like a
lost process.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class ProgressWatchdog:
    """Tracks step progress; `check()` says whether the rank looks hung."""

    def __init__(self, floor: float, factor: float, initial: float, window: int = 20) -> None:
        if floor <= 0 or factor < 1 or initial <= 0:
            raise ValueError(f"bad watchdog settings: floor={floor}, factor={factor}, "
                             f"initial={initial} (floor > 0, factor >= 1, initial > 0)")
        self.floor = floor
        self.factor = factor
        self.initial = initial
        self._durations: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._last_time = time.monotonic()
        self._last_step: int | None = None
        self._armed = True
        self._fresh = True   # no step since start/resume: use the initial timeout
        self._fired = False

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def timeout(self) -> float:
        """The current limit in seconds."""
        with self._lock:
            return self._timeout_locked()

    def _timeout_locked(self) -> float:
        if self._fresh or not self._durations:
            return max(self.initial, self.floor)
        return max(self.floor, self.factor * max(self._durations))

    def progress(self, step: int, now: float | None = None) -> None:
        """The training thread completed `step` (at `now`, default the monotonic clock)."""
        now = time.monotonic() if now is None else now
        with self._lock:
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
        with self._lock:
            self._armed = False

    def resume(self, now: float | None = None) -> None:
        """Watch again from `now` (default the monotonic clock), with the initial timeout
        until the next step."""
        with self._lock:
            self._armed = True
            self._fresh = True
            self._fired = False
            self._last_time = time.monotonic() if now is None else now

    def check(self, now: float | None = None) -> tuple[float, float] | None:
        """(idle seconds, timeout) the first time the limit is exceeded, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._armed or self._fired:
                return None
            idle = now - self._last_time
            limit = self._timeout_locked()
            if idle <= limit:
                return None
            self._fired = True
            return idle, limit
