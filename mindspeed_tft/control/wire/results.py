"""Typed results and reports: what a rank sends back (`result` and `report` messages).

A rank answers every order with a `result` message (`ResultMessage`): the order's id and
name, whether it succeeded, the order's result (one class per order below) or the error.
It reports what went wrong in its training thread with a `report` message
(`ReportMessage`). Like the orders (`order_types`), each is a frozen dataclass whose
`to_wire()` is a map with a fixed order of keys (the msgpack bytes are the same on every
rank) and whose `from_wire()` checks every field, raising
`ResultError` naming the message, the field, the value and what is allowed.

The results of the recovery callbacks (`callbacks.RecoveryCallbacks`) are these classes;
the processor adds what it knows itself (a stop's `step`, `status`, `parked`).

A `result` frame is checked as a `ResultEnvelope` (the order's id and name, ok, the result
as a map, the error): the controller then reads the result by the order's type
(`ResultEnvelope.typed`), so one that does not match fails that order, naming the field,
instead of being dropped as a bad frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .classify import FaultKind
from .fields import Reader, Wire, WireError, is_ranks, is_step
from .fields import is_replica as _is_replica  # the registration's check of a layout
from .names import ACTIONS, DATA_STATUS, MAX_RANK, MAX_STEP, MAX_TEXT, REPORT_KINDS, MsgType


class ResultError(WireError):
    """A result or report that does not match its type (the message names the field)."""


class _Result(Wire):
    """What the typed results share: the wire form, checked both ways."""

    ACTION: ClassVar[str]
    ERROR: ClassVar[type[WireError]] = ResultError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.WHAT = f"{cls.ACTION} result"


def _status(r: Reader) -> str:
    return r.choice("status", DATA_STATUS)


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_STEP


@dataclass(frozen=True)
class HoldResult(_Result):
    """Where the rank was when it was held: updated at `step`, or updating towards it + 1."""

    ACTION: ClassVar[str] = "hold"
    step: int
    status: str

    def _wire(self) -> dict[str, Any]:
        return {"step": self.step, "status": self.status}

    @classmethod
    def _read(cls, r: Reader) -> HoldResult:
        return cls(r.step("step"), _status(r))


@dataclass(frozen=True)
class PauseResult(HoldResult):
    """Where the rank was held by an operator pause."""

    ACTION: ClassVar[str] = "pause"


@dataclass(frozen=True)
class StopResult(_Result):
    """Where the stopped rank is; `parked`: its training thread came back to the fault
    handler (True), did not (False: hung), or none runs under it (None).
    `connections_closed`, `iterations`: what the stop callback says (the collectives it
    abandoned; the iteration records this rank completed)."""

    ACTION: ClassVar[str] = "stop"
    step: int = 0
    status: str = "updated"
    parked: bool | None = None
    connections_closed: int | None = None
    iterations: tuple[dict[str, Any], ...] | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {}
        if self.connections_closed is not None:
            wire["connections_closed"] = self.connections_closed
        if self.iterations is not None:
            wire["iterations"] = list(self.iterations)
        wire.update(step=self.step, status=self.status, parked=self.parked)
        return wire

    @classmethod
    def _read(cls, r: Reader) -> StopResult:
        closed = r.get("connections_closed", _is_count, "a count", required=False)
        iterations = r.records("iterations")
        step, status = r.step("step"), _status(r)
        parked = r.get("parked", lambda v: v is None or type(v) is bool, "true, false or nil")
        return cls(step, status, parked, closed, iterations)


@dataclass(frozen=True)
class CleanResult(_Result):
    """`spared`: a UCE hit nothing a repair would copy (no repair for this rank)."""

    ACTION: ClassVar[str] = "clean"
    spared: bool = False

    def _wire(self) -> dict[str, Any]:
        return {"detail": {"target": "spared"}} if self.spared else {}

    @classmethod
    def _read(cls, r: Reader) -> CleanResult:
        detail = r.get("detail", lambda v: v == {"target": "spared"},
                       "{'target': 'spared'}", required=False)
        return cls(detail is not None)


@dataclass(frozen=True)
class RepairResult(_Result):
    """`step`: the checkpoint iteration a checkpoint repair loaded; `received`, `sent`:
    the shards a replica repair moved."""

    ACTION: ClassVar[str] = "repair"
    step: int | None = None
    received: int | None = None
    sent: int | None = None

    def _wire(self) -> dict[str, Any]:
        return {k: v for k, v in (("step", self.step), ("received", self.received),
                                  ("sent", self.sent)) if v is not None}

    @classmethod
    def _read(cls, r: Reader) -> RepairResult:
        return cls(r.opt_step("step"), r.get("received", _is_count, "a count", False),
                   r.get("sent", _is_count, "a count", False))


@dataclass(frozen=True)
class RollbackResult(_Result):
    """The rank is back at `step`; `iterations`: its iteration records (final now)."""

    ACTION: ClassVar[str] = "rollback"
    step: int
    iterations: tuple[dict[str, Any], ...] | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"step": self.step}
        if self.iterations is not None:
            wire["iterations"] = list(self.iterations)
        return wire

    @classmethod
    def _read(cls, r: Reader) -> RollbackResult:
        return cls(r.step("step"), r.records("iterations"))


def _is_written(v: Any) -> bool:
    return type(v) in (list, tuple) and all(
        (type(x) is str and len(x) <= MAX_TEXT) or is_ranks(x) for x in v)


@dataclass(frozen=True)
class DumpResult(_Result):
    """What the rank wrote into the dump: shard files (or, through the SDK, the ranks of
    each shard it saved); `assembled`: the checkpoint it assembled (None: not its part)."""

    ACTION: ClassVar[str] = "dump"
    written: tuple[str | tuple[int, ...], ...] = ()
    assembled: str | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"written": [x if isinstance(x, str) else list(x)
                                            for x in self.written]}
        if self.assembled is not None:
            wire["assembled"] = self.assembled
        return wire

    @classmethod
    def _read(cls, r: Reader) -> DumpResult:
        written = r.get("written", _is_written, "a list of paths or of rank lists")
        assembled = r.get("assembled", lambda v: type(v) is str, "a path", required=False)
        return cls(tuple(x if isinstance(x, str) else tuple(x) for x in written), assembled)


@dataclass(frozen=True)
class RenameResult(_Result):
    """The dump of `iteration` is published (at `path`, when the rank knows it)."""

    ACTION: ClassVar[str] = "rename"
    iteration: int
    path: str | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {} if self.path is None else {"path": self.path}
        wire["iteration"] = self.iteration
        return wire

    @classmethod
    def _read(cls, r: Reader) -> RenameResult:
        path = r.get("path", lambda v: type(v) is str, "a path", required=False)
        return cls(r.step("iteration"), path)


@dataclass(frozen=True)
class ScaleResult(_Result):
    """A scale change: whether the rank `stays`, the new DP size; a rank that stays also
    says the dump `iteration` it loaded, its new replica layout (control-plane ranks) and
    the global batch in micro-batches."""

    ACTION: ClassVar[str] = "scale"
    stays: bool
    dp_size: int
    iteration: int | None = None
    replica: dict[str, Any] | None = None
    micro_batches: int | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"stays": self.stays, "dp_size": self.dp_size}
        if self.stays:
            wire.update(iteration=self.iteration, replica=self.replica,
                        micro_batches=self.micro_batches)
        return wire

    @classmethod
    def _read(cls, r: Reader) -> ScaleResult:
        stays = r.get("stays", lambda v: type(v) is bool, "true or false")
        dp_size = r.get("dp_size", lambda v: type(v) is int and 1 <= v <= MAX_RANK + 1,
                        "a DP size")
        if not stays:
            return cls(False, dp_size)
        iteration = r.get("iteration", lambda v: v is None or is_step(v), "a step or nil")
        replica = r.get("replica", lambda v: v is None or _is_replica(v), "a replica layout")
        batches = r.get("micro_batches", lambda v: v is None or _is_count(v), "a count")
        return cls(True, dp_size, iteration, replica, batches)


@dataclass(frozen=True)
class EmptyResult(_Result):
    """The result of an order that says nothing back (exit, resume)."""

    ACTION: ClassVar[str] = "exit or resume"

    def _wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def _read(cls, r: Reader) -> EmptyResult:
        return cls()


#: a typed result
ActionResult = (HoldResult | StopResult | CleanResult | RepairResult | RollbackResult
                | DumpResult | RenameResult | ScaleResult | EmptyResult)
#: order name -> the type of its result
RESULT_TYPES: dict[str, type[ActionResult]] = {
    "hold": HoldResult, "pause": PauseResult, "stop": StopResult, "clean": CleanResult,
    "repair": RepairResult, "rollback": RollbackResult, "dump": DumpResult,
    "rename": RenameResult, "scale_in": ScaleResult, "scale_out": ScaleResult,
    "exit": EmptyResult, "resume": EmptyResult}


@dataclass(frozen=True)
class ResultMessage(Wire):
    """A rank's answer to an order, typed: order `id` (`action`) succeeded with `result`,
    or failed with `error`. Its wire form is a `ResultEnvelope`'s."""

    WHAT: ClassVar[str] = "result"
    ERROR: ClassVar[type[WireError]] = ResultError
    id: int
    action: str
    result: ActionResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def _wire(self) -> dict[str, Any]:
        if self.error is not None:
            return {"id": self.id, "action": self.action, "ok": False, "result": {},
                    "error": self.error}
        assert self.result is not None, "a result without an error needs its result"
        return {"id": self.id, "action": self.action, "ok": True,
                "result": self.result.to_wire()}

    @classmethod
    def _read(cls, r: Reader) -> ResultMessage:
        return ResultEnvelope._read(r).typed()


