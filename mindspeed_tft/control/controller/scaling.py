"""Elastic training's phases of an incident: shrink without the lost ranks' data-parallel
replicas, or grow by returning ranks, each from the dump of the lock step.

`Scaling` is held by an `flow.IncidentFlow` (`flow.scaling`) and runs in the controller's
loop thread. The flow decides to shrink (no replacement for a lost rank) or is opened to grow
(`begin_scale_out`); once the dump is renamed it hands the path here: `start_scale_in` /
`start_scale_out` send the scale order (or return why they cannot), `after_scale_in` /
`after_scale_out` take the results and return how the stage ended (`phases.Turn`): the flow
resumes training in the new world, or ends the job with the dump (`phases.NEXT`). It
sends orders through `ScaleFlow` below and reads the controller's state through the flow's
context (`ScaleContext`); it writes none of the flow's fields.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ...records import CONTROLLER_RANK
from ..wire.order_types import ExitOrder, Payload, ScaleInOrder, ScaleOutOrder
from ..wire.results import ActionResult, ScaleResult
from .elasticity import Elasticity
from .phases import PhaseEnd, Stage, Turn, Why, done, failed
from .ranktable import Health, RankTable
from .states import State, StateMachine

if TYPE_CHECKING:  # the type only: its module reads the environment
    from ..wire.config import ControlConfig

log = logging.getLogger("mindspeed_tft.control.incident")


class _Numbered(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def lock_step(self) -> int: ...


class ScaleContext(Protocol):
    """The controller's state a scale change reads and changes (the flow's context)."""

    @property
    def table(self) -> RankTable: ...
    @property
    def config(self) -> ControlConfig: ...
    @property
    def sm(self) -> StateMachine: ...
    @property
    def elasticity(self) -> Elasticity: ...
    def now(self) -> float: ...
    def emit(self, event: str, rank: int, **fields: Any) -> dict[str, Any]: ...


class PhaseResults(Protocol):
    """What came back from one phase (`flow.Phase`)."""

    @property
    def results(self) -> dict[int, ActionResult]: ...
    @property
    def failures(self) -> dict[int, str]: ...


class ScaleFlow(Protocol):
    """What `Scaling` needs from its incident flow (`flow.IncidentFlow`'s public
    interface: its incident, send one order, start a phase)."""

    @property
    def incident(self) -> _Numbered: ...
    def send_order(self, rank: int, payload: Payload) -> None: ...
    def start_phase(self, name: Stage, targets: list[int], payload: Payload | None = None,
                    per_rank: Mapping[int, Payload] | None = None) -> None: ...


def fail_text(phase: PhaseResults) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(phase.failures.items()))


class Scaling:
    """A shrink or a grow of the job within one incident (see the module docstring)."""

    def __init__(self, flow: ScaleFlow, ctx: ScaleContext) -> None:
        self.flow = flow
        self.ctx = ctx
        #: elastic training: the lost ranks the dump is shrinking the job without
        self.shrinking: set[int] | None = None
        #: ranks that leave the job in the shrink (the lost ranks' whole DP replicas)
        self.leaving: list[int] = []
        #: elastic training, scale-out: the larger world (control-plane ranks, ascending),
        #: its DP size, and the returning ranks that join it
        self.growing: tuple[list[int], int] | None = None
        self.joining: list[int] = []

    def _dp_index(self, rank: int) -> int | None:
        row = self.ctx.table.get(rank)
        dense = (row.replica or {}).get("dense") if row is not None else None
        return None if dense is None else int(dense["dp_index"])

    def begin(self, world: list[int], dp_size: int, joining: list[int], incident: int) -> float:
        """A grow of the job to `world` (DP `dp_size`) by the returning ranks `joining`:
        ABNORMAL, as a fault would (the flow holds and stops every member, then the lock
        step is dumped and reloaded in the larger world). Returns the time of its
        `scale_out_started` event."""
        self.growing, self.joining = (list(world), dp_size), list(joining)
        at = self.ctx.emit("scale_out_started", CONTROLLER_RANK, world_size=len(world),
                           dp_size=dp_size, joining=self.joining, incident=incident)["time"]
        self.ctx.sm.to(State.ABNORMAL, f"scale-out: ranks {self.joining} came back; the job "
                                       f"grows to DP {dp_size}")
        return float(at)

    def start_scale_in(self, path: str) -> Turn | None:
        """The dump is saved: the DP replicas without a lost rank continue from it."""
        flow = self.flow
        inc, host = flow.incident, self.ctx
        assert self.shrinking is not None
        lost_dp = {self._dp_index(r) for r in self.shrinking}
        members = host.table.members()
        staying = [r for r in members if self._dp_index(r) not in lost_dp]
        # a lost rank that came back meanwhile waits outside the job already (`left`)
        self.leaving = sorted({r for r in members if r not in staying} | self.shrinking)
        gone = [r for r in staying if (row := host.table.get(r)) is None or not row.connected]
        if None in lost_dp or not staying or gone or 2 * len(staying) < len(members):
            why = ("no data-parallel replica is left" if not staying else
                   f"ranks {gone} of the remaining replicas are gone too" if gone else
                   "the lost ranks' data-parallel replicas are unknown" if None in lost_dp else
                   f"{len(staying)} of its {len(members)} ranks would train on: fewer than "
                   "half may be the minority side of a network partition, which never "
                   "resumes training")
            return failed("cannot_shrink", f"elastic training cannot shrink ({why}); "
                          f"dying-gasp checkpoint saved at iteration {inc.lock_step} in {path}",
                          gone)
        host.sm.to(State.REPAIR, f"scale-in without ranks {self.leaving}")
        for rank in self.leaving:  # the lost ranks' peers in their replicas leave too
            row = host.table.get(rank)
            if row is not None and row.connected:
                flow.send_order(rank, ExitOrder(0, "left the job: elastic training "
                                                   f"shrank it without data-parallel replica(s) "
                                                   f"of ranks {sorted(self.shrinking)}"))
                row.health = Health.EXITING
        flow.start_phase(Stage.SCALE_IN, staying,
                         ScaleInOrder(inc.id, inc.lock_step, path, tuple(staying)))
        return None

    def after_scale_in(self, phase: PhaseResults) -> Turn:
        flow = self.flow
        inc, host = flow.incident, self.ctx
        if phase.failures:
            return self._failed_with_the_dump(f"scale-in failed ({fail_text(phase)})", phase)
        results = {r: res for r, res in phase.results.items() if isinstance(res, ScaleResult)}
        staying = sorted(r for r, res in results.items() if res.stays)
        standby = sorted(r for r in results if r not in staying)
        for rank in standby:  # the DP size the global batch splits evenly over is smaller
            flow.send_order(rank, ExitOrder(0, "left the job: the global batch "
                                               f"splits evenly over {len(staying)} ranks only"))
        for rank in [*self.leaving, *standby]:
            row = host.table.get(rank)
            if row is not None:
                row.health = Health.LEFT
        for rank in staying:
            row = host.table.get(rank)
            replica = results[rank].replica
            if row is not None and replica is not None:
                row.replica = replica
        dp_size = results[staying[0]].dp_size if staying else None
        batches = results[staying[0]].micro_batches if staying else None
        if batches is not None and batches > 0:
            host.elasticity.micro_batches = batches
        left = sorted([*self.leaving, *standby])
        at = host.emit(
            "scale_in", CONTROLLER_RANK, world_size=len(staying), dp_size=dp_size,
            ranks=staying, left=left, lost=sorted(self.shrinking or ()), step=inc.lock_step,
            incident=inc.id)["time"]
        log.warning("incident %d: job shrunk to %d ranks (DP %s) at step %d; left: %s", inc.id,
                    len(staying), dp_size, inc.lock_step, left)
        return done(at=at)

    def after_stop(self, faults: bool, table: RankTable) -> tuple[Turn | None, list[int]]:
        """A grow's members are stopped: how its stop ended (None: decide as for a fault,
        or no grow), and the returning ranks sent away. It goes on to the dump of the lock
        step; a fault turns it into an ordinary incident; members that all finished training
        meanwhile end it (the job ends, it does not grow; found by the simulator's oracle:
        tft-sim --seed 18252 --world 8)."""
        if self.growing is None:
            return None, []
        if not faults and table.all_done():
            away = self.send_joining_away("the job finished training before it could grow")
            return Turn(PhaseEnd.FALSE_ALARM, Why(
                "finished", "every member finished training: the job does not grow")), away
        if faults:
            return None, self.send_joining_away("a fault arrived while the job was about to "
                                                "grow")
        return Turn(PhaseEnd.DUMP, Why(
            "scale_out", f"scale-out to DP {self.growing[1]}: the lock step is saved first "
            "and reloaded in the larger world", tuple(self.joining))), []

    def send_joining_away(self, why: str) -> list[int]:
        """The job does not grow: the returning ranks exit (their launcher may bring them
        back later) and stay out of the job. Returns them."""
        host, away = self.ctx, list(self.joining)
        for rank in self.joining:
            self.flow.send_order(rank, ExitOrder(host.config.failure_exit_code,
                                                    f"the job did not grow by this rank: {why}"))
            row = host.table.get(rank)
            if row is not None:
                row.health = Health.LEFT
        self.growing, self.joining = None, []
        return away

    def start_scale_out(self, path: str) -> Turn | None:
        """The dump is saved: members and returning ranks reload it in the larger world."""
        flow = self.flow
        inc, host = flow.incident, self.ctx
        assert self.growing is not None
        world, dp_size = self.growing
        gone = [r for r in world if r not in self.joining
                and ((row := host.table.get(r)) is None or not row.connected)]
        joiners = [r for r in self.joining if (row := host.table.get(r)) is not None
                   and host.now() - row.last_seen <= host.config.lost_after]
        if gone or joiners != self.joining:
            self.send_joining_away(f"ranks {gone or sorted(set(self.joining) - set(joiners))} "
                                   "went away before the scale-out")
            return failed("ranks_gone", "scale-out abandoned (ranks went away); dying-gasp "
                          f"checkpoint saved at iteration {inc.lock_step} in {path}", gone)
        host.sm.to(State.REPAIR, f"scale-out to DP {dp_size} with ranks {self.joining}")
        for rank in self.joining:  # part of the job again, holding no state yet
            row = host.table.get(rank)
            if row is not None:
                row.health, row.fresh = Health.ALIVE, True
        flow.start_phase(Stage.SCALE_OUT, world,
                         ScaleOutOrder(inc.id, inc.lock_step, path, tuple(world), dp_size,
                                       tuple(self.joining)))
        return None

    def after_scale_out(self, phase: PhaseResults) -> Turn:
        flow = self.flow
        inc, host = flow.incident, self.ctx
        if phase.failures:
            return self._failed_with_the_dump(f"scale-out failed ({fail_text(phase)})", phase)
        assert self.growing is not None
        world, dp_size = self.growing
        for rank, result in phase.results.items():
            row = host.table.get(rank)
            replica = result.replica if isinstance(result, ScaleResult) else None
            if row is not None and replica is not None:
                row.replica = replica
        at = host.emit(
            "scale_out", CONTROLLER_RANK, world_size=len(world), dp_size=dp_size, ranks=world,
            joined=self.joining, step=inc.lock_step, incident=inc.id)["time"]
        log.warning("incident %d: job grown to %d ranks (DP %d) at step %d; joined: %s",
                    inc.id, len(world), dp_size, inc.lock_step, self.joining)
        return done(at=at)

    def _failed_with_the_dump(self, what: str, phase: PhaseResults) -> Turn:
        """A scale change failed after its dump was published: the job ends with that dump
        (REPAIR -> DUMP -> EXIT, `phases.NEXT`)."""
        return failed("phase_failed", f"{what}; dying-gasp checkpoint saved at iteration "
                      f"{self.flow.incident.lock_step}", list(phase.failures))
