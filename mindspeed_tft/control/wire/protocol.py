"""Wire protocol between processors and controllers: msgpack frames, each payload typed.

Every message is one ZeroMQ frame holding a msgpack array

    [version, type, sender, seq, payload]

`version` is `PROTOCOL_VERSION`; `type` one of the `MsgType` names; `sender` the sending
rank (`CONTROLLER` = -1 for controllers); `seq` a per-sender counter that only grows (a
receiver takes a message only within `SEQ_WINDOW` of the sender's last one);
`payload` a map checked by the typed class of its type (`messages.MESSAGE_TYPES`, one
frozen dataclass per type, like the orders and results): required and optional keys with
their types and ranges; unknown keys are refused. A receiver gets the typed payload
(`Message.body`) and reads its attributes.

`decode` never unpickles and never trusts a length, and what a frame can cost is bounded
before any of it is decoded: `peek` reads the fixed header (`0x95`, the version, the type as
a msgpack fixstr: what every msgpack packer writes) in constant time, and a frame longer than
its type's cap (`Limits`: a heartbeat is tens of bytes, a sync one row per rank) is refused
there. Only then does msgpack run, with limits on every container and string sized by the
world size (`Limits.for_world`) and no extension types; anything that does not match its
type raises `ProtocolError` with a short reason (`schema`: the detail names the message,
the field, the value and what is allowed). Receivers count and log those
(`DropCounter`) and carry on; nothing that arrives can crash or block them.
"""

from __future__ import annotations

import builtins
import functools
import logging
from typing import Any, NamedTuple, TypeVar

import msgpack

from .fields import Wire, WireError
from .messages import MESSAGE_TYPES, MessageBody
from .names import ACTIONS as ACTIONS
from .names import DATA_STATUS as DATA_STATUS
from .names import MAX_EXIT_REASON as MAX_EXIT_REASON
from .names import MAX_RANK as MAX_RANK
from .names import MAX_RANKS_PER_MESSAGE as MAX_RANKS_PER_MESSAGE
from .names import MAX_STEP as MAX_STEP
from .names import MAX_TEXT as MAX_TEXT
from .names import REPORT_KINDS as REPORT_KINDS
from .names import ROLES as ROLES
from .names import MsgType as MsgType

log = logging.getLogger("mindspeed_tft.control.protocol")
BodyT = TypeVar("BodyT", bound=Wire)

PROTOCOL_VERSION = 1
CONTROLLER = -1
#: how far one message's `seq` may run ahead of the last one its receiver took from the same
#: sender (a sender's messages arrive in order over one connection: far more than a rank
#: sends in hours); one further ahead is dropped, so that a forged frame cannot push the
#: counter out of a live rank's reach (a bound, not an authentication: that is CURVE's)
SEQ_WINDOW = 100_000


def seq_in_window(seq: int, last: int) -> bool:
    """Whether `seq` follows `last` within `SEQ_WINDOW`."""
    return last < seq <= last + SEQ_WINDOW


class ProtocolError(ValueError):
    """A frame that is dropped; `reason` is a short category used for counting."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class Message(NamedTuple):
    """A decoded, checked message: `payload` the map as it arrived, `body` its typed form
    (the class of `messages.MESSAGE_TYPES` for its type) that receivers read."""

    type: str
    sender: int
    seq: int
    payload: dict[str, Any]
    body: MessageBody

    def read(self, kind: builtins.type[BodyT]) -> BodyT:
        """The typed payload as `kind`, the class of this message's type (TypeError when
        it is another's: a receiver's bug)."""
        body = self.body
        if not isinstance(body, kind):
            raise TypeError(f"a {self.type} message holds a {type(body).__name__}, "
                            f"not a {kind.__name__}")
        return body


def check_payload(mtype: str, payload: Any) -> MessageBody:
    """The typed payload of an `mtype` message; raises ProtocolError (`unknown_type`, or
    `schema` naming the message, the field, the value and what is allowed)."""
    kind = MESSAGE_TYPES.get(mtype)
    if kind is None:
        raise ProtocolError("unknown_type", repr(mtype)[:64])
    try:
        return kind.from_wire(payload)
    except WireError as e:
        raise ProtocolError("schema", str(e)) from None


def message(mtype: str, sender: int, seq: int, payload: dict[str, Any]) -> Message:
    """A message as `decode` gives it, from its parts (the payload is checked)."""
    return Message(mtype, sender, seq, payload, check_payload(mtype, payload))


def encode(mtype: str, sender: int, seq: int, payload: Wire | dict[str, Any], *,
           check: bool = True) -> bytes:
    """One frame for a message: `payload` its typed form (the class of its type) or its
    map; checked unless `check` is false (a bad send is a bug here)."""
    if isinstance(payload, Wire):
        if type(payload) is not MESSAGE_TYPES.get(mtype):
            raise ProtocolError("schema", f"{mtype} message: a {type(payload).__name__}")
        try:
            payload = payload.to_wire(check)
        except WireError as e:
            raise ProtocolError("schema", str(e)) from None
    elif check:
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
        limits.caps = dict.fromkeys(MESSAGE_TYPES, max_bytes)
        limits.unpack_kwargs = {
            t: {"max_array_len": MAX_RANKS_PER_MESSAGE, "max_map_len": 1 << 16,
                "max_str_len": max_bytes, "max_bin_len": max_bytes, "max_ext_len": 0}
            for t in MESSAGE_TYPES}
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
    if type(mtype) is not str or mtype not in MESSAGE_TYPES:
        raise ProtocolError("unknown_type", repr(mtype)[:64])
    if type(sender) is not int or not (CONTROLLER <= sender <= MAX_RANK):
        raise ProtocolError("schema", "bad sender")
    if type(seq) is not int or not (0 <= seq <= MAX_STEP):
        raise ProtocolError("schema", "bad seq")
    return Message(mtype, sender, seq, payload, check_payload(mtype, payload))


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
