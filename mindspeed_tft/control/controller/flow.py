"""The handling of one fault incident: from detection to NORMAL again or to FINAL (SPEC 5).

An `IncidentFlow` is created by the controller when a fault arrives in NORMAL or PAUSE and
drives the state machine through a sequence of phases. Each phase sends one action to a set
of ranks and waits for every result, a lost rank, or the phase's deadline (the action time
limit, `TTP_NORMAL_ACTION_TIME_LIMIT`), whichever comes first:

    ABNORMAL   hold      hold every rank before its next update; results carry step/status
               stop      stop them, with the provisional lock step the answers give (a rank
                         behind it catches up); results carry step/status
               (decide)  lock step, strategy (`StrategyPlanner`), `strategy` event; a
                         recover for a lost rank whose launcher said it will not restart it
                         (`no_replacement`) is a dump at once, its `reason` naming the
                         refusal (with elastic training the rejoin round fails at once
                         for it instead, and the job shrinks)
    ENV_CLEAR  clean     drop pending collectives, free bad memory
               rejoin    recover only: wait for restarted workers to register again
    REPAIR     repair    rebuild communication, copy state from replicas / load checkpoint
               rollback  every rank back to the lock step
               resume    notify normal -> NORMAL (`repaired` event)
    DUMP       dump      SPEC 7 holders write the dying-gasp checkpoint
               rename    one rank renames iter_X_tmp -> iter_X and updates the tracker
    REPAIR     scale_in  elastic training, when a lost rank gets no replacement: the
                         data-parallel replicas without a lost rank reload the dump in a
                         smaller world (`scale_in` event); the others leave the job

A scale-out (elastic training: ranks that left in a shrink came back, `begin_scale_out`) is
handled as an incident without a fault: ABNORMAL hold + stop (every rank held, the lock step
decided), DUMP dump + rename, then REPAIR `scale_out`: the members and the returning ranks
reload the dump in the larger world (`scale_out` event) and resume. A fault reported before
the dump turns it into an ordinary incident (the returning ranks are sent away); one after
the dump ends the job with that dump, as during a shrink.
    EXIT       exit      every rank exits with the decided code -> FINAL (`exit` event)

A failed or timed-out clean/repair/rollback falls back to DUMP; a failed dump, an
impossible dump (a shard without a healthy holder) or a lock step of 0 exit with a clear
reason. A new fault during ENV_CLEAR or REPAIR is a cascading fault and goes to DUMP; faults
arriving while still ABNORMAL join the incident before the decision, except a communication
error of a rank the stop was already sent to: stopped ranks shut their connections, so their
peers' collectives fail before their own stop arrives (withdrawn at once). No phase waits longer
than its deadline, so nothing hangs.

A phase ends in the method that takes its results (`_ends`; the elastic phases, scale_in
and scale_out, are `scaling.Scaling`'s), which returns how it ended and why
(`phases.Turn`); the stage that follows is the table's (`phases.NEXT`), started by `_starts`.

When a flow ends (`resume`, `end_job`), its `outcome` says how: the kind of its first fault, the
strategy, the outcome, the time to recover and the iterations lost. The controller's
`incidents.Incidents` adds it to its `IncidentStats` (`flow_finished`), which the metrics
endpoint serves (`metrics`).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ...records import CONTROLLER_RANK, validate_record
from ..wire.classify import FaultKind
from ..wire.order_types import ExitOrder, HoldOrder, Payload, ResumeOrder
from ..wire.results import (
    ActionResult,
    CleanResult,
    EmptyResult,
    HoldResult,
    ResultMessage,
    RollbackResult,
    StopResult,
)
from .dumping import Dumping
from .elasticity import Elasticity
from .phases import PhaseEnd, Stage, Turn, Why, done, failed, next_stage
from .ranktable import CONNECTED, Health, RankTable
from .scaling import Scaling, fail_text
from .states import State, StateMachine
from .strategy import (
    PROCESS_KINDS,
    REPAIR_STRATEGIES,
    SPARED_TARGETS,
    PlanError,
    Strategy,
    StrategyPlanner,
    left_before,
)

if TYPE_CHECKING:  # the type only: its module reads the environment
    from ..wire.config import ControlConfig

log = logging.getLogger("mindspeed_tft.control.incident")

_KIND_RANK = {FaultKind.COMM: 0, FaultKind.UCE: 1, FaultKind.UNKNOWN: 2, FaultKind.HANG: 3,
              FaultKind.LOST: 4}


@dataclass
class Incident:
    """What is known about one incident."""

    id: int
    started: float
    faults: dict[int, FaultKind] = field(default_factory=dict)
    #: what the reporting ranks said beyond the kind (e.g. which memory a UCE hit)
    details: dict[int, dict[str, Any]] = field(default_factory=dict)
    strategy: Strategy | None = None
    lock_step: int = 0
    source: str = "replica"
    #: last steps of ranks whose process is gone (their rows may be replaced on rejoin)
    lost_steps: dict[int, int] = field(default_factory=dict)
    #: restarted processes that registered during this incident
    new_ranks: set[int] = field(default_factory=set)
    #: recover: ranks whose restarted process we still wait for
    awaiting: set[int] = field(default_factory=set)
    #: ranks whose training thread came back to the handler when stopped (so: not hung)
    parked: set[int] = field(default_factory=set)
    #: ranks the stop was sent to: they shut their connections, so from then on a
    #: communication error of one of them is a consequence of the stop, not a fault
    stopped: set[int] = field(default_factory=set)
    rollback_step: int | None = None
    #: ranks whose launcher will not restart them (an exit code it does not restart, the
    #: job ending, its restart budget spent), and why
    unreplaceable: dict[int, str] = field(default_factory=dict)
    #: returning ranks a grow sent away when a fault turned it into this incident: outside
    #: the job (whatever their launcher does next)
    sent_away: set[int] = field(default_factory=set)
    #: the time (events clock) of its first `fault_detected` (or `scale_out_started`) event,
    #: and the kind of that first fault (None: a scale-out)
    detected: float | None = None
    first_kind: FaultKind | None = None
    #: iteration records from the ranks' stop and rollback results, by iteration: the
    #: resume hands those up to its step to the logging rank (logged exactly once)
    iterations: dict[int, dict[str, Any]] = field(default_factory=dict)

    def note_iterations(self, result: ActionResult) -> None:
        """Keep the iteration records a stop or rollback result carries (each record
        checked: network input)."""
        records = (result.iterations if isinstance(result, (StopResult, RollbackResult))
                   else None)
        for value in records[:8] if records is not None else ():
            record = validate_record(value)
            if record is None:
                continue
            known = self.iterations.get(record["iteration"])
            if known is None or (known["lr"] is None and record["lr"] is not None):
                # a whole record (logged after the update) beats one kept before it
                self.iterations[record["iteration"]] = record


#: how many recovery durations `IncidentStats` keeps (for the median)
RECOVERIES_KEPT = 1000


@dataclass
class Outcome:
    """How one incident ended (`IncidentFlow.outcome`, folded into `IncidentStats`)."""

    kind: str
    strategy: str
    #: repaired, false_alarm, scaled_in, scaled_out (training went on); dumped, exited
    outcome: str
    #: from its first `fault_detected` event to the event after which training resumed
    #: (`repaired`, `scale_in`, `scale_out`), read off the same clock as the events file;
    #: None where training did not resume after a recovery (a false alarm, an exit)
    recovery_seconds: float | None
    #: completed iterations the job went back on: the lock step minus the step training
    #: resumed from (a repair from the last periodic checkpoint without replicas); 0 for an
    #: incident that ends the job (its dump holds the lock step; without one the controller
    #: does not know the last checkpoint)
    iterations_lost: int


@dataclass
class IncidentStats:
    """The controller's counters over the incidents that ended (plain data, loop thread)."""

    #: (kind, strategy, outcome) -> incidents
    ended: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: the last `RECOVERIES_KEPT` recovery durations, oldest first (seconds)
    recoveries: deque[float] = field(default_factory=lambda: deque(maxlen=RECOVERIES_KEPT))
    iterations_lost: int = 0

    def add(self, outcome: Outcome) -> None:
        key = (outcome.kind, outcome.strategy, outcome.outcome)
        self.ended[key] = self.ended.get(key, 0) + 1
        if outcome.recovery_seconds is not None:
            self.recoveries.append(outcome.recovery_seconds)
        self.iterations_lost += outcome.iterations_lost

    def view(self) -> dict[str, Any]:
        """A JSON-ready copy (for snapshots and the metrics endpoint)."""
        return {
            "ended": [{"kind": k, "strategy": s, "outcome": o, "count": n}
                      for (k, s, o), n in sorted(self.ended.items())],
            "recoveries": len(self.recoveries),
            "recovery_last_seconds": self.recoveries[-1] if self.recoveries else None,
            "recovery_median_seconds": (statistics.median(self.recoveries)
                                        if self.recoveries else None),
            "iterations_lost": self.iterations_lost,
        }


