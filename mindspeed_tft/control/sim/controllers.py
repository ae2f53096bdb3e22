"""The simulated controller processes: the active one and, in some layouts, a backup.

Each `SimController` is a real `ControllerCore` with its own tick (at the core's
`next_deadline`) and a life: as under `tft-run`, the active controller runs in node 0's
launcher and a backup in node 1's, and dies with it. `SimControllers` feeds the cores their
inputs at virtual times and routes their outputs: frames to ranks over the network, the
active controller's syncs to the backup and the backup's hellos to the active one (their own
FIFO link), and every event to the job's invariants. When the backup takes charge
(`controller_takeover`), it is the job's controller from then on.
"""

from __future__ import annotations

from typing import Any, Protocol

from ...features import Features
from ..controller.core import ControllerCore
from ..controller.inputs import Command, Frame, Input, Start, Tick, Upstream
from ..controller.outbox import Outputs
from ..controller.states import State
from ..wire.config import ControlConfig
from .invariants import Checker, Violation
from .loop import Loop, Network

#: where the controllers listen (the backup's address is in `ControlConfig.backups`)
ACTIVE_ENDPOINT = "127.0.0.1:9000"
BACKUP_ADDR = ("127.0.0.2", 9001)
#: the routing id of the backup's link to the active controller
BACKUP_ID = b"backup-0"


class ControllerHost(Protocol):
    """What the controllers need from their job (`job.SimJob`)."""

    loop: Loop
    net: Network
    checker: Checker

    def deliver_to_rank(self, identity: bytes, frame: bytes, index: int,
                        core: ControllerCore) -> None: ...
    def on_events(self, events: list[dict[str, Any]], core: ControllerCore) -> None: ...


class SimController:
    """One controller process: a core, its next tick, alive or dead."""

    def __init__(self, index: int, core: ControllerCore) -> None:
        self.index = index
        self.core = core
        self.alive = True
        self.tick_at = float("inf")
        self.token = 0


class SimControllers:
    """The job's controllers (see the module docstring)."""

    def __init__(self, job: ControllerHost, world: int, config: ControlConfig,
                 features: Features, backup: bool) -> None:
        self.job = job
        self.list = [SimController(0, ControllerCore(world, config, features=features,
                                                     endpoint=ACTIVE_ENDPOINT))]
        if backup:
            core = ControllerCore(world, config, features=features, role="backup",
                                  endpoint=f"{BACKUP_ADDR[0]}:{BACKUP_ADDR[1]}",
                                  absent_ranks_return=False)  # as tft-run's backups
            self.list.append(SimController(1, core))
        self.active = 0
        #: every controller is dead
        self.dead = False

    @property
    def core(self) -> ControllerCore:
        """The controller in charge (the backup once it took over)."""
        return self.list[self.active].core

    def start(self) -> None:
        for c in self.list:
            self.feed(c, Start())

    def kill(self, index: int) -> None:
        if index < len(self.list):
            self.list[index].alive = False
            self.dead = not any(c.alive for c in self.list)

    # -- inputs -----------------------------------------------------------------------------
    def frame_from_rank(self, index: int, identity: bytes, frame: bytes) -> None:
        c = self.list[index]
        self.feed(c, Frame(identity, frame))

    def command(self, cmd: Command) -> None:
        c = self.list[self.active]
        self.feed(c, cmd)

    def feed(self, c: SimController, event: Input) -> None:
        core = c.core
        if not c.alive or core.state is State.FINAL:
            return  # a dead or stopped controller reads nothing
        try:
            out = core.handle(event, self.job.loop.now)
        except Violation:
            raise
        except Exception as e:  # a bug of the core: the run fails with it
            self.job.checker.crashed(f"controller {c.index}", e)
            out = core.out.take()
        self._route(c, out)
        self._schedule_tick(c)

    # -- outputs ----------------------------------------------------------------------------
    def _route(self, c: SimController, out: Outputs) -> None:
        if any(e["event"] == "controller_takeover" for e in out.events):
            self.active = c.index
        if out.events:
            self.job.on_events(out.events, c.core)
        net = self.job.net
        for identity, frame in out.frames:
            if identity == BACKUP_ID and len(self.list) > 1:
                net.down(BACKUP_ID, self._to_backup, frame)
            else:
                self.job.deliver_to_rank(identity, frame, c.index, c.core)
        for frame in out.upstream:
            net.up(BACKUP_ID, self._from_backup, frame)

    def _to_backup(self, frame: bytes) -> None:
        backup = self.list[1]
        self.feed(backup, Upstream((frame,)))

    def _from_backup(self, frame: bytes) -> None:
        active = self.list[0]
        self.feed(active, Frame(BACKUP_ID, frame))

    def _schedule_tick(self, c: SimController) -> None:
        loop = self.job.loop
        due = max(c.core.next_deadline(), loop.now + 0.01)
        if due < c.tick_at - 1e-9:
            c.tick_at = due
            c.token += 1
            loop.at(due, self._tick, c, c.token)

    def _tick(self, c: SimController, token: int) -> None:
        if token != c.token:
            return
        c.tick_at = float("inf")
        self.feed(c, Tick())
