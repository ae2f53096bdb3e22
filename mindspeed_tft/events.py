"""The JSON Lines event stream of SPEC 11: what happened, when, on which rank.

Every event is one JSON object on one line with at least `time` (unix seconds, float),
`event` (its name) and `rank` (the global rank; -1 for the controller). Tests and benchmarks
read this file to see faults, state transitions, strategies, dumps and iterations in order.

The file comes from `--tft-events-file` (via `configure_events`) or the `TFT_EVENTS_FILE`
environment variable, which is read here only (`events_file_from_env`). Writers in different
processes append to the same file: each event is written with a single `os.write` on a file
opened with O_APPEND, so lines never interleave.
With no file configured, `emit` does nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from .records import CONTROLLER_RANK, RECORD_FIELDS, iteration_record, validate_record  # noqa: F401

#: the Stable API of this module: the events file's check (the schema is docs/design.md,
#: section 11, "Events file"); the rest is internal
__all__ = ["validate_record"]

#: the environment variable naming the events file (`--tft-events-file` wins over it)
EVENTS_FILE_ENV = "TFT_EVENTS_FILE"

_lock = threading.Lock()
_path: str | None = None
_fd: int | None = None


def events_file_from_env() -> str | None:
    """The events file `TFT_EVENTS_FILE` names, or None (unset or empty)."""
    return os.environ.get(EVENTS_FILE_ENV) or None


def configure_events(path: str | None) -> None:
    """Send events to `path` (None: fall back to `TFT_EVENTS_FILE`, or disable)."""
    global _path, _fd
    with _lock:
        if _fd is not None:
            os.close(_fd)
            _fd = None
        _path = path or events_file_from_env()
        if _path:
            os.environ[EVENTS_FILE_ENV] = _path  # children (restarted workers) inherit it


def events_path() -> str | None:
    """The events file in use, or None."""
    if _path is None:
        return events_file_from_env()
    return _path


def emit(event: str, rank: int, **fields: Any) -> dict[str, Any]:
    """Append one event; returns the record (also when no file is configured)."""
    record: dict[str, Any] = {"time": time.time(), "event": event, "rank": rank, **fields}
    write_record(record)
    return record


def write_record(record: dict[str, Any]) -> None:
    """Append one record made elsewhere (the controller's core makes its own, stamped with
    the time of the input it answers) to the events file, as `emit` writes its own."""
    path = events_path()
    if not path:
        return
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    global _fd
    with _lock:
        if _fd is None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            # the user's and their group's (the umask applies too)
            _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        os.write(_fd, line)


class WorkCounts:
    """What this process did on the control plane and between ranks, counted where it is
    done, cumulative from the process's start: connections opened (the processor's channel,
    rendezvous-store clients, process-group connections), rendezvous-store operations and
    their bytes, control messages and their bytes (by message type), process groups created,
    bytes of training state moved. Nothing on a training step's own path counts (the
    channel's I/O thread counts its messages; the rest counts during repairs and set-up).

    `emit_work` writes the counts into the events stream as a `work` event, at the marks of
    a repair (`recovery.work`): benchmarks and tests take differences between two marks of
    one process. Names are plain strings; a name never counted reads as 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


#: this process's work counts
work_counts = WorkCounts()


