"""Typed orders: the payloads of the stop, repair, rollback, dump and exit orders.

The controller's planner (`strategy.StrategyPlanner`) and incident flow build these frozen
dataclasses; the controller sends `to_wire()` as the `payload` of an `action` message
(`protocol.SCHEMAS`: an opaque map there); the processor turns the map back into the
dataclass with `from_wire()` before a callback sees it, so the recovery actions (the
plugin's `RecoveryActions`, the `mindio_ttp` shim's `SdkActions`) read typed fields.

The wire form is exactly what the controller sent before these classes existed: the same
keys in the same order (msgpack keeps a map's order, so the frames are byte-for-byte the
same), lists of ranks as lists, entries as maps. Both directions check every field:
`from_wire` raises `OrderError` naming the order, the field, the value and what is
allowed (a processor answers such an order with a failure instead of running it);
`to_wire` raises it too, so a planner bug fails at the sender, as `protocol.encode` does.
Orders outside this module (hold, clean, rename, resume, pause, scale_in, scale_out) keep
travelling as plain maps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from .classify import FaultKind
from .protocol import MAX_RANK, MAX_STEP

#: the strategies an order can name (`strategy.Strategy` values; `none`: a false alarm)
STRATEGY_NAMES = ("dump", "retry", "recover", "load_checkpoint", "exit", "none")
#: where a repair's state comes from
SOURCES = ("replica", "checkpoint")
FAULT_NAMES = tuple(k.value for k in FaultKind)
#: exit codes a process can end with
MAX_EXIT_CODE = 255
MAX_NAME = 64


class OrderError(ValueError):
    """An order payload that does not match its type (the message names the field)."""


T = TypeVar("T")
OrderT = TypeVar("OrderT", bound="_Order")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _is_rank(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_RANK


def _is_step(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_STEP


def _is_ranks(v: Any) -> bool:
    # min/max over the list run in C: a world-sized list costs little (dump writers)
    return (type(v) in (list, tuple) and all(type(x) is int for x in v)
            and (not v or (min(v) >= 0 and max(v) <= MAX_RANK)))


_RANK = f"a rank: an integer in [0, {MAX_RANK}]"
_STEP = "a step: an integer in [0, 2**62]"
_RANKS = f"a list of ranks (integers in [0, {MAX_RANK}])"


class _Reader:
    """Reads the fields of one order's wire map; every failure names order and field."""

    def __init__(self, kind: str, payload: Any) -> None:
        if type(payload) is not dict:
            raise OrderError(f"{kind} order: the payload is {type(payload).__name__}, not a map")
        self.kind = kind
        self.payload: dict[Any, Any] = payload
        self.seen: set[str] = set()

    def _fail(self, key: str, value: Any, allowed: str) -> OrderError:
        return OrderError(f"{self.kind} order: bad {key!r}: {_show(value)} (allowed: {allowed})")

    def get(self, key: str, check: Callable[[Any], bool], allowed: str,
            required: bool = True) -> Any:
        self.seen.add(key)
        if key not in self.payload:
            if required:
                raise OrderError(f"{self.kind} order: missing {key!r} ({allowed})")
            return None
        value = self.payload[key]
        if not check(value):
            raise self._fail(key, value, allowed)
        return value

    def rank(self, key: str) -> int:
        return int(self.get(key, _is_rank, _RANK))

    def step(self, key: str) -> int:
        return int(self.get(key, _is_step, _STEP))

    def ranks(self, key: str, required: bool = True) -> tuple[int, ...] | None:
        value = self.get(key, _is_ranks, _RANKS, required)
        return None if value is None else tuple(value)

    def choice(self, key: str, allowed: Iterable[str]) -> str:
        names = tuple(allowed)
        return str(self.get(key, lambda v: type(v) is str and v in names,
                            "one of " + ", ".join(names)))

    def text(self, key: str) -> str:
        return str(self.get(key, lambda v: type(v) is str, "a string"))

    def entries(self, key: str, parse: Callable[[_Reader], T], required: bool = True
                ) -> tuple[T, ...]:
        value = self.get(key, lambda v: type(v) in (list, tuple), "a list of maps", required)
        out = []
        for i, item in enumerate(value or ()):
            entry = _Reader(f"{self.kind} order's {key}[{i}]", item)
            out.append(parse(entry))
            entry.done()
        return tuple(out)

    def done(self) -> None:
        """Refuse keys that no field reads (as the protocol refuses unknown keys)."""
        for key in self.payload:
            if key not in self.seen:
                raise OrderError(f"{self.kind} order: unknown key {_show(key)} (allowed: "
                                 f"{', '.join(sorted(self.seen))})")


