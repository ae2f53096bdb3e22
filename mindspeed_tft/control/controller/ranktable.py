"""The controller's rank table: one row per training rank (SPEC 4).

A row holds the connection the rank registered from (its ZeroMQ routing id; messages that
claim the rank from any other connection are dropped), where it runs, its step and data
status (`updated` outside an optimizer update, `updating` inside), its health, when it was
last heard from, and its replica layout (which ranks hold the same optimizer shard).

Health:
- `alive`: registered and heartbeating;
- `faulty`: reported an error, still connected;
- `hung`: heartbeating but its training makes no progress (watchdog);
- `lost`: silent for interval x misses (process exited, killed or node gone);
- `done`: said bye after training finished;
- `exiting`: ordered to exit, its silence is expected;
- `left`: no longer part of the job (elastic training shrank the job without it).
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class Health(str, Enum):
    ALIVE = "alive"
    FAULTY = "faulty"
    HUNG = "hung"
    LOST = "lost"
    DONE = "done"
    EXITING = "exiting"
    LEFT = "left"

    def __str__(self) -> str:
        return self.value


#: health values of a rank whose process is still connected
CONNECTED = frozenset({Health.ALIVE, Health.FAULTY, Health.HUNG})


class RankInfo:
    """One row of the rank table."""

    __slots__ = ("rank", "identity", "host", "pid", "step", "status", "progress", "health",
                 "last_seen", "registered_at", "replica", "last_seq", "fresh", "incarnation")

    def __init__(self, rank: int, identity: bytes, host: str, pid: int, now: float,
                 replica: dict[str, Any] | None, step: int = 0, status: str = "updated") -> None:
        self.rank = rank
        self.identity = identity
        self.host = host
        self.pid = pid
        self.step = step
        self.status = status
        self.progress = step
        self.health = Health.ALIVE
        self.last_seen = now
        self.registered_at = now
        self.replica = replica
        self.last_seq = 0
        #: a restarted process (ARF) that holds no training state yet
        self.fresh = False
        self.incarnation = 0

    @property
    def connected(self) -> bool:
        return self.health in CONNECTED

    def row(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "step": self.step,
                "status": self.status, "health": self.health.value, "fresh": self.fresh,
                "incarnation": self.incarnation}


class RankTable:
    """Rows by rank and by connection."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rows: list[RankInfo | None] = [None] * world_size
        self.by_identity: dict[bytes, RankInfo] = {}

    def get(self, rank: int) -> RankInfo | None:
        return self.rows[rank] if 0 <= rank < self.world_size else None

    def lookup(self, identity: bytes) -> RankInfo | None:
        return self.by_identity.get(identity)

    def register(self, rank: int, identity: bytes, host: str, pid: int, now: float,
                 replica: dict[str, Any] | None, step: int = 0,
                 status: str = "updated") -> RankInfo:
        """Bind `rank` to a connection (a new row; a previous row's binding is dropped)."""
        old = self.rows[rank]
        info = RankInfo(rank, identity, host, pid, now, replica, step, status)
        if old is not None:
            if self.by_identity.get(old.identity) is old:
                del self.by_identity[old.identity]
            info.incarnation = old.incarnation + 1
            if replica is None:
                info.replica = old.replica
        self.rows[rank] = info
        if identity:  # an empty identity: a row known only from a sync, bound to no connection
            self.by_identity[identity] = info
        return info

    def members(self) -> list[int]:
        """The ranks that are part of the job (all but those that left in a shrink)."""
        return [r for r in range(self.world_size)
                if (row := self.rows[r]) is None or row.health is not Health.LEFT]

    def any_done(self) -> bool:
        """A rank finished training (said bye)."""
        return any(row is not None and row.health is Health.DONE for row in self.rows)

    def all_done(self) -> bool:
        """Every member finished training (said bye)."""
        return all((row := self.rows[r]) is not None and row.health is Health.DONE
                   for r in self.members())

    def registered(self) -> int:
        return sum(1 for r in self.rows if r is not None)

    def all(self) -> list[RankInfo]:
        return [r for r in self.rows if r is not None]

    def with_health(self, *health: Health) -> list[RankInfo]:
        want = set(health)
        return [r for r in self.rows if r is not None and r.health in want]

    def connected(self) -> list[RankInfo]:
        return [r for r in self.rows if r is not None and r.health in CONNECTED]

    def overdue(self, now: float, limit: float) -> list[RankInfo]:
        """Connected rows not heard from for more than `limit` seconds."""
        cutoff = now - limit
        return [r for r in self.rows
                if r is not None and r.last_seen < cutoff and r.health in CONNECTED]

    def snapshot(self) -> dict[int, dict[str, Any]]:
        return {r.rank: r.row() for r in self.rows if r is not None}