def emit_work(rank: int, mark: str, **fields: Any) -> dict[str, Any]:
    """A `work` event: every count of this process now, at `mark` (with its pid, so a
    restarted rank's counts are told from its predecessor's)."""
    return emit("work", rank, mark=mark, pid=os.getpid(), counts=work_counts.snapshot(), **fields)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a file, in file order (for tests, benchmarks and tools)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_events_if_any(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a file that may not exist (yet): none then."""
    try:
        return read_events(path)
    except FileNotFoundError:
        return []


#: the fields of an iteration record besides `iteration` (SPEC 11, `iteration` event)
#: the store key holding the highest iteration the logging rank logged
LOGGED_KEY = "tft/iterations/logged"


def default_store() -> Any | None:
    """The default process group's store without PrefixStore wrappers, or None (the fault
    injection ledger and the iteration log use it). Does not import torch: without a
    torch.distributed already imported there is no group."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class IterationLog:
    """Every iteration logged exactly once, whoever fails and whenever the stop lands.

    Every rank that holds a step's reduced loss calls `record` after the step and keeps the
    record (`latest`); `prepare` keeps it before the update too (`pending`), so a rank
    stopped between its update and its log line still has it. The logging rank emits the
    `iteration` event only above the highest iteration it logged (kept here and in the
    torch.distributed store, for a replacement process or a new last rank), else
    `iteration_recomputed`. After a repair `fill` logs the records of iterations the stop
    cut off (the controller gathers them from every rank's stop and rollback results).
    """

    def __init__(self, store: Any | None = None) -> None:
        self.latest: dict[str, Any] | None = None
        self.pending: dict[str, Any] | None = None
        self._highest: int | None = None
        self._store = store
        #: the job's last iteration (`--train-iters`) when known: the store's value is
        #: bounded by it (the host sets it)
        self.limit: int | None = None
        #: the job's secret (`TTP_JOB_TOKEN`) when there is one: the store's value then
        #: carries its HMAC, and a value without a valid one is refused (anyone who reaches
        #: the store can write it; only the job's processes hold the token)
        self.key: bytes | None = None

    def store(self) -> Any | None:
        return self._store if self._store is not None else default_store()

    def prepare(self, iteration: int, **fields: Any) -> None:
        """The step's loss is known and its update is about to run."""
        self.pending = iteration_record(iteration, fields)

    def records(self) -> list[dict[str, Any]]:
        """What this rank knows of its last iterations (for the controller)."""
        known = [self.latest] if self.latest is not None else []
        if self.pending is not None and (
                self.latest is None or self.pending["iteration"] > self.latest["iteration"]):
            known.append(self.pending)
        return known

    def highest_logged(self, refresh: bool = False) -> int:
        """The highest iteration logged so far: this process's, read from the store on the
        first call and on `refresh` (another process may have logged since)."""
        if self._highest is None or refresh:
            store = self.store()
            if store is not None and store.check([LOGGED_KEY]):
                stored = self._parse_logged(store.get(LOGGED_KEY))
                if stored is not None:
                    self._highest = max(self._highest or 0, stored)
            self._highest = self._highest or 0
        return self._highest

    def _mac(self, number: bytes) -> bytes:
        import hashlib
        import hmac

        assert self.key is not None
        return hmac.new(self.key, LOGGED_KEY.encode() + b"=" + number,
                        hashlib.sha256).hexdigest()[:32].encode()

    def _stored(self, iteration: int) -> str:
        """What the store holds for `iteration`: the number, and its HMAC with a key."""
        number = str(iteration).encode()
        return (number + b":" + self._mac(number)).decode() if self.key else number.decode()

    def _parse_logged(self, raw: Any) -> int | None:
        """The store's highest logged iteration, or None (refused: `store_refused`)."""
        limit = self.limit if self.limit else STORE_INT_MAX
        if not self.key:
            return store_int(raw, LOGGED_KEY, limit)
        import hmac

        value = raw if isinstance(raw, bytes) else str(raw).encode()
        number, _, mac = value.partition(b":")
        if len(value) > 80 or not hmac.compare_digest(mac, self._mac(number)):
            store_refused(LOGGED_KEY, value, f"a whole number from 0 to {limit} with the "
                                             "job's HMAC (written by the job's logging rank)")
            return None
        return store_int(number, LOGGED_KEY, limit)

    def record(self, iteration: int, *, logger: bool, **fields: Any) -> bool:
        """Keep the step's record; on the logging rank emit it. False: a recomputed
        iteration, whose log line the host skips."""
        self.latest = iteration_record(iteration, fields)
        if not logger:
            return True
        if iteration <= self.highest_logged():
            emit("iteration_recomputed", _rank(), **self.latest)
            return False
        self._logged(self.latest)
        return True

    def fill(self, records: list[dict[str, Any]], *, logger: bool,
             train_iters: int | None = None,
             why: str = "logged after the repair: the stop cut its log line off") -> list[int]:
        """After a repair (or before the exit with a dump): log the records above the highest
        logged iteration, in order; each line ends with `why`."""
        if not logger:
            return []
        # read the store again: after a scale change this process may be a new last rank
        filled, highest = [], self.highest_logged(refresh=True)
        for rec in sorted(records, key=lambda r: r["iteration"]):
            if rec["iteration"] > highest:
                self._logged(iteration_record(rec["iteration"], rec))
                # one write: other ranks print to the same stream at this moment
                print(_fill_line(rec, train_iters, why) + "\n", end="", flush=True)
                filled.append(highest := rec["iteration"])
        return filled

    def _logged(self, rec: dict[str, Any]) -> None:
        emit("iteration", _rank(), **rec)
        self._highest = rec["iteration"]
        store = self.store()
        if store is not None:
            store.set(LOGGED_KEY, self._stored(rec["iteration"]))


