"""What the controller's core decides in answer to one input: frames, events, the upstream.

The core (`core.ControllerCore`) never writes to a socket or a file: each of its parts puts
what it decided here, and whoever fed it the input takes it (`take`): the running
`Controller` (its shell) writes the events to the events stream, then sends the frames over
its ROUTER and its link to the active controller; the simulator (`control.sim`) delivers
them over its virtual network and checks the events against the protocol's invariants.

An event is stamped with the time of the input it answers (`ControllerCore.handle`'s `now`,
on the loop's clock: the shell's `time.monotonic()`, the simulator's virtual time), shifted
to the events clock by the offset the last `Start` or `Tick` input gave (`wall_offset`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Admit(str, Enum):
    """Why the connection an input's frame came by is admitted."""

    #: it showed the job's token (a registration, a backup's hello)
    TOKEN = "token"
    #: a registered rank's frame over a connection still pending (a reconnect)
    KNOWN = "known"


@dataclass
class Outputs:
    """One input's outputs, in the order they were decided."""

    #: (routing id of a processor or backup connection, encoded frame)
    frames: list[tuple[bytes, bytes]] = field(default_factory=list)
    #: event records, as `events.emit` makes them (`events.write_record` writes them)
    events: list[dict[str, Any]] = field(default_factory=list)
    #: frames for the active controller (a backup's hellos)
    upstream: list[bytes] = field(default_factory=list)
    #: a backup took charge: its link to the active controller closes
    close_upstream: bool = False
    #: the connection the input's frame came by is admitted, and why (None: it is not)
    admit: Admit | None = None
    #: registered ranks whose processes the shell may watch: (rank, pid, where it runs as
    #: the registration said: `procfs.identity()`, or None)
    watch: list[tuple[int, int, str | None]] = field(default_factory=list)
    #: something a snapshot of the controller shows changed
    dirty: bool = False


class Outbox:
    """Collects the core's outputs until they are taken (see the module docstring)."""

    def __init__(self) -> None:
        self.now = 0.0
        #: the events clock minus the loop clock (`inputs.Tick.wall_offset`)
        self.wall_offset = 0.0
        self._out = Outputs()

    def at(self, now: float) -> None:
        """The time of the input about to be handled (loop clock)."""
        self.now = now

    def emit(self, event: str, rank: int, **fields: Any) -> dict[str, Any]:
        """An event record (the signature and record of `events.emit`)."""
        record: dict[str, Any] = {"time": self.now + self.wall_offset, "event": event, "rank": rank, **fields}
        self._out.events.append(record)
        return record

    def send(self, identity: bytes, frame: bytes) -> None:
        self._out.frames.append((identity, frame))

    def send_upstream(self, frame: bytes) -> None:
        self._out.upstream.append(frame)

    def close_upstream(self) -> None:
        self._out.close_upstream = True

    def admit(self, how: Admit) -> None:
        """Admit the connection the input's frame came by."""
        if self._out.admit is None:
            self._out.admit = how

    def watch(self, rank: int, pid: int, proc: str | None) -> None:
        self._out.watch.append((rank, pid, proc))

    def mark_dirty(self) -> None:
        self._out.dirty = True

    def take(self) -> Outputs:
        """What was decided since the last `take`."""
        out, self._out = self._out, Outputs()
        return out
