"""Controllers running inside this process, so that an exiting rank lets them finish first.

With plain torchrun the active controller is a thread of rank 0's training process (and a
backup a thread of a rank on another node). If that process exited as soon as its own
training ended, the controller would vanish while other ranks still need it, and the exit
orders it just queued might never leave the socket. `Processor.stop()` and the exit path of
`run_with_fault_tolerance` therefore call `wait_local_controllers` before the process ends.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class _Waitable(Protocol):
    def wait_final(self, timeout: float | None = None) -> bool: ...


_lock = threading.Lock()
_controllers: list[_Waitable] = []


def register(controller: _Waitable) -> None:
    with _lock:
        _controllers.append(controller)


def unregister(controller: _Waitable) -> None:
    with _lock:
        if controller in _controllers:
            _controllers.remove(controller)


def local_controllers() -> list[_Waitable]:
    with _lock:
        return list(_controllers)


def wait_local_controllers(timeout: float) -> bool:
    """Wait until every controller of this process reached FINAL or stopped (bounded)."""
    deadline = time.monotonic() + timeout
    ok = True
    for c in local_controllers():
        ok = c.wait_final(max(0.0, deadline - time.monotonic())) and ok
    return ok
