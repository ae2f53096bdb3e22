"""Scheduling priority of the control plane's threads.

An incident is a handful of message rounds (the fault report, hold, stop, clean, repair,
rollback). Each round needs the threads that carry it to get a CPU when a message arrives:
the controller's loop, each processor's I/O thread, and the ZeroMQ I/O thread behind each.
Where training keeps every core busy (more compute threads than cores, as in CPU training
with gloo), a woken thread of the same priority as the compute waits its turn behind it.
On the 2-core test machine, with 4 ranks training 60 M parameters, UCE jobs measured from
their events: the report reached the controller 5-375 ms after the fault (median 89 ms of
7 jobs) and the hold round, a few milliseconds of work, took 4-691 ms (median 117); with
these threads at nice -10, 3-968 ms (median 15 of 8 jobs) and 4-218 ms (median 60). The tail
that remains is the machine's: a separate process at nice -10 that sleeps 2 ms at a time
wakes 30 ms to 0.7 s late about twice a second while that job trains, and never under plain
matmul, allocation or gloo load (this VM's kernel runs without kernel preemption: the likely
reason, not proven).

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


def raise_priority(nice: int) -> int | None:
    """Run the calling thread (and the threads it creates from now on) at `nice` if that is
    below its current value; returns the thread's nice value afterwards, None where a
    thread's nice value cannot be read or set (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if nice >= current:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:
        _once(logging.INFO, "refused",
              "control-plane threads stay at nice %d: raising them to %d needs CAP_SYS_NICE "
              "or RLIMIT_NICE (TFT_CONTROL_NICE); where training keeps every core busy, an "
              "incident's messages can then wait for a CPU", current, nice)
        return current
    _once(logging.DEBUG, "raised", "control-plane threads run at nice %d", nice)
    return nice
