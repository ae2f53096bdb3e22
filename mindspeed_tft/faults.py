"""Fault injection for tests and benchmarks: the ``TFT_INJECT`` contract of SPEC 11.

``TFT_INJECT`` holds a ``;``-separated list of items ``KIND:key=value,...``::

    TFT_INJECT="kill:rank=3,step=5;uce:rank=0,step=7,phase=optimizer,target=param"

Kinds (what happens when an item fires):

- ``kill``: SIGKILL the own process (the event is written first, with one unbuffered write).
- ``exit``: end the own process with exit code 1 at once (`EXIT_CODE`, an error that escaped
  the training script; no bye to the controller): a launcher restarts no worker that exits
  so.
- ``raise``: ``RuntimeError("TFT_INJECT raise: injected error at rank R step S phase P")``,
  an error SPEC 6 classifies as unknown.
- ``uce``: call ``corrupt(target)`` if the trainer passed one, then raise
  ``RuntimeError("UCE ERROR: TFT_INJECT uce: injected on-chip memory fault in TARGET at rank
  R step S phase P")``.
- ``comm``: ``RuntimeError("HCCL OP RETRY FAILED: TFT_INJECT comm: injected communication
  error at rank R step S phase P")``, a communication error for SPEC 6.
- ``corrupt`` (phase ``transfer`` only, and the only kind of that phase): in the sender of
  a shard copy during a repair (`mindspeed_tft.replica.transfer`), flip one byte of what is
  sent, after its checksum was taken (the sender's own state stays intact), at the first
  copy whose lock step (the shard's optimizer step count) is at least ``step``. The
  receiver finds the damage and the repair fails.
- ``hang``: stop making progress: the calling thread sleeps in 0.05 s slices (other threads,
  heartbeats included, keep running; an asynchronous exception such as a FORCE STOP lands
  within a slice) for up to ``TFT_INJECT_HANG_SECONDS`` (default 3600) seconds; if nobody
  stopped the process by then it raises ``RuntimeError("TFT_INJECT hang: rank R step S phase
  P was not stopped within T s")``.

Keys: ``rank`` (global rank, required) and ``step`` (required), integers from 0 to
`MAX_NUMBER` (2**31 - 1),
``phase`` = forward | backward | optimizer | save | after | publish | scale | transfer (default
forward; transfer for kind corrupt, which needs it),
``target`` = optimizer | param | grad | activation (uce only; default optimizer), ``point`` =
written | synced | aside | renamed | tracker (required with phase publish, allowed only with
it). Kinds, keys and values are
lowercase; whitespace around items, keys and values is ignored. An unset or blank variable
means no faults. Anything else that does not follow these rules raises `FaultSpecError` at
startup, naming the item (1-based) and the bad part::

    TFT_INJECT item 2 'kill:rank=x,step=3': rank must be a non-negative integer, got 'x'

An echoed item or value longer than `SHOWN_CHARS` characters is cut there, with its length
(``'kill:rank=99999…' (5017 characters)``): a message stays one short line whatever the
variable holds.

Step numbering: ``step`` is the 0-based training step, the value of Megatron's ``iteration``
(completed updates) when the step starts; step s produces iteration s+1. The trainer calls
``injector.fire(step, phase)`` at each phase point: ``forward``, ``backward``, ``optimizer``
during step s; ``save`` during a periodic checkpoint save made at the end of step s (the save of
iteration s+1), after its files are written and before they are published; ``after`` once step
s is complete (iteration is s+1). An item whose phase point never comes (e.g. ``save`` at a step
without a save) never fires.

Phase ``scale`` fires in each remaining rank when elastic training shrinks the job from the
dump of lock step s (`TFTPlugin.scale_in`), and in each member and each returning rank when
it grows the job again from the dump of lock step s (`TFTPlugin.scale_out`), before the new
world's process groups are built: a fault during a scale change.

Phase ``publish`` fires inside `mindspeed_tft.recovery.layout.publish_checkpoint`, in the
process that publishes a checkpoint of iteration s+1 (a periodic save at the end of step s,
or a dying-gasp checkpoint of lock step s+1; rank: that process's global rank), at the
publishing point ``point`` (`PUBLISH_POINTS`, in the order they come):

- ``written``: every file is in ``iter_X_tmp``, nothing is fsynced yet;
- ``synced``: the files and folders of ``iter_X_tmp`` are fsynced, nothing is renamed yet;
- ``aside``: only where ``iter_X`` already exists and the file system cannot exchange two
  names atomically: the old ``iter_X`` was renamed to ``iter_X_old``, the new one is not in
  place yet (the one moment a tracker naming X points at no folder);
- ``renamed``: ``iter_X`` is the new checkpoint (the old copy, if any, is ``iter_X_old``),
  the tracker is not written yet;
- ``tracker``: the tracker names X (fsynced); the old copy is not removed yet.

`fire_publish_point` is what the publisher calls; it reads ``TFT_INJECT`` once per process
(with `parse_fault_spec`, like everything here).

Once per job: before an item acts, it is recorded as fired (a kill leaves no chance afterwards)
in every ledger available, and it acts only if none of them had it already:

- the torch.distributed store, when the default process group is initialized at fire time
  (``_get_default_store()`` with its PrefixStore wrappers removed, so a restarted worker whose
  store carries another attempt prefix sees the same key), key ``tft_inject/fired/<marker>``,
  claimed with the atomic ``store.add``. The store lives in the launcher agent (or rank 0) and
  survives a worker restart;
- a marker file ``<marker>`` created with O_EXCL in ``TFT_INJECT_STATE_DIR`` when that is set
  (use a directory per job);
- this process's memory (always).

``<marker>`` is ``fired-<index>-<kind>-rank<R>-step<S>-<phase>`` (plus ``-<target>`` for uce),
so a marker left by a different spec never matches. With neither a store nor a state directory,
a restarted worker fires the item again. Before acting, the event ``fault_injected`` (with
``kind``, ``step``, ``phase``, ``target`` (None except for uce) and ``item``) is emitted.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mindspeed_tft import events
from mindspeed_tft.envvars import launcher_value
from mindspeed_tft.process_exit import exit_without_teardown

logger = logging.getLogger(__name__)

INJECT_ENV = "TFT_INJECT"
STATE_DIR_ENV = "TFT_INJECT_STATE_DIR"
HANG_SECONDS_ENV = "TFT_INJECT_HANG_SECONDS"
DEFAULT_HANG_SECONDS = 3600.0
HANG_SLICE_SECONDS = 0.05
STORE_KEY_PREFIX = "tft_inject/fired/"

KINDS = ("kill", "raise", "uce", "comm", "hang", "corrupt", "exit")
#: the exit code of kind exit
EXIT_CODE = 1
KEYS = ("rank", "step", "phase", "target", "point")
PHASES = ("forward", "backward", "optimizer", "save", "after", "publish", "scale", "transfer")
PUBLISH_PHASE = "publish"
#: the phase of kind corrupt: a shard copy of a repair (`transfer_corruption`)
TRANSFER_PHASE = "transfer"
#: the points of publishing a checkpoint, in order (see the module docstring)
PUBLISH_POINTS = ("written", "synced", "aside", "renamed", "tracker")
TARGETS = ("optimizer", "param", "grad", "activation")
DEFAULT_PHASE = "forward"
DEFAULT_TARGET = "optimizer"

_NON_NEGATIVE_INT = re.compile(r"[0-9]+")
#: the largest rank or step an item may name (a bound, so that no value is too long to read)
MAX_NUMBER = 2**31 - 1
#: the longest echo of an item or value in a message (longer ones are cut, with their length)
SHOWN_CHARS = 60


class FaultSpecError(ValueError):
    """A malformed ``TFT_INJECT`` (or ``TFT_INJECT_HANG_SECONDS``) value."""


@dataclass(frozen=True)
class FaultItem:
    """One ``TFT_INJECT`` item. ``index`` is its 1-based position in the list (all ranks)."""

    kind: str
    rank: int
    step: int
    phase: str = DEFAULT_PHASE
    target: str | None = None
    index: int = 1
    point: str | None = None

    @property
    def marker(self) -> str:
        """The name under which this item is recorded as fired (store key suffix, file name)."""
        name = f"fired-{self.index}-{self.kind}-rank{self.rank}-step{self.step}-{self.phase}"
        if self.point:
            name = f"{name}-{self.point}"
        return f"{name}-{self.target}" if self.target else name

    def describe(self) -> str:
        """The item in ``TFT_INJECT`` syntax, defaults spelled out."""
        text = f"{self.kind}:rank={self.rank},step={self.step},phase={self.phase}"
        if self.point:
            text = f"{text},point={self.point}"
        return f"{text},target={self.target}" if self.target else text


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` quoted for a message: cut to `limit` characters, with its length, when longer."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def parse_bounded_int(text: str) -> int | None:
    """A whole number from 0 to `MAX_NUMBER` written in decimal digits, or None (checked on
    the text first: a number too long to convert is refused before any conversion)."""
    if not _NON_NEGATIVE_INT.fullmatch(text) or len(text.lstrip("0")) > len(str(MAX_NUMBER)):
        return None
    number = int(text)
    return number if number <= MAX_NUMBER else None


def parse_fault_spec(text: str | None) -> list[FaultItem]:
    """Parse a ``TFT_INJECT`` value into items of all ranks; raises `FaultSpecError`."""
    if text is None or not text.strip():
        return []
    return [_parse_item(raw.strip(), index) for index, raw in enumerate(text.split(";"), 1)]


def _parse_item(item: str, index: int) -> FaultItem:
    def fail(problem: str) -> FaultSpecError:
        return FaultSpecError(f"{INJECT_ENV} item {index} {shown(item)}: {problem}")

    if not item:
        raise fail(f"empty item; allowed: KIND:key=value,... with KIND one of {', '.join(KINDS)}")
    kind, _, rest = item.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise fail(f"unknown kind {shown(kind)}; allowed: {', '.join(KINDS)}")

    values: dict[str, str] = {}
    if rest.strip():
        for pair in rest.split(","):
            key, sep, value = pair.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key:
                raise fail(f"{shown(pair.strip())} is not key=value; allowed keys: "
                           f"{', '.join(KEYS)}")
            if key not in KEYS:
                raise fail(f"unknown key {shown(key)}; allowed: {', '.join(KEYS)}")
            if key in values:
                raise fail(f"duplicate key {key!r}")
            values[key] = value

    numbers: dict[str, int] = {}
    for key in ("rank", "step"):
        if key not in values:
            raise fail(f"missing required key {key!r}")
        number = parse_bounded_int(values[key])
        if number is None:
            problem = ("must be a non-negative integer" if not _NON_NEGATIVE_INT.fullmatch(
                values[key]) else f"must be at most {MAX_NUMBER}")
            raise fail(f"{key} {problem}, got {shown(values[key])}")
        numbers[key] = number

    phase = values.get("phase", DEFAULT_PHASE)
    if phase not in PHASES:
        raise fail(f"unknown phase {shown(phase)}; allowed: {', '.join(PHASES)}")

    if (kind == "corrupt") != (phase == TRANSFER_PHASE):
        raise fail(f"kind corrupt goes with phase {TRANSFER_PHASE}, and only it; got kind "
                   f"{kind} with phase {phase}")

    target: str | None = None
    if kind == "uce":
        target = values.get("target", DEFAULT_TARGET)
        if target not in TARGETS:
            raise fail(f"unknown target {shown(target)}; allowed: {', '.join(TARGETS)}")
    elif "target" in values:
        raise fail(f"target is only allowed for uce, not for {kind}")

    point: str | None = None
    if phase == PUBLISH_PHASE:
        if "point" not in values:
            raise fail(f"phase publish needs point=P; allowed: {', '.join(PUBLISH_POINTS)}")
        point = values["point"]
        if point not in PUBLISH_POINTS:
            raise fail(f"unknown point {shown(point)}; allowed: {', '.join(PUBLISH_POINTS)}")
    elif "point" in values:
        raise fail(f"point is only allowed with phase publish, not with phase {phase}")

    return FaultItem(kind, numbers["rank"], numbers["step"], phase, target, index, point)


def items_from_env(environ: Mapping[str, str] | None = None) -> list[FaultItem]:
    """Every rank's items of ``TFT_INJECT`` (`parse_fault_spec`)."""
    return parse_fault_spec((os.environ if environ is None else environ).get(INJECT_ENV))


