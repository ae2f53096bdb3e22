"""Wire protocol between processors and controllers: msgpack frames with a schema per type.

Every message is one ZeroMQ frame holding a msgpack array

    [version, type, sender, seq, payload]

`version` is `PROTOCOL_VERSION`; `type` one of the `MsgType` names; `sender` the sending
rank (`CONTROLLER` = -1 for controllers); `seq` a per-sender counter that only grows (a
receiver takes a message only within `SEQ_WINDOW` of the sender's last one);
`payload` a map checked against the schema of its type (`SCHEMAS`): required and optional
keys with their types and ranges; unknown keys are refused.

`decode` never unpickles and never trusts a length, and what a frame can cost is bounded
before any of it is decoded: `peek` reads the fixed header (`0x95`, the version, the type as
a msgpack fixstr: what every msgpack packer writes) in constant time, and a frame longer than
its type's cap (`Limits`: a heartbeat is tens of bytes, a sync one row per rank) is refused
there. Only then does msgpack run, with limits on every container and string sized by the
world size (`Limits.for_world`) and no extension types; anything that does not match its
schema raises `ProtocolError` with a short reason. Receivers count and log those
(`DropCounter`) and carry on; nothing that arrives can crash or block them.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

log = logging.getLogger("mindspeed_tft.control.protocol")

PROTOCOL_VERSION = 1
CONTROLLER = -1
MAX_RANK = (1 << 24) - 1
MAX_STEP = (1 << 62)
MAX_TEXT = 4096
#: the longest reason a launcher's `exited` report gives for not restarting a worker
MAX_EXIT_REASON = 1024
#: how far one message's `seq` may run ahead of the last one its receiver took from the same
#: sender (a sender's messages arrive in order over one connection: far more than a rank
#: sends in hours); one further ahead is dropped, so that a forged frame cannot push the
#: counter out of a live rank's reach (a bound, not an authentication: that is CURVE's)
SEQ_WINDOW = 100_000


def seq_in_window(seq: int, last: int) -> bool:
    """Whether `seq` follows `last` within `SEQ_WINDOW`."""
    return last < seq <= last + SEQ_WINDOW
MAX_RANKS_PER_MESSAGE = 1 << 21


class MsgType:
    """Message type names (strings on the wire)."""

    # processor -> controller
    REGISTER = "register"
    HEARTBEAT = "hb"
    REPORT = "report"
    RESULT = "result"
    BYE = "bye"
    # launcher -> controller: a worker of another node's launcher ended
    EXITED = "exited"
    # controller -> processor
    REGISTERED = "registered"
    ACK = "ack"
    ACTION = "action"
    REJECT = "reject"
    REDIRECT = "redirect"
    # backup controller <-> active controller
    BACKUP = "backup"
    SYNC = "sync"


#: actions a controller can order; processors run the callback registered for each name
ACTIONS = ("pause", "hold", "stop", "clean", "repair", "rollback", "dump", "rename", "resume",
           "exit", "scale_in", "scale_out")
#: what a processor can report (SPEC 6): see `classify.FaultKind`
REPORT_KINDS = ("uce", "comm", "normal", "unknown", "hang")
DATA_STATUS = ("updated", "updating")
ROLES = ("active", "standby")


class ProtocolError(ValueError):
    """A frame that is dropped; `reason` is a short category used for counting."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class Message(NamedTuple):
    """A decoded, schema-checked message."""

    type: str
    sender: int
    seq: int
    payload: dict[str, Any]


# ---------------------------------------------------------------------------------------
# field checks: each returns True when the value is acceptable


Check = Callable[[Any], bool]


def _int(lo: int, hi: int) -> Check:
    def check(v: Any) -> bool:
        return type(v) is int and lo <= v <= hi
    return check


def _num(lo: float, hi: float) -> Check:
    def check(v: Any) -> bool:
        return (type(v) is int or type(v) is float) and math.isfinite(v) and lo <= v <= hi
    return check


def _str(max_len: int) -> Check:
    def check(v: Any) -> bool:
        return type(v) is str and len(v) <= max_len
    return check


def _enum(*values: str) -> Check:
    allowed = frozenset(values)

    def check(v: Any) -> bool:
        return type(v) is str and v in allowed
    return check


def _bool(v: Any) -> bool:
    return type(v) is bool


def _list_of(item: Check, max_len: int) -> Check:
    def check(v: Any) -> bool:
        return type(v) is list and len(v) <= max_len and all(item(x) for x in v)
    return check


def _nullable(inner: Check) -> Check:
    def check(v: Any) -> bool:
        return v is None or inner(v)
    return check


def _map(v: Any) -> bool:
    """An opaque map with string keys (its values were decoded by msgpack: plain data)."""
    return type(v) is dict and all(type(k) is str for k in v)


