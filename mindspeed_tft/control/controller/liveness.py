"""Liveness: which connected ranks are gone, from their silence or from their processes.

`Liveness` is part of the controller's core (`ControllerCore.liveness`). Each supervision
tick it declares lost a connected rank silent for interval x misses (the shell reads the
input queued behind it first, `LOST_DRAIN`), and it takes the ends of processes: a
launcher's report of a worker's exit (`core.ProcessExit`) and, for ranks whose processes run
in the controller's pid namespace (plain torchrun, where no launcher reports deaths), what
the shell's `procwatch.LocalProcesses` sees in /proc. It decides, and returns its decision
(`Lost`): the core starts or joins the incident, or has the roll call wait again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .context import Context
from .ranktable import Health, RankInfo
from .states import State

log = logging.getLogger("mindspeed_tft.control.controller")

#: seconds of queued input read before a silent rank is declared lost (its heartbeats may wait)
LOST_DRAIN = 0.5


@dataclass(frozen=True)
class Lost:
    """The decision that `rank` is lost, and why: `message` (the `lost` fault's), or during
    INIT (`during_init`: the roll call waits for it again, no fault)."""

    rank: int
    message: str
    during_init: bool = False


class Liveness:
    """Silent ranks and ended processes (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.table = ctx.table
        self.sm = ctx.sm

    def heartbeat_age(self, now: float) -> float | None:
        """Seconds since the longest-silent connected rank was heard from (None: none)."""
        return max((now - r.last_seen for r in self.table.connected()), default=None)

    def supervise(self, now: float) -> list[Lost]:
        """One supervision tick: ranks silent for too long are lost."""
        lost = []
        for row in self.table.overdue(now, self.config.lost_after):
            silent = now - row.last_seen
            lost.append(self.declare_lost(row, f"silent for {silent:.1f}s",
                                          f"no heartbeat for {silent:.1f}s"))
        return lost

    def declare_lost(self, row: RankInfo, during_init: str, message: str) -> Lost:
        """A connected rank's process is gone (silence or a launcher's report)."""
        row.health = Health.LOST
        self.ctx.mark_dirty()
        if self.sm.state is State.INIT:
            log.warning("rank %d %s during registration", row.rank, during_init)
            return Lost(row.rank, during_init, during_init=True)
        return Lost(row.rank, message)

    def on_process_exit(self, rank: int, returncode: int,
                        source: str = "reported by its launcher") -> Lost | None:
        if self.ctx.role != "active" or returncode == 0:
            return None
        how = (f"killed by signal {-returncode}" if returncode < 0
               else f"exited with code {returncode}")
        return self.process_gone(rank, how, source)

    def process_gone(self, rank: int, how: str, source: str) -> Lost | None:
        """`rank`'s process `how` ("killed by signal 9", ...): lost, unless a bye or report
        it sent before it ended says otherwise (the shell reads its input first)."""
        row = self.table.get(rank)
        if row is None or not row.connected:
            log.info("rank %d: process %s, not connected (%s): nothing to do",
                     rank, how, "unregistered" if row is None else row.health)
            return None
        log.warning("rank %d: process %s (%s)", rank, how, source)
        return self.declare_lost(row, f"process {how}", f"process {how} ({source})")
