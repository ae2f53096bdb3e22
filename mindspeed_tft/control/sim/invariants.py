"""Every check of a simulated run, in one place: the protocol's invariants and the owed ending.

The simulated job hands `Checker` what happens, as typed facts: the controller's events
(read once, by `Event.of`, the one adapter from an event record), the orders a rank reads,
what a rank's callback used (a repair's source, a rollback's or a dump's own state: the
truth of the trainer model), a published dump and the shards written into it, the faults as
they strike, the passing of virtual time and the run's end. Each invariant is one method;
the first failure ends the run and is classified (`Violation.kind`):

- correctness: a decision the protocol forbids (docs/design.md, "The protocol's contract"),
  or a run that ends with less state than its schedule owes (`oracle`: it lost what a dump
  could have saved, or published a dump that lacks a shard);
- liveness: no progress once the faults stop. As in TigerBeetle's simulator: after the
  schedule's last fault has struck, nothing more is injected and the network heals (every
  cut link reconnects); from then the controller must be FINAL within `PROGRESS_BOUND`
  virtual seconds (plus the steps left to train), and the run must reach the ending it is
  owed (a run that stops training where a repair or a shrink was owed);
- crash: the controller's core, or a rank's processor cores, raised.

To add an invariant: a method here that reads the facts a hook is given (or give it more), a
call to it from that hook, and a line in the contract of docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .oracle import Ending, Owed

#: virtual seconds from the heal to FINAL: twelve action time limits, the replacement wait
#: and four heartbeat timeouts at the simulator's settings (`job.sim_config`), with margin
PROGRESS_BOUND = 100.0


class Kind(str, Enum):
    """What kind of failure a violation is."""

    CORRECTNESS = "correctness"
    LIVENESS = "liveness"
    CRASH = "crash"


class Violation(AssertionError):
    """A check failed: its kind and what (its text starts with the kind)."""

    def __init__(self, kind: Kind, what: str) -> None:
        super().__init__(f"{kind.value}: {what}")
        self.kind = kind


@dataclass(frozen=True)
class Event:
    """A controller event, typed (the only reader of event records' keys)."""

    name: str
    incident: int | None = None
    strategy: str | None = None
    lock_step: int | None = None
    dp_size: int | None = None
    ranks: tuple[int, ...] = ()
    code: int | None = None
    state: str | None = None
    #: a repair abandoned because ranks are gone (`repair_failed`, why `ranks_gone`): which
    gone: tuple[int, ...] = ()
    reason: str = ""

    @classmethod
    def of(cls, e: dict[str, Any]) -> Event:
        def num(key: str) -> int | None:
            v = e.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        return cls(e["event"], num("incident"), e.get("strategy"), num("lock_step"),
                   num("dp_size"), tuple(e.get("ranks") or ()), num("code"), e.get("state"),
                   tuple(e.get("ranks_of_reason") or ()) if e.get("why") == "ranks_gone" else (),
                   str(e.get("reason", "")))


#: an incident's events that end it (with `strategy` none: a false alarm)
_ENDINGS = ("repaired", "scale_in", "scale_out", "exit")


@dataclass
class _Incident:
    endings: list[str] = field(default_factory=list)
    resume_steps: set[int] = field(default_factory=set)
    lock_step: int | None = None


@dataclass(frozen=True)
class RankTruth:
    """What a simulated rank truly is at a moment (the trainer model's state)."""

    rank: int
    alive: bool
    member: bool
    registered: bool
    #: a restarted process that holds no training state yet
    fresh: bool
    step: int


class Checker:
    """The checks of one run (see the module docstring)."""

    def __init__(self, world: int, batch: int, dump_code: int, steps: int) -> None:
        self.world = world
        #: the global batch in micro-batches (a DP size after a shrink divides it)
        self.batch = batch
        self.dump_code = dump_code
        self.steps = steps
        self.incidents: dict[tuple[int, int], _Incident] = {}
        #: the epoch of the controller whose events came last
        self.epoch = 0
        #: every controller is gone (both of their nodes lost): the ranks give up
        self.orphaned = False
        self.exits = 0
        self.broadcasts: dict[int, tuple[str, Any]] = {}
        self.published: dict[tuple[int, int], int] = {}
        #: per dump (epoch, incident): the (group, shard) keys written into it
        self.written: dict[tuple[int, int], set[tuple[int, int]]] = {}
        #: when the last fault struck (0: none yet); FINAL is due `bound` seconds later
        self.healed_at = 0.0
        self.bound = PROGRESS_BOUND + 2.0 * steps
        self.deadline_at = self.bound
        self.final = False
        self.failure: str | None = None

    def fail(self, kind: Kind, what: str) -> None:
        v = Violation(kind, what)
        if self.failure is None:
            self.failure = str(v)
        raise v

    # -- the controller's events --------------------------------------------------------------
    def on_event(self, ev: Event, epoch: int, max_completed: int,
                 live_steps: list[int]) -> None:
        """An event of the controller of `epoch` (a backup that took charge numbers its
        incidents from 1 again: an incident is its epoch's); `max_completed`: the highest
        step any rank completed; `live_steps`: the steps of the job's live, not restarted
        ranks."""
        self.epoch = epoch
        key = (epoch, ev.incident) if ev.incident is not None else None
        if ev.name in ("fault_detected", "scale_out_started") and key is not None:
            self.incidents.setdefault(key, _Incident())
        inc = self.incidents.get(key) if key is not None else None
        if ev.name == "exit":
            self.exits += 1
            if self.exits > 1:
                self.fail(Kind.CORRECTNESS, f"the job's exit was published {self.exits} times")
            if ev.code == self.dump_code and not self.published:
                self.fail(Kind.CORRECTNESS, "exit with the dump code but no dump was published")
        if ev.name == "strategy" and ev.strategy != "exit":
            self.lock_step_completed(ev, max_completed)
            self.nothing_lost(ev, live_steps)
        if ev.name == "strategy" and inc is not None:
            inc.lock_step = ev.lock_step
            if ev.strategy == "none":
                self.ends(key, inc, "false_alarm")
        if ev.name in _ENDINGS and inc is not None:
            self.ends(key, inc, ev.name)
        if ev.name == "scale_in":
            self.dp_divides_batch(ev)
        if ev.name == "state" and ev.state == "FINAL":
            self.final = True

    def ends(self, key: Any, inc: _Incident, how: str) -> None:
        """Every incident ends once: a repair, a shrink or grow, a false alarm, or an exit."""
        inc.endings.append(how)
        if len(inc.endings) > 1:
            self.fail(Kind.CORRECTNESS, f"incident {key} ended {len(inc.endings)} times: "
                                        f"{inc.endings}")

    def lock_step_completed(self, ev: Event, max_completed: int) -> None:
        """The lock step is a step some rank completed (the ranks' truth)."""
        if ev.strategy != "none" and (ev.lock_step or 0) > max_completed:
            self.fail(Kind.CORRECTNESS, f"lock step {ev.lock_step} chosen, but no rank "
                                        f"completed a step beyond {max_completed}")

    def nothing_lost(self, ev: Event, live_steps: list[int]) -> None:
        """No fault loses more than the step in flight: the lock step is at least the highest
        step a live rank of the job completed (a rank's last step before it died may be newer
        than the controller could know)."""
        if live_steps and (ev.lock_step or 0) < max(live_steps):
            self.fail(Kind.CORRECTNESS, f"lock step {ev.lock_step} below step "
                                        f"{max(live_steps)}, which live ranks completed: "
                                        "iterations beyond the one in flight lost")

    def dp_divides_batch(self, ev: Event) -> None:
        """After a shrink the DP size divides the global batch."""
        dp = ev.dp_size
        if dp is None or dp < 1 or self.batch % dp:
            self.fail(Kind.CORRECTNESS, f"shrunk to DP {dp}, which does not divide the batch "
                                        f"{self.batch}")

    def gone_for_real(self, ev: Event, truths: dict[int, RankTruth]) -> None:
        """A repair abandoned because ranks are gone names ranks of the job whose process is
        gone (not one outside the job, nor one registered again from a live process)."""
        for rank in ev.gone:
            t = truths.get(rank)
            if t is None or not t.member or t.alive and t.registered:
                where = "outside the job" if t is None or not t.member else "registered again"
                self.fail(Kind.CORRECTNESS, f"repair abandoned for rank {rank} as gone, but "
                                            f"it is {where}: {ev.reason}")

    # -- orders -----------------------------------------------------------------------------
    def on_order(self, rank: int, name: str, wire: dict[str, Any], action_id: int,
                 members: set[int], seen: bool) -> None:
        """A rank reads an order (`seen`: its processor saw that action id before)."""
        if seen:
            self.fail(Kind.CORRECTNESS, f"rank {rank} dropped order {name} as a repeat of "
                                        f"action {action_id}: an action id was reused")
        self.inside_the_job(rank, name, members)
        self.same_decision(rank, name, wire, action_id)

    def inside_the_job(self, rank: int, name: str, members: set[int]) -> None:
        """No order but exit and scale-out goes to a rank outside the job."""
        if not 0 <= rank < self.world or (rank not in members
                                          and name not in ("exit", "scale_out")):
            self.fail(Kind.CORRECTNESS, f"order {name} sent to rank {rank}, outside the job "
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
            self.fail(Kind.CORRECTNESS, f"action {action_id}: rank {rank} got {name} {wire}, "
                                        f"another rank {seen[0]} {seen[1]}")
        inc = self.incidents.get((self.epoch, wire.get("incident", -1)))
        if name == "resume" and inc is not None and not wire.get("false_alarm"):
            inc.resume_steps.add(wire["step"])
            if len(inc.resume_steps) > 1:
                self.fail(Kind.CORRECTNESS, f"incident resumed at different steps "
                                            f"{inc.resume_steps}")

    def undecodable(self, rank: int, error: Exception) -> None:
        """Every frame a rank reads decodes."""
        self.fail(Kind.CORRECTNESS, f"rank {rank} got an undecodable frame: {error}")

    # -- what the ranks did with their state ------------------------------------------------
    def resumed_at(self, rank: int, held: int | None, step: int, false_alarm: bool) -> None:
        """A rank resumes training at the step of the decision, holding it."""
        if step >= 0 and held != step:
            self.fail(Kind.CORRECTNESS, f"rank {rank} resumes at step {step} holding {held}"
                      + (" (false alarm)" if false_alarm else ""))

    def state_used(self, rank: int, what: str, source: int, held: int | None, intact: bool,
                   step: int, known_bad: bool) -> None:
        """No rank is repaired from, rolled back to or dumped from a step its source does
        not hold, nor from memory the controller knew damaged (`known_bad`) when it sent the
        order (a transfer from a dead process, or damage the controller did not know of,
        fails the order instead: the caller raises)."""
        gone = held is None and not intact
        if (held != step and not gone) or (not intact and known_bad):
            self.fail(Kind.CORRECTNESS, f"rank {rank}: {what} rank {source} at step {step}, "
                                        f"which holds {held} "
                                        f"({'intact' if intact else 'damaged or gone'})")

    def dump_written(self, epoch: int, incident: int, keys: set[tuple[int, int]]) -> None:
        self.written.setdefault((epoch, incident), set()).update(keys)

    def dump_published(self, epoch: int, incident: int, lock_step: int,
                       shards: set[tuple[int, int]]) -> None:
        """A dump is published once per incident, of its incident's lock step, holding every
        (group, shard) of the job (`shards`)."""
        key = (epoch, incident)
        n = self.published[key] = self.published.get(key, 0) + 1
        if n > 1:
            self.fail(Kind.CORRECTNESS, f"incident {incident}: the dump was published {n} "
                                        "times")
        inc = self.incidents.get(key)
        if inc is not None and inc.lock_step is not None and inc.lock_step != lock_step:
            self.fail(Kind.CORRECTNESS, f"incident {incident}: the dump of step {lock_step} "
                                        f"published, its lock step is {inc.lock_step}")
        missing = shards - self.written.get(key, set())
        if missing:
            self.fail(Kind.CORRECTNESS, f"incident {incident}: the dump of step {lock_step} "
                                        f"published without (group, shard) {sorted(missing)}")

    # -- faults and time ----------------------------------------------------------------------
    def struck(self, now: float) -> None:
        """A fault struck: the progress bound counts from the last one."""
        self.healed_at = now
        self.deadline_at = now + self.bound

    def no_progress(self, now: float, state: str) -> None:
        """Liveness: FINAL within the bound of the heal."""
        if not self.final and now >= self.deadline_at:
            self.fail(Kind.LIVENESS, f"not FINAL {now - self.healed_at:.0f}s after the last "
                                     f"fault (bound {self.bound:g}s, state {state})")

    def crashed(self, where: str, error: Exception) -> None:
        self.fail(Kind.CRASH, f"{where} raised {type(error).__name__}: {error}")

    # -- the end ------------------------------------------------------------------------------
    def judge(self, owed: Owed, got: Ending, truths: dict[int, RankTruth]) -> None:
        """The run ends no worse than its schedule owes; an exit 0 has trained every step
        on every rank of the job."""
        if got < owed.ending:
            kind = Kind.CORRECTNESS if got is Ending.LOST else Kind.LIVENESS
            self.fail(kind, f"ended {got.name}, owed {owed.ending.name} ({owed.why})")
        if got in (Ending.REPAIRED, Ending.SHRUNK):
            short = sorted(t.rank for t in truths.values() if t.member and t.step != self.steps)
            if short:
                self.fail(Kind.CORRECTNESS, f"exit 0, but ranks {short} of the job did not "
                                            f"train all {self.steps} steps")
