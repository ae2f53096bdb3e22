"""Elastic training's phases of an incident: shrink without the lost ranks' data-parallel
replicas, or grow by returning ranks, each from the dump of the lock step.

`Scaling` is held by an `incident.IncidentFlow` (`flow.scaling`) and runs in the controller's
loop thread. The flow decides to shrink (no replacement for a lost rank) or is opened to grow
(`begin_scale_out`); once the dump is renamed it hands the path here: `start_scale_in` /
`start_scale_out` send the scale order, `after_scale_in` / `after_scale_out` take the
results and resume training in the new world. It reaches back into the flow only through
`ScaleFlow` below.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ...records import CONTROLLER_RANK
from ..wire.order_types import ExitOrder, Payload, ScaleInOrder, ScaleOutOrder
from ..wire.results import ActionResult, ScaleResult
from .elasticity import Elasticity
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


class _ScaleHost(Protocol):
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
    """What came back from one phase (`incident.Phase`)."""

    @property
    def results(self) -> dict[int, ActionResult]: ...
    @property
    def failures(self) -> dict[int, str]: ...


class ScaleFlow(Protocol):
    """What `Scaling` needs from its incident flow (`incident.IncidentFlow`'s public
    interface: send one order, start a phase, end the job, resume training)."""

    resumed_at: float | None

    @property
    def incident(self) -> _Numbered: ...
    @property
    def host(self) -> _ScaleHost: ...
    def send_order(self, rank: int, payload: Payload, action_id: int | None = None) -> None: ...
    def start_phase(self, name: str, targets: list[int], payload: Payload | None = None,
                    per_rank: Mapping[int, Payload] | None = None) -> None: ...
    def end_job(self, code: int, reason: str) -> None: ...
    def resume(self, *, false_alarm: bool) -> None: ...


def fail_text(phase: PhaseResults) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(phase.failures.items()))


class Scaling:
    """A shrink or a grow of the job within one incident (see the module docstring)."""

    def __init__(self, flow: ScaleFlow) -> None:
        self.flow = flow
        #: elastic training: the lost ranks the dump is shrinking the job without
        self.shrinking: set[int] | None = None
        #: ranks that leave the job in the shrink (the lost ranks' whole DP replicas)
        self.leaving: list[int] = []
        #: elastic training, scale-out: the larger world (control-plane ranks, ascending),
        #: its DP size, and the returning ranks that join it
        self.growing: tuple[list[int], int] | None = None
        self.joining: list[int] = []

    def _dp_index(self, rank: int) -> int | None:
        row = self.flow.host.table.get(rank)
        dense = (row.replica or {}).get("dense") if row is not None else None
        return None if dense is None else int(dense["dp_index"])

    def start_scale_in(self, path: str) -> None:
        """The dump is saved: the DP replicas without a lost rank continue from it."""
        flow = self.flow
        inc, host = flow.incident, flow.host
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
            flow.end_job(host.config.dump_exit_code,
                       f"elastic training cannot shrink ({why}); dying-gasp checkpoint saved "
                       f"at iteration {inc.lock_step} in {path}")
            return
        host.sm.to(State.REPAIR, f"scale-in without ranks {self.leaving}")
        for rank in self.leaving:  # the lost ranks' peers in their replicas leave too
            row = host.table.get(rank)
            if row is not None and row.connected:
                flow.send_order(rank, ExitOrder(0, "left the job: elastic training "
                                                   f"shrank it without data-parallel replica(s) "
                                                   f"of ranks {sorted(self.shrinking)}"))
                row.health = Health.EXITING
        flow.start_phase("scale_in", staying,
                         ScaleInOrder(inc.id, inc.lock_step, path, tuple(staying)))

    def after_scale_in(self, phase: PhaseResults) -> None:
        flow = self.flow
        inc, host = flow.incident, flow.host
        if phase.failures:
            self.end_with_the_dump(f"scale-in failed ({fail_text(phase)})")
            return
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
        flow.resumed_at = host.emit(
            "scale_in", CONTROLLER_RANK, world_size=len(staying), dp_size=dp_size,
            ranks=staying, left=left, lost=sorted(self.shrinking or ()), step=inc.lock_step,
            incident=inc.id)["time"]
        log.warning("incident %d: job shrunk to %d ranks (DP %s) at step %d; left: %s", inc.id,
                    len(staying), dp_size, inc.lock_step, left)
        flow.resume(false_alarm=False)

    def send_joining_away(self, why: str) -> None:
        """The job does not grow: the returning ranks exit (their launcher may bring them
        back later) and stay out of the job."""
        host = self.flow.host
        for rank in self.joining:
            self.flow.send_order(rank, ExitOrder(host.config.failure_exit_code,
                                                    f"the job did not grow by this rank: {why}"))
            row = host.table.get(rank)
            if row is not None:
                row.health = Health.LEFT
        self.growing, self.joining = None, []

    def start_scale_out(self, path: str) -> None:
        """The dump is saved: members and returning ranks reload it in the larger world."""
        flow = self.flow
        inc, host = flow.incident, flow.host
        assert self.growing is not None
        world, dp_size = self.growing
        gone = [r for r in world if r not in self.joining
                and ((row := host.table.get(r)) is None or not row.connected)]
        joiners = [r for r in self.joining if (row := host.table.get(r)) is not None
                   and host.now() - row.last_seen <= host.config.lost_after]
        if gone or joiners != self.joining:
            self.send_joining_away(f"ranks {gone or sorted(set(self.joining) - set(joiners))} "
                                   "went away before the scale-out")
            flow.end_job(host.config.dump_exit_code,
                       f"scale-out abandoned (ranks went away); dying-gasp checkpoint saved at "
                       f"iteration {inc.lock_step} in {path}")
            return
        host.sm.to(State.REPAIR, f"scale-out to DP {dp_size} with ranks {self.joining}")
        for rank in self.joining:  # part of the job again, holding no state yet
            row = host.table.get(rank)
            if row is not None:
                row.health, row.fresh = Health.ALIVE, True
        flow.start_phase("scale_out", world,
                         ScaleOutOrder(inc.id, inc.lock_step, path, tuple(world), dp_size,
                                       tuple(self.joining)))

    def after_scale_out(self, phase: PhaseResults) -> None:
        flow = self.flow
        inc, host = flow.incident, flow.host
        if phase.failures:
            self.end_with_the_dump(f"scale-out failed ({fail_text(phase)})")
            return
        assert self.growing is not None
        world, dp_size = self.growing
        for rank, result in phase.results.items():
            row = host.table.get(rank)
            replica = result.replica if isinstance(result, ScaleResult) else None
            if row is not None and replica is not None:
                row.replica = replica
        flow.resumed_at = host.emit(
            "scale_out", CONTROLLER_RANK, world_size=len(world), dp_size=dp_size, ranks=world,
            joined=self.joining, step=inc.lock_step, incident=inc.id)["time"]
        log.warning("incident %d: job grown to %d ranks (DP %d) at step %d; joined: %s",
                    inc.id, len(world), dp_size, inc.lock_step, self.joining)
        flow.resume(false_alarm=False)

    def end_with_the_dump(self, why: str) -> None:
        """A scale change failed after its dump was published: exit with the dump code
        (REPAIR -> DUMP -> EXIT: the dump is the state the job ends in)."""
        flow = self.flow
        reason = f"{why}; dying-gasp checkpoint saved at iteration {flow.incident.lock_step}"
        flow.host.sm.to(State.DUMP, reason)
        flow.end_job(flow.host.config.dump_exit_code, reason)
