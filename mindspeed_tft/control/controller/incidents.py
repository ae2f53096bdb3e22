"""The incidents of one controller: the one under way, their counters, and the orders that
carry them; with elastic training, the ranks waiting to grow the job back.

`Incidents` is part of the controller's core (`ControllerCore.incidents`).
It opens an `flow.IncidentFlow` for a fault (or a scale-out) and is that flow's
`FlowHost`: it numbers actions, sends them to ranks (the same order to many encoded once),
and counts each incident's outcome when the flow finishes. It reaches back into the
controller only through the `IncidentsHost` methods below.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..wire.classify import FaultKind
from ..wire.order_types import ExitOrder, Payload, to_wire
from ..wire.protocol import CONTROLLER, MsgType, encode
from .context import Context
from .flow import Incident, IncidentFlow, IncidentStats
from .ranktable import Health, RankInfo

if TYPE_CHECKING:  # the type only: its module reads the environment
    pass

log = logging.getLogger("mindspeed_tft.control.controller")


class Incidents:
    """The incident under way and the orders it sends (see the module docstring)."""

    def __init__(self, ctx: Context, unreplaceable: dict[int, str] | None = None) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.table = ctx.table
        self.sm = ctx.sm
        self.planner = ctx.planner
        self.elasticity = ctx.elasticity
        #: the exit code the last incident ended the job with (None: it did not)
        self.exit_code: int | None = None
        self.flow: IncidentFlow | None = None
        #: ranks that get no replacement whatever happens (their node's launcher is silent:
        #: `nodes.Nodes`), and why: every incident starts knowing them
        self.unreplaceable = {} if unreplaceable is None else unreplaceable
        #: how many incidents were opened
        self.count = 0
        #: counters over the incidents that ended (kind/strategy/outcome, recoveries, ...)
        self.stats = IncidentStats()
        #: elastic training: ranks that left in a shrink and registered again; they wait
        #: (health `left`, outside every incident) until the job can grow by them
        self.returning: set[int] = set()
        self.grow_check = False
        self._action_id = 0

    def open(self, rank: int, kind: FaultKind, message: str, detail: dict[str, Any] | None,
             now: float) -> None:
        """A first fault: a new incident (NORMAL/PAUSE -> ABNORMAL)."""
        self.count += 1
        self.flow = IncidentFlow(self, Incident(
            self.count, now, details={rank: detail} if detail else {},
            unreplaceable=dict(self.unreplaceable)))
        self.flow.begin(rank, kind, message)

    def view(self) -> dict[str, Any] | None:
        """The incident under way, for the controller's snapshot (None: none)."""
        flow = self.flow
        if flow is None:
            return None
        phase, last = flow.phase, flow.last_turn
        return {
            "id": flow.incident.id,
            "faults": {str(r): k.value for r, k in flow.incident.faults.items()},
            "strategy": str(flow.incident.strategy),
            "lock_step": flow.incident.lock_step,
            "phase": phase.name.value if phase else None,
            # what it waits for: the ranks whose answer (or, rejoin: whose restarted
            # process) the phase still lacks, until when (loop clock)
            "waiting_for": sorted(phase.pending) if phase else [],
            "until": phase.deadline if phase else None,
            # why it is in this stage: the decision that led here
            "why": None if last is None or last[1] is None else {
                "stage": last[0].value, "code": last[1].code, "text": last[1].text,
                "ranks": list(last[1].ranks)},
        }

    def claim(self) -> str:
        """Who orders a dump (`DumpOrder.claim`): this controller's endpoint and epoch (a
        backup that took charge has a later epoch and another endpoint)."""
        return f"controller {self.ctx.endpoint or '-'} epoch {self.ctx.epoch}"

    def lock_step(self) -> int | None:
        """The lock step of the incident under way; None when there is none."""
        return self.flow.incident.lock_step if self.flow is not None else None

    def order(self, rank: int, payload: Payload) -> None:
        """One order to one rank, with a new action id and the action time limit."""
        self.send_action(rank, self.new_action_id(), payload, self.config.action_time_limit)

    def rank_restarted(self, row: RankInfo) -> None:
        """A restarted process registered for `row`'s rank: it joins the recovery under
        way, or exits when there is none."""
        if self.flow is not None:
            self.flow.on_registered(row.rank)
        else:
            self.order(row.rank, ExitOrder(
                self.config.failure_exit_code,
                f"rank {row.rank} restarted while no recovery was under way"))
            row.health = Health.EXITING

    # -- FlowHost ---------------------------------------------------------------------------
    def now(self) -> float:
        """The time of the input being handled (the core's loop clock)."""
        return self.ctx.now

    def emit(self, event: str, rank: int, **fields: Any) -> dict[str, Any]:
        return self.ctx.emit(event, rank, **fields)

    def new_action_id(self) -> int:
        self._action_id += 1
        return self._action_id

    def number_actions_from(self, base: int) -> None:
        """Action ids from now on are above `base` (a backup taking charge)."""
        self._action_id = max(self._action_id, base)

    def send_action(self, rank: int, action_id: int, payload: Payload, timeout: float) -> None:
        """One order to one rank (its name is its type's: `KIND`)."""
        row = self.table.get(rank)
        if row is None or not row.identity:
            return
        self.ctx.send(row.identity, MsgType.ACTION,
                       {"id": action_id, "name": payload.KIND, "timeout": float(timeout),
                        "payload": to_wire(payload)})

    def send_action_many(self, ranks: list[int], action_id: int, payload: Payload,
                         timeout: float) -> None:
        """The same order to many ranks (encoded once)."""
        frame = encode(MsgType.ACTION, CONTROLLER, self.ctx.next_seq(),
                       {"id": action_id, "name": payload.KIND, "timeout": float(timeout),
                        "payload": to_wire(payload)})
        for rank in ranks:
            row = self.table.get(rank)
            if row is not None and row.identity:
                self.ctx.raw_send(row.identity, frame)

    def flow_finished(self, flow: IncidentFlow) -> None:
        if self.flow is flow:
            self.flow = None
        if flow.outcome is not None:
            self.stats.add(flow.outcome)
        if flow.exit_code is not None:
            self.exit_code = flow.exit_code
            self.dismiss_returning(f"the job ended (exit code {flow.exit_code}) before it "
                                   "could grow by this rank")
        # after it: may the job grow, or did every member finish training meanwhile?
        self.grow_check = bool(self.returning) or self.table.any_done()
        self.ctx.mark_dirty()

    # -- elastic training: growing back ------------------------------------------------------
    def rank_returned(self, row: RankInfo, replica: dict[str, Any] | None) -> None:
        """A restarted process registered while the job is shrunk (for a rank that left, or
        one lost since: a replacement cannot take a rank's place in a shrunk world, whose
        layout differs from its own). It waits outside the job (health `left`) until its
        replica is complete and the job can grow by it (`maybe_grow`)."""
        row.health = Health.LEFT
        row.replica = replica  # its place in the job's current layout, until it grows
        self.returning.add(row.rank)
        self.grow_check = True
        log.warning("rank %d came back into a shrunk job: the job grows by it once its "
                    "data-parallel replica is complete", row.rank)
        flow = self.flow
        # an incident waiting for it does not get it back; a rank that left in an earlier
        # shrink is no part of this incident at all (tft-sim --seed 10904 --world 8: it was
        # taken for one this incident's repair needed, which then ended in a dump)
        if flow is not None and row.rank in flow.incident.faults:
            flow.no_replacement(row.rank, "it came back into a shrunk job: it rejoins by a "
                                          "scale-out")

    def maybe_grow(self, now: float) -> None:
        """Start a scale-out when the returning ranks let the job grow (loop thread)."""
        self.grow_check = False
        lost = self.config.lost_after
        for rank in sorted(self.returning):  # a returning process that went silent is gone
            row = self.table.get(rank)
            if row is None or row.health is not Health.LEFT or now - row.last_seen > lost:
                self.returning.discard(rank)
        if self.table.any_done():
            return  # a member finished training: the job ends, it does not grow
        members = [r for r in self.table.members() if r not in self.returning]
        grown = self.elasticity.grown_world(members, self.returning)
        if grown is None:
            return
        world, dp_size = grown
        joining = [r for r in world if r in self.returning]
        self.returning -= set(joining)
        self.count += 1
        self.flow = IncidentFlow(self, Incident(self.count, now))
        self.flow.begin_scale_out(world, dp_size, joining)

    def dismiss_returning(self, reason: str) -> None:
        """The job ends: returning ranks still waiting to join exit cleanly."""
        for rank in sorted(self.returning):
            self.order(rank, ExitOrder(0, reason))
        self.returning.clear()
