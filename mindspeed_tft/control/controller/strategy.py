"""Strategy choice (SPEC 6) and the plans that go with it (SPEC 7, 8, 9).

`choose_strategy` maps the fault kinds of an incident and the enabled features to one
strategy:

| kind | strategy |
| --- | --- |
| uce, comm | retry if hbmfault-repair is on (load_checkpoint with no-replica), else dump |
| lost, hang | recover if worker-reboot is on (repairing from the checkpoint with no-replica), else dump |
| unknown | dump |
| normal | none (not a fault) |

Several kinds in one incident: the most conservative wins (dump > recover > load_checkpoint >
retry). A lock step of 0 (no optimizer update ever completed) means exit: nothing to repair
or dump.

`StrategyPlanner` builds the payload of every action the controller sends. The lead extends
it (subclass and pass to `Controller(planner=...)`) for richer UCE and ARF plans; the default
already picks dump holders per SPEC 7 and repair sources from the replica layout the ranks
registered: `{optimizer name: {dp_index, dp_size, replica_num, shard, holders}}` where
`holders` lists the global ranks holding the same shard in DP-index order (i, i + d/N, ...).
The planner reads an incident through `IncidentFacts` (`flow.Incident` is one), so this
module does not depend on the incident flow that uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Protocol

from ...features import Features
from ..wire.classify import FaultKind
from ..wire.order_types import (
    CleanOrder,
    DumpOrder,
    DumpShard,
    Receive,
    RenameOrder,
    RepairOrder,
    RollbackOrder,
    Send,
    StopOrder,
)
from ..wire.results import ActionResult, RepairResult
from .phases import Why
from .ranktable import CONNECTED, Health, RankInfo, RankTable


class Strategy(str, Enum):
    DUMP = "dump"
    RETRY = "retry"
    RECOVER = "recover"
    LOAD_CHECKPOINT = "load_checkpoint"
    EXIT = "exit"

    def __str__(self) -> str:
        return self.value


REPAIR_STRATEGIES = frozenset({Strategy.RETRY, Strategy.RECOVER, Strategy.LOAD_CHECKPOINT})
_SEVERITY = {Strategy.RETRY: 0, Strategy.LOAD_CHECKPOINT: 1, Strategy.RECOVER: 2,
             Strategy.DUMP: 3, Strategy.EXIT: 4}

#: kinds whose rank's training data cannot be trusted (never a dump holder or repair source).
#: An exception (unknown, comm) leaves the optimizer data intact: the rank stays a holder if
#: its data is Updated at the lock step (so with no replicas every rank dumps its own shard).
FAULTY_DATA_KINDS = frozenset({FaultKind.UCE, FaultKind.HANG, FaultKind.LOST})
#: UCE targets that leave the optimizer state and params intact: nothing to copy (SPEC 8);
#: `spared`: the framework's own check found nothing to repair (an SDK host's clean handler)
SPARED_TARGETS = frozenset({"grad", "activation", "spared"})
#: kinds whose rank's process is gone or must be restarted (ARF)
PROCESS_KINDS = frozenset({FaultKind.HANG, FaultKind.LOST})


def strategy_for(kind: FaultKind, features: Features) -> Strategy | None:
    """The SPEC 6 row for one fault kind (None for `normal`)."""
    if kind is FaultKind.NORMAL:
        return None
    if kind in (FaultKind.UCE, FaultKind.COMM):
        if features.hbm_repair:
            return Strategy.LOAD_CHECKPOINT if features.no_replica else Strategy.RETRY
        return Strategy.DUMP
    if kind in PROCESS_KINDS:
        return Strategy.RECOVER if features.worker_reboot else Strategy.DUMP
    return Strategy.DUMP


def choose_strategy(kinds: Iterable[FaultKind], features: Features) -> Strategy | None:
    """One strategy for all the faults of an incident (None: no fault at all)."""
    chosen: Strategy | None = None
    for kind in kinds:
        s = strategy_for(kind, features)
        if s is not None and (chosen is None or _SEVERITY[s] > _SEVERITY[chosen]):
            chosen = s
    return chosen


class IncidentFacts(Protocol):
    """What the planner knows of an incident (it writes `rollback_step` only)."""

    id: int
    faults: dict[int, FaultKind]
    details: dict[int, dict[str, Any]]
    strategy: Strategy | None
    lock_step: int
    source: str
    lost_steps: dict[int, int]
    new_ranks: set[int]
    rollback_step: int | None
    unreplaceable: dict[int, str]
    sent_away: set[int]


def left_before(incident: IncidentFacts, row: RankInfo) -> bool:
    """True when `row`'s rank is outside the job: it left in an earlier shrink (its process,
    back or not, waits to grow the job), or a grow this incident turned into sent it away;
    no part of this incident's repair or dump. A rank that came back during this incident,
    or that is one of its faults, is not."""
    if row.health is not Health.LEFT:
        return False
    return row.rank in incident.sent_away or (row.rank not in incident.faults
                                              and row.rank not in incident.unreplaceable)


@dataclass(frozen=True)
class StrategyDecision:
    """What the planner decided for an incident once every rank stopped, and why: the
    strategy (None: every fault was withdrawn, a false alarm), the lock step, where
    repaired state comes from, and `refusal`: why a recover became a dump at once."""

    strategy: Strategy | None
    lock_step: int
    source: str
    why: Why
    refusal: Why | None = None


class PlanError(RuntimeError):
    """A repair or dump that cannot be done (the message says why, naming the shard)."""


def _shards(row: RankInfo) -> list[tuple[str, int, tuple[int, ...]]]:
    """(optimizer, shard, holders) for each shard a rank holds; no layout: its own shard."""
    if not row.replica:
        return [("rank", row.rank, (row.rank,))]
    return [(name, int(info["shard"]), tuple(info["holders"]))
            for name, info in sorted(row.replica.items())]


class StrategyPlanner:
    """Chooses the strategy and builds every action's payload (override to extend)."""

    def __init__(self, features: Features) -> None:
        self.features = features

    # -- choice ---------------------------------------------------------------------
    def decide(self, incident: IncidentFacts, table: RankTable) -> StrategyDecision:
        """The lock step and the strategy, with the reason for it (`StrategyDecision`)."""
        lock_step = self.lock_step(incident, table)
        strategy = self.choose(incident)
        if strategy is None:
            return StrategyDecision(None, lock_step, incident.source,
                                    Why("false_alarm", "every fault was withdrawn"))
        faults = incident.faults
        why = Why("faults", "faults " + ", ".join(f"rank {r}: {k}" for r, k in
                                                    sorted(faults.items())), tuple(sorted(faults)))
        refusal = self._refusal(strategy, incident)
        if refusal is not None:
            strategy, why = Strategy.DUMP, refusal
        if lock_step == 0:
            strategy, refusal = Strategy.EXIT, None
            why = Why("lock_step_0", "no optimizer update completed yet (lock step 0): there "
                      "is nothing to repair or dump")
        return StrategyDecision(strategy, lock_step, self.repair_source(strategy, incident),
                                why, refusal)

    def _refusal(self, strategy: Strategy, incident: IncidentFacts) -> Why | None:
        """Why a recover would wait in vain, without elastic training (then the incident
        dumps at once): the launcher of a rank whose process is gone said it will not
        restart it (`no_replacement`). None: no such rank, or another strategy."""
        refused = {r: why for r, why in incident.unreplaceable.items()
                   if incident.faults.get(r) in PROCESS_KINDS}
        if strategy is not Strategy.RECOVER or not refused or self.features.elastic:
            return None
        return Why("no_replacement", "no replacement: " + "; ".join(
            f"rank {r}: {w}" for r, w in sorted(refused.items())), tuple(sorted(refused)))

    def choose(self, incident: IncidentFacts) -> Strategy | None:
        """One strategy for the incident. When a process is lost or hung, the communication
        errors of the other ranks are what its loss did to their collectives: they follow
        the process fault's strategy and do not count on their own."""
        kinds = list(incident.faults.values())
        if any(kind in PROCESS_KINDS for kind in kinds):
            kinds = [kind for kind in kinds if kind is not FaultKind.COMM]
        return choose_strategy(kinds, self.features)

    def repair_source(self, strategy: Strategy, incident: IncidentFacts | None = None) -> str:
        """Where repaired state comes from: replica holders or the last checkpoint (also
        when a report asks for the checkpoint: an SDK host's precision error or corrupted
        memory, detail `source`)."""
        asked = incident is not None and any(
            d.get("source") == "checkpoint" for d in incident.details.values())
        if self.features.no_replica or strategy is Strategy.LOAD_CHECKPOINT or asked:
            return "checkpoint"
        return "replica"

    def lock_step(self, incident: IncidentFacts, table: RankTable, *,
                  under_way: bool = False) -> int:
        """The highest step any rank reported (fresh, restarted processes excluded).

        under_way: the provisional lock step a stop carries, where a rank reported `updating`
        at step s counts as s + 1. A rank inside update s + 1 has passed every collective
        before it (gradient reduction, grad norm), so every other healthy rank has the inputs
        of that update too and may run it while the stop holds it. Then a rank whose own
        update failed half-way has healthy holders at s + 1, and the ranks that were inside
        the update when the stop came are not left alone ahead of their replicas (which,
        held before the update, could not source their shard at s + 1)."""
        steps = [r.step + (under_way and r.status == "updating") for r in table.all()
                 if not r.fresh and r.health is not Health.LEFT]
        steps += incident.lost_steps.values()  # last steps of processes that are gone
        return max(steps, default=0)

    def faulty(self, incident: IncidentFacts) -> set[int]:
        """Ranks whose data is not to be trusted (a UCE in grads or activations spares it)."""
        out = set()
        for r, k in incident.faults.items():
            if k not in FAULTY_DATA_KINDS:
                continue
            if k is FaultKind.UCE and incident.details.get(r, {}).get("target") in SPARED_TARGETS:
                continue
            out.add(r)
        return out

    def healthy_holder(self, row: RankInfo | None, lock_step: int, faulty: set[int]) -> bool:
        """SPEC 7: not faulty, connected, data Updated, step == lock step."""
        return (row is not None and row.rank not in faulty and row.health in CONNECTED
                and not row.fresh and row.status == "updated" and row.step == lock_step)

    # -- payloads ---------------------------------------------------------------------
    def stop_payload(self, incident: IncidentFacts, table: RankTable) -> StopOrder:
        """Stop orders carry the provisional lock step (`lock_step(under_way=True)`): a rank
        behind it may catch up."""
        return StopOrder(incident.id, self.lock_step(incident, table, under_way=True),
                         {r: k.value for r, k in incident.faults.items()})

    def clean_payload(self, incident: IncidentFacts) -> CleanOrder:
        return CleanOrder(incident.id, str(incident.strategy), incident.lock_step,
                          tuple(sorted(self.faulty(incident))))

    def repair_payloads(self, incident: IncidentFacts, table: RankTable,
                        targets: Iterable[int]) -> dict[int, RepairOrder]:
        """Per-rank repair orders: who receives which shard from whom (replica source),
        or everyone reloads the last checkpoint (checkpoint source)."""
        lock = incident.lock_step
        faulty = self.faulty(incident)
        base = RepairOrder(incident.id, str(incident.strategy), lock, incident.source,
                           tuple(sorted(faulty)), tuple(sorted(incident.new_ranks)))
        targets = list(targets)
        if incident.source == "checkpoint":
            return dict.fromkeys(targets, base)
        receive: dict[int, list[Receive]] = {r: [] for r in targets}
        send: dict[int, list[Send]] = {r: [] for r in targets}
        for r in targets:
            row = table.get(r)
            if row is None:
                continue
            needs = row.fresh or r in faulty or row.step != lock or row.status != "updated"
            if not needs:
                continue
            for name, shard, holders in _shards(row):
                src = next((h for h in holders if h != r
                            and self.healthy_holder(table.get(h), lock, faulty)), None)
                if src is None:
                    raise PlanError(
                        f"rank {r} needs {name} shard {shard} at step {lock} but no other "
                        f"holder is healthy ({self._describe(table, holders, faulty)})"
                    )
                receive[r].append(Receive(name, shard, src))
                if src in send:
                    send[src].append(Send(name, shard, r))
        # every rank that sends or receives, on every rank's order: an SDK host's handler
        # builds its repair group of them (`repair_info["rank_list"]`)
        involved = tuple(sorted(r for r in targets if receive[r] or send[r]))
        return {r: replace(base, receive=tuple(receive[r]), send=tuple(send[r]),
                           involved=involved) for r in targets}

    def rollback_payload(self, incident: IncidentFacts,
                         repair_results: Mapping[int, ActionResult]) -> RollbackOrder:
        """Everyone back to the lock step (or to the step a checkpoint load reported)."""
        step = incident.lock_step
        loaded = {res.step for res in repair_results.values()
                  if isinstance(res, RepairResult) and res.step is not None}
        if len(loaded) > 1:
            raise PlanError(f"ranks loaded different steps {sorted(loaded)}")
        if loaded:
            step = next(iter(loaded))
        incident.rollback_step = step
        return RollbackOrder(incident.id, step, str(incident.strategy),
                             tuple(sorted(self.params_damaged(incident))))

    def params_damaged(self, incident: IncidentFacts) -> set[int]:
        """Ranks whose model params cannot be trusted outside their own shard: every faulty
        rank but one whose UCE hit optimizer state only (its own shard's params are derived
        from the main params it receives)."""
        return {r for r in self.faulty(incident)
                if not (incident.faults[r] is FaultKind.UCE
                        and incident.details.get(r, {}).get("target") == "optimizer")}

    def dump_holders(self, incident: IncidentFacts, table: RankTable) -> dict[tuple[str, int, tuple[int, ...]], int]:
        """SPEC 7: for every shard the first healthy holder; PlanError names a shard without one."""
        lock = incident.lock_step
        faulty = self.faulty(incident)
        chosen: dict[tuple[str, int, tuple[int, ...]], int] = {}
        for row in table.all():
            # outside the job: no part of the dump (a member lost now whose restarted process
            # waits outside the shrunk job is: its shard must be in the dump)
            if left_before(incident, row):
                continue
            for key in _shards(row):
                if key in chosen:
                    continue
                name, shard, holders = key
                pick = next((h for h in holders if self.healthy_holder(table.get(h), lock, faulty)),
                            None)
                if pick is None:
                    raise PlanError(
                        f"no healthy holder for {name} shard {shard} at lock step {lock} "
                        f"(holders: {self._describe(table, holders, faulty)}): the dump would "
                        "be incomplete"
                    )
                chosen[key] = pick
        return chosen

    def dump_payloads(self, incident: IncidentFacts, table: RankTable,
                      targets: Iterable[int]) -> tuple[dict[int, DumpOrder], int]:
        """Per-rank dump orders and the rank that renames the finished dump."""
        chosen = self.dump_holders(incident, table)
        shards: dict[int, list[DumpShard]] = {r: [] for r in targets}
        for (name, shard, holders), rank in chosen.items():
            if rank in shards:
                shards[rank].append(DumpShard(name, shard, holders))
        writers = tuple(sorted({r for r in chosen.values()}))
        if not writers:
            raise PlanError("no rank can write the dump")
        # an SDK host's save handler is told its group's writers
        out = {r: DumpOrder(incident.id, incident.lock_step, tuple(mine), writers)
               for r, mine in shards.items()}
        return out, writers[0]

    @staticmethod
    def _describe(table: RankTable, ranks: Iterable[int], faulty: set[int]) -> str:
        parts = []
        for r in ranks:
            row = table.get(r)
            if row is None:
                parts.append(f"rank {r} never registered")
                continue
            bad = " faulty" if r in faulty else ""
            fresh = " restarted" if row.fresh else ""
            parts.append(f"rank {r} {row.health}{bad}{fresh} step {row.step} {row.status}")
        return ", ".join(parts)

    def rename_payload(self, incident: IncidentFacts) -> RenameOrder:
        return RenameOrder(incident.id, incident.lock_step)
