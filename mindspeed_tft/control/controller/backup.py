"""Backup controllers: keeping them in sync, and a backup taking charge (SPEC 4).

Up to two backups run beside the active controller, on other nodes. A backup binds its own
address, connects to the active controller as a client and announces itself (`backup`
message, accepted only from a peer holding the server key pair under CURVE and the job's
token when there is one, for an address listed in `TTP_BACKUP_ADDRS`). The active
controller sends every backup a full `sync` (state, epoch, features, rank table with
replica layouts) every interval and right after each transition.

A processor that loses the active controller fails over to the backups in order. A backup
answers as `standby`, or redirects processors back while the active controller is alive.
It takes charge when the active controller has been silent for interval x misses:

- with more than half of the ranks heartbeating to it, fully: it keeps the synced state (an
  incident under way is handled again from the start) and declares lost the ranks that do
  not show up within one timeout; the job may go on training (a repair);
- with half of the ranks or fewer (but at least one), only after waiting one more timeout
  plus an interval, and a timeout plus two intervals after it last sent a rank back to the
  active controller (every surviving rank has then had the time to fail over to it, also
  one sent back just before the active controller fell silent), and
  *dump-only*: the absent ranks are declared lost at once and every fault is handled with
  the dump strategy (a dying-gasp checkpoint from the survivors' replicas, then exit 75, or
  exit 1 when they do not hold a complete copy). It never resumes training.

Why that is safe (split brain): the backup cannot tell a dead active controller from one
cut off from it. If the active one is alive with the other ranks, both may act, but a
minority backup only stops its ranks and writes a checkpoint: no training step is taken
on either side without all ranks (every step needs a collective with the ranks that
stopped), the dump is of a step all ranks had completed (the lock step), and the active
controller sees those ranks leave and handles that as a fault of its own. Two controllers
can never both resume training: resuming needs a majority.

`absent_ranks_return = False` (a backup in a `tft-run` launcher: the active controller
lived in node 0's launcher, with node 0's ranks and the job's store) makes any takeover
with absent ranks dump-only: those ranks cannot be restarted, so a repair could not work.

Every controller's core holds one `BackupSync` (`ControllerCore.backups`): on the active
controller it keeps the backups that joined in sync; on a backup it speaks over the upstream
link to the active controller (the shell's socket: frames go out through the core's outbox)
and decides when to take charge. It shares the controller's rank table, state
machine and drop counter, and reaches the rest of the controller only through `BackupHost`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Protocol

from ...features import Features
from ...records import CONTROLLER_RANK
from ..wire.classify import FaultKind
from ..wire.messages import BackupMessage, SyncMessage, SyncRow
from ..wire.order_types import ExitOrder, Payload
from ..wire.peers import hostport, parse_hostport, token_ok
from ..wire.protocol import CONTROLLER, Message, MsgType, ProtocolError, decode, encode
from .context import Context
from .ranktable import CONNECTED, Health, RankInfo
from .states import INCIDENT_STATES, State

if TYPE_CHECKING:  # the type only: its module reads the environment
    pass

log = logging.getLogger("mindspeed_tft.control.backup")

#: the largest sync a backup reads (its shell's link to the active controller has this cap)
SYNC_MAX_BYTES = 256 << 20


class BackupHost(Protocol):
    """What `BackupSync` asks of the rest of the core (from the controller's loop thread):
    the incident's lock step, taking the active controller's epoch and features, taking
    charge, and what a takeover sends and reports."""

    def incident_lock_step(self) -> int | None: ...
    def adopt(self, epoch: int, features: Features) -> None: ...
    def become_active(self) -> None: ...
    def broadcast(self, payload: Payload) -> None: ...
    def send_registered(self, row: RankInfo) -> None: ...
    def fault(self, rank: int, kind: FaultKind, message: str) -> None: ...


class BackupSync:
    """The backup half of a controller (see the module docstring)."""

    def __init__(self, ctx: Context, host: BackupHost, *, backup_index: int,
                 absent_ranks_return: bool = True) -> None:
        self.ctx = ctx
        self.host = host
        self.config = config = ctx.config
        self.table = ctx.table
        self.sm = ctx.sm
        self.drops = ctx.drops
        self.world_size = ctx.world_size
        self.backup_index = backup_index
        #: addresses a backup may announce (`TTP_BACKUP_ADDRS`)
        self.allowed = {hostport(a, p) for a, p in config.backups}
        #: CURVE: the ZAP User-Id a backup must present (the server's public key: backups
        #: hold the server pair); `expect_server_key`, None without CURVE
        self.server_key: str | None = None
        #: on the active controller: the backups that joined, by connection
        self.peers: dict[bytes, dict[str, Any]] = {}
        #: on a backup: the link to the active controller is open (until it takes charge)
        self.upstream = False
        self._last_sync = 0.0
        #: when this backup last sent a rank back to the active controller
        self._last_redirect = float("-inf")
        self._next_hello = 0.0
        self._next_sync = 0.0
        #: whether ranks absent at a takeover may come back (see the module docstring)
        self.absent_ranks_return = absent_ranks_return
        #: the takeover was dump-only
        self.dump_only = False

    # -- both roles -----------------------------------------------------------------------
    def expect_server_key(self, key: str | None) -> None:
        """Under CURVE, the key a backup shows (the controllers' server pair; None: no
        CURVE): the controller learns it when it starts listening."""
        self.server_key = key

    def addresses(self) -> list[str]:
        """The backup addresses processors may fail over to."""
        return sorted(self.allowed)

    def joined(self) -> list[str]:
        """Endpoints of the backups that joined this (active) controller."""
        return sorted(b["endpoint"] for b in self.peers.values())

    # -- active controller ------------------------------------------------------------------
    def on_backup(self, identity: bytes, msg: Message, now: float,
                  peer_key: str | None = None) -> None:
        """A backup announced itself (or said it is still there).

        A backup is recognised by what it holds, not by the endpoint it names: under CURVE
        the connection's key must be the server's (`peer_key`, the ZAP User-Id), and the
        job's token (`TTP_JOB_TOKEN`) must match when there is one. Without either (CURVE
        off on loopback, no token) any local peer naming a `TTP_BACKUP_ADDRS` entry is
        taken for a backup."""
        hello = msg.read(BackupMessage)
        ep = hello.endpoint
        if (self.server_key is not None and peer_key != self.server_key) or not token_ok(
                self.config.job_token, hello.token):
            self.drops.drop("backup_refused", f"{ep[:80]} without the backup key or token")
            self.ctx.mark_dirty()
            return
        try:
            key = hostport(*parse_hostport(ep, "backup endpoint"))
        except ValueError:
            key = ""
        if key not in self.allowed:
            self.drops.drop("backup_unknown", ep[:80])
            self.ctx.mark_dirty()
            return
        new = identity not in self.peers
        self.peers[identity] = {"endpoint": key, "index": hello.index,
                                "last_seen": now}
        if new:
            log.info("backup controller %s joined", key)
            self.ctx.mark_dirty()
            self.sync(now)

    def sync_soon(self) -> None:
        """Sync the backups at the next tick (after a transition)."""
        self._next_sync = 0.0

    def tick_active(self, now: float) -> None:
        if self.peers and now >= self._next_sync:
            self.sync(now)

    def sync(self, now: float) -> None:
        """Send every live backup the full state; forget the silent ones."""
        self._next_sync = now + self.config.heartbeat_interval
        for ident in [i for i, b in self.peers.items()
                      if now - b["last_seen"] > self.config.lost_after]:
            log.warning("backup controller %s went silent", self.peers.pop(ident)["endpoint"])
        if not self.peers:
            return
        frame = encode(MsgType.SYNC, CONTROLLER, self.ctx.next_seq(), self._sync_payload(),
                       check=False)
        for ident in self.peers:
            self.ctx.raw_send(ident, frame)

    def _sync_payload(self) -> SyncMessage:
        host, ctx = self.host, self.ctx
        return SyncMessage(
            self.sm.state.value, ctx.epoch, self.world_size, ctx.features.to_dict(),
            tuple(SyncRow(r.rank, r.step, r.status, r.health.value, r.replica)
                  for r in self.table.all()),
            tuple(self.addresses()), host.incident_lock_step())

    # -- backup controller ------------------------------------------------------------------
    def linked(self, now: float) -> None:
        """A backup's shell connected it to the active controller (when it starts)."""
        self.upstream = True
        self._last_sync = now

    def next_deadline(self, now: float) -> float:
        """When `tick_active` / `standby_tick` next has something to do (loop clock)."""
        if self.ctx.role == "active":
            return self._next_sync if self.peers else float("inf")
        cfg = self.config
        silent = self._last_sync + cfg.lost_after
        if now <= silent:  # the active controller is alive: its silence is the next moment
            takeover = silent + 1e-9
        else:  # a minority takeover waits longer; before it, the rank count may change
            takeover = max(silent + cfg.lost_after + cfg.heartbeat_interval,
                           self._last_redirect + cfg.lost_after + 2 * cfg.heartbeat_interval)
            takeover = takeover + 1e-9 if takeover > now else now + cfg.heartbeat_interval
        return min(takeover, self._next_hello) if self.upstream else takeover

    def on_upstream(self, frames: list[bytes], now: float) -> None:
        """A frame from the active controller: only `sync` is expected."""
        if len(frames) != 1:
            self.drops.drop("frames", "upstream")
            return
        try:
            msg = decode(frames[0], SYNC_MAX_BYTES)
        except ProtocolError as e:
            self.drops.drop(e.reason, "upstream " + e.detail)
            return
        if msg.type != MsgType.SYNC or msg.sender != CONTROLLER or self.ctx.role != "backup":
            self.drops.drop("unexpected_type", "upstream " + msg.type)
            return
        p = msg.read(SyncMessage)
        try:
            state = State(p.state)
            rows = [(r.rank, r.step, r.status, Health(r.health), r.replica) for r in p.ranks]
        except ValueError:
            self.drops.drop("schema", "sync values")
            return
        if p.world_size != self.world_size:
            self.drops.drop("schema", f"sync for world size {p.world_size}")
            return
        self._last_sync = now
        try:
            features = Features.from_dict(p.features)
        except ValueError as e:
            self.drops.drop("schema", f"sync features: {e}")
            return
        self.host.adopt(p.epoch, features)
        self._adopt_rows(rows, now)
        if state is not self.sm.state:
            self.sm.force(state, "synced from the active controller")
        self.ctx.mark_dirty()

    def _adopt_rows(self, rows: list[tuple[int, int, str, Health, Any]], now: float) -> None:
        for rank, step, status, health, replica in rows:
            if not 0 <= rank < self.world_size:
                continue
            row = self.table.get(rank)
            if row is None:
                row = self.table.register(rank, b"", "", 0, now - self.config.lost_after,
                                          replica, step, status)
            row.step, row.status, row.replica = step, status, replica
            if health in (Health.DONE, Health.LOST, Health.EXITING) or not row.identity:
                row.health = health

    def _hello_payload(self) -> BackupMessage:
        return BackupMessage(self.ctx.endpoint, self.backup_index, self.config.job_token)

    def active_alive(self, now: float) -> bool:
        """Did the active controller sync within the heartbeat timeout?"""
        return now - self._last_sync <= self.config.lost_after

    def redirected(self, now: float) -> None:
        """A rank was sent back to the active controller (it comes back here only once
        that one has been silent for the rank's own timeout: `standby_tick` waits for it)."""
        self._last_redirect = now

    def standby_tick(self, now: float) -> None:
        """Say hello upstream; take charge when the active controller is gone."""
        if self.upstream and now >= self._next_hello:
            self._next_hello = now + self.config.heartbeat_interval
            self.ctx.out.send_upstream(encode(MsgType.BACKUP, CONTROLLER, self.ctx.next_seq(),
                                           self._hello_payload()))
        if self.active_alive(now):
            return
        live = sum(1 for r in self.table.all()
                   if r.identity and now - r.last_seen <= self.config.lost_after)
        if 2 * live > self.world_size and (live == self.world_size
                                           or self.absent_ranks_return):
            self._take_over(now, live)
        elif live and now - self._last_sync > (2 * self.config.lost_after
                                               + self.config.heartbeat_interval) and (
                now - self._last_redirect > self.config.lost_after
                + 2 * self.config.heartbeat_interval):
            # every survivor had time to come, also one sent back to the dead active
            # controller just before it fell silent (it fails over again after its own
            # timeout, lost_after + an interval: at most one interval later than above)
            self._take_over(now, live, dump_only=True)

    def _take_over(self, now: float, live: int, dump_only: bool = False) -> None:
        log.warning("backup %d takes charge%s: active controller silent, %d of %d ranks here",
                    self.backup_index, " (dump-only)" if dump_only else "", live,
                    self.world_size)
        host, ctx = self.host, self.ctx
        host.become_active()
        self.dump_only = dump_only
        if dump_only:  # every fault is handled with a dump (strategy.strategy_for)
            host.adopt(ctx.epoch, dataclasses.replace(ctx.features, worker_reboot=False,
                                                       hbm_repair=False))
        if self.upstream:
            self.ctx.out.close_upstream()
            self.upstream = False
        ctx.emit("controller_takeover", CONTROLLER_RANK, endpoint=ctx.endpoint, epoch=ctx.epoch,
             live=live, backup_index=self.backup_index, dump_only=dump_only)
        synced = self.sm.state
        faulty = self._survey(now)
        if synced in (State.EXIT, State.FINAL):
            self.sm.force(State.EXIT, "took over a job that was exiting")
            host.broadcast(ExitOrder(self.config.failure_exit_code,
                                             "controller failover during exit"))
            self.sm.to(State.FINAL, "took over a job that was exiting")
        else:
            self._carry_on(synced, faulty)

    def _carry_on(self, synced: State, faulty: list[tuple[int, FaultKind]]) -> None:
        """Go on from the synced state: the ranks hear from their new controller, and the
        faults known (or an incident that was under way) are handled again from the start."""
        host = self.host
        if synced in INCIDENT_STATES:
            self.sm.force(State.NORMAL, "took over during an incident: handling it again")
        else:
            self.sm.force(synced, "backup controller took charge")
        for row in self.table.all():
            if row.identity and row.health in CONNECTED:
                host.send_registered(row)
        for rank, kind in faulty:
            if self.sm.state is State.INIT:
                break
            host.fault(rank, kind, "known at failover")
        if (synced in INCIDENT_STATES and host.incident_lock_step() is None
                and self.sm.state is State.NORMAL):
            host.fault(min(r.rank for r in self.table.all()), FaultKind.UNKNOWN,
                       "the active controller was lost during an incident")

    def _survey(self, now: float) -> list[tuple[int, FaultKind]]:
        """The faults known from the synced table; rows of absent ranks get one timeout to
        fail over here, the others are alive again unless they were faulty."""
        faulty: list[tuple[int, FaultKind]] = []
        for row in self.table.all():
            if not row.identity or now - row.last_seen > self.config.lost_after:
                if row.health in CONNECTED and self.dump_only:  # had its time to come
                    row.health = Health.LOST
                elif row.health in CONNECTED:  # give it one timeout to fail over here
                    row.last_seen = now
            elif row.health not in (Health.DONE, Health.EXITING):
                if row.health is Health.HUNG:
                    faulty.append((row.rank, FaultKind.HANG))
                elif row.health is Health.FAULTY:
                    faulty.append((row.rank, FaultKind.UNKNOWN))
                row.health = Health.ALIVE
        faulty += [(row.rank, FaultKind.LOST) for row in self.table.all()
                   if row.health is Health.LOST]
        return faulty
