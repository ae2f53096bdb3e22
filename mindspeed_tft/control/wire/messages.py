"""Typed messages: the payload of every message type, and the one table that checks them.

Each message type's payload is a frozen dataclass on `fields.Wire`, like the orders
(`order_types`) and the results and reports (`results`): `from_wire` checks every field and
raises `MessageError` naming the message, the field, the value and what is allowed;
`to_wire` gives its map, the keys in a fixed order and optional ones only when set (the
same msgpack bytes from every sender), checked the same way. `MESSAGE_TYPES` maps
every `MsgType` to its class; `protocol` checks each payload by it, on sending and on
receiving, and hands the receiver the typed payload (`protocol.Message.body`).

The `action` message carries its order as a map (`ActionMessage.payload`), and the `result`
message its order's result (`results.ResultEnvelope.result`): the receiver reads those by
the order's name (`order_types.from_wire`, `ResultEnvelope.typed`), and one that does not
match fails the order instead of being dropped as a frame.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .fields import (
    REPLICA,
    STEP,
    Reader,
    Wire,
    WireError,
    is_int,
    is_map,
    is_rank,
    is_replica,
    is_step,
    is_text,
)
from .names import (
    ACTIONS,
    DATA_STATUS,
    MAX_EXIT_REASON,
    MAX_RANK,
    MAX_RANKS_PER_MESSAGE,
    MAX_STEP,
    MAX_TEXT,
    ROLES,
    MsgType,
)
from .results import ReportMessage, ResultEnvelope

#: the most backup controllers a job names
MAX_BACKUPS = 8
_ENDPOINT = is_text(300)
_PID = is_int(0, 1 << 31)
_CODE = is_int(-(1 << 31), 1 << 31)
_WORLD = is_int(1, MAX_RANK + 1)
_EPOCH = is_int(0, MAX_STEP)
_STATE = is_text(32)
_TOKEN = is_text(256)
_HOST = is_text(255)
_PROC = is_text(160)
_TEXT = is_text(MAX_TEXT)
_REASON = is_text(MAX_EXIT_REASON)
_INDEX = is_int(0, MAX_BACKUPS - 1)
_MISSES = is_int(1, 1000)
_STATUS_TEXT = "one of " + ", ".join(DATA_STATUS)


def _is_bool(v: Any) -> bool:
    return type(v) is bool


def _is_status(v: Any) -> bool:
    return type(v) is str and v in DATA_STATUS


def _is_replica_or_nil(v: Any) -> bool:
    return v is None or is_replica(v)


def _is_step_or_nil(v: Any) -> bool:
    return v is None or is_step(v)


def _is_backups(v: Any) -> bool:
    return type(v) is list and len(v) <= MAX_BACKUPS and all(_ENDPOINT(x) for x in v)


def _is_seconds(lo: float, hi: float) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return type(v) in (int, float) and math.isfinite(v) and lo <= v <= hi
    return check


_INTERVAL = _is_seconds(1e-3, 3600)
_TIMEOUT = _is_seconds(0, 1e6)


class MessageError(WireError):
    """A message payload that does not match its type (the text names the field)."""


class _Message(Wire):
    """What the typed messages share: the wire form, checked both ways."""

    TYPE: ClassVar[str]
    ERROR: ClassVar[type[WireError]] = MessageError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.WHAT = f"{cls.TYPE} message"


def _flag(r: Reader, key: str, default: bool) -> bool:
    value = r.get(key, _is_bool, "true or false", required=False)
    return default if value is None else bool(value)


def _token(r: Reader) -> str | None:
    return r.get("token", _TOKEN, "the job's token: at most 256 characters", required=False)


def _status(r: Reader, required: bool = True) -> str | None:
    return r.get("status", _is_status, _STATUS_TEXT, required)


def _backups(r: Reader) -> tuple[str, ...]:
    return tuple(r.get("backups", _is_backups,
                       f"a list of at most {MAX_BACKUPS} endpoints of at most 300 characters"))


def _lock_step(r: Reader) -> int | None:
    return r.get("lock_step", _is_step_or_nil, STEP + ", or nil")


def _role(r: Reader) -> str:
    return r.choice("role", ROLES)


# -- processor -> controller --------------------------------------------------------------


@dataclass(frozen=True)
class RegisterMessage(_Message):
    """A rank registers (or tells a new layout): who its process is, its replica layout,
    whether it fails over from another controller, where its data is."""

    TYPE: ClassVar[str] = MsgType.REGISTER
    world_size: int
    pid: int
    host: str
    replica: dict[str, Any] | None = None
    failover: bool = False
    step: int = 0
    status: str = "updated"
    #: the job's secret (over CURVE: encrypted), when the job has one
    token: str | None = None
    #: `procfs.identity()`: where the process runs and its start (a controller in the same
    #: pid namespace watches /proc)
    proc: str | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "world_size": self.world_size, "pid": self.pid, "host": self.host,
            "replica": self.replica, "failover": self.failover, "step": self.step,
            "status": self.status}
        if self.token is not None:
            wire["token"] = self.token
        if self.proc is not None:
            wire["proc"] = self.proc
        return wire

    @classmethod
    def _read(cls, r: Reader) -> RegisterMessage:
        world_size = r.get("world_size", _WORLD, f"a world size: an integer in [1, {MAX_RANK + 1}]")
        pid = r.get("pid", _PID, "a pid: an integer in [0, 2**31]")
        host = r.get("host", _HOST, "a host name of at most 255 characters")
        replica = r.get("replica", _is_replica_or_nil, REPLICA + ", or nil", required=False)
        step = r.get("step", is_step, STEP, required=False)
        return cls(world_size, pid, host, replica, _flag(r, "failover", False),
                   0 if step is None else step, _status(r, required=False) or "updated",
                   _token(r), r.get("proc", _PROC, "at most 160 characters", required=False))


@dataclass(frozen=True)
class HeartbeatMessage(_Message):
    """A rank is alive: where its data is, the last step it trained (`progress`: None,
    unchanged), and whether it wants an ack back."""

    TYPE: ClassVar[str] = MsgType.HEARTBEAT
    step: int
    status: str
    progress: int | None = None
    ack: bool = True

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"step": self.step, "status": self.status}
        if self.progress is not None:
            wire["progress"] = self.progress
        wire["ack"] = self.ack
        return wire

    @classmethod
    def _read(cls, r: Reader) -> HeartbeatMessage:
        return cls(r.step("step"), str(_status(r)), r.opt_step("progress"),
                   _flag(r, "ack", True))


@dataclass(frozen=True)
class ByeMessage(_Message):
    """A rank's training ended with `code`."""

    TYPE: ClassVar[str] = MsgType.BYE
    code: int

    def _wire(self) -> dict[str, Any]:
        return {"code": self.code}

    @classmethod
    def _read(cls, r: Reader) -> ByeMessage:
        return cls(r.get("code", _CODE, "an exit code: an integer in [-2**31, 2**31]"))


