"""The controller's decisions, without I/O: a state machine from inputs to outputs.

`ControllerCore` is everything a controller decides: registrations and the INIT roll call
(`registration`), silent and ended ranks (`liveness`), what each message means (`inbox`),
the incident under way and its phases (`incidents`, `flow`, `phases`, `dumping`, `scaling`, `strategy`),
backups kept in sync and a backup taking charge (`backup`). It holds no socket, thread,
clock or random source, and calls nothing outside itself.

Its one entry point is `handle(input, now) -> Outputs` (h11's shape): an input of
`inputs` (a frame with what the shell knows of its connection, frames from the active
controller, a command, a tick) at `now` on the loop's clock, and what it decided: frames
to send to routing ids, event records to write, frames for the active controller, the
admission of the frame's connection, processes to watch, whether a snapshot changed.
`next_deadline()` says when the next `Tick` is due. The running controller
(`controller.Controller`) is the shell around it: a ROUTER, its loop thread, the real
clock, admission of connections, /proc watching and the metrics endpoint. The simulator
(`control.sim`) feeds the same core from its virtual network and clock, the same call.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from ...features import Features
from ...records import CONTROLLER_RANK
from ..wire.classify import FaultKind
from ..wire.messages import AckMessage, RegisteredMessage
from ..wire.order_types import ExitOrder, PauseOrder, Payload, ResumeOrder
from ..wire.protocol import CONTROLLER, DropCounter, Limits, MsgType, encode
from .backup import BackupSync
from .context import Context
from .flow import IncidentFlow
from .inbox import Inbox
from .incidents import Incidents
from .inputs import (
    Command,
    Frame,
    Input,
    NewFeatures,
    NodeBack,
    NodeSilent,
    NoReplacement,
    Pause,
    ProcessExit,
    ProcessGone,
    Resume,
    Start,
    Tick,
    Upstream,
)
from .liveness import Liveness, Lost
from .nodes import Nodes
from .outbox import Outputs
from .ranktable import RankInfo
from .registration import Registration
from .states import State
from .strategy import StrategyPlanner

if TYPE_CHECKING:  # the type only: its module reads the environment
    from ..wire.config import ControlConfig

log = logging.getLogger("mindspeed_tft.control.controller")

#: action ids an epoch of the active controller may use (ids of epoch e start at e << 40)
ACTION_ID_BITS = 40


class ControllerCore:
    """A controller's decision logic (see the module docstring)."""

    def __init__(self, world_size: int, config: ControlConfig, *, features: Features,
                 planner: StrategyPlanner | None = None, role: str = "active",
                 backup_index: int = 0, endpoint: str = "",
                 absent_ranks_return: bool = True) -> None:
        planner = planner or StrategyPlanner(features)
        planner.features = features
        #: what every part shares (`context.Context`)
        self.ctx = ctx = Context(world_size, config, planner, role=role, endpoint=endpoint,
                                 drops=DropCounter(log),
                                 limits=Limits.for_world(world_size, config.max_message_bytes))
        self.config, self.world_size, self.planner = config, world_size, planner
        self.out, self.table, self.sm = ctx.out, ctx.table, ctx.sm
        self.drops, self.limits, self.elasticity = ctx.drops, ctx.limits, ctx.elasticity
        self.sm.listeners.append(self._on_transition)
        self.backup_index = backup_index
        #: the job's end decided outside an incident (training finished, INIT failed)
        self._exit_code: int | None = None
        self.started = 0.0
        self._ack_frame: bytes | None = None
        self.backups = BackupSync(ctx, self, backup_index=backup_index,
                                  absent_ranks_return=absent_ranks_return)
        #: silent ranks and ended processes (`liveness.Liveness`)
        self.liveness = Liveness(ctx)
        #: registrations and the INIT roll call (`registration.Registration`)
        self.registration = Registration(ctx, self)
        #: silent launchers of other nodes, and the ranks that get no replacement (`nodes`)
        self.nodes = Nodes(ctx)
        #: the incident under way, the orders it sends, its counters (`incidents.Incidents`)
        self.incidents = Incidents(ctx, unreplaceable=self.nodes.unreplaceable)
        #: what processors and backups send (`inbox.Inbox`)
        self.inbox = Inbox(ctx, self, registration=self.registration, backups=self.backups)

    # -- reading ------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.sm.state

    @property
    def flow(self) -> IncidentFlow | None:
        """The incident under way (`Incidents.flow`)."""
        return self.incidents.flow

    @property
    def now(self) -> float:
        """The time of the input being handled (loop clock)."""
        return self.out.now

    @property
    def role(self) -> str:
        return self.ctx.role

    @property
    def epoch(self) -> int:
        return self.ctx.epoch

    @property
    def endpoint(self) -> str:
        return self.ctx.endpoint

    @property
    def features(self) -> Features:
        return self.ctx.features

    @property
    def exit_code(self) -> int | None:
        """The job's exit code once decided (None: not yet)."""
        return self._exit_code if self._exit_code is not None else self.incidents.exit_code

    def role_name(self) -> str:
        return self.ctx.role_name()

    def emit(self, event: str, rank: int, **fields: Any) -> dict[str, Any]:
        """An event (into the outbox: the shell writes it, the simulator checks it)."""
        return self.ctx.emit(event, rank, **fields)

    # -- inputs -------------------------------------------------------------------------
    def handle(self, event: Input, now: float) -> Outputs:
        """The core's one entry point: `event` at `now` (loop clock), and what it decided."""
        self.out.at(now)
        if isinstance(event, Frame):
            self.inbox.on_frame(event)
        elif isinstance(event, Tick):
            self.out.wall_offset = event.wall_offset
            self._tick()
        elif isinstance(event, Upstream):
            self.backups.on_upstream(list(event.frames), now)
        elif isinstance(event, Start):
            self._start(event)  # before anything is emitted: its offset stamps the events
        else:
            self._command(event)
        return self.out.take()

    def _start(self, start: Start) -> None:
        """The controller listens."""
        self.started = self.now
        self.out.wall_offset = start.wall_offset
        self.ctx.endpoint = start.endpoint or self.ctx.endpoint
        self.backups.expect_server_key(start.server_key)
        if self.role == "backup":
            self.backups.linked(self.now)
        else:
            self.sm.emit_events = True
            self.sm.announce("controller started")

    def _command(self, cmd: Command) -> None:
        """An operator's or a launcher's command."""
        state = self.sm.state
        if isinstance(cmd, Pause):
            if state is State.NORMAL and self.role == "active":
                self.sm.to(State.PAUSE, "operator pause")
                self.broadcast(PauseOrder("operator pause"))
        elif isinstance(cmd, Resume):
            if state is State.PAUSE:
                self.sm.to(State.NORMAL, "operator resume")
                self.broadcast(ResumeOrder(0, None, "none", True))
        elif isinstance(cmd, ProcessExit):
            self._lost(self.liveness.on_process_exit(cmd.rank, cmd.returncode, cmd.source))
            if cmd.no_replacement is not None and self.flow is not None:
                self.flow.no_replacement(cmd.rank, cmd.no_replacement)
        elif isinstance(cmd, ProcessGone):
            self._lost(self.liveness.process_gone(cmd.rank, cmd.how, cmd.source))
        elif isinstance(cmd, NoReplacement):
            if self.flow is not None:
                self.flow.no_replacement(cmd.rank, cmd.why)
        elif isinstance(cmd, NodeSilent):
            if self.role == "active":
                self._no_replacement(self.nodes.on_silent(cmd.node, tuple(cmd.ranks),
                                                          cmd.silent_for, self.now))
        elif isinstance(cmd, NodeBack):
            self.nodes.on_back(cmd.node)
        elif isinstance(cmd, NewFeatures):
            self.adopt(self.epoch, cmd.features)
        else:  # pragma: no cover - a new input type without its case
            raise TypeError(f"unknown controller input {cmd!r}")

    def _lost(self, lost: Lost | None) -> None:
        """Liveness decided a rank is lost: the roll call waits for it again (INIT), or a
        `lost` fault."""
        if lost is None:
            return
        if lost.during_init:
            self.registration.mark_missing(lost.rank)
        else:
            self.fault(lost.rank, FaultKind.LOST, lost.message)

    def _no_replacement(self, given_up: list[tuple[int, str]]) -> None:
        """Ranks no replacement is coming for (`Nodes`): the incident under way knows."""
        flow = self.flow
        if flow is not None:
            for rank, why in given_up:
                flow.no_replacement(rank, why)

    def launcher_exit(self, rank: int, returncode: int, no_replacement: str | None) -> None:
        """Another node's launcher reported `rank`'s process' end (`inbox`, `exited`): the
        same as node 0's launcher's `ProcessExit`."""
        self._command(ProcessExit(rank, returncode, no_replacement))

    def overdue(self, now: float) -> bool:
        """Would a tick at `now` find silent ranks? (The shell reads its input first.)"""
        return self.role == "active" and bool(self.table.overdue(now, self.config.lost_after))

    def _tick(self) -> None:
        """Time passed: deadlines, silences, syncs."""
        now = self.now
        state = self.sm.state
        if self.role == "active":
            for lost in self.liveness.supervise(now):
                self._lost(lost)
            self._no_replacement(self.nodes.tick(now))
            if self.flow is not None:
                self.flow.tick(now)
            if state is State.INIT and (late := self.registration.overdue(now, self.started)):
                self.fail_init(late)
            if self.incidents.grow_check and self.flow is None and state is State.NORMAL:
                if self.table.all_done():  # every member finished during the incident
                    self.training_finished()
                else:
                    self.incidents.maybe_grow(now)
            self.backups.tick_active(now)
        else:
            self.backups.standby_tick(now)

    def next_deadline(self) -> float:
        """When a tick next has something to decide (loop clock; inf: only on input)."""
        cfg = self.config
        if self.sm.state is State.FINAL:
            return math.inf
        times = [self.backups.next_deadline(self.now)]
        if self.role == "active":
            times.append(self.nodes.next_deadline())
            rows = self.table.connected()
            if rows:
                times.append(min(r.last_seen for r in rows) + cfg.lost_after + 1e-9)
            flow = self.flow
            if flow is not None and flow.phase is not None and flow.phase.pending:
                times.append(flow.phase.deadline)
            if self.sm.state is State.INIT:
                times.append(self.started + cfg.register_timeout + 1e-9)
            if self.incidents.grow_check:
                times.append(self.now)
        return min(times)

    # -- InboxHost, RegistrationHost, LivenessHost, IncidentsHost, BackupHost ----------------
    def rank_restarted(self, row: RankInfo) -> None:
        self.incidents.rank_restarted(row)

    def rank_returned(self, row: RankInfo, replica: dict[str, Any] | None) -> None:
        self.incidents.rank_returned(row, replica)

    def order(self, rank: int, payload: Payload) -> None:
        self.incidents.order(rank, payload)

    def ack_frame(self) -> bytes:
        """The answer to a heartbeat (encoded once per state, epoch and role)."""
        frame = self._ack_frame
        if frame is None:
            frame = self._ack_frame = encode(
                MsgType.ACK, CONTROLLER, self.ctx.next_seq(),
                AckMessage(self.sm.state.value, self.epoch, self.role_name()))
        return frame

    def training_finished(self) -> None:
        """Every member said bye: the job ends with code 0."""
        self.sm.to(State.EXIT, "training finished")
        self.incidents.dismiss_returning("training finished before the job could grow by "
                                         "this rank")
        self._exit_code = 0
        self.emit("exit", CONTROLLER_RANK, code=0, reason="training finished")
        self.sm.to(State.FINAL, "training finished")

    def send_registered(self, row: RankInfo) -> None:
        """The answer to a registration: the rank is registered here."""
        cfg = self.config
        self.ctx.send(row.identity, MsgType.REGISTERED, RegisteredMessage(
            self.epoch, self.sm.state.value, cfg.heartbeat_interval, cfg.heartbeat_misses,
            tuple(self.backups.addresses()), row.fresh, self.incident_lock_step(),
            self.role_name()))

    def fault(self, rank: int, kind: FaultKind, message: str,
              detail: dict[str, Any] | None = None) -> None:
        """A fault on `rank`: starts an incident, joins the one under way, or ends INIT."""
        state = self.sm.state
        if state is State.INIT:
            self.emit("fault_detected", CONTROLLER_RANK, ranks=[rank], kind=kind.value,
                      message=message[:500])
            self.fail_init(f"{kind} on rank {rank} before all ranks registered: {message[:200]}")
        elif self.flow is None and state in (State.NORMAL, State.PAUSE):
            self.incidents.open(rank, kind, message, detail, self.now)
        elif self.flow is not None:
            self.flow.add_fault(rank, kind, message, detail)

    def fail_init(self, reason: str) -> None:
        log.error("initialisation failed: %s", reason)
        code = self.config.failure_exit_code
        self._exit_code = code
        self.emit("exit", CONTROLLER_RANK, code=code, reason=reason)
        self.broadcast(ExitOrder(code, reason))
        self.sm.to(State.FINAL, reason)

    def incident_lock_step(self) -> int | None:
        """The lock step of the incident under way; None when there is none."""
        return self.incidents.lock_step()

    def adopt(self, epoch: int, features: Features) -> None:
        """A backup takes the active controller's epoch and features (sync)."""
        self.ctx.epoch = epoch
        self.planner.features = features

    def become_active(self) -> None:
        """A backup takes charge: a new epoch, and its transitions are events from now on."""
        self.ctx.role = "active"
        self.ctx.epoch += 1
        # its action ids must not repeat ones the ranks saw from the controller before it
        # (a processor drops an id it has seen as a repeat): each epoch numbers its own
        # (found by the simulator: tft-sim --seed 480 --world 8)
        self.incidents.number_actions_from(self.epoch << ACTION_ID_BITS)
        self.sm.emit_events = True
        self._ack_frame = None

    def broadcast(self, payload: Payload) -> None:
        """One order to every connected rank."""
        self.incidents.send_action_many([r.rank for r in self.table.connected()],
                                        self.incidents.new_action_id(), payload,
                                        self.config.action_time_limit)

    def _on_transition(self, old: State, new: State, reason: str) -> None:
        self._ack_frame = None
        self.out.mark_dirty()
        self.backups.sync_soon()