_rank = _int(0, MAX_RANK)
_step = _int(0, MAX_STEP)
_ranks = _list_of(_rank, MAX_RANKS_PER_MESSAGE)
_REPLICA_FIELDS: dict[str, Check] = {
    "dp_index": _int(0, MAX_RANK),
    "dp_size": _int(1, MAX_RANK + 1),
    "replica_num": _int(1, MAX_RANK + 1),
    "shard": _int(0, MAX_RANK),
    "holders": _list_of(_rank, 1 << 16),
}
#: optional: the index of the rank's DP group (its model-parallel position)
_REPLICA_OPTIONAL: dict[str, Check] = {"group": _int(0, MAX_RANK)}


def _replica(v: Any) -> bool:
    """{optimizer name: {dp_index, dp_size, replica_num, shard, holders[, group]}} (SPEC 2, 7)."""
    if type(v) is not dict or len(v) > 16:
        return False
    for name, info in v.items():
        if type(name) is not str or len(name) > 64 or type(info) is not dict:
            return False
        optional = info.keys() - _REPLICA_FIELDS.keys()
        if not _REPLICA_FIELDS.keys() <= info.keys() or not optional <= _REPLICA_OPTIONAL.keys():
            return False
        if not all(check(info[k]) for k, check in _REPLICA_FIELDS.items()):
            return False
        if not all(_REPLICA_OPTIONAL[k](info[k]) for k in optional):
            return False
        if info["dp_index"] >= info["dp_size"] or not info["holders"]:
            return False
    return True


def _sync_ranks(v: Any) -> bool:
    """[[rank, step, status, health, replica-or-None], ...] (controller -> backup)."""
    if type(v) is not list or len(v) > MAX_RANKS_PER_MESSAGE:
        return False
    for row in v:
        if type(row) is not list or len(row) != 5:
            return False
        if not (_rank(row[0]) and _step(row[1]) and type(row[2]) is str
                and type(row[3]) is str and (row[4] is None or _replica(row[4]))):
            return False
    return True


Schema = dict[str, tuple[Check, bool]]  # key -> (check, required)

SCHEMAS: dict[str, Schema] = {
    MsgType.REGISTER: {
        "world_size": (_int(1, MAX_RANK + 1), True),
        "pid": (_int(0, 1 << 31), True),
        "host": (_str(255), True),
        "proc": (_str(160), False),  # procfs.identity(): where the process runs, its start
        "token": (_str(256), False),  # TTP_JOB_TOKEN, when the job has one
        "replica": (_nullable(_replica), False),
        "failover": (_bool, False),
        "step": (_step, False),
        "status": (_enum(*DATA_STATUS), False),
    },
    MsgType.HEARTBEAT: {
        "step": (_step, True),
        "status": (_enum(*DATA_STATUS), True),
        "progress": (_step, False),
        "ack": (_bool, False),  # answer with an ack (default true); see Processor
    },
    MsgType.REPORT: {
        "kind": (_enum(*REPORT_KINDS), True),
        "message": (_str(MAX_TEXT), True),
        "step": (_step, True),
        "status": (_enum(*DATA_STATUS), True),
        "detail": (_map, False),
    },
    MsgType.RESULT: {
        "id": (_int(0, MAX_STEP), True),
        "action": (_enum(*ACTIONS), True),
        "ok": (_bool, True),
        "result": (_map, True),
        "error": (_str(MAX_TEXT), False),
    },
    MsgType.BYE: {"code": (_int(-(1 << 31), 1 << 31), True)},
    # sender: the rank whose process ended; pid: that process (as it registered)
    MsgType.EXITED: {
        "pid": (_int(0, 1 << 31), True),
        "code": (_int(-(1 << 31), 1 << 31), True),
        "token": (_str(256), False),  # TTP_JOB_TOKEN, when the job has one
        "no_replacement": (_str(MAX_EXIT_REASON), False),  # why its launcher will not restart it
    },
    MsgType.REGISTERED: {
        "epoch": (_int(0, MAX_STEP), True),
        "state": (_str(32), True),
        "interval": (_num(1e-3, 3600), True),
        "misses": (_int(1, 1000), True),
        "backups": (_list_of(_str(300), 8), True),
        "rejoin": (_bool, True),
        "lock_step": (_nullable(_step), True),
        "role": (_enum(*ROLES), True),
    },
    MsgType.ACK: {
        "state": (_str(32), True),
        "epoch": (_int(0, MAX_STEP), True),
        "role": (_enum(*ROLES), True),
    },
    MsgType.ACTION: {
        "id": (_int(0, MAX_STEP), True),
        "name": (_enum(*ACTIONS), True),
        "timeout": (_num(0, 1e6), True),
        "payload": (_map, True),
    },
    MsgType.REJECT: {"reason": (_str(MAX_TEXT), True), "retry": (_bool, True)},
    MsgType.REDIRECT: {"reason": (_str(MAX_TEXT), True)},
    MsgType.BACKUP: {
        "endpoint": (_str(300), True),
        "index": (_int(0, 7), True),
        "token": (_str(256), False),  # TTP_JOB_TOKEN, when the job has one
    },
    MsgType.SYNC: {
        "state": (_str(32), True),
        "epoch": (_int(0, MAX_STEP), True),
        "world_size": (_int(1, MAX_RANK + 1), True),
        "features": (_map, True),
        "ranks": (_sync_ranks, True),
        "backups": (_list_of(_str(300), 8), True),
        "lock_step": (_nullable(_step), True),
    },
}


