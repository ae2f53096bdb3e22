"""Backup controllers: keeping them in sync, and a backup taking charge (SPEC 4).

Up to two backups run beside the active controller, on other nodes. A backup binds its own
address, connects to the active controller as a client and announces itself (`backup`
message; only addresses listed in `TTP_BACKUP_ADDRS` are accepted). The active controller
sends every backup a full `sync` (state, epoch, features, rank table with replica layouts)
every interval and right after each transition.

A processor that loses the active controller fails over to the backups in order. A backup
answers as `standby`, or redirects processors back while the active controller is alive.
It takes charge only when the active controller has been silent for interval x misses AND
more than half of the ranks heartbeat to it; two controllers therefore can never both be in
charge, and with half the ranks gone none is. On taking charge it keeps the synced state
(an incident under way is handled again from the start) and declares lost the ranks that do
not show up within one timeout.

`BackupSync` holds this logic; `Controller` mixes it in (the attributes it uses belong to
the controller).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import zmq

from ..events import CONTROLLER_RANK, emit
from .classify import FaultKind
from .config import parse_hostport
from .protocol import CONTROLLER, Message, MsgType, ProtocolError, decode, encode
from .ranktable import CONNECTED, Health
from .states import INCIDENT_STATES, State
from .strategy import Features
from .transport import hostport

if TYPE_CHECKING:
    from .controller import Controller

log = logging.getLogger("mindspeed_tft.control.backup")


class BackupSync:
    """The backup half of a controller (mixed into `Controller`)."""

    def _on_backup(self: Controller, identity: bytes, msg: Message) -> None:
        ep = msg.payload["endpoint"]
        try:
            key = hostport(*parse_hostport(ep, "backup endpoint"))
        except ValueError:
            key = ""
        if key not in self._allowed_backups:
            self.drops.drop("backup_unknown", ep[:80])
            self._snapshot_dirty = True
            return
        new = identity not in self._backups
        self._backups[identity] = {"endpoint": key, "index": msg.payload["index"],
                                   "last_seen": self._now}
        if new:
            log.info("backup controller %s joined", key)
            self._sync_backups(self._now)

    def _sync_payload(self: Controller) -> dict[str, Any]:
        return {
            "state": self.sm.state.value, "epoch": self.epoch, "world_size": self.world_size,
            "features": self.features.to_dict(),
            "ranks": [[r.rank, r.step, r.status, r.health.value, r.replica]
                      for r in self.table.all()],
            "backups": sorted(self._allowed_backups),
            "lock_step": self.flow.incident.lock_step if self.flow is not None else None,
        }

    def _sync_backups(self: Controller, now: float) -> None:
        self._next_sync = now + self.config.heartbeat_interval
        for ident in [i for i, b in self._backups.items()
                      if now - b["last_seen"] > self.config.lost_after]:
            log.warning("backup controller %s went silent", self._backups.pop(ident)["endpoint"])
        if not self._backups:
            return
        frame = encode(MsgType.SYNC, CONTROLLER, self._next_seq(), self._sync_payload(),
                       check=False)
        for ident in self._backups:
            self._raw_send(ident, frame)

    def _on_upstream(self: Controller, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.drops.drop("frames", "upstream")
            return
        try:
            msg = decode(frames[0], 256 << 20)
        except ProtocolError as e:
            self.drops.drop(e.reason, "upstream " + e.detail)
            return
        if msg.type != MsgType.SYNC or msg.sender != CONTROLLER or self.role != "backup":
            self.drops.drop("unexpected_type", "upstream " + msg.type)
            return
        p = msg.payload
        try:
            state = State(p["state"])
            rows = [(r, step, st, Health(h), rep) for r, step, st, h, rep in p["ranks"]]
        except ValueError:
            self.drops.drop("schema", "sync values")
            return
        if p["world_size"] != self.world_size:
            self.drops.drop("schema", f"sync for world size {p['world_size']}")
            return
        self._last_sync = self._now
        self.epoch = p["epoch"]
        self.features = Features(**{k: bool(v) for k, v in p["features"].items()
                                    if k in Features.__dataclass_fields__})
        self.planner.features = self.features
        for rank, step, status, health, replica in rows:
            if not 0 <= rank < self.world_size:
                continue
            row = self.table.get(rank)
            if row is None:
                row = self.table.register(rank, b"", "", 0, self._now - self.config.lost_after,
                                          replica, step, status)
            row.step, row.status, row.replica = step, status, replica
            if health in (Health.DONE, Health.LOST, Health.EXITING) or not row.identity:
                row.health = health
        if state is not self.sm.state:
            self.sm.force(state, "synced from the active controller")
        self._snapshot_dirty = True

    def _active_alive(self: Controller) -> bool:
        return self._now - self._last_sync <= self.config.lost_after

    def _standby_tick(self: Controller, now: float) -> None:
        if self._upstream is not None and now >= self._next_hello:
            self._next_hello = now + self.config.heartbeat_interval
            frame = encode(MsgType.BACKUP, CONTROLLER, self._next_seq(),
                           {"endpoint": self.endpoint, "index": self.backup_index})
            try:
                self._upstream.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self._active_alive():
            return
        live = sum(1 for r in self.table.all()
                   if r.identity and now - r.last_seen <= self.config.lost_after)
        if 2 * live > self.world_size:
            self._take_over(now, live)

    def _take_over(self: Controller, now: float, live: int) -> None:
        log.warning("backup %d takes charge: active controller silent, %d of %d ranks here",
                    self.backup_index, live, self.world_size)
        self.role = "active"
        self.epoch += 1
        self.sm.emit_events = True
        self._ack_frame = None
        if self._upstream is not None:
            self._upstream.close(0)
            self._upstream = None
        emit("controller_takeover", CONTROLLER_RANK, endpoint=self.endpoint, epoch=self.epoch,
             live=live, backup_index=self.backup_index)
        synced = self.sm.state
        faulty: list[tuple[int, FaultKind]] = []
        for row in self.table.all():
            if not row.identity or now - row.last_seen > self.config.lost_after:
                if row.health in CONNECTED:  # give it one timeout to fail over here
                    row.last_seen = now
            elif row.health not in (Health.DONE, Health.EXITING):
                if row.health is Health.HUNG:
                    faulty.append((row.rank, FaultKind.HANG))
                elif row.health is Health.FAULTY:
                    faulty.append((row.rank, FaultKind.UNKNOWN))
                row.health = Health.ALIVE
        faulty += [(row.rank, FaultKind.LOST) for row in self.table.all()
                   if row.health is Health.LOST]
        if synced in (State.EXIT, State.FINAL):
            self.sm.force(State.EXIT, "took over a job that was exiting")
            self._broadcast("exit", {"code": self.config.failure_exit_code,
                                     "reason": "controller failover during exit"})
            self.sm.to(State.FINAL, "took over a job that was exiting")
            return
        if synced in INCIDENT_STATES:
            self.sm.force(State.NORMAL, "took over during an incident: handling it again")
        else:
            self.sm.force(synced, "backup controller took charge")
        for row in self.table.all():
            if row.identity and row.health in CONNECTED:
                self._send_registered(row)
        for rank, kind in faulty:
            if self.sm.state is State.INIT:
                break
            self._fault(rank, kind, "known at failover")
        if synced in INCIDENT_STATES and self.flow is None and self.sm.state is State.NORMAL:
            self._fault(min(r.rank for r in self.table.all()), FaultKind.UNKNOWN,
                        "the active controller was lost during an incident")
