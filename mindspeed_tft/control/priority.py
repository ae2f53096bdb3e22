"""Scheduling priority of the control plane's threads.

An incident is a handful of message rounds (the fault report, hold, stop, clean, repair,
rollback). Each round needs the threads that carry it to get a CPU when a message arrives:
the controller's loop, each processor's I/O thread, and the ZeroMQ I/O thread behind each.
Where training keeps every core busy (more compute threads than cores, as in CPU training
with gloo), a woken thread of the same priority as the compute waits its turn behind it:
at 60 M parameters on the 2-core test machine, the median hold round went from 117 ms to 60
ms with these threads at nice -10 (figures and the stalls that remain: docs/design.md,
section 9).

`raise_priority(nice)` asks the kernel to run the calling thread at `nice` (lower is
favoured). The controller's loop and the processors' I/O threads call it first thing, so the
threads they create afterwards inherit it: ZeroMQ starts its I/O thread with a context's
first socket, and the order lanes start their workers from the I/O thread. These threads
sleep nearly all the time, so the training threads, which keep their priority, give up
little CPU to them. The work of a repair runs on the training thread, at its own priority.

Going below the process's nice value needs CAP_SYS_NICE or an RLIMIT_NICE that allows it
(root has it; a container often does not). Where the kernel refuses, the thread keeps its
priority and the log says so once per process. Linux only (there a nice value belongs to a
thread); elsewhere, and with `TFT_CONTROL_NICE=0`, nothing is changed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("mindspeed_tft.control")

#: the range `TFT_CONTROL_NICE` allows (0: leave the threads' priority alone)
NICE_RANGE = (-20, 0)

_said: set[str] = set()


def _once(level: int, key: str, message: str, *args: object) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, message, *args)


def raise_priority(nice: int) -> None:
    """Run the calling thread (and the threads it creates from now on) at `nice` if that is
    below its current value (Linux; elsewhere nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if nice >= current:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:
        _once(logging.INFO, "refused",
              "control-plane threads stay at nice %d: raising them to %d needs CAP_SYS_NICE "
              "or RLIMIT_NICE (TFT_CONTROL_NICE); where training keeps every core busy, an "
              "incident's messages can then wait for a CPU", current, nice)
        return
    _once(logging.DEBUG, "raised", "control-plane threads run at nice %d", nice)