def check_payload(mtype: str, payload: Any) -> None:
    """Raise ProtocolError unless `payload` matches the schema of `mtype`."""
    schema = SCHEMAS.get(mtype)
    if schema is None:
        raise ProtocolError("unknown_type", repr(mtype)[:64])
    if type(payload) is not dict:
        raise ProtocolError("schema", f"{mtype}: payload is not a map")
    for key in payload:
        if key not in schema:
            raise ProtocolError("schema", f"{mtype}: unknown key {str(key)[:64]!r}")
    for key, (check, required) in schema.items():
        if key in payload:
            if not check(payload[key]):
                raise ProtocolError("schema", f"{mtype}: bad value for {key!r}")
        elif required:
            raise ProtocolError("schema", f"{mtype}: missing {key!r}")


def encode(mtype: str, sender: int, seq: int, payload: dict[str, Any], *,
           check: bool = True) -> bytes:
    """One frame for a message (the payload is checked: a bad send is a bug here)."""
    if check:
        check_payload(mtype, payload)
    return msgpack.packb([PROTOCOL_VERSION, mtype, sender, seq, payload], use_bin_type=True)


#: what the controller's ROUTER takes (from processors, backups and other nodes' launchers);
#: anything else is dropped as `unexpected_type` before decoding
TO_CONTROLLER = frozenset({MsgType.REGISTER, MsgType.HEARTBEAT, MsgType.REPORT, MsgType.RESULT,
                           MsgType.BYE, MsgType.BACKUP, MsgType.EXITED})
_HEADER = 0x95  # a msgpack fixarray of 5 elements


