"""Typed orders: the payload of every order a controller sends (`protocol.ACTIONS`).

The controller's planner (`strategy.StrategyPlanner`) and incident flow build these frozen
dataclasses; the controller sends `to_wire()` as the `payload` of an `action` message
(`messages.ActionMessage`: an opaque map there); the processor turns the map back into the
dataclass with `from_wire()` before a callback sees it, so the recovery actions (the
plugin's `RecoveryActions`, the `mindio_ttp` shim's `SdkActions`) read typed fields.

The wire form is a map with a fixed order of keys (msgpack keeps a map's order, so an order
encodes to the same bytes on every controller), lists of ranks as lists, entries as maps. Both directions check every field:
`from_wire` raises `OrderError` naming the order, the field, the value and what is
allowed (a processor answers such an order with a failure instead of running it);
`to_wire` raises it too, so a planner bug fails at the sender, as `protocol.encode` does.
Every order of `protocol.ACTIONS` has its class here (`ORDER_TYPES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .classify import FaultKind
from .fields import RANK as _RANK
from .fields import Reader as _Reader
from .fields import Wire, WireError
from .fields import is_rank as _is_rank
from .fields import is_records as _is_records
from .fields import is_step as _is_step
from .fields import show as _show
from .names import MAX_RANK

#: the strategies an order can name (`strategy.Strategy` values; `none`: a false alarm)
STRATEGY_NAMES = ("dump", "retry", "recover", "load_checkpoint", "exit", "none")
#: where a repair's state comes from
SOURCES = ("replica", "checkpoint")
FAULT_NAMES = tuple(k.value for k in FaultKind)
#: exit codes a process can end with
MAX_EXIT_CODE = 255
MAX_NAME = 64
MAX_PATH = 4096


class OrderError(WireError):
    """An order payload that does not match its type (the message names the field)."""


class _Order(Wire):
    """What the typed orders share: the wire form, checked both ways."""

    KIND: ClassVar[str]
    ERROR: ClassVar[type[WireError]] = OrderError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.WHAT = f"{cls.KIND} order"


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
    nothing); `writers`: every rank that writes one; `claim`: who orders it (the controller
    and its epoch), claimed in the dump's folder so that two controllers (the sides of a
    partition) never write one checkpoint together (`recovery.dump.claim`)."""

    KIND: ClassVar[str] = "dump"
    incident: int
    lock_step: int
    shards: tuple[DumpShard, ...]
    writers: tuple[int, ...]
    strategy: str = "dump"
    claim: str = ""

    def _wire(self) -> dict[str, Any]:
        return {"incident": self.incident, "lock_step": self.lock_step,
                "strategy": self.strategy, "shards": [s._wire() for s in self.shards],
                "writers": list(self.writers), **({"claim": self.claim} if self.claim else {})}

    @classmethod
    def _read(cls, r: _Reader) -> DumpOrder:
        incident, lock_step = r.step("incident"), r.step("lock_step")
        strategy = r.choice("strategy", ("dump",))
        claim = r.get("claim", lambda v: type(v) is str and len(v) <= 300,
                      "a string of at most 300 characters", required=False) or ""
        return cls(incident, lock_step, r.entries("shards", DumpShard._read),
                   r.ranks("writers") or (), strategy, claim)


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



@dataclass(frozen=True)
class HoldOrder(_Order):
    """The first round of a stop: hold the rank before its next update, say where it is."""

    KIND: ClassVar[str] = "hold"
    incident: int

    def _wire(self) -> dict[str, Any]:
        return {"incident": self.incident}

    @classmethod
    def _read(cls, r: _Reader) -> HoldOrder:
        return cls(r.step("incident"))


@dataclass(frozen=True)
class CleanOrder(_Order):
    """Clean the rank's device state before a repair (`faulty`: the incident's faulty
    ranks)."""

    KIND: ClassVar[str] = "clean"
    incident: int
    strategy: str
    lock_step: int
    faulty: tuple[int, ...]

    def _wire(self) -> dict[str, Any]:
        return {"incident": self.incident, "strategy": self.strategy,
                "lock_step": self.lock_step, "faulty": list(self.faulty)}

    @classmethod
    def _read(cls, r: _Reader) -> CleanOrder:
        return cls(r.step("incident"), r.choice("strategy", STRATEGY_NAMES),
                   r.step("lock_step"), r.ranks("faulty") or ())


@dataclass(frozen=True)
class RenameOrder(_Order):
    """Publish the dump of `lock_step` (stage 3 of the dying-gasp checkpoint)."""

    KIND: ClassVar[str] = "rename"
    incident: int
    lock_step: int

    def _wire(self) -> dict[str, Any]:
        return {"incident": self.incident, "lock_step": self.lock_step}

    @classmethod
    def _read(cls, r: _Reader) -> RenameOrder:
        return cls(r.step("incident"), r.step("lock_step"))


