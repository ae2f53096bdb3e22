"""Scheduling priority of the control plane's threads.

An incident is a handful of message rounds (the fault report, hold, stop, clean, repair,
rollback). Each round needs the threads that carry it to get a CPU when a message arrives:
the controller's loop, each processor's I/O thread, and the ZeroMQ I/O thread behind each.
Where training keeps every core busy (more runnable threads than cores, as in CPU training
with gloo), a woken thread waits its turn behind the compute.

`raise_priority(nice, rtprio)` asks the kernel to run the calling thread at `nice` (lower is
favoured) and, with `rtprio` > 0, under the real-time round-robin policy (`SCHED_RR`) at that
priority: a woken real-time thread runs as soon as the CPU it wakes on reaches a preemption
point, ahead of every normal thread, whatever their number. A nice value only weights a
thread's share against the others: on the 2-core test machine, where each rank also runs a
gloo I/O thread per process group that wakes every 10 ms (about 60 runnable threads at a
time), a probe thread at nice -10 inside a rank waited up to 0.8 s for a CPU, as often as
one at nice 0; at `SCHED_RR` 1 it waited at most 75 ms (figures: docs/design.md, section 9).
The controller's loop and the processors' I/O threads call it first thing, so the ZeroMQ
threads they start afterwards (ZeroMQ starts its I/O thread with a context's first socket)
inherit it. These threads sleep nearly all the time and their work per message is small,
so the training threads, which keep their priority, give up little CPU to them.

Threads such a thread starts for other work (the order lanes' workers, the metrics
endpoint) call `leave_realtime()` first: they keep the nice value and go back to the normal
policy, because their work can be long (a callback, a checkpoint) and must not hold a core
ahead of training.

Going below the process's nice value needs CAP_SYS_NICE or an RLIMIT_NICE that allows it;
a real-time policy needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at least `rtprio` (root has
both; a container often has neither). Where the kernel refuses, the thread keeps what it had
and the log says so once per process. Linux only (there a policy and a nice value belong to
a thread); elsewhere, and with `TFT_CONTROL_NICE=0` and `TFT_CONTROL_RTPRIO=0`, nothing is
changed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("mindspeed_tft.control")

#: the range `TFT_CONTROL_NICE` allows (0: leave the threads' nice value alone)
NICE_RANGE = (-20, 0)
#: the range `TFT_CONTROL_RTPRIO` allows (0: no real-time policy)
RTPRIO_RANGE = (0, 99)

_REALTIME = frozenset(getattr(os, name) for name in ("SCHED_RR", "SCHED_FIFO")
                      if hasattr(os, name))

_said: set[str] = set()


def _once(level: int, key: str, message: str, *args: object) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, message, *args)


def raise_priority(nice: int, rtprio: int = 0) -> None:
    """Run the calling thread (and the threads it creates from now on) at `nice` if that is
    below its current value, and under `SCHED_RR` at `rtprio` if that is > 0 (Linux;
    elsewhere nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    _lower_nice(tid, nice)
    if rtprio > 0:
        _realtime(tid, rtprio)


def _lower_nice(tid: int, nice: int) -> None:
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


def _realtime(tid: int, rtprio: int) -> None:
    try:
        os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(rtprio))
    except PermissionError:
        _once(logging.INFO, "rt-refused",
              "control-plane threads stay under the normal scheduling policy: SCHED_RR "
              "priority %d needs CAP_SYS_NICE or RLIMIT_RTPRIO >= %d (TFT_CONTROL_RTPRIO; "
              "0: do not ask); where training keeps every core busy, an incident's messages "
              "can then wait for a CPU", rtprio, rtprio)
        return
    _once(logging.DEBUG, "rt", "control-plane threads run under SCHED_RR priority %d", rtprio)


def leave_realtime() -> None:
    """Put the calling thread back under the normal policy if it inherited a real-time one
    (its nice value stays). For threads that a control-plane thread starts for other work."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    if os.sched_getscheduler(tid) in _REALTIME:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