def check_ranks(items: Iterable[FaultItem], world_size: int) -> None:
    """Refuse an item whose rank is outside a job of `world_size` ranks (it would never
    fire): `FaultSpecError` naming the item."""
    for item in items:
        if item.rank >= world_size:
            raise FaultSpecError(
                f"{INJECT_ENV} item {item.index} {shown(item.describe())}: rank {item.rank} is "
                f"outside the job's {world_size} ranks; allowed: 0 to {world_size - 1}")


def parse_hang_seconds(text: str | None) -> float:
    """``TFT_INJECT_HANG_SECONDS``: a positive number (unset or blank: 3600)."""
    if text is None or not text.strip():
        return DEFAULT_HANG_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise FaultSpecError(
            f"{HANG_SECONDS_ENV}={shown(text)}: allowed: a positive number of seconds"
        )
    return seconds


# --- once-per-job ledgers --------------------------------------------------------------------


class _DefaultStore:
    """Marker for "the torch.distributed default store, looked up at fire time"."""

    def __repr__(self) -> str:
        return "DEFAULT_STORE"


DEFAULT_STORE: Any = _DefaultStore()


default_store = events.default_store


def _claim_in_store(store: Any, item: FaultItem) -> bool:
    """True if this call is the first to record ``item`` in ``store``: an atomic
    compare-and-set from "absent" to a value of this process's own (never `store.add`: the
    store's server drops the connection of an add to a value that is not a number, which
    anyone who can reach the store could have written)."""
    claim = f"{os.getpid()}-{time.time_ns()}".encode()
    return bytes(store.compare_set(STORE_KEY_PREFIX + item.marker, "", claim)) == claim


