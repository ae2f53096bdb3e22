"""Host memory that a parked warm spare keeps ready for the state it will build.

A spare that takes a rank builds the model, its DDP buffers and the optimizer state before
the repair can copy a shard into them. On CPU that state lives in host memory the process
has never touched, and the kernel gives it page by page on first touch: at 60 M parameters
(~0.8 GB of params, grads, param buffer and Adam state per rank) that was 0.31 s of the
spare's 0.39 s set-up after it joined the process groups on the 2-core test machine, and
0.09 s with the memory faulted in beforehand (`bench/HISTORY.md`, "Warm spare memory").

`HeapReserve` does it the way glibc allows: `mallopt` makes every later allocation of the
process come from the heap (`M_MMAP_MAX` 0) and never hands freed heap back to the kernel
(`M_TRIM_THRESHOLD` -1); one block of the wanted size is then allocated, touched and freed,
so its pages stay resident in the heap and the set-up's allocations reuse them. A process
that took a rank keeps those settings: it holds its peak memory instead of mapping and
unmapping its large temporaries at each step.

How much: the largest anonymous resident memory (`RssAnon`) of the launcher's other
children (the workers), less the spare's own before it reserved anything, at most half the
host's available memory. A spare polls it while it waits and grows the reserve as the
workers grow (a reserve only grows). Only where training keeps its state in host memory
(the CPU platform); only with glibc (elsewhere `mallopt` is missing or does nothing, and
nothing is reserved).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

from ..procfs import children, kib

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
#: bytes touched between two checks of `interrupted` (a reserve never delays a handover
#: by more than touching this much: ~25 ms)
TOUCH_STEP = 64 << 20
#: a reserve grows only when the target passes it by this much
GROWTH_MIN = 64 << 20
#: share of the host's available memory a reserve may take at most
AVAILABLE_SHARE = 0.5
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def anon_bytes(pid: int | str = "self") -> int:
    """Anonymous resident memory of a process, in bytes (0 when unknown)."""
    return (kib(f"/proc/{pid}/status", "RssAnon") or 0) * 1024


def available_bytes() -> int:
    """The host's available memory (`MemAvailable`), in bytes (0 when unknown)."""
    return (kib("/proc/meminfo", "MemAvailable") or 0) * 1024


class HeapReserve:
    """Resident heap pages held for this process' own later allocations (module docstring)."""

    def __init__(self) -> None:
        self.held = 0  # bytes of the largest block touched so far
        self.baseline = anon_bytes()
        self._libc: ctypes.CDLL | None = None
        self._failed = not sys.platform.startswith("linux")

    @property
    def usable(self) -> bool:
        """False once glibc refused the settings (or off Linux): nothing is reserved."""
        return not self._failed

    def _settings(self) -> ctypes.CDLL | None:
        if self._libc is None and not self._failed:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, -1) == 1
            except (OSError, AttributeError):
                ok = False
            if ok:
                libc.malloc.restype = ctypes.c_void_p
                libc.malloc.argtypes = [ctypes.c_size_t]
                libc.free.argtypes = [ctypes.c_void_p]
                self._libc = libc
            else:
                self._failed = True
        return self._libc

    def grow_to(self, size: int, interrupted: Callable[[], bool] = lambda: False) -> int:
        """Make at least `size` bytes of heap resident (no-op when as much is held already or
        the platform does not allow it); stops early, keeping what it touched, as soon as
        `interrupted()` says so. Returns the bytes held afterwards."""
        if size < self.held + GROWTH_MIN:
            return self.held
        libc = self._settings()
        if libc is None:
            return self.held
        block = libc.malloc(size)
        if not block:
            return self.held
        touched = 0
        try:
            while touched < size:
                step = min(TOUCH_STEP, size - touched)
                ctypes.memset(block + touched, 0, step)
                touched += step
                if touched < size and interrupted():
                    break
        finally:
            libc.free(block)
        self.held = max(self.held, touched)
        return self.held

    def target(self, launcher_pid: int) -> int:
        """Bytes to hold for a worker of `launcher_pid`: its largest other child's anonymous
        memory less this process' own before the reserve, capped by the host's memory."""
        me = os.getpid()
        peak = max((anon_bytes(p) for p in children(launcher_pid) if p != me), default=0)
        wanted = max(0, peak - self.baseline)
        cap = int((available_bytes() + self.held) * AVAILABLE_SHARE)
        return min(wanted, cap) // PAGE * PAGE