@dataclass
class Phase:
    """One action sent to a set of ranks, and what came back."""

    name: Stage
    action_id: int
    deadline: float
    pending: set[int]
    results: dict[int, ActionResult] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)


def outcome_of(inc: Incident, resumed_at: float | None, outcome: str, lost: int) -> Outcome:
    """How `inc` ended (`resumed_at`: the events-clock time training resumed, if it did)."""
    took = None
    if resumed_at is not None and inc.detected is not None:
        took = max(0.0, resumed_at - inc.detected)
    kind = inc.first_kind.value if inc.first_kind is not None else "none"
    return Outcome(kind, str(inc.strategy or "none"), outcome, took, lost)


class FlowHost(Protocol):
    """What an incident flow needs from its controller."""

    table: RankTable
    planner: StrategyPlanner
    config: ControlConfig
    sm: StateMachine
    elasticity: Elasticity

    def now(self) -> float: ...
    def emit(self, event: str, rank: int, **fields: Any) -> dict[str, Any]: ...
    def new_action_id(self) -> int: ...
    def send_action(self, rank: int, action_id: int, payload: Payload, timeout: float) -> None: ...
    def send_action_many(self, ranks: list[int], action_id: int, payload: Payload,
                         timeout: float) -> None: ...
    def flow_finished(self, flow: IncidentFlow) -> None: ...
    def claim(self) -> str: ...


