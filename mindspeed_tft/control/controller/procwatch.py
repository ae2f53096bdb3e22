"""The shell's watch over ranks whose processes run in the controller's pid namespace.

Under plain torchrun no launcher reports its workers' deaths, but rank 0's process (where the
controller runs) sees its siblings in /proc. `LocalProcesses` is the controller core's
`registration.ProcessWatch`: a rank that registers from this pid namespace is watched, and
each tick (`poll`) a process a signal is ending is reported to the core at once, as a
launcher would report it; one that ended otherwise or is already gone (reaped) is reported
`GONE_GRACE` later if its rank is still connected then (a clean exit's bye, sent before it
ended, is read first). Reading /proc is I/O: it stays out of the core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ... import procfs
from .ranktable import RankInfo, RankTable

#: how a `lost` fault's message names this source
SEEN_IN_PROC = "seen by the controller in /proc"
#: seconds a rank's process may be gone without a signal before it is lost (its bye first)
GONE_GRACE = 0.2


class ProcessEnds(Protocol):
    """Where a process's end goes (the controller's core, after the shell read its input)."""

    def process_exit(self, rank: int, returncode: int, source: str) -> None: ...
    def process_gone(self, rank: int, how: str, source: str) -> None: ...


class LocalProcesses:
    """Ranks in this pid namespace (see the module docstring)."""

    def __init__(self, table: Callable[[], RankTable], enabled: bool) -> None:
        self._table = table
        #: this process' pid namespace: ranks registered from it are watched in /proc;
        #: None: nobody is (a launcher reports its workers)
        self.pid_namespace = procfs.namespace() if enabled else None
        #: the ranks whose processes run in it (their rows have `start`)
        self.local: set[int] = set()

    def watch(self, row: RankInfo, proc: Any) -> None:
        """A rank registered: watch its process in /proc if it runs in this pid namespace."""
        row.start = procfs.local_start(proc, row.pid, self.pid_namespace)
        if row.start is not None:
            self.local.add(row.rank)

    def poll(self, now: float, ends: ProcessEnds) -> None:
        table = self._table()
        for rank in sorted(self.local):  # not every row: thousands of remote ranks, 4 x/s
            row = table.get(rank)
            if row is None or row.start is None:
                self.local.discard(rank)
                continue
            if not row.connected:
                continue
            running, code = procfs.process_state(row.pid, row.start)
            if running:
                continue
            if code is not None:
                ends.process_exit(row.rank, code, SEEN_IN_PROC)
            elif row.gone_since is None:
                row.gone_since = now
            elif now - row.gone_since >= GONE_GRACE:
                ends.process_gone(row.rank, "ended", SEEN_IN_PROC)