class _Order:
    """What the typed orders share: the wire form, checked both ways."""

    KIND: ClassVar[str]

    def _wire(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _read(cls: type[OrderT], r: _Reader) -> OrderT:
        raise NotImplementedError

    def to_wire(self) -> dict[str, Any]:
        """The map sent as the action's payload (checked as `from_wire` checks it)."""
        wire = self._wire()
        type(self).from_wire(wire)
        return wire

    @classmethod
    def from_wire(cls: type[OrderT], payload: Any) -> OrderT:
        """The order a wire map holds; `OrderError` names the first field that is wrong."""
        reader = _Reader(cls.KIND, payload)
        order = cls._read(reader)
        reader.done()
        return order


@dataclass(frozen=True)
class StopOrder(_Order):
    """Stop the rank; a rank behind `lock_step` (the provisional one) may catch up."""

    KIND: ClassVar[str] = "stop"
    incident: int
    lock_step: int
    #: rank -> fault kind (`classify.FaultKind` value) of the incident so far
    faults: Mapping[int, str]

    def _wire(self) -> dict[str, Any]:
        return {"incident": self.incident, "lock_step": self.lock_step,
                "faults": {str(r): k for r, k in self.faults.items()}}

    @classmethod
    def _read(cls, r: _Reader) -> StopOrder:
        faults = r.get("faults", _is_faults, "a map of rank (decimal string) to one of "
                       + ", ".join(FAULT_NAMES))
        return cls(r.step("incident"), r.step("lock_step"),
                   {int(k): v for k, v in faults.items()})


def _is_faults(v: Any) -> bool:
    return type(v) is dict and all(
        type(k) is str and k.isdigit() and len(k) <= 8 and int(k) <= MAX_RANK
        and type(kind) is str and kind in FAULT_NAMES for k, kind in v.items())


@dataclass(frozen=True)
class Receive:
    """A shard a repaired rank receives: `optimizer` shard `shard` from rank `source`."""

    optimizer: str
    shard: int
    source: int

    def _wire(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "shard": self.shard, "from": self.source}

    @classmethod
    def _read(cls, r: _Reader) -> Receive:
        return cls(_name(r, "optimizer"), r.rank("shard"), r.rank("from"))


@dataclass(frozen=True)
class Send:
    """A shard a healthy holder sends: `optimizer` shard `shard` to rank `target`."""

    optimizer: str
    shard: int
    target: int

    def _wire(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "shard": self.shard, "to": self.target}

    @classmethod
    def _read(cls, r: _Reader) -> Send:
        return cls(_name(r, "optimizer"), r.rank("shard"), r.rank("to"))


def _name(r: _Reader, key: str) -> str:
    return str(r.get(key, lambda v: type(v) is str and 0 < len(v) <= MAX_NAME,
                     f"a name of 1 to {MAX_NAME} characters"))


@dataclass(frozen=True)
class RepairOrder(_Order):
    """Repair a rank's state at `lock_step`: from replica holders (`receive`, `send`) or by
    reloading the last checkpoint (`source` checkpoint: no transfers)."""

    KIND: ClassVar[str] = "repair"
    incident: int
    strategy: str
    lock_step: int
    source: str
    faulty: tuple[int, ...]
    new_ranks: tuple[int, ...]
    receive: tuple[Receive, ...] = ()
    send: tuple[Send, ...] = ()
    #: every rank that sends or receives (None: a checkpoint repair, where nobody does)
    involved: tuple[int, ...] | None = None

    def _wire(self) -> dict[str, Any]:
        wire = {"incident": self.incident, "strategy": self.strategy,
                "lock_step": self.lock_step, "source": self.source,
                "faulty": list(self.faulty), "new_ranks": list(self.new_ranks),
                "receive": [e._wire() for e in self.receive],
                "send": [e._wire() for e in self.send]}
        if self.involved is not None:
            wire["involved"] = list(self.involved)
        return wire

    @classmethod
    def _read(cls, r: _Reader) -> RepairOrder:
        return cls(r.step("incident"), r.choice("strategy", STRATEGY_NAMES),
                   r.step("lock_step"), r.choice("source", SOURCES),
                   r.ranks("faulty") or (), r.ranks("new_ranks") or (),
                   r.entries("receive", Receive._read), r.entries("send", Send._read),
                   r.ranks("involved", required=False))


@dataclass(frozen=True)
class RollbackOrder(_Order):
    """Every rank back to `step`; `params_damaged`: ranks whose model params must be
    gathered again."""

    KIND: ClassVar[str] = "rollback"
    incident: int
    step: int
    strategy: str
    params_damaged: tuple[int, ...] = ()

    def _wire(self) -> dict[str, Any]:
        return {"incident": self.incident, "step": self.step, "strategy": self.strategy,
                "params_damaged": list(self.params_damaged)}

    @classmethod
    def _read(cls, r: _Reader) -> RollbackOrder:
        return cls(r.step("incident"), r.step("step"), r.choice("strategy", STRATEGY_NAMES),
                   r.ranks("params_damaged") or ())


@dataclass(frozen=True)
class DumpShard:
    """A shard a rank writes into the dump, and every rank that holds it."""

    optimizer: str
    shard: int
    holders: tuple[int, ...]

    def _wire(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "shard": self.shard, "holders": list(self.holders)}

    @classmethod
    def _read(cls, r: _Reader) -> DumpShard:
        return cls(_name(r, "optimizer"), r.rank("shard"), r.ranks("holders") or ())


@dataclass(frozen=True)
class DumpOrder(_Order):
    """Write the dying-gasp checkpoint of `lock_step`: this rank's `shards` (none: it writes
    nothing); `writers`: every rank that writes one."""

    KIND: ClassVar[str] = "dump"
    incident: int
    lock_step: int
    shards: tuple[DumpShard, ...]
    writers: tuple[int, ...]
    strategy: str = "dump"

    def _wire(self) -> dict[str, Any]:
        return {"incident": self.incident, "lock_step": self.lock_step,
                "strategy": self.strategy, "shards": [s._wire() for s in self.shards],
                "writers": list(self.writers)}

    @classmethod
    def _read(cls, r: _Reader) -> DumpOrder:
        incident, lock_step = r.step("incident"), r.step("lock_step")
        strategy = r.choice("strategy", ("dump",))
        return cls(incident, lock_step, r.entries("shards", DumpShard._read),
                   r.ranks("writers") or (), strategy)


@dataclass(frozen=True)
class ExitOrder(_Order):
    """End the process with `code`. After a dump, `logger` (a surviving rank) logs the
    `iterations` records the stop cut off."""

    KIND: ClassVar[str] = "exit"
    code: int
    reason: str = ""
    iterations: tuple[dict[str, Any], ...] | None = None
    logger: int | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"code": self.code, "reason": self.reason}
        if self.iterations is not None:
            wire["iterations"] = list(self.iterations)
        if self.logger is not None:
            wire["logger"] = self.logger
        return wire

    @classmethod
    def _read(cls, r: _Reader) -> ExitOrder:
        code = r.get("code", lambda v: type(v) is int and 0 <= v <= MAX_EXIT_CODE,
                     f"an exit code: an integer in [0, {MAX_EXIT_CODE}]")
        reason = r.get("reason", lambda v: type(v) is str, "a string", required=False)
        iterations = r.get("iterations", _is_records, "a list of maps (iteration records)",
                           required=False)
        logger = r.get("logger", _is_rank, _RANK, required=False)
        return cls(code, reason or "", None if iterations is None else tuple(iterations),
                   logger)


def _is_records(v: Any) -> bool:
    return type(v) in (list, tuple) and all(
        type(x) is dict and all(type(k) is str for k in x) for x in v)


#: a typed order
TypedOrder = StopOrder | RepairOrder | RollbackOrder | DumpOrder | ExitOrder
#: what the controller's send functions take: a typed order or a plain map (other orders)
Payload = TypedOrder | dict[str, Any]
#: order name -> how its payload is read
ORDER_TYPES: dict[str, Callable[[Any], TypedOrder]] = {
    "stop": StopOrder.from_wire, "repair": RepairOrder.from_wire,
    "rollback": RollbackOrder.from_wire, "dump": DumpOrder.from_wire,
    "exit": ExitOrder.from_wire}


def to_wire(payload: Payload) -> dict[str, Any]:
    """The wire map of `payload` (a typed order's `to_wire()`; a plain map as it is)."""
    return payload if isinstance(payload, dict) else payload.to_wire()


def from_wire(name: str, payload: dict[str, Any]) -> Payload:
    """The payload a callback of order `name` receives: the typed order for the orders of
    this module, the map itself for the others. Raises `OrderError`."""
    read = ORDER_TYPES.get(name)
    return payload if read is None else read(payload)
