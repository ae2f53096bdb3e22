"""The protocol's invariants, checked after every event of a simulated run.

`Checker` sees every event the controller's core writes (`on_event`), every order a rank
reads (`on_order`) and the passing of time (`on_time`); the simulated ranks add what only
the truth of their state can tell (`violation`: a repair from, a rollback to or a dump of a
step a rank does not hold). Each invariant is one method; the first violation ends the run
and names it. docs/design.md ("The protocol's contract") states them.

To add one: write a method here that reads what `on_event` / `on_order` keep (or keep more),
call it from the hook where its facts change, give it a name in `violation(...)`'s text, and
add a line to the contract in docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: an incident's events that end it (with `strategy` none: a false alarm)
_ENDINGS = ("repaired", "scale_in", "scale_out", "exit")


@dataclass
class _Incident:
    opened: float
    endings: list[str] = field(default_factory=list)
    lock_steps: set[int] = field(default_factory=set)
    resume_steps: set[int] = field(default_factory=set)
    published: int = 0


class Violation(AssertionError):
    """An invariant does not hold (the message names it)."""


class Checker:
    """Invariants of one run (see the module docstring)."""

    def __init__(self, world: int, bound: float, batch: int) -> None:
        self.world = world
        #: the global batch in micro-batches (a DP size after a shrink divides it)
        self.batch = batch
        #: virtual seconds within which every incident must end
        self.bound = bound
        self.incidents: dict[tuple[int, int], _Incident] = {}
        #: the epoch of the controller whose events came last
        self.epoch = 0
        #: every controller is gone (both of their nodes lost): no incident can end
        self.orphaned = False
        self.exits = 0
        self.broadcasts: dict[int, tuple[str, Any]] = {}
        self.failure: str | None = None

    def violation(self, what: str) -> None:
        if self.failure is None:
            self.failure = what
        raise Violation(what)

    # -- events -----------------------------------------------------------------------------
    def on_event(self, e: dict[str, Any], now: float, max_completed: int,
                 epoch: int = 0) -> None:
        """An event of the controller of `epoch` (a backup that took charge numbers its
        incidents from 1 again: an incident is its epoch's)."""
        self.epoch = epoch
        name = e["event"]
        raw = e.get("incident")
        inc_id = (epoch, raw) if isinstance(raw, int) else None
        if name in ("fault_detected", "scale_out_started") and inc_id is not None:
            self.incidents.setdefault(inc_id, _Incident(now))
        inc = self.incidents.get(inc_id) if inc_id is not None else None
        if name == "exit":
            self.exits += 1
            if self.exits > 1:
                self.violation(f"the job's exit was published {self.exits} times")
        if name == "strategy" and inc is not None:
            self.lock_step_completed(e, max_completed)
            if e["strategy"] == "none":
                self.ends(inc_id, inc, "false_alarm")
        if name in _ENDINGS and inc is not None:
            self.ends(inc_id, inc, name)
        if name == "scale_in":
            self.dp_divides_batch(e)

    def ends(self, inc_id: Any, inc: _Incident, how: str) -> None:
        """Every incident ends once: a repair, a shrink or grow, a false alarm, or an exit."""
        inc.endings.append(how)
        if len(inc.endings) > 1:
            self.violation(f"incident {inc_id} ended {len(inc.endings)} times: {inc.endings}")

    def lock_step_completed(self, e: dict[str, Any], max_completed: int) -> None:
        """The lock step is a step some rank completed (the ranks' truth)."""
        if e["strategy"] not in ("none", "exit") and e["lock_step"] > max_completed:
            self.violation(f"lock step {e['lock_step']} chosen, but no rank completed a step "
                           f"beyond {max_completed}")

    def dp_divides_batch(self, e: dict[str, Any]) -> None:
        """After a shrink the DP size divides the global batch."""
        dp = e.get("dp_size")
        if not isinstance(dp, int) or dp < 1 or self.batch % dp:
            self.violation(f"shrunk to DP {dp}, which does not divide the batch {self.batch}")

    # -- orders -----------------------------------------------------------------------------
    def on_order(self, rank: int, name: str, wire: dict[str, Any], action_id: int,
                 members: set[int]) -> None:
        self.inside_the_job(rank, name, members)
        self.same_decision(rank, name, wire, action_id)

    def inside_the_job(self, rank: int, name: str, members: set[int]) -> None:
        """No order but exit and scale-out goes to a rank outside the job."""
        if not 0 <= rank < self.world or (rank not in members
                                          and name not in ("exit", "scale_out")):
            self.violation(f"order {name} sent to rank {rank}, outside the job "
                           f"(members {sorted(members)})")

    def same_decision(self, rank: int, name: str, wire: dict[str, Any],
                      action_id: int) -> None:
        """Every rank of one action gets the same stop lock step, clean, rollback and
        resume; every resume of one incident names the same step."""
        if name not in ("stop", "clean", "rollback", "resume"):
            return
        key = (name, wire)
        seen = self.broadcasts.setdefault(action_id, key)
        if seen != key:
            self.violation(f"action {action_id}: rank {rank} got {name} {wire}, another rank "
                           f"{seen[0]} {seen[1]}")
        inc = self.incidents.get((self.epoch, wire.get("incident", -1)))
        if name == "resume" and inc is not None and not wire.get("false_alarm"):
            inc.resume_steps.add(wire["step"])
            if len(inc.resume_steps) > 1:
                self.violation(f"incident resumed at different steps {inc.resume_steps}")

    def resumed_at(self, rank: int, held: int | None, step: int, false_alarm: bool) -> None:
        """A rank resumes training at the step of the decision, holding it."""
        if step >= 0 and held != step:
            self.violation(f"rank {rank} resumes at step {step} holding {held}"
                           + (" (false alarm)" if false_alarm else ""))

    # -- time -------------------------------------------------------------------------------
    def on_time(self, now: float) -> None:
        """Every incident ends within the bound (while a controller is left)."""
        if self.orphaned:
            return
        for inc_id, inc in self.incidents.items():
            if not inc.endings and now - inc.opened > self.bound:
                self.violation(f"incident {inc_id} open for {now - inc.opened:.1f}s "
                               f"(bound {self.bound:g}s)")
