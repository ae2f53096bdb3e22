"""What every part of the controller's core shares: one explicit context.

The parts of `core.ControllerCore` (`inbox`, `registration`, `liveness`, `nodes`,
`incidents`, `backup`) decide about the same rank table, state machine and settings, and
each puts what it decides into the same outbox. `Context` holds those, and the few facts of
the controller itself that any part may read: its role, its epoch, its features, its
endpoint. Sending a frame, writing an event and saying that the snapshot changed go
through it, so that no part needs the core for them. What one part asks of another goes
through that part's own methods (a narrow Protocol where a lower part must call back);
no part writes another's fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...features import Features
from ..wire.fields import Wire
from ..wire.protocol import CONTROLLER, DropCounter, Limits, encode
from .elasticity import Elasticity
from .outbox import Outbox
from .ranktable import RankTable
from .states import StateMachine
from .strategy import StrategyPlanner

if TYPE_CHECKING:  # the type only: its module reads the environment
    from ..wire.config import ControlConfig


class Context:
    """The core's shared state and outputs (see the module docstring)."""

    def __init__(self, world_size: int, config: ControlConfig, planner: StrategyPlanner, *,
                 role: str, endpoint: str, drops: DropCounter, limits: Limits) -> None:
        self.world_size = world_size
        self.config = config
        #: the strategy and every order's payload; its `features` are the job's
        self.planner = planner
        #: "active" or "backup" (a backup that took charge becomes "active")
        self.role = role
        #: the active controller's term: a backup taking charge starts the next
        self.epoch = 0
        #: `ip:port` of the controller this core decides for (a backup names it upstream)
        self.endpoint = endpoint
        self.out = Outbox()
        self.table = RankTable(world_size)
        self.sm = StateMachine(self.out.emit, emit_events=False)
        self.drops = drops
        #: per-type frame caps and msgpack limits for this world size (protocol.Limits)
        self.limits = limits
        #: elastic training: home replicas, the global batch in micro-batches (scale-out)
        self.elasticity = Elasticity()
        self._seq = 0

    @property
    def features(self) -> Features:
        """The job's features (one object: the planner's)."""
        return self.planner.features

    @property
    def now(self) -> float:
        """The time of the input being handled (loop clock)."""
        return self.out.now

    def role_name(self) -> str:
        return "active" if self.role == "active" else "standby"

    def emit(self, event: str, rank: int, **fields: Any) -> dict[str, Any]:
        """An event (into the outbox: the shell writes it, the simulator checks it)."""
        return self.out.emit(event, rank, **fields)

    def mark_dirty(self) -> None:
        """Something a snapshot shows changed."""
        self.out.mark_dirty()

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def send(self, identity: bytes, mtype: str, payload: Wire | dict[str, Any]) -> None:
        self.raw_send(identity, encode(mtype, CONTROLLER, self.next_seq(), payload))

    def raw_send(self, identity: bytes, frame: bytes) -> None:
        self.out.send(identity, frame)
