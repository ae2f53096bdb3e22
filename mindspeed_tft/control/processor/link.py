"""The processor's link to its controllers without I/O: registration, heartbeats, failover.

`LinkCore` decides what one rank says to its controller and which controller it talks to;
it has no socket, thread or clock. `channel.Channel` is its shell: the DEALER socket, the
I/O thread and the real clock; the simulator's `sim.rank` is another.

One entry point: `handle(input, now) -> outputs`. Inputs: `Connected` once the shell
(re)connected to `address`, `FromController` for every checked message from a controller,
`Tick` on every turn of the shell's loop, `NewReplica` when the rank learns its layout.
Those that may make it speak carry what it says about the rank (`core.RankState`, read from
the processor's core by the shell). Outputs (`Out`): `Transmit` a message now, `Connect` to
another address, `Action` and `CheckHang` (inputs of the processor's core: the shell hands
them over, and sends what the core answers), `Accepted` / `Refused` (the registration's answer), `GiveUp` (no active controller for
`controller_lost_timeout`: the processor exits as an exit order would). `wait(now)` says how
long the shell may wait for input before the next `Tick`.

- Until a controller registered it, the rank registers again every interval.
- Registered, it heartbeats every interval with its step, data status and progress (asking
  for an ack only every other time or so: enough to know the controller is there), and
  has the processor's core check for a hang (`CheckHang`: reported once).
- A controller silent for interval x (misses + 1) is left for the next address (a storm of
  handshakes is allowed for before the first registration there); a backup that redirects
  sends the rank back to the first address.
- A new active controller is told the error report no decision answered yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..wire.fields import Wire
from ..wire.messages import (
    AckMessage,
    ActionMessage,
    HeartbeatMessage,
    RedirectMessage,
    RegisteredMessage,
    RegisterMessage,
    RejectMessage,
)
from ..wire.peers import parse_hostport
from ..wire.protocol import Message, MsgType
from .core import Action, CheckHang, RankState

log = logging.getLogger("mindspeed_tft.control.processor")


# -- inputs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Connected:
    """The shell connected to `address`: register there."""


@dataclass(frozen=True)
class Tick:
    """A turn of the shell's loop."""

    rank: RankState


@dataclass(frozen=True)
class FromController:
    """A checked message from a controller."""

    msg: Message
    rank: RankState


@dataclass(frozen=True)
class NewReplica:
    """The rank's layout, learnt after it registered: a registered rank tells now."""

    replica: dict[str, Any]
    rank: RankState


LinkInput = Connected | Tick | FromController | NewReplica


# -- outputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Transmit:
    """Send `payload` (the typed message, or its map) as a `mtype` message to the
    controller now."""

    mtype: str
    payload: Wire | dict[str, Any]


@dataclass(frozen=True)
class Connect:
    """Connect to `address` (index `index` of the addresses) instead."""

    index: int
    address: tuple[str, int]


@dataclass(frozen=True)
class Accepted:
    """An active controller accepted the registration (the first time)."""


@dataclass(frozen=True)
class Refused:
    """The registration was refused for good."""

    reason: str


@dataclass(frozen=True)
class GiveUp:
    """No active controller was heard for `silent` seconds."""

    silent: float


Out = Transmit | Connect | Action | CheckHang | Accepted | Refused | GiveUp
#: what a controller sends a processor (anything else is dropped by the shell)
TO_PROCESSOR = frozenset({MsgType.ACK, MsgType.ACTION, MsgType.REGISTERED, MsgType.REJECT,
                          MsgType.REDIRECT})


@dataclass(frozen=True)
class Identity:
    """What a registration says about the process."""

    world_size: int
    pid: int
    host: str
    proc: str | None = None     # `procfs.identity()`
    token: str | None = None    # the job's token, when it has one


