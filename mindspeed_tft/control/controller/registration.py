"""Registration: which connection speaks for which rank, and the roll call of INIT.

`Registration` is part of the controller's core (`ControllerCore.registration`), in its loop
thread. It refuses registrations without the job's token, for a rank or world size the job
does not have, or beyond the admitted connections' rank cap; binds a rank to the connection
(and, under CURVE, the key) it registered from; tells a repeated registration from a
restarted process and a failing-over one; and keeps the set of ranks INIT still waits for
(NORMAL once it is empty). It reaches back into the controller only through the
`RegistrationHost` methods below; the connection's admission and the watch over a
registered process are outputs (`Outputs.admit`, `Outputs.watch`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from ..wire.messages import RegisterMessage
from ..wire.peers import REFUSED, REFUSED_FOR_NOW, token_ok
from ..wire.protocol import Message, MsgType, seq_in_window
from .context import Context
from .outbox import Admit
from .ranktable import CONNECTED, Health, RankInfo
from .states import State

if TYPE_CHECKING:  # the type only: its module reads the environment
    pass

log = logging.getLogger("mindspeed_tft.control.controller")


class RegistrationHost(Protocol):
    """What `Registration` asks of the rest of the core (from the controller's loop thread):
    the answer to a registration, and a restarted or returning rank's place in an incident."""

    def send_registered(self, row: RankInfo) -> None: ...
    def rank_returned(self, row: RankInfo, replica: dict[str, Any] | None) -> None: ...
    def rank_restarted(self, row: RankInfo) -> None: ...


class Registration:
    """Registrations and the INIT roll call (see the module docstring)."""

    def __init__(self, ctx: Context, host: RegistrationHost) -> None:
        self.ctx = ctx
        self.host = host
        self.config = ctx.config
        self.world_size = world_size = ctx.world_size
        self.table = ctx.table
        self.sm = ctx.sm
        self.drops = ctx.drops
        self.elasticity = ctx.elasticity
        #: CURVE: the client key each rank first registered with (rank -> z85 key)
        self.rank_keys: dict[int, str] = {}
        #: ranks not (or no longer) registered during INIT; NORMAL when it is empty
        self.missing: set[int] = set(range(world_size))

    def mark_missing(self, rank: int) -> None:
        """A rank was lost during INIT: the roll call waits for it again."""
        self.missing.add(rank)

    def arrived(self, rank: int) -> None:
        """`rank` is registered (again) during INIT: NORMAL once every rank is."""
        self.missing.discard(rank)
        if not self.missing:
            self.sm.to(State.NORMAL, f"all {self.world_size} ranks registered")

    def overdue(self, now: float, started: float) -> str | None:
        """Why INIT failed (ranks did not register in time), or None."""
        if now - started <= self.config.register_timeout:
            return None
        missing = [r for r in range(self.world_size)
                   if (row := self.table.get(r)) is None or not row.connected]
        return (f"ranks {missing[:32]} did not register within "
                f"{self.config.register_timeout:g}s")

    def rebindable(self, row: RankInfo, now: float) -> bool:
        """May another connection take over this rank's row?"""
        if self.ctx.role == "backup":
            return now - row.last_seen > self.config.lost_after
        return row.health not in CONNECTED

    def refused(self, identity: bytes, msg: Message, room: bool) -> bool:
        """Refuse a registration without the job's token, for a rank or world size this
        job does not have, or beyond the rank cap of admitted connections (True: refused).
        A refusal says nothing about the job (no world size, no rank state): the details
        go to this controller's log only."""
        p, rank = msg.read(RegisterMessage), msg.sender
        if not token_ok(self.config.job_token, p.token):
            self.drops.drop("bad_token", f"register claiming rank {rank}")
            self.ctx.send(identity, MsgType.REJECT, REFUSED)
            return True
        if not (0 <= rank < self.world_size) or p.world_size != self.world_size:
            self.drops.drop("bad_register", f"rank {rank} of world size {p.world_size} "
                            f"(this job: {self.world_size})")
            self.ctx.send(identity, MsgType.REJECT, REFUSED)
            return True
        if not room:  # its connection shows the token, but the cap is reached
            self.drops.drop("over_cap", f"register claiming rank {rank}")
            self.ctx.send(identity, MsgType.REJECT, REFUSED_FOR_NOW)
            return True
        self.ctx.out.admit(Admit.TOKEN)
        return False

    def on_register(self, identity: bytes, msg: Message, now: float, key: str | None = None,
                    room: bool = True) -> None:
        """A rank registers; `key`: its CURVE public key (None without CURVE); `room`: its
        connection is admitted or may be (it is, once the token matches: `Outputs.admit`)."""
        rank = msg.sender
        if self.refused(identity, msg, room):
            return
        bound = self.table.lookup(identity)
        if bound is not None and bound.rank != rank:
            self.drops.drop("spoof", f"connection of rank {bound.rank} registers as {rank}")
            return
        row = self.table.get(rank)
        if row is not None and row.identity == identity:  # a repeated registration
            self._repeated(row, msg, now)
            return
        failover = msg.read(RegisterMessage).failover
        if self._taken(identity, row, rank, key, failover, now):
            return
        self._bind(identity, msg, now, key, row, failover)

    def _repeated(self, row: RankInfo, msg: Message, now: float) -> None:
        p, rank = msg.read(RegisterMessage), row.rank
        if seq_in_window(msg.seq, row.last_seq):
            row.last_seq = msg.seq
        row.last_seen = now
        if p.replica is not None:  # the layout, known after the registration
            row.replica = p.replica
            self.elasticity.note_registration(rank, p.replica)
            self.ctx.mark_dirty()
        if row.health is Health.LOST and (self.sm.state is State.INIT or self.ctx.role == "backup"):
            row.health = Health.ALIVE
        self.host.send_registered(row)
        if self.sm.state is State.INIT and self.ctx.role == "active":
            self.arrived(rank)

    def _taken(self, identity: bytes, row: RankInfo | None, rank: int, key: str | None,
               failover: bool, now: float) -> bool:
        """Whether another connection, process or key holds `rank` (True: refused)."""
        if row is not None and row.identity and not self.rebindable(row, now):
            self.drops.drop("rank_taken", f"rank {rank} registers from a second connection")
            self.ctx.send(identity, MsgType.REJECT, REFUSED_FOR_NOW)
            return True
        if row is not None and row.health is Health.DONE and not failover:
            # a rank that finished training is not restarted: only its own process, failing
            # over, reconnects (a fresh registration here would undo the job's end)
            self.drops.drop("rank_done", f"rank {rank} registers after it finished")
            self.ctx.send(identity, MsgType.REJECT, REFUSED)
            return True
        owner = self.rank_keys.get(rank)
        if key is not None and owner is not None and key != owner:
            # CURVE: a rank is bound to the key it first registered with; only a process
            # holding that key (its replacement) takes it back
            self.drops.drop("rank_key", f"rank {rank} registers with another CURVE key")
            self.ctx.send(identity, MsgType.REJECT, REFUSED)
            return True
        return False

    def _bind(self, identity: bytes, msg: Message, now: float, key: str | None,
              row: RankInfo | None, failover: bool) -> None:
        """Bind `rank` to this connection (a first registration, a restarted process or a
        failover) and tell the rest of the controller."""
        p, rank = msg.read(RegisterMessage), msg.sender
        state = self.sm.state
        fresh = state is not State.INIT and not failover and self.ctx.role == "active"
        prev_health = row.health if row is not None else None
        prev_replica = row.replica if row is not None else None
        info = self.table.register(rank, identity, p.host, p.pid, now, p.replica, p.step,
                                   p.status)
        info.last_seq = msg.seq
        info.fresh = fresh
        self.ctx.out.watch(rank, p.pid, p.proc)
        self.elasticity.note_registration(rank, p.replica)
        if key is not None:
            self.rank_keys.setdefault(rank, key)
        if prev_health in (Health.DONE,) and failover:
            info.health = Health.DONE
        self.ctx.mark_dirty()
        log.info("rank %d registered (pid %s on %s%s)", rank, p.pid, p.host,
                 ", restarted" if fresh else (", failover" if failover else ""))
        self.host.send_registered(info)
        if self.ctx.role != "active":
            return
        if state is State.INIT:
            self.arrived(rank)
        elif fresh and self.ctx.features.elastic and (
                prev_health is Health.LEFT or len(self.table.members()) < self.world_size):
            self.host.rank_returned(info, prev_replica)
        elif fresh:
            self.host.rank_restarted(info)
