"""Checked reading of the maps every message travels as (`messages`, `order_types`, `results`).

A `Reader` reads the fields of one wire map: each read checks the value and raises the
reader's error naming the message, the field, the value and what is allowed; `done` refuses
keys that no field read (as `protocol` refuses unknown keys). The typed messages build on
`Wire`: `to_wire` checks what it produces by reading it back, so a sender's bug fails at
the sender.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

from .names import MAX_RANK, MAX_STEP

T = TypeVar("T")
WireT = TypeVar("WireT", bound="Wire")


class WireError(ValueError):
    """A map that does not match its message type (the text names the field)."""


def show(value: Any) -> str:
    """A value for an error message, cut to 64 characters."""
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def is_rank(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_RANK


def is_step(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_STEP


def is_ranks(v: Any) -> bool:
    # min/max over the list run in C: a world-sized list costs little (dump writers)
    return (type(v) in (list, tuple) and all(type(x) is int for x in v)
            and (not v or (min(v) >= 0 and max(v) <= MAX_RANK)))


def is_records(v: Any) -> bool:
    """A list of maps with string keys (iteration records: plain data)."""
    return type(v) in (list, tuple) and all(
        type(x) is dict and all(type(k) is str for k in x) for x in v)


def is_text(max_len: int) -> Callable[[Any], bool]:
    """A check: a string of at most `max_len` characters."""
    def check(v: Any) -> bool:
        return type(v) is str and len(v) <= max_len
    return check


def is_int(lo: int, hi: int) -> Callable[[Any], bool]:
    """A check: an integer in [lo, hi] (not a bool)."""
    def check(v: Any) -> bool:
        return type(v) is int and lo <= v <= hi
    return check


def is_map(v: Any) -> bool:
    """An opaque map with string keys (its values were decoded by msgpack: plain data)."""
    return type(v) is dict and all(type(k) is str for k in v)


_REPLICA_FIELDS: dict[str, Callable[[Any], bool]] = {
    "dp_index": is_int(0, MAX_RANK),
    "dp_size": is_int(1, MAX_RANK + 1),
    "replica_num": is_int(1, MAX_RANK + 1),
    "shard": is_int(0, MAX_RANK),
    "holders": lambda v: type(v) is list and len(v) <= 1 << 16 and all(is_rank(x) for x in v),
}
#: optional: the index of the rank's DP group (its model-parallel position)
_REPLICA_OPTIONAL: dict[str, Callable[[Any], bool]] = {"group": is_int(0, MAX_RANK)}
REPLICA = ("a replica layout: {optimizer name: {dp_index, dp_size, replica_num, shard, "
           "holders[, group]}}")


def is_replica(v: Any) -> bool:
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


RANK = f"a rank: an integer in [0, {MAX_RANK}]"
STEP = "a step: an integer in [0, 2**62]"
RANKS = f"a list of ranks (integers in [0, {MAX_RANK}])"


_ABSENT = object()


@functools.lru_cache(maxsize=64)
def _one_of(names: tuple[str, ...]) -> tuple[Callable[[Any], bool], str]:
    """The check and its text for a value that is one of `names`."""
    allowed = frozenset(names)
    return (lambda v: type(v) is str and v in allowed), "one of " + ", ".join(names)


class Reader:
    """Reads the fields of one wire map; every failure names the message and the field."""

    def __init__(self, what: str, payload: Any, error: type[WireError]) -> None:
        if type(payload) is not dict:
            raise error(f"{what}: the payload is {type(payload).__name__}, not a map")
        self.what = what
        self.error = error
        self.payload: dict[Any, Any] = payload
        self.seen: set[str] = set()

    def get(self, key: str, check: Callable[[Any], bool], allowed: str,
            required: bool = True) -> Any:
        self.seen.add(key)
        value = self.payload.get(key, _ABSENT)
        if value is _ABSENT:
            if required:
                raise self.error(f"{self.what}: missing {key!r} ({allowed})")
            return None
        if not check(value):
            raise self.error(f"{self.what}: bad {key!r}: {show(value)} (allowed: {allowed})")
        return value

    def rank(self, key: str) -> int:
        return int(self.get(key, is_rank, RANK))

    def step(self, key: str) -> int:
        return int(self.get(key, is_step, STEP))

    def opt_step(self, key: str) -> int | None:
        value = self.get(key, is_step, STEP, required=False)
        return None if value is None else int(value)

    def ranks(self, key: str, required: bool = True) -> tuple[int, ...] | None:
        value = self.get(key, is_ranks, RANKS, required)
        return None if value is None else tuple(value)

    def choice(self, key: str, allowed: Iterable[str]) -> str:
        check, text = _one_of(tuple(allowed))
        return str(self.get(key, check, text))

    def text(self, key: str) -> str:
        return str(self.get(key, lambda v: type(v) is str, "a string"))

    def records(self, key: str) -> tuple[dict[str, Any], ...] | None:
        value = self.get(key, is_records, "a list of maps (iteration records)", required=False)
        return None if value is None else tuple(value)

    def entries(self, key: str, parse: Callable[[Reader], T], required: bool = True
                ) -> tuple[T, ...]:
        value = self.get(key, lambda v: type(v) in (list, tuple), "a list of maps", required)
        out = []
        for i, item in enumerate(value or ()):
            entry = Reader(f"{self.what}'s {key}[{i}]", item, self.error)
            out.append(parse(entry))
            entry.done()
        return tuple(out)

    def done(self) -> None:
        """Refuse keys that no field reads (as the protocol refuses unknown keys)."""
        if self.payload.keys() <= self.seen:
            return
        for key in self.payload:
            if key not in self.seen:
                raise self.error(f"{self.what}: unknown key {show(key)} (allowed: "
                                 f"{', '.join(sorted(self.seen))})")


class Wire:
    """A typed message map: its wire form, checked both ways."""

    #: how the message is named in errors ("stop order", "stop result")
    WHAT: ClassVar[str]
    ERROR: ClassVar[type[WireError]] = WireError

    def _wire(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _read(cls: type[WireT], r: Reader) -> WireT:
        raise NotImplementedError

    def to_wire(self, check: bool = True) -> dict[str, Any]:
        """The map sent on the wire (checked as `from_wire` checks it, unless `check` is
        false: a large message its sender builds from checked parts)."""
        wire = self._wire()
        if check:
            type(self).from_wire(wire)
        return wire

    @classmethod
    def from_wire(cls: type[WireT], payload: Any) -> WireT:
        """The message a wire map holds; the error names the first field that is wrong."""
        reader = Reader(cls.WHAT, payload, cls.ERROR)
        message = cls._read(reader)
        reader.done()
        return message