def _claim_in_dir(state_dir: str, item: FaultItem) -> bool:
    """True if this call created ``item``'s marker file in ``state_dir``."""
    os.makedirs(state_dir, exist_ok=True)
    try:
        fd = os.open(os.path.join(state_dir, item.marker), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    try:
        os.write(fd, f"{item.describe()} pid={os.getpid()} time={time.time()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


# --- the injector ----------------------------------------------------------------------------


class FaultInjector:
    """Fires this rank's ``TFT_INJECT`` items at the trainer's phase points.

    ``store``: a torch.distributed Store to record fired items in, ``None`` for none, or
    `DEFAULT_STORE` (the default process group's store, looked up each time an item is about to
    fire). ``state_dir``: a directory for marker files, or None.
    """

    def __init__(
        self,
        items: Iterable[FaultItem],
        rank: int,
        *,
        store: Any = DEFAULT_STORE,
        state_dir: str | None = None,
        hang_seconds: float = DEFAULT_HANG_SECONDS,
    ) -> None:
        self.rank = rank
        self.items = tuple(item for item in items if item.rank == rank)
        self.store = store
        self.state_dir = state_dir
        self.hang_seconds = hang_seconds
        self._fired: set[int] = set()
        self._lock = threading.Lock()
        self._by_point: dict[tuple[int, str, str | None], list[FaultItem]] = {}
        for item in self.items:
            self._by_point.setdefault((item.step, item.phase, item.point), []).append(item)

    @classmethod
    def from_env(
        cls,
        rank: int,
        environ: Mapping[str, str] | None = None,
        *,
        store: Any = DEFAULT_STORE,
    ) -> FaultInjector:
        """Parse ``TFT_INJECT`` (all items are checked; this rank's are kept),
        ``TFT_INJECT_STATE_DIR`` and ``TFT_INJECT_HANG_SECONDS``; raises `FaultSpecError`."""
        environ = os.environ if environ is None else environ
        return cls(
            parse_fault_spec(environ.get(INJECT_ENV)),
            rank,
            store=store,
            state_dir=environ.get(STATE_DIR_ENV) or None,
            hang_seconds=parse_hang_seconds(environ.get(HANG_SECONDS_ENV)),
        )

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def pending(self) -> tuple[FaultItem, ...]:
        """This rank's items that have not fired in this process."""
        return tuple(item for item in self.items if item.index not in self._fired)

    def fire(self, step: int, phase: str, point: str | None = None, **context: Any) -> None:
        """Fire the items for (``step``, ``phase``, ``point``) that no ledger has recorded
        yet, in order (``point``: one of `PUBLISH_POINTS` with phase publish, else None).

        Context: ``corrupt`` (``Callable[[str], None]``): corrupts the given target memory in
        place, for uce. Other keys are ignored.
        """
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; allowed: {', '.join(PHASES)}")
        if (point is None) != (phase != PUBLISH_PHASE) or (
                point is not None and point not in PUBLISH_POINTS):
            raise ValueError(f"phase {phase} with point {point!r}: phase publish takes one of "
                             f"{', '.join(PUBLISH_POINTS)}, other phases none")
        for item in self._by_point.get((step, phase, point), ()):
            if self._claim(item):
                self._act(item, context)

    def claim(self, step: int, phase: str, point: str | None = None) -> list[FaultItem]:
        """The items for (``step``, ``phase``, ``point``) that no ledger has recorded yet,
        recorded now: for a caller that acts on them itself (kind corrupt)."""
        return [item for item in self._by_point.get((step, phase, point), ())
                if self._claim(item)]

    # internals

    def _claim(self, item: FaultItem) -> bool:
        """Record ``item`` as fired in every ledger; True if none had it already."""
        with self._lock:
            first = item.index not in self._fired
            self._fired.add(item.index)
        store = default_store() if self.store is DEFAULT_STORE else self.store
        if store is not None:
            try:
                first = _claim_in_store(store, item) and first
            except Exception as error:  # an unreachable store must not stop the run
                logger.warning("TFT_INJECT: cannot record %s in the store: %s", item.marker, error)
        if self.state_dir:
            first = _claim_in_dir(self.state_dir, item) and first
        if not first:
            logger.info("TFT_INJECT: %s already fired in this job; skipped", item.describe())
        return first

    def _act(self, item: FaultItem, context: Mapping[str, Any]) -> None:
        events.emit(
            "fault_injected", self.rank, kind=item.kind, step=item.step, phase=item.phase,
            target=item.target, item=item.index,
            **({"point": item.point} if item.point else {}),
        )
        where = f"rank {self.rank} step {item.step} phase {item.phase}"
        if item.point:
            where = f"{where} point {item.point}"
        logger.warning("TFT_INJECT: firing %s", item.describe())
        if item.kind == "kill":
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # a closed stream must not save the process
                    pass
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is delivered before this returns
        elif item.kind == "exit":
            exit_without_teardown(EXIT_CODE)
        elif item.kind == "raise":
            raise RuntimeError(f"TFT_INJECT raise: injected error at {where}")
        elif item.kind == "uce":
            corrupt: Callable[[str], None] | None = context.get("corrupt")
            if corrupt is not None:
                corrupt(item.target or DEFAULT_TARGET)  # parse_spec sets it for every uce
            raise RuntimeError(
                f"UCE ERROR: TFT_INJECT uce: injected on-chip memory fault in {item.target} "
                f"at {where}"
            )
        elif item.kind == "comm":
            raise RuntimeError(
                f"HCCL OP RETRY FAILED: TFT_INJECT comm: injected communication error at {where}"
            )
        elif item.kind == "hang":
            deadline = time.monotonic() + self.hang_seconds
            while (left := deadline - time.monotonic()) > 0:
                time.sleep(min(HANG_SLICE_SECONDS, left))
            raise RuntimeError(
                f"TFT_INJECT hang: {where} was not stopped within {self.hang_seconds:g} s"
            )


# --- publishing points -----------------------------------------------------------------------

_publish_injectors: dict[int, FaultInjector] = {}
_publish_lock = threading.Lock()


def _own_rank() -> int:
    """This process's global rank: torch.distributed's when it is initialized, else the
    launcher's ``RANK``, else 0 (a process outside any job)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    text = launcher_value("RANK")
    if text is None or not text.strip():
        return 0
    rank = parse_bounded_int(text.strip())
    if rank is None:
        raise FaultSpecError(f"RANK={shown(text)}: allowed: an integer from 0 to {MAX_NUMBER}")
    return rank


def fire_publish_point(iteration: int, point: str) -> None:
    """The publisher of the checkpoint of ``iteration`` reached ``point`` (`PUBLISH_POINTS`):
    fire this rank's ``phase=publish`` items for step ``iteration - 1`` at that point.

    ``TFT_INJECT`` is parsed on the first call of the process (per rank), so this costs a
    dictionary look-up when nothing is injected."""
    rank = _own_rank()
    with _publish_lock:
        injector = _publish_injectors.get(rank)
        if injector is None:
            injector = FaultInjector.from_env(rank)
            injector = FaultInjector(
                [item for item in injector.items if item.phase == PUBLISH_PHASE], rank,
                state_dir=injector.state_dir, hang_seconds=injector.hang_seconds,
            )
            _publish_injectors[rank] = injector
    if injector:
        injector.fire(iteration - 1, PUBLISH_PHASE, point)


# --- shard transfers -------------------------------------------------------------------------

_transfer_injectors: dict[int, FaultInjector] = {}


def transfer_corruption(step: int) -> bool:
    """Whether this rank, sending a shard of the lock step `step`, must damage it on the way
    (a ``corrupt:rank=R,step=S,phase=transfer`` item of this rank with S <= `step`, not
    fired yet in this job; claimed here). Parsed once per process."""
    rank = _own_rank()
    with _publish_lock:
        injector = _transfer_injectors.get(rank)
        if injector is None:
            injector = FaultInjector.from_env(rank)
            injector = FaultInjector(
                [item for item in injector.items if item.phase == TRANSFER_PHASE], rank,
                state_dir=injector.state_dir, hang_seconds=injector.hang_seconds,
            )
            _transfer_injectors[rank] = injector
    for item in injector.pending:
        if item.step <= step and injector.claim(item.step, TRANSFER_PHASE):
            events.emit("fault_injected", rank, kind=item.kind, step=item.step,
                        phase=item.phase, target=None, item=item.index, lock_step=step)
            logger.warning("TFT_INJECT: firing %s at lock step %d", item.describe(), step)
            return True
    return False
