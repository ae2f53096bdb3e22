"""What SIGTERM does to a training process under high availability, and how a decided exit
ends it (hosts: the plugin, and `mindio_ttp` above it).

A launcher (torchrun) terminates the survivors as soon as one worker dies and kills them
after a grace period; the survivors must live long enough to handle the fault (dump or
repair). `Termination` therefore only marks the process on SIGTERM; at its next step
boundary (`check`) a rank that is not part of a fault's handling waits briefly for one to
begin and otherwise exits with `SIGTERM_EXIT_CODE`.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from ...process_exit import exit_without_teardown
from ..wire.classify import ForceStop

#: exit code of a process ended by SIGTERM when no fault is being handled
SIGTERM_EXIT_CODE = 143


class Termination:
    """SIGTERM under high availability: a launcher (torchrun) terminates the survivors as
    soon as one worker dies, and kills them after a grace period. The survivors must live
    long enough to handle the fault (dump or repair), so SIGTERM only marks the process;
    at its next step boundary a rank that is not part of a fault's handling waits briefly
    for one to begin and otherwise exits."""

    def __init__(self, wait_seconds: float) -> None:
        self.requested = threading.Event()
        self.wait_seconds = wait_seconds

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self.requested.is_set():
            print("[mindspeed-tft] SIGTERM received: finishing the fault handling before "
                  "exiting", flush=True)
        self.requested.set()

    def check(self, processor: Any) -> None:
        if not self.requested.is_set():
            return
        deadline = time.monotonic() + self.wait_seconds
        while time.monotonic() < deadline and not processor.stopped:
            time.sleep(0.05)
        if processor.stopped:
            raise ForceStop("FORCE STOP: terminated while a fault is handled")
        print("[mindspeed-tft] SIGTERM: no fault to handle; exiting", flush=True)
        processor.stop(SIGTERM_EXIT_CODE)
        exit_without_teardown(SIGTERM_EXIT_CODE)


