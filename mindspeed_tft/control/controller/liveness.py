"""Liveness: which connected ranks are gone, from their silence or from their processes.

`Liveness` is held by the controller (`Controller.liveness`) and runs in its loop thread. Each
supervision tick it declares lost a connected rank silent for interval x misses (after
reading the input queued behind it) and, for ranks whose processes run in this process' pid
namespace (plain torchrun, where no launcher reports deaths), watches /proc: a process a
signal ended is lost at once, one that ended otherwise after a short grace (its bye first).
A launcher's report of a worker's exit (`Controller.report_process_exit`) takes the same path.
It reaches back into the controller only through the `LivenessHost` methods below.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ... import procfs
from ..wire.classify import FaultKind
from ..wire.config import ControlConfig
from .ranktable import Health, RankInfo, RankTable
from .states import State, StateMachine

log = logging.getLogger("mindspeed_tft.control.controller")

#: how `watch_local_processes` names its source in a `lost` fault's message
_SEEN_IN_PROC = "seen by the controller in /proc"
#: seconds a rank's process may be gone without a signal before it is lost (its bye first)
_GONE_GRACE = 0.2
#: seconds of queued input read before a silent rank is declared lost (its heartbeats may wait)
LOST_DRAIN = 0.5


class LivenessHost(Protocol):
    """What `Liveness` needs from its controller (all from the controller's loop thread)."""

    role: str

    def drain_router(self, budget: float = ...) -> int: ...
    def fault(self, rank: int, kind: FaultKind, message: str,
              detail: dict[str, Any] | None = None) -> None: ...
    def mark_dirty(self) -> None: ...
    def rank_missing(self, rank: int) -> None: ...


class Liveness:
    """Silent ranks and ended processes (see the module docstring)."""

    def __init__(self, host: LivenessHost, *, config: ControlConfig, table: RankTable,
                 sm: StateMachine, watch_processes: bool) -> None:
        self.host = host
        self.config = config
        self.table = table
        self.sm = sm
        #: this process' pid namespace: ranks registered from it are watched in /proc
        #: (`watch_local_processes`); None: nobody is (a launcher reports its workers)
        self.pid_namespace = procfs.namespace() if watch_processes else None
        #: the ranks whose processes run in it (their rows have `start`)
        self.local: set[int] = set()

    def watch(self, row: RankInfo, proc: Any) -> None:
        """A rank registered: watch its process in /proc if it runs in this pid namespace."""
        row.start = procfs.local_start(proc, row.pid, self.pid_namespace)
        if row.start is not None:
            self.local.add(row.rank)

    def heartbeat_age(self, now: float) -> float | None:
        """Seconds since the longest-silent connected rank was heard from (None: none)."""
        return max((now - r.last_seen for r in self.table.connected()), default=None)

    def supervise(self, now: float) -> None:
        """One supervision tick: processes gone, then ranks silent for too long."""
        self.watch_local_processes(now)
        overdue = self.table.overdue(now, self.config.lost_after)
        if overdue:
            # their heartbeats may be queued behind other input: read it first (bounded)
            self.host.drain_router(LOST_DRAIN)
            overdue = self.table.overdue(now, self.config.lost_after)  # still silent
        for row in overdue:
            silent = now - row.last_seen
            self.declare_lost(row, f"silent for {silent:.1f}s", f"no heartbeat for {silent:.1f}s")

    def declare_lost(self, row: RankInfo, during_init: str, message: str) -> None:
        """A connected rank's process is gone (silence or a launcher's report)."""
        row.health = Health.LOST
        self.host.mark_dirty()
        if self.sm.state is State.INIT:
            log.warning("rank %d %s during registration", row.rank, during_init)
            self.host.rank_missing(row.rank)
            return
        self.host.fault(row.rank, FaultKind.LOST, message)

    def watch_local_processes(self, now: float) -> None:
        """Ranks in this pid namespace (`RankInfo.start`; under plain torchrun no launcher
        reports deaths): one whose process a signal is ending is lost now, as a launcher
        would report it; one whose process ended otherwise or is already gone (reaped) is
        lost `_GONE_GRACE` later if it is still connected then (a clean exit's bye, sent
        before it ended, is read first)."""
        for rank in sorted(self.local):  # not every row: thousands of remote ranks, 4 x/s
            row = self.table.get(rank)
            if row is None or row.start is None:
                self.local.discard(rank)
                continue
            if not row.connected:
                continue
            running, code = procfs.process_state(row.pid, row.start)
            if running:
                continue
            if code is not None:
                self.on_process_exit(row.rank, code, _SEEN_IN_PROC)
            elif row.gone_since is None:
                row.gone_since = now
            elif now - row.gone_since >= _GONE_GRACE:
                self.process_gone(row.rank, "ended", _SEEN_IN_PROC)

    def on_process_exit(self, rank: int, returncode: int,
                        source: str = "reported by its launcher") -> None:
        if self.host.role != "active" or returncode == 0:
            return
        how = (f"killed by signal {-returncode}" if returncode < 0
               else f"exited with code {returncode}")
        self.process_gone(rank, how, source)

    def process_gone(self, rank: int, how: str, source: str) -> None:
        """`rank`'s process `how` ("killed by signal 9", ...): lost, unless a bye or report
        it sent before it ended says otherwise."""
        self.host.drain_router()  # a bye or report it sent before it ended comes first
        row = self.table.get(rank)
        if row is None or not row.connected:
            log.info("rank %d: process %s, not connected (%s): nothing to do",
                     rank, how, "unregistered" if row is None else row.health)
            return
        log.warning("rank %d: process %s (%s)", rank, how, source)
        self.declare_lost(row, f"process {how}", f"process {how} ({source})")