class Limits:
    """What one frame may cost, by message type, for a job of `world_size` ranks.

    `caps[type]`: the most bytes a frame of that type may have (checked by `peek` before
    decoding); `unpack_kwargs`: msgpack's limits on arrays, maps, strings and binaries. A
    heartbeat, bye or backup announcement is a few dozen bytes; a registration carries its
    replica layout (holders lists, at most one entry per rank); a report or result carries
    text and a small map; orders and the backup sync carry up to one row per rank. Every cap
    is at most `max_bytes`, the protocol limit (ZMQ_MAXMSGSIZE of every socket)."""

    __slots__ = ("world_size", "max_bytes", "caps", "unpack_kwargs")

    def __init__(self, world_size: int, max_bytes: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if max_bytes < 1024:
            raise ValueError(f"max_bytes={max_bytes} must be >= 1024")
        self.world_size = world_size
        self.max_bytes = max_bytes
        per_rank = 5 * world_size  # a rank number is at most 5 bytes of msgpack
        sync_row = 96 + 16 * 128  # [rank, step, status, health, replica of <= 16 optimizers]
        caps = {
            MsgType.HEARTBEAT: 128,
            MsgType.BYE: 64,
            MsgType.BACKUP: 1024,  # endpoint (<= 300) and job token (<= 256)
            MsgType.EXITED: 2048,  # job token (<= 256) and the reason (<= 1024)
            MsgType.REGISTER: 4096 + 16 * (256 + per_rank),
            MsgType.REPORT: 2 * MAX_TEXT + 8192,
            MsgType.RESULT: 2 * MAX_TEXT + 65536 + 8 * per_rank,
            MsgType.REGISTERED: 4096,
            MsgType.ACK: 256,
            MsgType.REJECT: 2 * MAX_TEXT,
            MsgType.REDIRECT: 2 * MAX_TEXT,
            MsgType.ACTION: 65536 + 16 * per_rank,
            MsgType.SYNC: 65536 + world_size * sync_row,
        }
        self.caps = {t: min(c, max_bytes) for t, c in caps.items()}
        containers = world_size + 64  # one entry per rank, plus a payload's own keys
        self.unpack_kwargs = {
            t: {"max_array_len": containers, "max_map_len": containers,
                "max_str_len": cap, "max_bin_len": cap, "max_ext_len": 0}
            for t, cap in self.caps.items()}

    @classmethod
    def for_world(cls, world_size: int, max_bytes: int = 1 << 20) -> Limits:
        """Limits for a job of `world_size` ranks under the protocol limit `max_bytes`."""
        return cls(world_size, max_bytes)

    @classmethod
    def largest(cls, max_bytes: int = 1 << 20) -> Limits:
        """Limits when the world size is not known (every container up to
        `MAX_RANKS_PER_MESSAGE` entries, every type up to `max_bytes`)."""
        limits = cls(1, max(max_bytes, 1024))
        limits.caps = dict.fromkeys(SCHEMAS, max_bytes)
        limits.unpack_kwargs = {
            t: {"max_array_len": MAX_RANKS_PER_MESSAGE, "max_map_len": 1 << 16,
                "max_str_len": max_bytes, "max_bin_len": max_bytes, "max_ext_len": 0}
            for t in SCHEMAS}
        return limits


@functools.lru_cache(maxsize=8)
def _largest(max_bytes: int) -> Limits:
    return Limits.largest(max_bytes)


def peek(frame: bytes, limits: Limits, accept: frozenset[str] | None = None) -> str:
    """The type of a frame, read from its header without decoding the rest; raises
    ProtocolError (`malformed`, `version`, `unknown_type`, `unexpected_type` when `accept`
    does not hold it, `oversized` past the type's cap). Constant time."""
    size = len(frame)
    if size > limits.max_bytes:
        raise ProtocolError("oversized", f"{size} bytes > {limits.max_bytes}")
    if size < 4 or frame[0] != _HEADER:
        raise ProtocolError("malformed", "not a 5-element array")
    if frame[1] != PROTOCOL_VERSION:
        raise ProtocolError("version", f"header byte {frame[1]:#04x}")
    head = frame[2]
    if not 0xA0 <= head <= 0xBF:  # the type is a short string
        raise ProtocolError("unknown_type", f"type header byte {head:#04x}")
    end = 3 + (head & 0x1F)
    mtype = frame[3:end].decode("ascii", "replace")
    cap = limits.caps.get(mtype)
    if cap is None:
        raise ProtocolError("unknown_type", repr(mtype)[:64])
    if accept is not None and mtype not in accept:
        raise ProtocolError("unexpected_type", mtype)
    if size > cap:
        raise ProtocolError("oversized", f"{mtype}: {size} bytes > {cap}")
    return mtype


def decode(frame: bytes, max_bytes: int = 1 << 20, *, limits: Limits | None = None,
           accept: frozenset[str] | None = None, mtype: str | None = None) -> Message:
    """Decode and check one frame; raises ProtocolError (never anything else).

    `limits`: the per-type caps and msgpack limits (default `Limits.largest(max_bytes)`);
    `accept`: the types this receiver takes; `mtype`: the type `peek` already returned
    (the header is then not read again)."""
    if limits is None:
        limits = _largest(max_bytes)
    if mtype is None:
        mtype = peek(frame, limits, accept)
    try:
        obj = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True,
                              **limits.unpack_kwargs[mtype])
    except Exception as e:  # msgpack raises several types (ValueError, ExtraData, ...)
        raise ProtocolError("malformed", type(e).__name__) from None
    if type(obj) is not list or len(obj) != 5:
        raise ProtocolError("malformed", "not a 5-element array")
    version, mtype, sender, seq, payload = obj
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError("version", repr(version)[:32])
    if type(mtype) is not str or mtype not in SCHEMAS:
        raise ProtocolError("unknown_type", repr(mtype)[:64])
    if type(sender) is not int or not (CONTROLLER <= sender <= MAX_RANK):
        raise ProtocolError("schema", "bad sender")
    if type(seq) is not int or not (0 <= seq <= MAX_STEP):
        raise ProtocolError("schema", "bad seq")
    check_payload(mtype, payload)
    return Message(mtype, sender, seq, payload)


class DropCounter:
    """Counts dropped frames by reason and logs them without flooding the log."""

    def __init__(self, logger: logging.Logger | None = None, every: int = 1000) -> None:
        self.counts: dict[str, int] = {}
        self._log = logger or log
        self._every = every

    def drop(self, reason: str, detail: str = "", peer: str = "") -> None:
        """Count one dropped frame; the first few of each reason (then every Nth) are logged."""
        n = self.counts.get(reason, 0) + 1
        self.counts[reason] = n
        if n <= 10 or n % self._every == 0:
            self._log.warning("dropped frame #%d (%s) %s %s", n, reason, detail, peer)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
