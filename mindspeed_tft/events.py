"""The JSON Lines event stream of SPEC 11: what happened, when, on which rank.

Every event is one JSON object on one line with at least `time` (unix seconds, float),
`event` (its name) and `rank` (the global rank; -1 for the controller). Tests and benchmarks
read this file to see faults, state transitions, strategies, dumps and iterations in order.

The file comes from `--tft-events-file` (via `configure_events`) or the `TFT_EVENTS_FILE`
environment variable. Writers in different processes append to the same file: each event is
written with a single `os.write` on a file opened with O_APPEND, so lines never interleave.
With no file configured, `emit` does nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

CONTROLLER_RANK = -1

_lock = threading.Lock()
_path: str | None = None
_fd: int | None = None


def configure_events(path: str | None) -> None:
    """Send events to `path` (None: fall back to `TFT_EVENTS_FILE`, or disable)."""
    global _path, _fd
    with _lock:
        if _fd is not None:
            os.close(_fd)
            _fd = None
        _path = path or os.environ.get("TFT_EVENTS_FILE") or None
        if _path:
            os.environ["TFT_EVENTS_FILE"] = _path  # children (restarted workers) inherit it


def events_path() -> str | None:
    """The events file in use, or None."""
    if _path is None:
        return os.environ.get("TFT_EVENTS_FILE") or None
    return _path


def emit(event: str, rank: int, **fields: Any) -> dict[str, Any]:
    """Append one event; returns the record (also when no file is configured)."""
    record: dict[str, Any] = {"time": time.time(), "event": event, "rank": rank, **fields}
    path = events_path()
    if not path:
        return record
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    global _fd
    with _lock:
        if _fd is None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(_fd, line)
    return record


def read_events(path: str) -> list[dict[str, Any]]:
    """All events of a file, in file order (for tests, benchmarks and tools)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