# -- launcher -> controller -----------------------------------------------------------------


@dataclass(frozen=True)
class ExitedMessage(_Message):
    """Another node's launcher saw the sender rank's process `pid` end with `code`;
    `no_replacement`: why it will not restart it."""

    TYPE: ClassVar[str] = MsgType.EXITED
    pid: int
    code: int
    token: str | None = None
    no_replacement: str | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"pid": self.pid, "code": self.code}
        if self.token is not None:
            wire["token"] = self.token
        if self.no_replacement is not None:
            wire["no_replacement"] = self.no_replacement
        return wire

    @classmethod
    def _read(cls, r: Reader) -> ExitedMessage:
        return cls(r.get("pid", _PID, "a pid: an integer in [0, 2**31]"),
                   r.get("code", _CODE, "an exit code: an integer in [-2**31, 2**31]"),
                   _token(r),
                   r.get("no_replacement", _REASON,
                         f"a reason of at most {MAX_EXIT_REASON} characters", required=False))


# -- controller -> processor ------------------------------------------------------------------


@dataclass(frozen=True)
class RegisteredMessage(_Message):
    """A controller took a registration: its epoch, state and role, the heartbeat period,
    the backups, whether the rank rejoins a job being recovered, the lock step under way."""

    TYPE: ClassVar[str] = MsgType.REGISTERED
    epoch: int
    state: str
    interval: float
    misses: int
    backups: tuple[str, ...]
    rejoin: bool
    lock_step: int | None
    role: str

    def _wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "state": self.state, "interval": self.interval,
                "misses": self.misses, "backups": list(self.backups), "rejoin": self.rejoin,
                "lock_step": self.lock_step, "role": self.role}

    @classmethod
    def _read(cls, r: Reader) -> RegisteredMessage:
        epoch = r.get("epoch", _EPOCH, "an epoch: an integer in [0, 2**62]")
        state = r.get("state", _STATE, "a state name of at most 32 characters")
        interval = r.get("interval", _INTERVAL, "seconds in [0.001, 3600]")
        misses = r.get("misses", _MISSES, "an integer in [1, 1000]")
        backups = _backups(r)
        rejoin = r.get("rejoin", _is_bool, "true or false")
        return cls(epoch, state, interval, misses, backups, rejoin, _lock_step(r), _role(r))


