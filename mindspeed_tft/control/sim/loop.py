"""The simulator's virtual clock and network.

`Loop` runs callbacks in virtual-time order (ties in the order they were scheduled, so a
run is a pure function of its schedule). `Network` carries frames over per-connection
links: each direction is FIFO with a random delay drawn from the run's seeded generator; a
cut (`disconnect`) drops what is in flight, drops what the controller sends while the link
is down (a ROUTER drops frames to a peer it lost) and queues what the rank sends until it
reconnects (a DEALER queues while it reconnects).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Loop:
    """Virtual time and the callbacks due in it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._n = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(when, self.now), self._n, fn, args))
        self._n += 1

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def step(self) -> None:
        """Run the next callback (its time becomes now)."""
        when, _, fn, args = heapq.heappop(self._heap)
        self.now = when
        fn(*args)

    def __bool__(self) -> bool:
        return bool(self._heap)


@dataclass
class _Link:
    """One connection's state: when each direction last delivered, and cuts."""

    up_last: float = 0.0
    down_last: float = 0.0
    #: bumped at each cut: what was in flight before it is dropped
    generation: int = 0
    #: the link is down until then (virtual time)
    down_until: float = 0.0


class Network:
    """Per-connection FIFO links with delays and cuts (see the module docstring)."""

    def __init__(self, loop: Loop, rng: random.Random, delay: tuple[float, float]) -> None:
        self.loop = loop
        self.rng = rng
        self.delay = delay
        self.links: dict[bytes, _Link] = {}
        self.dropped = 0

    def _delay(self) -> float:
        lo, hi = self.delay
        return lo + (hi - lo) * self.rng.random()

    def up(self, identity: bytes, deliver: Callable[[bytes], None], frame: bytes) -> None:
        """A rank's frame to the controller (queued while the link is down)."""
        link = self.links.setdefault(identity, _Link())
        start = max(self.loop.now, link.down_until)
        when = max(start + self._delay(), link.up_last + 1e-7)
        link.up_last = when
        self.loop.at(when, self._arrive, link, link.generation, deliver, frame)

    def down(self, identity: bytes, deliver: Callable[[bytes], None], frame: bytes) -> None:
        """The controller's frame to a rank (dropped while the link is down)."""
        link = self.links.setdefault(identity, _Link())
        if self.loop.now < link.down_until:
            self.dropped += 1
            return
        when = max(self.loop.now + self._delay(), link.down_last + 1e-7)
        link.down_last = when
        self.loop.at(when, self._arrive, link, link.generation, deliver, frame)

    def _arrive(self, link: _Link, generation: int, deliver: Callable[[bytes], None],
                frame: bytes) -> None:
        if generation != link.generation:
            self.dropped += 1
            return
        deliver(frame)

    def heal(self) -> None:
        """Every cut link comes back now (nothing more is cut)."""
        now = self.loop.now
        for link in self.links.values():
            link.down_until = min(link.down_until, now)

    def disconnect(self, identity: bytes, seconds: float) -> None:
        """Cut a connection for `seconds`: in-flight frames are lost, then it reconnects."""
        link = self.links.setdefault(identity, _Link())
        link.generation += 1
        link.down_until = self.loop.now + seconds
        link.up_last = max(link.up_last, link.down_until)
