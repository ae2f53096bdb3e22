"""The outcome oracle: which ending a simulated job is owed, from its schedule alone.

A model of what the fault-tolerance features promise, written apart from the controller
(it imports nothing of `control.controller`: a bug shared by both would hide itself). From
the schedule (features, the DP x TP x PP layout, optimizer replicas, elastic training, each
node's launcher policy, the controllers' places) and the faults in the order they struck
(`owed(schedule, struck)`) it says the best ending the job is owed (`Ending`):

- REPAIRED: every fault repaired (retry from a replica, a reload of the checkpoint without
  replicas, a restarted worker given its shard): exit 0 after training every step;
- SHRUNK: elastic training without a replacement for a lost rank: the job goes on without
  that rank's data-parallel replica, exit 0 after training every step;
- DUMPED: the dying-gasp checkpoint of the lock step, exit 75;
- LOST: exit 1 (or 77): only when every copy of some optimizer shard is gone, damaged or
  behind the lock step, when both controllers are lost, or when a fault strikes the dump
  itself.

The faults are grouped into episodes (what one incident handles): faults of one step, or of
two adjacent steps, may meet in one incident; a fault at an order of a recovery joins its
incident (hold, stop: before the decision; clean, repair, rollback, scale-in: a cascading
fault, the incident falls back to its dump; dump, rename: the dump may fail; scale-out: the
grow ends the job with its dump). Where the model cannot tell (two adjacent-step faults in one
incident or two; a shrunk job grown back by a late replacement or not) it follows every case
and owes the worst of them.

The strategies (SPEC 6): a UCE or a communication error is repaired in place when HBM repair
is on (from a replica; from the checkpoint without replicas), a lost or hung process is
restarted and repaired when worker reboot is on, anything else (an unknown error, the features
off) is a dump. A rank's data is gone (its process), damaged (a UCE in the parameters or the
optimizer state) or behind the lock step (a fault at or inside the update of a step the others
completed); a shard is lost when no member of the job holds it intact at the lock step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from enum import IntEnum

from .schedule import Fault, Schedule

#: the launcher policies whose replacement comes while an incident waits for it
_IN_TIME = ("restart", "warm")
#: restarts a launcher grants a rank (`launcher.RESTART_BUDGET`, the launcher's own rule)
_BUDGET = 3
_STEP_POINTS = ("start", "allreduce", "update", "inside", "end")
#: losses the controller learns of only from a silence (no launcher reports them at once)
_UNSEEN = ("node", "launcher", "hang", "net")
_JOIN, _CASCADE, _DUMP, _GROW = ("hold", "stop"), ("clean", "repair", "rollback"), (
    "dump", "rename"), ("scale_out",)


#: what the controller is known to do worse than the features promise (each found by this
#: oracle; the model owes the worse ending there until the controller is changed)
GAPS = {
    "silent_at_the_end": "a rank silent past the heartbeat timeout while its peers finish "
                         "training is taken for lost; its finished peers hold nothing to dump "
                         "(exit 1 though every step was trained)",
    "early": "a fault before every rank registered ends the job (exit 1)",
    "writer_lost": "a process lost but not yet detected when the dump starts fails the "
                   "dump; the dump is not planned again with another holder (exit 1)",
}


class Ending(IntEnum):
    """How a job ends, worst first (a run may end better than owed, never worse)."""

    LOST = 0
    DUMPED = 1
    SHRUNK = 2
    REPAIRED = 3


@dataclass(frozen=True)
class Owed:
    """The ending a schedule owes and why (the episode that decided it)."""

    ending: Ending
    why: str


@dataclass
class _Episode:
    """Faults one incident may handle: those of a step (or two adjacent ones), and those at
    its orders (`role`: join, cascade, dump, scale_in, grow)."""

    step: int
    faults: list[Fault] = field(default_factory=list)
    later: list[tuple[str, Fault]] = field(default_factory=list)


@dataclass
class _Job:
    """One possible state of the job in the model."""

    world: tuple[int, ...]
    dp: int
    dead_launchers: frozenset[int] = frozenset()
    controllers: frozenset[int] = frozenset({0})
    restarts: Counter[int] = field(default_factory=Counter)
    shrunk: bool = False
    #: a late replacement may grow the job back (ranks that left, the world before)
    may_grow: tuple[int, ...] = ()
    #: ranks alive but silent (a cut link): no launcher replaces them
    silent: frozenset[int] = frozenset()
    #: the step every rank holds after a reload of the checkpoint (None: not known)
    at: int | None = None
    #: a loss that may go unseen until a dump has started
    unseen: bool = False
    ended: Ending | None = None
    why: str = ""


class _Model:
    def __init__(self, schedule: Schedule, early: list[Fault]) -> None:
        self.s = schedule
        self.early = {id(f) for f in early}
        #: the faults of the episode being judged
        self.current: list[Fault] = []
        self.lay = schedule.layout

    def node(self, rank: int) -> int:
        return rank // self.lay.ranks_per_node

    def policy(self, rank: int) -> str:
        policies = self.s.replacement or ("restart",)
        return policies[self.node(rank) % len(policies)]

    def shard(self, job: _Job, rank: int) -> tuple[int, int, int]:
        """(tp index, pp index, shard): the ranks with the same key hold the same shard."""
        lay, i = self.lay, job.world.index(rank)
        tp_i, dp_i, pp_i = i % lay.tp, (i // lay.tp) % job.dp, i // (lay.tp * job.dp)
        copies = max(n for n in range(1, min(lay.replicas, job.dp) + 1) if job.dp % n == 0)
        return tp_i, pp_i, dp_i % (job.dp // copies)

    def dp_index(self, job: _Job, rank: int) -> int:
        return (job.world.index(rank) // self.lay.tp) % job.dp

    def lost_shard(self, job: _Job, bad: set[int]) -> tuple[int, int, int] | None:
        """A shard no member holds intact at the lock step (None: every one is held)."""
        held = {self.shard(job, r) for r in job.world if r not in bad}
        return next((self.shard(job, r) for r in job.world if self.shard(job, r) not in held),
                    None)

    # -- one episode -----------------------------------------------------------------------
    def damage(self, job: _Job, faults: list[Fault]) -> tuple[dict[int, set[str]], set[int]]:
        """(rank -> the classes of its faults: uce, comm, unknown, process; the ranks whose
        data is unusable at the lock step)."""
        kinds: dict[int, set[str]] = {}
        bad: set[int] = set()
        for f in faults:
            if f.kind in ("node", "launcher"):
                ranks = [r for r in job.world if self.node(r) == f.target]
                job.dead_launchers = job.dead_launchers | {f.target}
                if self.lay.backup and f.target in (0, 1):
                    job.controllers = job.controllers - {f.target}
            elif f.target in job.world:
                ranks = [f.target]
            else:
                continue  # a rank outside the job: nothing of the job is lost
            for r in ranks:
                mine = kinds.setdefault(r, set())
                if f.kind in ("kill", "hang", "node", "launcher", "net"):
                    # a cut control link: the rank may miss an order or fall silent past the
                    # heartbeat timeout (taken for hung or lost, its process not restarted)
                    mine.add("process")
                    bad.add(r)
                    if f.kind == "net":
                        job.silent = job.silent | {r}
                    continue
                mine.add({"uce": "uce", "comm": "comm", "raise": "unknown"}[f.kind])
                if f.point == "stop" and f.kind != "uce":
                    mine.add("process")  # its stop raised: it could not be stopped (hung)
                    bad.add(r)
                # the others completed the step: at (or inside) its update, or at a hold or
                # stop that found it between the all-reduce and its update
                behind = f.point in ("update", "inside", "hold", "stop")
                if behind or f.kind == "uce" and f.detail in ("param", "optimizer"):
                    bad.add(r)
        return kinds, bad

    def strategy(self, kinds: dict[int, set[str]]) -> str:
        """SPEC 6: the most conservative of the faults' strategies; with a process lost or
        hung, the communication errors are what its loss did to its peers' collectives."""
        lay = self.lay
        every = set().union(*kinds.values()) if kinds else set()
        if "process" in every:
            every.discard("comm")
        order = {"retry": 0, "reload": 1, "recover": 2, "dump": 3}
        picked = "retry"
        for k in every:
            s = ("dump" if k == "unknown" else
                 ("reload" if lay.replicas == 1 else "retry") if k in ("uce", "comm")
                 and lay.hbm_repair else "recover" if k == "process" and lay.worker_reboot
                 else "dump")
            picked = max(picked, s, key=order.__getitem__)
        return picked

    def end(self, job: _Job, ending: Ending, why: str) -> _Job:
        job.ended, job.why = ending, why
        return job

    def dump(self, job: _Job, bad: set[int], why: str) -> _Job:
        if job.unseen:
            return self.end(job, Ending.LOST, f"{why}: {GAPS['writer_lost']}")
        if len(job.controllers) == 0:
            return self.end(job, Ending.LOST, f"{why}; no controller left")
        lost = self.lost_shard(job, bad)
        if lost is not None:
            return self.end(job, Ending.LOST, f"{why}; no intact copy of shard {lost}")
        return self.end(job, Ending.DUMPED, why)

    def episode(self, job: _Job, ep: _Episode) -> list[_Job]:
        """The job's possible states after one episode (ended, or training again)."""
        out = self.one_episode(job, ep)
        return out if isinstance(out, list) else [out]

    def one_episode(self, job: _Job, ep: _Episode) -> _Job | list[_Job]:
        """The job after one episode (several states where the model cannot tell)."""
        faults = ep.faults + [f for role, f in ep.later if role == "join"]
        job.unseen, self.current = False, faults
        kinds, bad = self.damage(job, faults)
        if any(id(f) in self.early for f in faults):
            return self.end(job, Ending.LOST, GAPS["early"])
        if not kinds and not ep.later:
            return job
        tag = f"faults {[(f.kind, f.target, f.point, f.step) for f in faults]}"
        if all(f.kind == "net" for f in faults) and not ep.later:
            return self.end(job, Ending.LOST, f"{tag}: {GAPS['silent_at_the_end']}")
        broken = [f for role, f in ep.later if role == "dump"]
        if broken:
            return self.end(job, Ending.LOST, f"{tag}; {broken[0].kind} at the "
                                              f"{broken[0].point}: the dump may fail")
        grow = [f for role, f in ep.later if role == "grow" and f.kind != "net"]
        if grow and job.may_grow:
            return self.end(job, Ending.DUMPED, f"{grow[0].kind} during the grow: the job "
                                                "ends with its dump")
        locks = [self.lock(f) for f in faults if f.point in _STEP_POINTS]
        if locks and max(locks) == 0:
            return self.end(job, Ending.LOST, f"{tag}: no update completed (lock step 0)")
        if job.at == 0 and all(f.point not in _STEP_POINTS for f in faults):
            return self.end(job, Ending.LOST, f"{tag}: reloaded to step 0, no update since")
        job.at = None
        if job.controllers != {0} and 0 not in job.controllers:  # a backup took charge
            return self.dump(job, bad, f"{tag}: the backup controller dumps")
        if len(job.controllers) == 0:
            return self.end(job, Ending.LOST, f"{tag}: no controller left")
        strategy = self.strategy(kinds)
        after = [(role, f) for role, f in ep.later if role != "join"]
        for role, f in after:
            if role == "grow" and (f.kind == "net" or f.target not in job.world):
                continue
            more, worse = self.damage(job, [f])
            if role in ("scale_in", "grow"):
                continue  # judged after the shrink below
            if strategy == "dump":
                continue
            what = f"{tag}; cascading {f.kind} at {f.point}"
            reloading = strategy == "reload" or strategy == "recover" and self.lay.replicas == 1
            if reloading and f.point in ("repair", "rollback"):
                return self.end(job, Ending.LOST, f"{what}: the ranks were reloading the "
                                                  "checkpoint, no dump of the lock step")
            if f.kind in _UNSEEN:
                return self.end(job, Ending.LOST, f"{what}: {GAPS['writer_lost']}")
            return self.dump(job, bad | worse, what)
        if not kinds:
            return job
        unseen = len(faults) > 1 and any(f.kind in _UNSEEN for f in faults)
        if unseen:  # the incident may be decided, its dump planned, before the loss is seen
            job.unseen = True
        if strategy == "dump":
            return self.dump(job, bad, f"{tag}: dump")
        if strategy == "reload":
            return self.reloaded(job, faults)
        if strategy == "retry":
            lost = self.lost_shard(job, bad)
            return job if lost is None else self.end(job, Ending.LOST,
                                                     f"{tag}: no copy of shard {lost}")
        return self.recover(job, [r for r, k in kinds.items() if "process" in k], bad, tag,
                            [f for role, f in after if role in ("scale_in", "grow")])

    @staticmethod
    def lock(f: Fault) -> int:
        """The lock step a fault at a step's point leaves (the others complete the update
        of a step a fault strikes at or inside)."""
        return f.step - (f.point in ("start", "allreduce"))

    def reloaded(self, job: _Job, faults: list[Fault]) -> _Job:
        """Every rank reloaded the last periodic checkpoint before the lock step."""
        lock = max((self.lock(f) for f in faults if f.point in _STEP_POINTS), default=None)
        job.at = None if lock is None else lock // self.lay.checkpoint_every * (
            self.lay.checkpoint_every)
        return job

    def recover(self, job: _Job, gone: list[int], bad: set[int], tag: str,
                during_scale: list[Fault]) -> _Job | list[_Job]:
        # in a shrunk job a lost rank's restarted process waits outside it: it shrinks again
        unreplaced = [r for r in gone if job.shrunk or r in job.silent
                      or self.node(r) in job.dead_launchers
                      or self.policy(r) not in _IN_TIME or job.restarts[r] >= _BUDGET]
        for r in gone:
            job.restarts[r] += 1
        if not unreplaced:
            if self.lay.replicas == 1:
                return self.reloaded(job, self.current)  # repaired from the checkpoint
            lost = self.lost_shard(job, bad)
            return job if lost is None else self.end(job, Ending.LOST,
                                                     f"{tag}: no copy of shard {lost}")
        if not self.lay.elastic:
            return self.dump(job, bad, f"{tag}: no replacement for {unreplaced}")
        return self.shrink(job, unreplaced, bad, tag, during_scale)

    def shrink(self, job: _Job, unreplaced: list[int], bad: set[int], tag: str,
               during_scale: list[Fault]) -> _Job | list[_Job]:
        dumped = self.dump(replace(job), bad, f"{tag}: the shrink's dump")
        if dumped.ended is Ending.LOST:
            return dumped
        lost_dp = {self.dp_index(job, r) for r in unreplaced}
        staying = [r for r in job.world if self.dp_index(job, r) not in lost_dp]
        # restarted ranks of the staying replicas: back in time for the shrink, or not
        others_gone = [r for r in staying if r in bad and r not in unreplaced]
        if not staying or 2 * len(staying) < len(job.world) or during_scale:
            return self.end(job, Ending.DUMPED, f"{tag}: no shrink, the dump")
        replicas = sorted({self.dp_index(job, r) for r in staying})
        size = next(n for n in range(len(replicas), 0, -1) if self.lay.micro_batches % n == 0)
        kept = set(replicas[:size])
        world = tuple(r for r in job.world if self.dp_index(job, r) in kept)
        late = tuple(r for r in unreplaced if self.node(r) not in job.dead_launchers
                     and self.policy(r) == "late")
        shrunk = replace(job, world=world, dp=size, shrunk=True,
                         may_grow=job.world if late else ())
        if others_gone:
            return [shrunk, self.end(replace(job), Ending.DUMPED,
                                     f"{tag}: ranks {others_gone} not back for the shrink")]
        return shrunk

    # -- the whole schedule ----------------------------------------------------------------
    def run(self, struck: list[Fault]) -> Owed:
        lay = self.lay
        broken = [f for f in struck if f.point in _DUMP]
        if broken:  # whichever dump it struck may fail: nothing is owed
            return Owed(Ending.LOST, f"{broken[0].kind} at a {broken[0].point}: the dump may "
                                     "fail")
        first = _Job(tuple(range(lay.world)), lay.dp,
                     controllers=frozenset({0, 1}) if lay.backup else frozenset({0}))
        jobs = [first]
        for ep_choices in self.episodes(struck):
            nxt: list[_Job] = []
            for job in jobs:
                for eps in ([[]] if job.ended is not None else ep_choices):
                    outs = [job]
                    for ep in eps:
                        outs = [o for out in outs for o in self.then(out, ep)]
                    nxt += outs
            jobs = nxt
        worst = min(jobs, key=lambda j: (
            Ending.REPAIRED if j.ended is None and not j.shrunk and not j.may_grow
            else Ending.SHRUNK if j.ended is None else j.ended))
        if worst.ended is not None:
            return Owed(worst.ended, worst.why)
        if worst.shrunk or worst.may_grow:
            return Owed(Ending.SHRUNK, "shrunk, trains on")
        return Owed(Ending.REPAIRED, "every fault repaired")

    def then(self, job: _Job, ep: _Episode) -> list[_Job]:
        """The job's possible states after `ep` (a shrunk job may have grown back first)."""
        if job.ended is not None:
            return [job]
        states = [job]
        if job.may_grow:  # grown back by the late replacement, or not yet
            states.append(replace(job, world=job.may_grow, dp=self.lay.dp, may_grow=()))
        return [o for state in states
                for o in self.episode(replace(state, restarts=Counter(state.restarts)), ep)]

    def episodes(self, struck: list[Fault]) -> list[list[list[_Episode]]]:
        """Per group of faults: its possible splits into episodes (one incident, or two for
        faults of adjacent steps)."""
        groups: list[_Episode] = []
        for f in struck:
            if f.point in (*_STEP_POINTS, "resume"):
                step = f.step if f.point != "resume" else 10**6 + len(groups)
                if groups and abs(groups[-1].step - step) <= 1 and groups[-1].faults:
                    groups[-1].faults.append(f)
                    groups[-1].step = max(groups[-1].step, step)
                else:
                    groups.append(_Episode(step, [f]))
                continue
            role = ("join" if f.point in _JOIN else "cascade" if f.point in _CASCADE else
                    "dump" if f.point in _DUMP else "grow" if f.point in _GROW else "scale_in")
            if not groups or f.incident > len(groups) and len(groups[-1].faults) < 2:
                groups.append(_Episode(10**6 + len(groups)))  # a later incident: a grow's
            if role == "join" and f.kind == "hang" and f.target in {
                    g.target for g in groups[-1].faults}:
                # it waits in the fault handler: it hangs once the decision lets it train
                groups.append(_Episode(10**6 + len(groups), [f]))
                continue
            if role == "join" and f.kind == "hang":  # seen in this incident, or after it
                groups[-1].faults.append(f)
                continue
            groups[min(f.incident, len(groups)) - 1].later.append((role, f))
        out = []
        for g in groups:
            choices = []
            n = len(g.faults)
            for cuts in range(2 ** max(0, n - 1)):  # every split into consecutive episodes
                parts, start = [], 0
                for i in range(1, n + 1):
                    if i == n or cuts >> (i - 1) & 1:
                        parts.append(_Episode(g.step, g.faults[start:i]))
                        start = i
                if not parts:
                    parts = [_Episode(g.step)]
                parts[-1].later = g.later
                choices.append(parts)
            out.append(choices)
        return out


def owed(schedule: Schedule, struck: list[Fault], early: list[Fault] | None = None) -> Owed:
    """The ending `schedule` owes, its faults having struck in the order `struck` (`early`:
    those that struck before every rank had registered)."""
    return _Model(schedule, early or []).run(struck)


def ending_of(exit_code: int | None, shrank: bool, dump_code: int = 75) -> Ending:
    """The ending a run reached: its exit code, and whether it ended smaller than it began."""
    if exit_code == 0:
        return Ending.SHRUNK if shrank else Ending.REPAIRED
    return Ending.DUMPED if exit_code == dump_code else Ending.LOST
