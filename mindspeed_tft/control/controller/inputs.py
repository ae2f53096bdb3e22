"""What the controller's core takes in: one typed value per kind of input.

`ControllerCore.handle(input, now)` is the core's one entry point; the running controller's
loop (`controller.Controller`) and the simulator (`control.sim`) make the same call. An
input carries everything the core needs to decide on it: a frame comes with what the shell
knows of the connection it came by (its CURVE key, and whether it is admitted or may be),
so the core never calls out to ask.

- `Start`: the controller listens.
- `Frame`: a frame from a processor, backup or launcher connection.
- `Upstream`: frames from the active controller (a backup's link).
- `Tick`: time passed (deadlines of phases, silences, INIT, syncs).
- commands, from an operator or a launcher: `Pause`, `Resume`, `ProcessExit` (a process
  seen ended: by a launcher, or by the shell in /proc), `ProcessGone` (ended, its code
  unknown), `NoReplacement`, `NodeSilent`, `NodeBack`, `NewFeatures`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...features import Features

#: how a `lost` fault's message names a launcher's report of a process's end
BY_LAUNCHER = "reported by its launcher"


@dataclass(frozen=True)
class Start:
    """The controller listens on `endpoint` (`ip:port`, known once bound; "" keeps the one
    it was made with); `server_key`: under CURVE, the public key of the controllers' server
    pair (a backup shows it), else None; `wall_offset`: see `Tick`."""

    endpoint: str = ""
    server_key: str | None = None
    wall_offset: float = 0.0


@dataclass(frozen=True)
class Frame:
    """A frame from a processor, backup or launcher connection.

    identity: the connection's routing id. data: the frame's bytes. key: the sender's CURVE
    public key (the ZAP User-Id of its frame; None without CURVE). room: the connection is
    admitted already, or may be (the cap of admitted connections is not reached): a
    registration that shows the job's token over a connection without room is refused for
    now. extra: how many frames more the message had (a protocol error).
    """

    identity: bytes
    data: bytes
    key: str | None = None
    room: bool = True
    extra: int = 0


@dataclass(frozen=True)
class Upstream:
    """Frames from the active controller (a backup's link)."""

    frames: tuple[bytes, ...]


@dataclass(frozen=True)
class Tick:
    """Time passed. `wall_offset`: the events clock minus the loop clock, read now (the
    shell's `time.time() - time.monotonic()`; the simulator's 0): events are stamped with
    the loop's time plus the last offset given, so that the durations between them are the
    loop clock's."""

    wall_offset: float = 0.0


@dataclass(frozen=True)
class Pause:
    """Operator pause: NORMAL -> PAUSE, ranks hold before their next update."""


@dataclass(frozen=True)
class Resume:
    """End an operator pause: PAUSE -> NORMAL."""


@dataclass(frozen=True)
class ProcessExit:
    """`rank`'s process ended with `returncode`, seen by `source` (its launcher, or the
    shell in /proc); `no_replacement`: why its launcher will not restart it (None: it may),
    known to the incident before it decides."""

    rank: int
    returncode: int
    no_replacement: str | None = None
    source: str = BY_LAUNCHER


@dataclass(frozen=True)
class ProcessGone:
    """`rank`'s process `how` ("ended": its code unknown), seen by `source`."""

    rank: int
    how: str
    source: str


@dataclass(frozen=True)
class NoReplacement:
    """A launcher will not restart lost `rank`."""

    rank: int
    why: str


@dataclass(frozen=True)
class NodeSilent:
    """Node 0's launcher has not heard node `node`'s launcher (holding `ranks`) for
    `silent_for` seconds (`nodes.Nodes`)."""

    node: int
    ranks: tuple[int, ...]
    silent_for: float


@dataclass(frozen=True)
class NewFeatures:
    """Features learnt later (the SDK's runtime, before training starts)."""

    features: Features


@dataclass(frozen=True)
class NodeBack:
    """Node `node`'s launcher, silent before, is heard again."""

    node: int


Command = (Pause | Resume | ProcessExit | ProcessGone | NoReplacement | NodeSilent | NodeBack
           | NewFeatures)
Input = Start | Frame | Upstream | Tick | Command