@dataclass(frozen=True)
class AckMessage(_Message):
    """The answer to a heartbeat: the controller's state, epoch and role."""

    TYPE: ClassVar[str] = MsgType.ACK
    state: str
    epoch: int
    role: str

    def _wire(self) -> dict[str, Any]:
        return {"state": self.state, "epoch": self.epoch, "role": self.role}

    @classmethod
    def _read(cls, r: Reader) -> AckMessage:
        return cls(r.get("state", _STATE, "a state name of at most 32 characters"),
                   r.get("epoch", _EPOCH, "an epoch: an integer in [0, 2**62]"), _role(r))


@dataclass(frozen=True)
class ActionMessage(_Message):
    """Order `id`: run order `name` within `timeout` seconds; `payload`: the order's map
    (`order_types`, read by the processor)."""

    TYPE: ClassVar[str] = MsgType.ACTION
    id: int
    name: str
    timeout: float
    payload: dict[str, Any]

    def _wire(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "timeout": self.timeout,
                "payload": self.payload}

    @classmethod
    def _read(cls, r: Reader) -> ActionMessage:
        return cls(r.get("id", _EPOCH, "an order id: an integer in [0, 2**62]"),
                   r.choice("name", ACTIONS),
                   r.get("timeout", _TIMEOUT, "seconds in [0, 1e6]"),
                   r.get("payload", is_map, "a map with string keys"))


@dataclass(frozen=True)
class RejectMessage(_Message):
    """A registration refused; `retry`: it may be tried again later."""

    TYPE: ClassVar[str] = MsgType.REJECT
    reason: str
    retry: bool

    def _wire(self) -> dict[str, Any]:
        return {"reason": self.reason, "retry": self.retry}

    @classmethod
    def _read(cls, r: Reader) -> RejectMessage:
        return cls(r.get("reason", _TEXT, f"at most {MAX_TEXT} characters"),
                   r.get("retry", _is_bool, "true or false"))