@dataclass(frozen=True)
class PauseOrder(_Order):
    """Hold the rank before its next update until a resume (an operator pause)."""

    KIND: ClassVar[str] = "pause"
    reason: str

    def _wire(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def _read(cls, r: _Reader) -> PauseOrder:
        return cls(r.text("reason"))


@dataclass(frozen=True)
class ResumeOrder(_Order):
    """Train on: at `step` after a repair (None: where the rank is; -1 on the wire);
    `iterations`: the records the stop cut off (the logging rank logs them)."""

    KIND: ClassVar[str] = "resume"
    incident: int
    step: int | None
    strategy: str
    false_alarm: bool
    iterations: tuple[dict[str, Any], ...] | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"incident": self.incident,
                                "step": -1 if self.step is None else self.step,
                                "strategy": self.strategy, "false_alarm": self.false_alarm}
        if self.iterations is not None:
            wire["iterations"] = list(self.iterations)
        return wire

    @classmethod
    def _read(cls, r: _Reader) -> ResumeOrder:
        incident = r.step("incident")
        step = r.get("step", lambda v: (type(v) is int and v == -1) or _is_step(v),
                     "a step, or -1: where the rank is")
        strategy = r.choice("strategy", STRATEGY_NAMES)
        false_alarm = r.get("false_alarm", lambda v: type(v) is bool, "true or false")
        iterations = r.get("iterations", _is_records, "a list of maps (iteration records)",
                           required=False)
        return cls(incident, None if step == -1 else step, strategy, false_alarm,
                   None if iterations is None else tuple(iterations))


@dataclass(frozen=True)
class ScaleInOrder(_Order):
    """Elastic training: continue from the dump at `path` in the world of the DP replicas
    of `ranks` that split the global batch evenly."""

    KIND: ClassVar[str] = "scale_in"
    incident: int
    lock_step: int
    path: str
    ranks: tuple[int, ...]

    def _wire(self) -> dict[str, Any]:
        return {"incident": self.incident, "lock_step": self.lock_step, "path": self.path,
                "ranks": list(self.ranks)}

    @classmethod
    def _read(cls, r: _Reader) -> ScaleInOrder:
        return cls(r.step("incident"), r.step("lock_step"), _path(r), r.ranks("ranks") or ())


@dataclass(frozen=True)
class ScaleOutOrder(_Order):
    """Elastic training: continue from the dump at `path` in the larger world `ranks` at
    DP `dp_size`; `joining` are the ranks that come back into it."""

    KIND: ClassVar[str] = "scale_out"
    incident: int
    lock_step: int
    path: str
    ranks: tuple[int, ...]
    dp_size: int
    joining: tuple[int, ...] = ()

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"incident": self.incident, "lock_step": self.lock_step,
                                "path": self.path, "ranks": list(self.ranks),
                                "dp_size": self.dp_size}
        if self.joining:  # the SDK's grow calls its handlers with them
            wire["joining"] = list(self.joining)
        return wire

    @classmethod
    def _read(cls, r: _Reader) -> ScaleOutOrder:
        incident, lock_step, path = r.step("incident"), r.step("lock_step"), _path(r)
        ranks = r.ranks("ranks") or ()
        dp_size = r.get("dp_size", lambda v: type(v) is int and 1 <= v <= MAX_RANK + 1,
                        f"a DP size: an integer in [1, {MAX_RANK + 1}]")
        return cls(incident, lock_step, path, ranks, dp_size,
                   r.ranks("joining", required=False) or ())


def _path(r: _Reader) -> str:
    return str(r.get("path", lambda v: type(v) is str and 0 < len(v) <= MAX_PATH,
                     f"a path of 1 to {MAX_PATH} characters"))


#: a typed order: what every `action` message carries
TypedOrder = (HoldOrder | StopOrder | CleanOrder | RepairOrder | RollbackOrder | DumpOrder
              | RenameOrder | ExitOrder | PauseOrder | ResumeOrder | ScaleInOrder
              | ScaleOutOrder)
#: what the controller's send functions take
Payload = TypedOrder
#: order name -> its type (every name of `protocol.ACTIONS`)
ORDER_TYPES: dict[str, type[TypedOrder]] = {
    t.KIND: t for t in (HoldOrder, StopOrder, CleanOrder, RepairOrder, RollbackOrder,
                        DumpOrder, RenameOrder, ExitOrder, PauseOrder, ResumeOrder,
                        ScaleInOrder, ScaleOutOrder)}


def to_wire(payload: Payload) -> dict[str, Any]:
    """The wire map of `payload` (checked)."""
    return payload.to_wire()


def from_wire(name: str, payload: Any) -> TypedOrder:
    """The typed order of an `action` message named `name`. Raises `OrderError` (an
    unknown name too)."""
    kind = ORDER_TYPES.get(name)
    if kind is None:
        raise OrderError(f"unknown order {_show(name)} (allowed: {', '.join(ORDER_TYPES)})")
    return kind.from_wire(payload)
