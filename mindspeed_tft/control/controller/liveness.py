"""Liveness: which connected ranks are gone, from their silence or from their processes.

`Liveness` is part of the controller's core (`ControllerCore.liveness`). Each supervision
tick it declares lost a connected rank silent for interval x misses (the shell reads the
input queued behind it first, `LOST_DRAIN`), and it takes the ends of processes: a
launcher's report of a worker's exit (`core.ProcessExit`) and, for ranks whose processes run
in the controller's pid namespace (plain torchrun, where no launcher reports deaths), what
the shell's `procwatch.LocalProcesses` sees in /proc. It reaches back into the core only
through the `LivenessHost` methods below.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from ..wire.classify import FaultKind
from .ranktable import Health, RankInfo, RankTable
from .states import State, StateMachine

if TYPE_CHECKING:  # the type only: its module reads the environment
    from ..wire.config import ControlConfig

log = logging.getLogger("mindspeed_tft.control.controller")

#: seconds of queued input read before a silent rank is declared lost (its heartbeats may wait)
LOST_DRAIN = 0.5


class LivenessHost(Protocol):
    """What `Liveness` needs from its controller (all from the controller's loop thread)."""

    role: str

    def fault(self, rank: int, kind: FaultKind, message: str,
              detail: dict[str, Any] | None = None) -> None: ...
    def mark_dirty(self) -> None: ...
    def rank_missing(self, rank: int) -> None: ...


class Liveness:
    """Silent ranks and ended processes (see the module docstring)."""

    def __init__(self, host: LivenessHost, *, config: ControlConfig, table: RankTable,
                 sm: StateMachine) -> None:
        self.host = host
        self.config = config
        self.table = table
        self.sm = sm

    def heartbeat_age(self, now: float) -> float | None:
        """Seconds since the longest-silent connected rank was heard from (None: none)."""
        return max((now - r.last_seen for r in self.table.connected()), default=None)

    def supervise(self, now: float) -> None:
        """One supervision tick: ranks silent for too long are lost."""
        for row in self.table.overdue(now, self.config.lost_after):
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

    def on_process_exit(self, rank: int, returncode: int,
                        source: str = "reported by its launcher") -> None:
        if self.host.role != "active" or returncode == 0:
            return
        how = (f"killed by signal {-returncode}" if returncode < 0
               else f"exited with code {returncode}")
        self.process_gone(rank, how, source)

    def process_gone(self, rank: int, how: str, source: str) -> None:
        """`rank`'s process `how` ("killed by signal 9", ...): lost, unless a bye or report
        it sent before it ended says otherwise (the shell reads its input first)."""
        row = self.table.get(rank)
        if row is None or not row.connected:
            log.info("rank %d: process %s, not connected (%s): nothing to do",
                     rank, how, "unregistered" if row is None else row.health)
            return
        log.warning("rank %d: process %s (%s)", rank, how, source)
        self.declare_lost(row, f"process {how}", f"process {how} ({source})")