@dataclass(frozen=True)
class RedirectMessage(_Message):
    """A standby backup sends the rank back to the active controller."""

    TYPE: ClassVar[str] = MsgType.REDIRECT
    reason: str

    def _wire(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def _read(cls, r: Reader) -> RedirectMessage:
        return cls(r.get("reason", _TEXT, f"at most {MAX_TEXT} characters"))


# -- backup controller <-> active controller --------------------------------------------------


@dataclass(frozen=True)
class BackupMessage(_Message):
    """A backup controller announces itself (`endpoint`, its `index`) to the active one."""

    TYPE: ClassVar[str] = MsgType.BACKUP
    endpoint: str
    index: int
    token: str | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"endpoint": self.endpoint, "index": self.index}
        if self.token is not None:
            wire["token"] = self.token
        return wire

    @classmethod
    def _read(cls, r: Reader) -> BackupMessage:
        return cls(r.get("endpoint", _ENDPOINT, "an endpoint of at most 300 characters"),
                   r.get("index", _INDEX, f"an integer in [0, {MAX_BACKUPS - 1}]"), _token(r))


@dataclass(frozen=True)
class SyncRow:
    """One rank in a sync: its step, data status, health (`Health` value) and layout."""

    rank: int
    step: int
    status: str
    health: str
    replica: dict[str, Any] | None

    def _wire(self) -> list[Any]:
        return [self.rank, self.step, self.status, self.health, self.replica]


def _is_sync_rows(v: Any) -> bool:
    """[[rank, step, status, health, replica-or-None], ...]"""
    return type(v) is list and len(v) <= MAX_RANKS_PER_MESSAGE and all(
        type(row) is list and len(row) == 5 and is_rank(row[0]) and is_step(row[1])
        and type(row[2]) is str and type(row[3]) is str
        and (row[4] is None or is_replica(row[4])) for row in v)


@dataclass(frozen=True)
class SyncMessage(_Message):
    """The active controller's whole state, for its backups: state, epoch, features, a row
    per rank, the backups, the lock step under way."""

    TYPE: ClassVar[str] = MsgType.SYNC
    state: str
    epoch: int
    world_size: int
    features: dict[str, Any]
    ranks: tuple[SyncRow, ...]
    backups: tuple[str, ...]
    lock_step: int | None

    def _wire(self) -> dict[str, Any]:
        return {"state": self.state, "epoch": self.epoch, "world_size": self.world_size,
                "features": self.features, "ranks": [row._wire() for row in self.ranks],
                "backups": list(self.backups), "lock_step": self.lock_step}

    @classmethod
    def _read(cls, r: Reader) -> SyncMessage:
        state = r.get("state", _STATE, "a state name of at most 32 characters")
        epoch = r.get("epoch", _EPOCH, "an epoch: an integer in [0, 2**62]")
        world_size = r.get("world_size", _WORLD,
                           f"a world size: an integer in [1, {MAX_RANK + 1}]")
        features = r.get("features", is_map, "a map with string keys")
        rows = r.get("ranks", _is_sync_rows,
                     "a list of [rank, step, status, health, replica layout or nil]")
        return cls(state, epoch, world_size, features, tuple(SyncRow(*row) for row in rows),
                   _backups(r), _lock_step(r))


#: a typed payload: what `protocol.decode` hands a receiver
MessageBody = (RegisterMessage | HeartbeatMessage | ReportMessage | ResultEnvelope
               | ByeMessage | ExitedMessage | RegisteredMessage | AckMessage | ActionMessage
               | RejectMessage | RedirectMessage | BackupMessage | SyncMessage)
#: message type -> the class its payload is checked and read by (every `MsgType`)
MESSAGE_TYPES: dict[str, type[MessageBody]] = {
    MsgType.REGISTER: RegisterMessage, MsgType.HEARTBEAT: HeartbeatMessage,
    MsgType.REPORT: ReportMessage, MsgType.RESULT: ResultEnvelope, MsgType.BYE: ByeMessage,
    MsgType.EXITED: ExitedMessage, MsgType.REGISTERED: RegisteredMessage,
    MsgType.ACK: AckMessage, MsgType.ACTION: ActionMessage, MsgType.REJECT: RejectMessage,
    MsgType.REDIRECT: RedirectMessage, MsgType.BACKUP: BackupMessage,
    MsgType.SYNC: SyncMessage}