@dataclass(frozen=True)
class ResultEnvelope(Wire):
    """The payload of a `result` message as the frame is checked: the order's id and name,
    whether it succeeded, its result as a map (read by the order's name in `typed`: one
    that does not match its order fails that order, it does not drop the frame), the
    error."""

    TYPE: ClassVar[str] = MsgType.RESULT
    WHAT: ClassVar[str] = "result message"
    ERROR: ClassVar[type[WireError]] = ResultError
    id: int
    action: str
    ok: bool
    result: dict[str, Any]
    error: str | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"id": self.id, "action": self.action, "ok": self.ok,
                                "result": self.result}
        if self.error is not None:
            wire["error"] = self.error
        return wire

    @classmethod
    def _read(cls, r: Reader) -> ResultEnvelope:
        aid = r.get("id", is_step, "an order id")
        action = r.choice("action", ACTIONS)
        ok = r.get("ok", lambda v: type(v) is bool, "true or false")
        result = r.get("result", lambda v: type(v) is dict and all(type(k) is str for k in v),
                       "a map with string keys")
        error = r.get("error", lambda v: type(v) is str and len(v) <= MAX_TEXT,
                      f"a text of at most {MAX_TEXT} characters", required=False)
        return cls(aid, action, ok, result, error)

    def typed(self) -> ResultMessage:
        """The typed result: the order's result read by its type (`RESULT_TYPES`); raises
        `ResultError` naming the field when it does not match."""
        if not self.ok:
            return ResultMessage(self.id, self.action, None,
                                 "failed" if self.error is None else self.error)
        return ResultMessage(self.id, self.action, RESULT_TYPES[self.action].from_wire(self.result))

    def failed(self, error: str) -> ResultMessage:
        """This order failed with `error` (its result did not match its type)."""
        return ResultMessage(self.id, self.action, error=error)


