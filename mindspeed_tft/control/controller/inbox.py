"""The controller's inbox: what it does with each message a processor or a backup sends.

`Inbox` is part of the controller's core (`ControllerCore.inbox`). Every frame is checked
before it is decoded (its type's size cap, and whether the connection it
came by may send it at all), then bound to the rank registered from that connection (a
spoofed sender or a replayed sequence number is dropped), and dispatched: heartbeats (rank
progress, answers), registrations (`registration`), fault reports, action results (the
incident under way), byes (a rank finished training), backup controllers' hellos
(`backup`) and other nodes' launchers' reports of a worker's end (`exited`). It reaches
back into the core only through the `InboxHost` methods below, and to the connection a
frame came by only through what the input (`inputs.Frame`) says of it: its CURVE key and
whether it has room to be admitted; an admission is an output (`Outputs.admit`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from ..wire.classify import FaultKind
from ..wire.messages import BackupMessage, ByeMessage, ExitedMessage, HeartbeatMessage
from ..wire.order_types import ExitOrder, Payload, ResumeOrder
from ..wire.peers import token_ok
from ..wire.protocol import (
    SEQ_WINDOW,
    TO_CONTROLLER,
    Message,
    MsgType,
    ProtocolError,
    decode,
    peek,
    seq_in_window,
)
from ..wire.results import ReportMessage, ResultEnvelope, ResultError
from .backup import BackupSync
from .context import Context
from .flow import IncidentFlow
from .inputs import Frame
from .outbox import Admit
from .ranktable import CONNECTED, Health, RankInfo
from .registration import Registration
from .states import State

if TYPE_CHECKING:  # the type only: its module reads the environment
    pass

log = logging.getLogger("mindspeed_tft.control.controller")

#: types an unregistered connection may send (anything else is dropped before decoding)
_UNBOUND_TYPES = frozenset({MsgType.REGISTER, MsgType.BACKUP, MsgType.EXITED})


class InboxHost(Protocol):
    """What `Inbox` asks of the rest of the core (from the controller's loop thread)."""

    @property
    def flow(self) -> IncidentFlow | None: ...
    def fault(self, rank: int, kind: FaultKind, message: str,
              detail: dict[str, Any] | None = None) -> None: ...
    def ack_frame(self) -> bytes: ...
    def order(self, rank: int, payload: Payload) -> None: ...
    def training_finished(self) -> None: ...
    def launcher_exit(self, rank: int, returncode: int, no_replacement: str | None) -> None: ...


class Inbox:
    """Messages to the controller (see the module docstring)."""

    def __init__(self, ctx: Context, host: InboxHost, *, registration: Registration,
                 backups: BackupSync) -> None:
        self.ctx = ctx
        self.host = host
        self.config = ctx.config
        self.table = ctx.table
        self.sm = ctx.sm
        self.drops = ctx.drops
        self.limits = ctx.limits
        self.registration = registration
        self.backups = backups

    def on_frame(self, frame: Frame) -> None:
        """One message from the ROUTER, and what the shell knows of its connection."""
        if frame.extra:
            self.drops.drop("frames", f"{frame.extra + 1} frames")
            return
        identity = frame.identity
        bound = self.table.lookup(identity)
        try:
            # the type from the header, its size cap, and whether this connection may send
            # it at all, before anything is decoded: a refused frame costs microseconds
            t = peek(frame.data, self.limits, TO_CONTROLLER)
            if t not in _UNBOUND_TYPES and bound is None:
                raise ProtocolError("unregistered", t)
            msg = decode(frame.data, limits=self.limits, mtype=t)
        except ProtocolError as e:
            self.drops.drop(e.reason, e.detail)
            self.ctx.mark_dirty()
            return
        if bound is not None:
            # a registered rank's process, maybe on a new connection (a reconnect keeps its
            # routing id): that connection is admitted
            self.ctx.out.admit(Admit.KNOWN)
        self._dispatch(t, identity, msg, frame)

    def _dispatch(self, t: str, identity: bytes, msg: Message, frame: Frame) -> None:
        now = self.ctx.now
        if t == MsgType.HEARTBEAT:
            self._on_heartbeat(identity, msg)
        elif t == MsgType.REGISTER:
            self.registration.on_register(identity, msg, now, frame.key, frame.room)
        elif t == MsgType.REPORT:
            self._on_report(identity, msg)
        elif t == MsgType.RESULT:
            self._on_result(identity, msg)
        elif t == MsgType.BYE:
            self._on_bye(identity, msg)
        elif t == MsgType.BACKUP and self.ctx.role == "active":
            key = frame.key
            server_key = self.backups.server_key
            if token_ok(self.config.job_token, msg.read(BackupMessage).token) and (
                    server_key is None or key == server_key):
                self.ctx.out.admit(Admit.TOKEN)  # a backup controller: it holds the job's token
            self.backups.on_backup(identity, msg, now, key)
        elif t == MsgType.EXITED:
            self._on_exited(msg, frame.key)
        else:
            self.drops.drop("unexpected_type", t)
            self.ctx.mark_dirty()

    def _bound(self, identity: bytes, msg: Message) -> RankInfo | None:
        row = self.table.lookup(identity)
        if row is None:
            self.drops.drop("unregistered", msg.type)
        elif row.rank != msg.sender:
            self.drops.drop("spoof", f"{msg.type} claims rank {msg.sender} from rank {row.rank}'s connection")
        elif msg.seq <= row.last_seq:
            self.drops.drop("replay", f"{msg.type} seq {msg.seq} <= {row.last_seq}")
        elif not seq_in_window(msg.seq, row.last_seq):
            self.drops.drop("seq_jump", f"{msg.type} seq {msg.seq} > {row.last_seq} + "
                                        f"{SEQ_WINDOW}")
        else:
            row.last_seq = msg.seq
            row.last_seen = self.ctx.now
            return row
        self.ctx.mark_dirty()
        return None

    def _on_heartbeat(self, identity: bytes, msg: Message) -> None:
        row = self._bound(identity, msg)
        if row is None:
            return
        health = row.health
        if health in CONNECTED:
            hb = msg.read(HeartbeatMessage)
            row.step, row.status = hb.step, hb.status
            progress = row.progress if hb.progress is None else hb.progress
            flow = self.host.flow
            if health is Health.HUNG and progress > row.progress and flow is not None:
                flow.clear_fault(row.rank)
            row.progress = progress
        elif health is Health.LOST:
            if self.sm.state is State.INIT or self.ctx.role == "backup":
                row.health = Health.ALIVE
                self.ctx.mark_dirty()
                if self.sm.state is State.INIT:
                    self.registration.arrived(row.rank)
            else:  # declared lost and handled as such: this process must go
                self.host.order(row.rank, ExitOrder(self.config.failure_exit_code,
                                                            "this rank was declared lost"))
                row.health = Health.EXITING
                return
        now = self.ctx.now
        if self.ctx.role == "backup" and self.backups.active_alive(now):
            self.ctx.send(identity, MsgType.REDIRECT, {"reason": "the active controller is alive"})
            self.backups.redirected(now)
            return
        if not msg.read(HeartbeatMessage).ack:
            return
        self.ctx.raw_send(identity, self.host.ack_frame())

    def _on_report(self, identity: bytes, msg: Message) -> None:
        row = self._bound(identity, msg)
        if row is None or self.ctx.role != "active":
            return
        report = msg.read(ReportMessage)
        kind = report.fault
        if row.health in CONNECTED:
            row.step, row.status = report.step, report.status
        flow = self.host.flow
        if kind is FaultKind.NORMAL:
            if flow is None and self.sm.state in (State.NORMAL, State.PAUSE):
                # a rank stopped itself with no incident under way: let it go on
                self.host.order(row.rank, ResumeOrder(0, row.step, "none", True))
            return
        if row.health not in CONNECTED:
            return
        if kind is FaultKind.HANG and flow is not None and row.rank in flow.incident.parked:
            return  # a report that crossed the stop: its training thread did come back
        row.health = Health.HUNG if kind is FaultKind.HANG else Health.FAULTY
        self.ctx.mark_dirty()
        self.host.fault(row.rank, kind, report.message, report.detail)

    def _on_result(self, identity: bytes, msg: Message) -> None:
        row = self._bound(identity, msg)
        flow = self.host.flow
        if row is None or flow is None:
            return
        envelope = msg.read(ResultEnvelope)  # id, action, ok, result, error: checked
        try:
            result = envelope.typed()
        except ResultError as e:
            # a result that does not match its order's type: the order failed, and the
            # failure names the field
            log.error("rank %d: %s", row.rank, e)
            result = envelope.failed(f"ResultError: {e}")
        flow.on_result(row.rank, result)

    def _on_exited(self, msg: Message, key: str | None) -> None:
        """A launcher without the controller (another node's) saw rank `msg.sender`'s
        process `pid` end: the same as a report of node 0's launcher (`launcher_exit`).
        Taken only with the job's token, under CURVE only from the key the rank registered
        with (a job with neither token nor CURVE takes none), and only about the process
        registered for the rank: a report that crossed its replacement's registration
        changes nothing. The connection stays pending (the launcher closes it once the
        frame is sent)."""
        if self.ctx.role != "active":
            return
        p, rank = msg.read(ExitedMessage), msg.sender
        if not token_ok(self.config.job_token, p.token) or (
                self.config.job_token is None and key is None):
            self.drops.drop("bad_token", f"exited claiming rank {rank}")
            self.ctx.mark_dirty()
            return
        owner = self.registration.rank_keys.get(rank)
        if key is not None and key != owner:
            self.drops.drop("rank_key", f"exited for rank {rank} with another CURVE key")
            self.ctx.mark_dirty()
            return
        row = self.table.get(rank)
        if row is None or row.pid != p.pid:
            log.info("rank %d: its launcher reports pid %d ended (code %d), not the process "
                     "registered for it%s: nothing to do", rank, p.pid, p.code,
                     "" if row is None else f" (pid {row.pid})")
            return
        self.host.launcher_exit(rank, p.code, p.no_replacement)

    def _on_bye(self, identity: bytes, msg: Message) -> None:
        row = self._bound(identity, msg)
        if row is None or self.ctx.role != "active":
            return
        row.health = Health.DONE
        self.ctx.mark_dirty()
        log.info("rank %d finished (code %d)", row.rank, msg.read(ByeMessage).code)
        flow = self.host.flow
        if flow is not None:
            flow.on_gone(row.rank, "finished")
        if self.sm.state is State.NORMAL and self.table.all_done():
            self.host.training_finished()
