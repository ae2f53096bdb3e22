"""The shell's watch over ranks whose processes run in the controller's pid namespace.

Under plain torchrun no launcher reports its workers' deaths, but rank 0's process (where the
controller runs) sees its siblings in /proc. `LocalProcesses` takes the core's `Outputs.watch`:
a rank that registers from this pid namespace is watched, and
each tick (`poll`) a process a signal is ending is reported to the core at once, as a
launcher would report it; one that ended otherwise or is already gone (reaped) is reported
`GONE_GRACE` later if its rank is still connected then (a clean exit's bye, sent before it
ended, is read first). Reading /proc is I/O: it stays out of the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ... import procfs
from .ranktable import RankTable

#: how a `lost` fault's message names this source
SEEN_IN_PROC = "seen by the controller in /proc"
#: seconds a rank's process may be gone without a signal before it is lost (its bye first)
GONE_GRACE = 0.2


class ProcessEnds(Protocol):
    """Where a process's end goes (the controller's core, after the shell read its input)."""

    def process_exit(self, rank: int, returncode: int, source: str) -> None: ...
    def process_gone(self, rank: int, how: str, source: str) -> None: ...


@dataclass
class _Watched:
    """A rank's process in this pid namespace: its pid and start time, and since when it
    is seen gone without a code (None: not seen gone)."""

    pid: int
    start: int
    gone_since: float | None = None


class LocalProcesses:
    """Ranks in this pid namespace (see the module docstring)."""

    def __init__(self, enabled: bool) -> None:
        #: this process' pid namespace: ranks registered from it are watched in /proc;
        #: None: nobody is (a launcher reports its workers)
        self.pid_namespace = procfs.namespace() if enabled else None
        #: the ranks whose processes run in it, by rank
        self.local: dict[int, _Watched] = {}

    def watch(self, rank: int, pid: int, proc: str | None) -> None:
        """A rank registered (`Outputs.watch`): watch its process in /proc if it runs in
        this pid namespace."""
        start = procfs.local_start(proc, pid, self.pid_namespace)
        if start is None:
            self.local.pop(rank, None)
        else:
            self.local[rank] = _Watched(pid, start)

    def poll(self, now: float, table: RankTable, ends: ProcessEnds) -> None:
        """Each tick: report the watched processes that ended (`table`: read only)."""
        for rank in sorted(self.local):  # not every row: thousands of remote ranks, 4 x/s
            watched = self.local[rank]
            row = table.get(rank)
            if row is None or row.pid != watched.pid:
                del self.local[rank]
                continue
            if not row.connected:
                continue
            running, code = procfs.process_state(watched.pid, watched.start)
            if running:
                continue
            if code is not None:
                ends.process_exit(rank, code, SEEN_IN_PROC)
            elif watched.gone_since is None:
                watched.gone_since = now
            elif now - watched.gone_since >= GONE_GRACE:
                ends.process_gone(rank, "ended", SEEN_IN_PROC)