def worse_detail(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """Two reports of one rank: the detail that says more is damaged (a second UCE in
    its grads does not make a first one in its params harmless; found by the simulator's
    oracle: tft-sim --seed 5278 --world 8)."""
    if old is None:
        return new
    return new if _target_harm(new.get("target")) >= _target_harm(old.get("target")) else old


def _target_harm(target: Any) -> int:
    """How much a UCE's target damaged: 0 spared (grads, activations), 1 optimizer state
    only, 2 anything else (params, unknown)."""
    return 0 if target in SPARED_TARGETS else 1 if target == "optimizer" else 2


class IncidentFlow:
    """Drives one incident through its phases (called from the controller's loop thread)."""

    def __init__(self, host: FlowHost, incident: Incident) -> None:
        self.host = host
        self.incident = incident
        self.phase: Phase | None = None
        #: elastic training: a shrink or a grow of the job (`scaling`)
        self.scaling = Scaling(self, host)
        #: the dying-gasp checkpoint's stages (`dumping`)
        self.dumping = Dumping(self, host)
        self.done = False
        #: a repair that reloads the last checkpoint was sent (the lock step is gone)
        self.reloaded = False
        self.exit_code: int | None = None
        #: the time (events clock) of the event after which training resumed
        self.resumed_at: float | None = None
        #: how it ended, for the controller's counters (set by `_resume` and `end_job`)
        self.outcome: Outcome | None = None
        #: the phase that ended last (its results and failures), for the stage after it
        self.ended: Phase | None = None
        #: the last decision: the stage it led to and why (the snapshot shows it)
        self.last_turn: tuple[Stage, Why | None] | None = None
        self._ends: dict[Stage, Callable[[Phase], Turn]] = {
            Stage.HOLD: self._end_hold, Stage.STOP: self._end_stop,
            Stage.CLEAN: self._end_clean, Stage.REJOIN: self._end_rejoin,
            Stage.REPAIR: self._end_repair, Stage.ROLLBACK: self._end_rollback,
            Stage.DUMP: self.dumping.after_dump, Stage.RENAME: self.dumping.after_rename,
            Stage.SCALE_IN: self.scaling.after_scale_in,
            Stage.SCALE_OUT: self.scaling.after_scale_out}
        self._starts: dict[Stage, Callable[[Turn], Turn | None]] = {
            Stage.STOP: self._start_stop, Stage.CLEAN: self._start_clean,
            Stage.REJOIN: self._start_rejoin, Stage.REPAIR: self._start_repair,
            Stage.ROLLBACK: self._start_rollback, Stage.DUMP: self.dumping.start_dump,
            Stage.RENAME: self.dumping.start_rename,
            Stage.SCALE_IN: lambda turn: self.scaling.start_scale_in(turn.path or ""),
            Stage.SCALE_OUT: lambda turn: self.scaling.start_scale_out(turn.path or ""),
            Stage.RESUME: self._resume, Stage.REPAIR_FAILED: self._repair_failed,
            # the job ends with the dump code (the dump holds the lock step), or the failure's
            Stage.EXIT_DUMPED: lambda turn: self._exit(self.host.config.dump_exit_code, turn),
            Stage.EXIT_FAILED: lambda turn: self._exit(self.host.config.failure_exit_code, turn)}

    # -- inputs ---------------------------------------------------------------------
    def begin(self, rank: int, kind: FaultKind, message: str) -> None:
        """First fault: NORMAL/PAUSE -> ABNORMAL; hold, then stop, every rank."""
        self._record(rank, kind, message)
        self.host.sm.to(State.ABNORMAL, f"{kind} on rank {rank}")
        self._hold_every_rank()

    def begin_scale_out(self, world: list[int], dp_size: int, joining: list[int]) -> None:
        """Elastic training: grow the job to `world` (DP `dp_size`) with the returning
        ranks `joining` (`Scaling.begin`), then hold every member as a fault would."""
        self.incident.detected = self.scaling.begin(world, dp_size, joining, self.incident.id)
        self._hold_every_rank()

    def add_fault(self, rank: int, kind: FaultKind, message: str,
                  detail: dict[str, Any] | None = None) -> None:
        """A further fault while the incident is handled (`detail`: what its report said
        beyond the kind)."""
        inc = self.incident
        if detail:
            inc.details[rank] = worse_detail(inc.details.get(rank), detail)
        if kind is FaultKind.HANG and rank in inc.parked:
            log.info("rank %d: late hang report ignored (its training thread came back)", rank)
            return
        state = self.host.sm.state
        if (kind is FaultKind.COMM and state is State.ABNORMAL and rank in inc.stopped
                and rank not in inc.faults):
            # a stopped peer shut its connections before this rank's own stop arrived
            self._record(rank, kind, message)
            self._withdraw(rank, "communication error after the stop was sent: a consequence "
                                 "of the stop (stopped peers shut their connections)")
            return
        old = inc.faults.get(rank)
        expected = (old in PROCESS_KINDS and kind is FaultKind.LOST) or (
            old is not None and _KIND_RANK.get(kind, 0) <= _KIND_RANK.get(old, 0))
        self._record(rank, kind, message)
        if kind is FaultKind.LOST:  # a hung rank's processor still answers: keep waiting for it
            self.on_gone(rank, "lost")
        if expected or state is State.ABNORMAL or self.done or self.host.sm.state is not state:
            return
        phase = self.phase
        if phase is not None and phase.name in (Stage.SCALE_IN, Stage.SCALE_OUT):
            # the dump of the lock step is published: end there rather than dump again from
            # ranks that are tearing their state down
            change = "shrink" if phase.name is Stage.SCALE_IN else "grow"
            self._interrupt(Why("fault_during_scaling", f"{kind} on rank {rank} during the "
                                f"{change}; dying-gasp checkpoint saved at iteration "
                                f"{self.incident.lock_step}", (rank,)))
        elif state in (State.ENV_CLEAR, State.REPAIR):
            self._interrupt(Why("cascading_fault", f"cascading fault: {kind} on rank {rank} "
                                f"during {state}", (rank,)))

    def clear_fault(self, rank: int) -> None:
        """A hung rank made progress again before the decision (false alarm for it)."""
        if self.host.sm.state is State.ABNORMAL and self.incident.faults.get(rank) is FaultKind.HANG:
            self._withdraw(rank, "made progress again")

    def on_result(self, rank: int, message: ResultMessage) -> None:
        phase = self.phase
        if phase is None or message.id != phase.action_id or rank not in phase.pending:
            return
        phase.pending.discard(rank)
        log.debug("rank %d: %s result ok=%s %s", rank, phase.name, message.ok,
                  str(message.result if message.ok else message.error)[:200])
        if message.result is not None:
            phase.results[rank] = message.result
            if isinstance(message.result, (HoldResult, StopResult)):
                self._note_status(rank, message.result)
            self.incident.note_iterations(message.result)
        else:
            phase.failures[rank] = message.error or "failed"
        if not phase.pending:
            self._phase_done()

    def on_gone(self, rank: int, why: str) -> None:
        """A rank that will not answer (lost, hung, exiting or done)."""
        phase = self.phase
        if phase is not None and rank in phase.pending:
            phase.pending.discard(rank)
            phase.failures[rank] = why
            if not phase.pending:
                self._phase_done()

    def on_registered(self, rank: int) -> None:
        """A restarted process registered for `rank` (it holds no training state)."""
        inc = self.incident
        inc.new_ranks.add(rank)
        state = self.host.sm.state
        if self.done or state in (State.DUMP, State.EXIT, State.FINAL) or (
                inc.strategy is not None and inc.strategy is not Strategy.RECOVER):
            self.send_order(rank, ExitOrder(self.host.config.failure_exit_code,
                                               "the job is not being recovered"))
            row = self.host.table.get(rank)
            if row is not None:
                row.health = Health.EXITING
            return
        inc.awaiting.discard(rank)
        phase = self.phase
        if phase is not None and phase.name is Stage.REJOIN and rank in phase.pending:
            phase.pending.discard(rank)
            phase.results[rank] = EmptyResult()
            if not phase.pending:
                self._phase_done()

    def no_replacement(self, rank: int, why: str) -> None:
        """The launcher of lost `rank` will not restart it: stop waiting for it."""
        self.incident.unreplaceable[rank] = why
        phase = self.phase
        if phase is not None and phase.name is Stage.REJOIN and rank in phase.pending:
            phase.pending.discard(rank)
            phase.failures[rank] = f"no replacement ({why})"
            if not phase.pending:
                self._phase_done()

    def tick(self, now: float) -> None:
        phase = self.phase
        if phase is not None and now >= phase.deadline and phase.pending:
            config = self.host.config
            limit = (config.effective_replacement_wait if phase.name is Stage.REJOIN
                     else config.action_time_limit)
            for r in phase.pending:
                phase.failures[r] = f"no result for {phase.name} within {limit:g}s"
            phase.pending.clear()
            log.warning("phase %s timed out on ranks %s", phase.name, sorted(phase.failures))
            self._phase_done()

    # -- phases ---------------------------------------------------------------------
    def _record(self, rank: int, kind: FaultKind, message: str) -> None:
        inc = self.incident
        old = inc.faults.get(rank)
        if old is None or _KIND_RANK.get(kind, -1) > _KIND_RANK.get(old, -1):
            inc.faults[rank] = kind
            row = self.host.table.get(rank)
            if kind in PROCESS_KINDS and row is not None and not row.fresh:
                inc.lost_steps[rank] = row.step
            event = self.host.emit("fault_detected", CONTROLLER_RANK, ranks=[rank], kind=kind.value,
                         message=message[:500], incident=inc.id)
            if inc.detected is None:
                inc.detected = event["time"]
            if inc.first_kind is None:
                inc.first_kind = kind
            log.warning("fault on rank %d: %s (%s)", rank, kind, message[:200])

    def _withdraw(self, rank: int, why: str) -> None:
        """The fault recorded for `rank` was not one (`fault_withdrawn` event)."""
        inc = self.incident
        kind = inc.faults.pop(rank)
        self.host.emit("fault_withdrawn", CONTROLLER_RANK, ranks=[rank], kind=kind.value, message=why,
             incident=inc.id)
        log.info("rank %d: %s report withdrawn: %s", rank, kind, why)

    def _note_status(self, rank: int, result: HoldResult | StopResult) -> None:
        row = self.host.table.get(rank)
        if row is None:
            return
        parked = result.parked if isinstance(result, StopResult) else None
        if parked is True:
            self.incident.parked.add(rank)
        if parked is True and self.incident.faults.get(rank) is FaultKind.HANG:
            # its training thread came back when stopped: it was blocked by others, not hung
            if row.health is Health.HUNG:
                row.health = Health.ALIVE
            self._withdraw(rank, "training thread came back when stopped (blocked by others)")
        elif parked is False and rank not in self.incident.faults:
            row.health = Health.HUNG
            self._record(rank, FaultKind.HANG, "training thread did not come back when stopped")
        row.step, row.status = result.step, result.status

    def send_order(self, rank: int, payload: Payload) -> None:
        self.host.send_action(rank, self.host.new_action_id(), payload,
                              self.host.config.action_time_limit)

    def start_phase(self, name: Stage, targets: list[int], payload: Payload | None = None,
                    per_rank: Mapping[int, Payload] | None = None) -> None:
        """Send `name`'s order to `targets` (one `payload`, or one each: `per_rank`); the
        phase ends when every one answered or at its deadline."""
        aid = self.host.new_action_id()
        limit = self.host.config.action_time_limit
        self.phase = Phase(name, aid, self.host.now() + limit, set(targets))
        self.host.emit("action", CONTROLLER_RANK, action=name.value, targets=len(targets),
                       incident=self.incident.id)
        if per_rank is None:
            assert payload is not None and payload.KIND == name.value
            self.host.send_action_many(list(targets), aid, payload, limit)
        else:
            for r in targets:
                self.host.send_action(r, aid, per_rank[r], limit)
        if not targets:
            self._phase_done()

    def _phase_done(self) -> None:
        phase = self.phase
        assert phase is not None
        self.phase = None
        self.ended = phase
        self._advance(phase.name, self._ends[phase.name](phase))

    def _advance(self, stage: Stage, turn: Turn) -> None:
        """`stage` ended with `turn`: run the stages that follow (`phases.NEXT`) until one
        waits for the ranks or the incident ends."""
        while True:
            stage = next_stage(stage, turn.end)
            self.last_turn = (stage, turn.why)
            after = self._starts[stage](turn)
            if after is None:
                return
            turn = after

    def _interrupt(self, why: Why) -> None:
        """A fault arrived during the stage under way: it ends with `FAULT`."""
        stage = self.phase.name if self.phase is not None else Stage.REPAIR
        self.phase = None
        self._advance(stage, Turn(PhaseEnd.FAULT, why))

    # -- ABNORMAL: hold, stop, decide ---------------------------------------------------
    def _hold_every_rank(self) -> None:
        """ABNORMAL, first round: hold every rank before its next update and learn its
        exact step (heartbeats are up to an interval old); then the stop."""
        targets = [r.rank for r in self.host.table.connected() if not r.fresh]
        self.start_phase(Stage.HOLD, targets, HoldOrder(self.incident.id))

    def _end_hold(self, phase: Phase) -> Turn:
        """A rank that did not answer the hold is hung."""
        self._mark_hung(phase, "could not be held")
        return done()

    def _start_stop(self, turn: Turn) -> None:
        """Second round: stop the held ranks with the provisional lock step their answers
        give (a rank behind it catches up)."""
        held = self.ended
        failed_hold = held.failures if held is not None else {}
        targets = [r.rank for r in self.host.table.connected()
                   if not r.fresh and r.rank not in failed_hold]
        self.incident.stopped.update(targets)
        payload = self.host.planner.stop_payload(self.incident, self.host.table)
        log.info("incident %d: stop sent to %d ranks, provisional lock step %d",
                 self.incident.id, len(targets), payload.lock_step)
        self.start_phase(Stage.STOP, targets, payload)

    def _mark_hung(self, phase: Phase, why: str) -> None:
        for r, err in phase.failures.items():
            row = self.host.table.get(r)
            if r not in self.incident.faults and row is not None and row.connected:
                row.health = Health.HUNG
                self._record(r, FaultKind.HANG, f"{why}: {err}")

    def _end_stop(self, phase: Phase) -> Turn:
        self._mark_hung(phase, "could not be stopped")
        turn, away = self.scaling.after_stop(bool(self.incident.faults), self.host.table)
        self.incident.sent_away.update(away)
        if turn is None:
            return self._decide()
        self.incident.lock_step = self.host.planner.lock_step(self.incident, self.host.table)
        return turn

    def _decide(self) -> Turn:
        """The planner's decision (`StrategyPlanner.decide`), and the `strategy` event."""
        inc, host = self.incident, self.host
        decision = host.planner.decide(inc, host.table)
        inc.lock_step = decision.lock_step
        if decision.strategy is None:  # every fault was withdrawn: false alarm
            host.emit("strategy", CONTROLLER_RANK, strategy="none", lock_step=inc.lock_step,
                      incident=inc.id)
            return Turn(PhaseEnd.FALSE_ALARM, decision.why)
        strategy, refusal = decision.strategy, decision.refusal
        inc.strategy, inc.source = strategy, decision.source
        host.emit("strategy", CONTROLLER_RANK, strategy=strategy.value, lock_step=inc.lock_step,
                  source=inc.source, faults={str(r): k.value for r, k in inc.faults.items()},
                  incident=inc.id, **({} if refusal is None else {"reason": refusal.text}))
        log.warning("incident %d: strategy %s at lock step %d (%s)", inc.id, strategy,
                    inc.lock_step, decision.why.text)
        if strategy in REPAIR_STRATEGIES:
            return Turn(PhaseEnd.REPAIR, decision.why)
        return Turn(PhaseEnd.EXIT if strategy is Strategy.EXIT else PhaseEnd.DUMP, decision.why)

    # -- ENV_CLEAR and REPAIR: clean, rejoin, repair, rollback ---------------------------
    def _start_clean(self, turn: Turn) -> None:
        inc, table = self.incident, self.host.table
        self.host.sm.to(State.ENV_CLEAR, f"{inc.strategy} at step {inc.lock_step}")
        if inc.strategy is Strategy.RECOVER:
            for r, kind in inc.faults.items():
                row = table.get(r)
                # a rank whose process came back into a shrunk job meanwhile (it registered
                # between the fault and now: `unreplaceable`) is awaited too, so that the
                # rejoin round fails for it and the job shrinks, as when it comes back later
                if kind in PROCESS_KINDS and row is not None and (
                        not row.fresh or r in inc.unreplaceable):
                    if row.connected:  # hung: end the process so its launcher restarts it
                        self.send_order(r, ExitOrder(self.host.config.reboot_exit_code,
                                                     "hung rank restarted (ARF)"))
                        row.health = Health.EXITING
                    inc.awaiting.add(r)
            inc.awaiting -= {r for r in inc.new_ranks if (row := table.get(r)) and row.connected}
        targets = [r.rank for r in table.connected() if not r.fresh]
        self.start_phase(Stage.CLEAN, targets, self.host.planner.clean_payload(inc))

    def _end_clean(self, phase: Phase) -> Turn:
        if phase.failures:
            return failed("phase_failed", f"clean failed: {fail_text(phase)}", list(phase.failures))
        inc = self.incident
        for rank, result in phase.results.items():
            # a faulty rank's clean may find what its fault damaged (an SDK host: a UCE
            # that hit memory holding nothing to copy back, SPEC 8)
            if rank in inc.faults and isinstance(result, CleanResult) and result.spared:
                inc.details.setdefault(rank, {})["target"] = "spared"
        if inc.awaiting:
            return Turn(PhaseEnd.AWAIT, Why("restarts", "waiting for restarted workers",
                                            tuple(sorted(inc.awaiting))))
        return done()

    def _start_rejoin(self, turn: Turn) -> None:
        """Recover: wait for the lost ranks' restarted processes to register."""
        inc = self.incident
        limit = self.host.config.effective_replacement_wait
        phase = Phase(Stage.REJOIN, -1, self.host.now() + limit, set(inc.awaiting))
        self.phase = phase
        log.info("waiting up to %gs for ranks %s to restart", limit, sorted(inc.awaiting))
        for rank in sorted(inc.awaiting & inc.unreplaceable.keys()):
            phase.pending.discard(rank)
            phase.failures[rank] = f"no replacement ({inc.unreplaceable[rank]})"
        if not phase.pending:
            self._phase_done()

    def _end_rejoin(self, phase: Phase) -> Turn:
        if phase.failures and self.host.planner.features.elastic:
            self.scaling.shrinking = set(phase.failures)
            return Turn(PhaseEnd.SHRINK, Why(
                "no_replacement", f"elastic training: no replacement for ranks "
                f"{sorted(phase.failures)} ({fail_text(phase)}); the job shrinks without "
                "their data-parallel replicas, from a dump", tuple(sorted(phase.failures))))
        if phase.failures:
            return failed("no_restart", f"restarted workers did not register: "
                          f"{fail_text(phase)}", list(phase.failures))
        return done()

    def _start_repair(self, turn: Turn) -> Turn | None:
        inc, host = self.incident, self.host
        host.sm.to(State.REPAIR, f"{inc.strategy} from {inc.source}")
        missing = [r for r in range(host.table.world_size)
                   if (row := host.table.get(r)) is None
                   or row.health not in (*CONNECTED, Health.DONE) and not left_before(inc, row)]
        if missing:
            return failed("ranks_gone", f"ranks {missing} are gone: nothing to repair them "
                          "into", missing)
        targets = [r.rank for r in host.table.connected()]
        try:
            payloads = host.planner.repair_payloads(inc, host.table, targets)
        except PlanError as e:
            return failed("plan", f"repair impossible: {e}")
        # a repair from the checkpoint replaces the ranks' state: no dump of the lock step
        # after it has begun (found by the simulator: tft-sim --seed 656 --world 8)
        self.reloaded = inc.source == "checkpoint"
        self.start_phase(Stage.REPAIR, targets, per_rank=payloads)
        return None

    def _end_repair(self, phase: Phase) -> Turn:
        if phase.failures:
            return failed("phase_failed", f"repair failed: {fail_text(phase)}",
                          list(phase.failures))
        return done()

    def _start_rollback(self, turn: Turn) -> Turn | None:
        repaired = self.ended
        assert repaired is not None
        try:
            payload = self.host.planner.rollback_payload(self.incident, repaired.results)
        except PlanError as e:
            return failed("plan", f"rollback impossible: {e}")
        targets = [r.rank for r in self.host.table.connected()]
        self.start_phase(Stage.ROLLBACK, targets, payload)
        return None

    def _end_rollback(self, phase: Phase) -> Turn:
        if phase.failures:
            return failed("phase_failed", f"rollback failed: {fail_text(phase)}",
                          list(phase.failures))
        inc = self.incident
        step = inc.rollback_step if inc.rollback_step is not None else inc.lock_step
        at = self.host.emit("repaired", CONTROLLER_RANK, strategy=str(inc.strategy),
                            lock_step=inc.lock_step, step=step, incident=inc.id)["time"]
        return done(at=at)

    def _resume(self, turn: Turn) -> None:
        """Training resumes at the lock step (or the rollback's step): NORMAL."""
        inc, host = self.incident, self.host
        false_alarm = turn.end is PhaseEnd.FALSE_ALARM
        self.resumed_at = turn.at
        step = inc.rollback_step if inc.rollback_step is not None else inc.lock_step
        payload = ResumeOrder(inc.id, step, str(inc.strategy or "none"), false_alarm,
                              tuple(inc.iterations[i] for i in sorted(inc.iterations) if i <= step))
        self.outcome = outcome_of(
            inc, self.resumed_at, "false_alarm" if false_alarm else "scaled_in" if self.scaling.shrinking is not None
            else "scaled_out" if self.scaling.growing is not None else "repaired",
            lost=0 if false_alarm else max(0, inc.lock_step - step))
        rows = host.table.connected()
        for row in rows:
            row.health = Health.ALIVE
            row.fresh = False
            row.step = step
            row.status = "updated"
            row.last_seen = host.now()
        host.send_action_many([r.rank for r in rows], host.new_action_id(), payload,
                              host.config.action_time_limit)
        host.sm.to(State.NORMAL, "false alarm" if false_alarm else f"repaired ({inc.strategy})")
        self._finish()

    def _repair_failed(self, turn: Turn) -> Turn:
        """The repair is abandoned: the `repair_failed` event, then the dump."""
        assert turn.why is not None
        log.error("incident %d: %s; falling back to dump", self.incident.id, turn.why.text)
        self.host.emit("repair_failed", CONTROLLER_RANK, **turn.why.fields(),
                       incident=self.incident.id)
        return done(turn.why)

    # -- EXIT ------------------------------------------------------------------------------
    def _exit(self, code: int, turn: Turn) -> None:
        """The job ends with `code` (DUMP first: EXIT follows it, SPEC 5)."""
        reason = turn.why.text if turn.why is not None else "exit"
        if self.host.sm.state is not State.DUMP:
            self.host.sm.to(State.DUMP, reason)
        self.end_job(code, reason)

    def end_job(self, code: int, reason: str) -> None:
        host = self.host
        self.phase = None
        if self.scaling.growing is not None:
            self.scaling.send_joining_away(reason)
        self.exit_code = code
        self.outcome = outcome_of(self.incident, self.resumed_at, "dumped"
                                  if code == host.config.dump_exit_code else "exited", lost=0)
        host.sm.to(State.EXIT, reason)
        self.host.emit("exit", CONTROLLER_RANK, code=code, reason=reason, incident=self.incident.id)
        (log.info if code == 0 else log.error)("exit with code %d: %s", code, reason)
        rows = host.table.connected()
        payload = ExitOrder(code, reason)
        # a hung rank's training thread, stuck, would not log before the exit
        waiting = [r.rank for r in rows if r.health is not Health.HUNG]
        if code == host.config.dump_exit_code and waiting and self.incident.lock_step is not None:
            # the dump holds the lock step: iterations up to it the stop cut off are logged
            # now, by one surviving rank (the logging rank may be the one that failed)
            inc = self.incident
            payload = ExitOrder(code, reason, tuple(inc.iterations[i] for i in sorted(
                inc.iterations) if i <= inc.lock_step), logger=max(waiting))
        host.send_action_many([r.rank for r in rows], host.new_action_id(), payload,
                              host.config.action_time_limit)
        for row in rows:
            row.health = Health.EXITING
        host.sm.to(State.FINAL, reason)
        self._finish()

    def _finish(self) -> None:
        self.done = True
        self.phase = None
        self.host.flow_finished(self)
