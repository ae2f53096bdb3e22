"""A simulated launcher: one per node, reporting its workers' ends and replacing them.

Like `tft-run`'s agent it tells the controller at once that a worker ended
(`core.ProcessExit`, with why it will not restart it when its exit code is not one it
restarts) and, for a worker a signal ended or the controller rebooted (the reboot
exit code), starts a replacement by its policy (`schedule.REPLACEMENTS`): a restart after
a second or two, a warm spare within a tenth of a second, one that comes only after the
incident stopped waiting, or none (`core.NoReplacement`, as when its restart budget is
spent). A dead launcher (its node lost, or itself) reports and restarts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..controller.core import Command, NoReplacement, ProcessExit
from ..wire.config import ControlConfig
from .loop import Loop

#: restarts a launcher grants a rank before it reports that it will not restart it
RESTART_BUDGET = 3


class Spawner(Protocol):
    """Where a launcher's commands and replacements go (`job.SimJob`)."""

    loop: Loop
    config: ControlConfig

    def command(self, cmd: Command) -> None: ...
    def spawn(self, rank: int) -> None: ...


class SimLauncher:
    """The launcher of one node (see the module docstring)."""

    def __init__(self, job: Spawner, node: int, policy: str) -> None:
        self.job = job
        self.node = node
        self.policy = policy
        self.alive = True
        self.restarts: dict[int, int] = {}

    def worker_ended(self, rank: int, code: int, job_over: Callable[[], bool]) -> None:
        if not self.alive:
            return
        loop, cfg = self.job.loop, self.job.config
        restartable = code < 0 or code == cfg.reboot_exit_code
        refusal = (None if code == 0 or restartable or job_over()
                   else f"exited with code {code}: its launcher does not restart it")
        loop.after(0.005, self.job.command, ProcessExit(rank, code, refusal))
        if job_over() or not restartable:
            return
        used = self.restarts.get(rank, 0)
        if self.policy == "never" or used >= RESTART_BUDGET:
            loop.after(0.01, self.job.command,
                       NoReplacement(rank, f"restart budget spent ({used} restarts)"))
            return
        self.restarts[rank] = used + 1
        delay = {"restart": 1.5, "warm": 0.1,
                 "late": cfg.effective_replacement_wait + 3.0}[self.policy]
        loop.after(delay, self._start, rank, job_over)

    def _start(self, rank: int, job_over: Callable[[], bool]) -> None:
        if self.alive and not job_over():
            self.job.spawn(rank)