def _rank() -> int:
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist.get_rank() if dist is not None and dist.is_initialized() else 0


def _fill_line(rec: dict[str, Any], train_iters: int | None, why: str) -> str:
    """Megatron-LM's log line for an iteration logged after the repair (or at the exit)."""
    from datetime import datetime

    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    line = (f" [{stamp}] iteration {rec['iteration']:8d}/{train_iters or 0:8d} |"
            f" consumed samples: {rec.get('consumed_samples') or 0:12d} |")
    if rec.get("lr") is not None:
        line += f" learning rate: {rec['lr']:.6E} |"
    line += f" lm loss: {rec['loss']:.6E} |"
    if rec.get("grad_norm") is not None:
        line += f" grad norm: {rec['grad_norm']:.3f} |"
    return line + f" ({why}) |"


#: the largest whole number a store value may hold unless its reader knows a smaller bound
STORE_INT_MAX = 2**31 - 1
#: the longest value a refusal echoes
_SHOWN_BYTES = 40
_refused: set[tuple[str, bytes]] = set()


def _shown(value: bytes) -> str:
    if len(value) <= _SHOWN_BYTES:
        return repr(value)
    return f"{value[:_SHOWN_BYTES]!r}... ({len(value)} bytes)"


def store_refused(key: str, value: bytes, allowed: str) -> None:
    """A value read from the rendezvous store that its reader refuses (any local user can
    write the store): one `store_value_refused` event and one log line per key and value,
    never an exception; the reader goes on without it."""
    import logging

    with _lock:
        if (key, value[:256]) in _refused:
            return
        _refused.add((key, value[:256]))
    detail = f"store key {key} holds {_shown(value)}; allowed: {allowed}; ignored"
    logging.getLogger("mindspeed_tft.store").warning("%s", detail)
    emit("store_value_refused", _rank(), key=key, value=_shown(value), allowed=allowed)


def store_int(value: Any, key: str, limit: int = STORE_INT_MAX) -> int | None:
    """A whole number from 0 to `limit` read from the store under `key`, or None (refused:
    `store_refused`). Checked on the bytes first: nothing long is converted."""
    raw = value if isinstance(value, bytes) else str(value).encode()
    text = raw.decode("ascii", "replace")
    if 0 < len(raw) <= len(str(limit)) and text.isascii() and text.isdigit():
        number = int(text)
        if number <= limit:
            return number
    store_refused(key, raw, f"a whole number from 0 to {limit}")
    return None


#: the process's iteration log (SPEC 11: every iteration logged exactly once)
iteration_log = IterationLog()