@dataclass(frozen=True)
class ReportMessage(Wire):
    """The payload of a `report` message: what went wrong (`kind`: `FaultKind` value) in
    the training thread, where the rank's data was (`step`, `status`), and optional plain
    `detail` for the planner (e.g. `{"target": "activation"}` for a UCE)."""

    TYPE: ClassVar[str] = MsgType.REPORT
    WHAT: ClassVar[str] = "report"
    ERROR: ClassVar[type[WireError]] = ResultError
    kind: str
    message: str
    step: int
    status: str
    detail: dict[str, Any] | None = None

    def _wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"kind": self.kind, "message": self.message,
                                "step": self.step, "status": self.status}
        if self.detail:
            wire["detail"] = dict(self.detail)
        return wire

    @classmethod
    def _read(cls, r: Reader) -> ReportMessage:
        kind = r.choice("kind", REPORT_KINDS)
        message = r.get("message", lambda v: type(v) is str and len(v) <= MAX_TEXT,
                        f"a text of at most {MAX_TEXT} characters")
        step, status = r.step("step"), _status(r)
        detail = r.get("detail", lambda v: type(v) is dict and all(type(k) is str for k in v),
                       "a map with string keys", required=False)
        return cls(kind, message, step, status, detail)

    @property
    def fault(self) -> FaultKind:
        return FaultKind(self.kind)
