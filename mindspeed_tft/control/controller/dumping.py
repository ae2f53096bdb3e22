"""The dying-gasp checkpoint's stages of an incident (SPEC 7): dump, then rename.

`Dumping` is held by an `flow.IncidentFlow` (`flow.dumping`) and runs in the
controller's loop thread. When the flow's table leads to the dump (`phases.NEXT`: no repair,
a failed repair, a shrink or a grow), `start_dump` moves the controller to DUMP and orders
the holders chosen by the planner (`StrategyPlanner.dump_payloads`) to write the lock step;
`after_dump` takes their results; `start_rename` has one rank publish the dump;
`after_rename` says what follows: the exit with the dump code, or with elastic training the
shrink or the grow from the dump's folder. Each returns how its stage ended (`phases.Turn`);
none writes the flow's fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from ..wire.order_types import Payload
from ..wire.results import RenameResult
from .phases import PhaseEnd, Stage, Turn, Why, done, failed
from .ranktable import RankTable
from .scaling import PhaseResults, Scaling, fail_text
from .states import State, StateMachine
from .strategy import IncidentFacts, PlanError, StrategyPlanner


class DumpFlow(Protocol):
    """What `Dumping` reads of its incident flow, and how it starts a phase."""

    @property
    def incident(self) -> IncidentFacts: ...
    @property
    def reloaded(self) -> bool: ...
    @property
    def scaling(self) -> Scaling: ...
    def start_phase(self, name: Stage, targets: list[int], payload: Payload | None = None,
                    per_rank: Mapping[int, Payload] | None = None) -> None: ...


class DumpContext(Protocol):
    """The controller's state the dump reads (the flow's context)."""

    @property
    def table(self) -> RankTable: ...
    @property
    def planner(self) -> StrategyPlanner: ...
    @property
    def sm(self) -> StateMachine: ...
    def claim(self) -> str: ...


class Dumping:
    """The dump and rename stages of one incident (see the module docstring)."""

    def __init__(self, flow: DumpFlow, ctx: DumpContext) -> None:
        self.flow = flow
        self.ctx = ctx
        #: the ranks that write a shard of the dump (a failure of another does not count)
        self.writers: set[int] = set()
        #: the rank that publishes it (renames iter_X_tmp -> iter_X, updates the tracker)
        self.renamer: int | None = None

    def start_dump(self, turn: Turn) -> Turn | None:
        """DUMP: the holders write the lock step (None: sent; a Turn: it cannot be)."""
        inc, ctx = self.flow.incident, self.ctx
        reason = turn.why.text if turn.why is not None else "dump"
        ctx.sm.to(State.DUMP, reason)
        if self.flow.reloaded:  # what the ranks hold is the checkpoint's step, or part of it
            return failed("reloaded", f"{reason}; no dump: the ranks were reloading the last "
                          "checkpoint, they no longer hold the lock step")
        targets = [r.rank for r in ctx.table.connected() if not r.fresh]
        try:
            payloads, self.renamer = ctx.planner.dump_payloads(inc, ctx.table, targets)
        except PlanError as e:
            return failed("plan", f"dump impossible: {e}")
        payloads = {r: replace(p, claim=ctx.claim()) for r, p in payloads.items()}
        self.writers = {r for r, p in payloads.items() if p.shards}
        self.flow.start_phase(Stage.DUMP, targets, per_rank=payloads)
        return None

    def after_dump(self, phase: PhaseResults) -> Turn:
        failed_writers = {r: e for r, e in phase.failures.items() if r in self.writers}
        if failed_writers:
            text = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed_writers.items()))
            return failed("phase_failed", f"dump failed ({text})", list(failed_writers))
        return done()

    def start_rename(self, turn: Turn) -> None:
        assert self.renamer is not None
        self.flow.start_phase(Stage.RENAME, [self.renamer],
                              self.ctx.planner.rename_payload(self.flow.incident))

    def after_rename(self, phase: PhaseResults) -> Turn:
        if phase.failures:
            return failed("phase_failed", f"rename of the dump failed: {fail_text(phase)}",
                          list(phase.failures))
        where = next((res.path for res in phase.results.values()
                      if isinstance(res, RenameResult) and res.path), None)
        scaling = self.flow.scaling
        if scaling.shrinking is not None and where:
            return Turn(PhaseEnd.SHRINK, None, where)
        if scaling.growing is not None and where:
            return Turn(PhaseEnd.GROW, None, where)
        return done(Why("dumped", f"dying-gasp checkpoint saved at iteration "
                        f"{self.flow.incident.lock_step}" + (f" in {where}" if where else "")))
