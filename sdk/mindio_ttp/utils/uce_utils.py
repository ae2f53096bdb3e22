"""When the last optimizer update started and ended, to decide whether an HBM multi-bit ECC
error can be repaired in place (the SDK's rule, `tft_can_do_uce_repair`).

On an NPU the times are the device's event clock (torch_npu's `Event.recorded_time`, in
microseconds) and the error message carries the device's time of the error (`time us=N`).
Without a device clock a time left out (None) is CLOCK_MONOTONIC in microseconds, which is
what a host-side error report would carry.
"""

from __future__ import annotations

import re
import threading
import time

TIME_US_PATTERN = re.compile(r"time us=(\d+)")

_lock = threading.Lock()
_times: dict[str, int | None] = {"start": None, "end": None}


def _now_us() -> int:
    return time.monotonic_ns() // 1000


def tft_set_update_start_time(start_time: int | None = None) -> None:
    """The optimizer update starts now (or at `start_time`, microseconds)."""
    with _lock:
        _times["start"] = _now_us() if start_time is None else int(start_time)


def tft_set_update_end_time(end_time: int | None = None) -> None:
    """The optimizer update ended now (or at `end_time`, microseconds)."""
    with _lock:
        _times["end"] = _now_us() if end_time is None else int(end_time)


def update_times() -> tuple[int | None, int | None]:
    """(start, end) of the last update, as set."""
    with _lock:
        return _times["start"], _times["end"]


def tft_can_do_uce_repair(hbm_error_time: int | None, start_time: int | None = None,
                          end_time: int | None = None) -> bool:
    """Whether an error at `hbm_error_time` spared the optimizer's data: it came after the
    last update ended, or while one ran (its inputs are intact: the update is redone). False
    before any update, or without a time."""
    start, end = update_times()
    start = start if start_time is None else start_time
    end = end if end_time is None else end_time
    if not hbm_error_time or not start or not end:
        return False
    return max(start, end) < hbm_error_time or start < hbm_error_time < end


def hbm_error_time(message: str) -> int | None:
    """The device time of an HBM error from its message (`time us=N`), if it says."""
    match = TIME_US_PATTERN.search(message)
    return int(match.group(1)) if match else None