class LinkCore:
    """The link state of one rank (see the module docstring)."""

    def __init__(self, rank: int, identity: Identity, *,
                 addresses: list[tuple[str, int]], interval: float, misses: int,
                 controller_lost_timeout: float, storm_allowance: float,
                 replica: dict[str, Any] | None = None) -> None:
        self.rank = rank
        self.identity = identity
        self.addresses = list(addresses)
        self.interval = interval
        self.misses = misses
        self.controller_lost_timeout = controller_lost_timeout
        self.storm_allowance = storm_allowance
        self.replica = replica
        self.index = 0
        self.registered_here = False
        self.ever_registered = False
        self.controller_state: str | None = None
        self.controller_role: str | None = None
        #: the first registration reply of the active controller
        self.join_info: RegisteredMessage | None = None
        self.last_ack: float | None = None
        self.failovers = 0
        self.last_heard = 0.0
        self.last_active = 0.0
        self.next_register = 0.0
        self.next_heartbeat = 0.0
        self.switch_to: int | None = None
        self.gave_up = False
        self.refused: str | None = None
        #: a registration that only tells this controller a new layout is under way (its
        #: reply is no new controller: an unanswered report is not sent again)
        self.updating_here = False

    @property
    def address(self) -> tuple[str, int]:
        return self.addresses[self.index]

    # -- the entry point --------------------------------------------------------------------
    def handle(self, event: LinkInput, now: float) -> list[Out]:
        """The one entry point: an input at `now` (seconds of any monotonic clock); the
        outputs, in order."""
        if isinstance(event, Tick):
            return self._tick(event.rank, now)
        if isinstance(event, FromController):
            return self._on_message(event.msg, event.rank, now)
        if isinstance(event, Connected):
            self._connected(now)
            return []
        return self._update_replica(event.replica, event.rank)

    def registration(self, rank: RankState) -> RegisterMessage:
        """The payload of a registration (the rank's identity, layout and position)."""
        step, status = rank.step, rank.status
        who = self.identity
        return RegisterMessage(who.world_size, who.pid, who.host[:255], self.replica,
                               self.ever_registered, step, status, who.token, who.proc)

    def _update_replica(self, replica: dict[str, Any], rank: RankState) -> list[Out]:
        self.replica = replica
        self.updating_here = self.registered_here
        return ([Transmit(MsgType.REGISTER, self.registration(rank))] if self.ever_registered
                else [])

    def _connected(self, now: float) -> None:
        self.last_heard = now
        self.next_register = 0.0
        self.controller_role = None
        self.registered_here = False
        self.updating_here = False

    def wait(self, now: float) -> float:
        """How long the shell may wait for input before the next `tick`."""
        if not self.registered_here and now >= self.next_register:
            return 0.0  # the (next) registration is due: send it without a poll first
        return min(self.interval / 4, 0.25)

    def _tick(self, rank: RankState, now: float) -> list[Out]:
        out: list[Out] = []
        silent = now - self.last_active
        if (not self.gave_up and self.ever_registered
                and silent > self.controller_lost_timeout):
            self.gave_up = True
            out.append(GiveUp(silent))
        switch_to = self._failover_target(now)
        if switch_to is not None:
            self.switch_to = None
            self.index = switch_to
            self.failovers += 1
            out.append(Connect(switch_to, self.address))
            return out
        if self.registered_here:
            out.extend(self._talk(rank, now))
        elif now >= self.next_register:
            self.next_register = now + self.interval
            out.append(Transmit(MsgType.REGISTER, self.registration(rank)))
        return out

    def _failover_target(self, now: float) -> int | None:
        """The address to switch to: asked for (redirect), or the next after a silence."""
        if self.switch_to is not None:
            return self.switch_to
        # one interval more than a rank gets: acks come every other heartbeat or so; until
        # it is registered there, as long again as every rank's handshake at once may take
        # (a registration storm: a reconnect would throw its handshake's work away)
        patience = self.interval * (self.misses + 1)
        if not self.registered_here:
            patience += self.storm_allowance
        if now - self.last_heard > patience:
            log.warning("rank %d: controller %s:%d silent for %.1fs; failing over", self.rank,
                        *self.address, now - self.last_heard)
            return (self.index + 1) % len(self.addresses)
        return None

    def _talk(self, rank: RankState, now: float) -> list[Out]:
        """Registered here: a heartbeat when due, then the core checks for a hang."""
        out: list[Out] = []
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + self.interval
            step, status, progress = rank.step, rank.status, rank.progress
            # an ack only when needed to know the controller is there: with the default
            # 3 misses, every other heartbeat (half the traffic)
            out.append(Transmit(MsgType.HEARTBEAT, HeartbeatMessage(
                step, status, progress,
                now - self.last_heard >= self.interval * self.misses / 2)))
        out.append(CheckHang())
        return out

    def _on_message(self, msg: Message, rank: RankState, now: float) -> list[Out]:
        self.last_heard = now
        if msg.type not in TO_PROCESSOR:
            return []  # heard, but not for a processor (the shell counts it dropped)
        p = msg.body
        if isinstance(p, ActionMessage) or (isinstance(p, (AckMessage, RegisteredMessage))
                                            and p.role == "active"):
            self.last_active = now
        if isinstance(p, AckMessage):
            self.last_ack = now
            self.controller_state, self.controller_role = p.state, p.role
        elif isinstance(p, ActionMessage):
            if self.registered_here:
                return [Action(p.id, p.name, p.payload, p.timeout)]
        elif isinstance(p, RegisteredMessage):
            return self._on_registered(p, rank)
        elif isinstance(p, RejectMessage):
            if p.retry:
                log.warning("rank %d: controller says: %s", self.rank, p.reason)
            else:
                self.refused = p.reason
                return [Refused(p.reason)]
        elif isinstance(p, RedirectMessage) and self.index != 0:
            log.info("rank %d: %s; going back", self.rank, p.reason)
            self.switch_to = 0
        return []

    def _on_registered(self, p: RegisteredMessage, rank: RankState) -> list[Out]:
        self.controller_state, self.controller_role = p.state, p.role
        update, self.updating_here = self.updating_here, False
        self.interval = float(p.interval)
        self.misses = p.misses
        for b in p.backups:
            try:
                hp = parse_hostport(b, "backup from controller")
            except ValueError:
                continue
            if hp not in self.addresses:
                self.addresses.append(hp)
        if not self.registered_here:
            log.info("rank %d registered with %s controller (state %s)", self.rank, p.role,
                     p.state)
        self.registered_here = True
        if p.role != "active":
            return []  # a standby backup: heartbeat here, wait for it to take charge
        first = not self.ever_registered
        self.ever_registered = True
        out: list[Out] = []
        if first:
            self.join_info = p
            out.append(Accepted())
        report = rank.unanswered
        if report is not None and not first and not update:  # the new controller never saw it
            out.append(Transmit(MsgType.REPORT, report.to_wire()))
        return out
