"""An incident's phases and their transitions, as a table; and the decisions that drive it.

An incident (`flow.IncidentFlow`) goes through stages. Most are phases: one order sent
to a set of ranks, ended when every one answered or its deadline passed (`HOLD`, `STOP`,
`CLEAN`, `REPAIR`, `ROLLBACK`, `DUMP`, `RENAME`, `SCALE_IN`, `SCALE_OUT`) or a wait for
restarted processes (`REJOIN`). The others end the incident or lead on at once: `RESUME`
(training resumes), `REPAIR_FAILED` (the repair is abandoned: the dump follows),
`EXIT_DUMPED` (the job ends with the dump code, the dump holds the lock step) and
`EXIT_FAILED` (the job ends with the failure code).

When a stage ends, its part of the flow returns a `Turn`: how it ended (`PhaseEnd`) and
why (`Why`: a code, the ranks it is about, the sentence events and logs carry). The stage
that comes next is `NEXT[(stage, end)]`, nothing else: a pair the table lacks is a bug of
the controller (`IllegalPhaseTransition`). docs/architecture.md draws this table
(tests/control/test_phases.py checks the drawing against it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Stage(str, Enum):
    """A stage of an incident (a phase's value is its order's name)."""

    HOLD = "hold"
    STOP = "stop"
    CLEAN = "clean"
    REJOIN = "rejoin"
    REPAIR = "repair"
    ROLLBACK = "rollback"
    DUMP = "dump"
    RENAME = "rename"
    SCALE_IN = "scale_in"
    SCALE_OUT = "scale_out"
    RESUME = "resume"
    REPAIR_FAILED = "repair_failed"
    EXIT_DUMPED = "exit_dumped"
    EXIT_FAILED = "exit_failed"

    def __str__(self) -> str:
        return self.value


class PhaseEnd(str, Enum):
    """How a stage ended."""

    #: it did what it was for (every rank answered, nothing failed)
    DONE = "done"
    #: a rank failed or did not answer, or the stage could not start
    FAILED = "failed"
    #: a fault arrived while it ran
    FAULT = "fault"
    #: the stop's decision: every fault was withdrawn
    FALSE_ALARM = "false_alarm"
    #: the stop's decision: a repair strategy (retry, recover)
    REPAIR = "repair"
    #: the stop's decision: the dump (no repair possible, or a scale-out's first step)
    DUMP = "dump"
    #: the stop's decision: nothing to repair or dump (lock step 0)
    EXIT = "exit"
    #: the clean: restarted processes are to be waited for
    AWAIT = "await"
    #: elastic training: the job shrinks without the lost ranks' replicas
    SHRINK = "shrink"
    #: elastic training: the job grows by returning ranks
    GROW = "grow"

    def __str__(self) -> str:
        return self.value


S, E = Stage, PhaseEnd
#: (stage, how it ended) -> the stage that follows
NEXT: dict[tuple[Stage, PhaseEnd], Stage] = {
    (S.HOLD, E.DONE): S.STOP,
    (S.STOP, E.REPAIR): S.CLEAN,
    (S.STOP, E.DUMP): S.DUMP,
    (S.STOP, E.EXIT): S.EXIT_FAILED,
    (S.STOP, E.FALSE_ALARM): S.RESUME,
    (S.CLEAN, E.DONE): S.REPAIR,
    (S.CLEAN, E.AWAIT): S.REJOIN,
    (S.CLEAN, E.FAILED): S.REPAIR_FAILED,
    (S.CLEAN, E.FAULT): S.REPAIR_FAILED,
    (S.REJOIN, E.DONE): S.REPAIR,
    (S.REJOIN, E.SHRINK): S.DUMP,
    (S.REJOIN, E.FAILED): S.REPAIR_FAILED,
    (S.REJOIN, E.FAULT): S.REPAIR_FAILED,
    (S.REPAIR, E.DONE): S.ROLLBACK,
    (S.REPAIR, E.FAILED): S.REPAIR_FAILED,
    (S.REPAIR, E.FAULT): S.REPAIR_FAILED,
    (S.ROLLBACK, E.DONE): S.RESUME,
    (S.ROLLBACK, E.FAILED): S.REPAIR_FAILED,
    (S.ROLLBACK, E.FAULT): S.REPAIR_FAILED,
    (S.REPAIR_FAILED, E.DONE): S.DUMP,
    (S.DUMP, E.DONE): S.RENAME,
    (S.DUMP, E.FAILED): S.EXIT_FAILED,
    (S.RENAME, E.DONE): S.EXIT_DUMPED,
    (S.RENAME, E.SHRINK): S.SCALE_IN,
    (S.RENAME, E.GROW): S.SCALE_OUT,
    (S.RENAME, E.FAILED): S.EXIT_FAILED,
    (S.SCALE_IN, E.DONE): S.RESUME,
    (S.SCALE_IN, E.FAILED): S.EXIT_DUMPED,
    (S.SCALE_IN, E.FAULT): S.EXIT_DUMPED,
    (S.SCALE_OUT, E.DONE): S.RESUME,
    (S.SCALE_OUT, E.FAILED): S.EXIT_DUMPED,
    (S.SCALE_OUT, E.FAULT): S.EXIT_DUMPED,
}
del S, E

#: the stages that end the incident
FINAL_STAGES = frozenset({Stage.RESUME, Stage.EXIT_DUMPED, Stage.EXIT_FAILED})


def diagram() -> str:
    """`NEXT` as a Mermaid state diagram (docs/architecture.md carries it; a test checks)."""
    lines = ["stateDiagram-v2"]
    lines += [f"    {stage.value} --> {after.value}: {end.value}"
              for (stage, end), after in NEXT.items()]
    lines += [f"    {stage.value} --> [*]" for stage in sorted(FINAL_STAGES, key=list(Stage).index)]
    return "\n".join(lines)


class IllegalPhaseTransition(RuntimeError):
    """A (stage, end) pair `NEXT` does not have: a bug of the controller."""


def next_stage(stage: Stage, end: PhaseEnd) -> Stage:
    """The stage that follows `stage` ended with `end` (`NEXT`)."""
    try:
        return NEXT[(stage, end)]
    except KeyError:
        raise IllegalPhaseTransition(f"{stage} ended {end}: no stage follows") from None


@dataclass(frozen=True)
class Why:
    """Why a decision was made: `code` (what kind of reason, for programs: the simulator,
    the metrics), `ranks` (the ranks it is about) and `text` (the sentence events and logs
    carry)."""

    code: str
    text: str
    ranks: tuple[int, ...] = ()

    def fields(self) -> dict[str, object]:
        """The reason as an event's fields: `reason` (the text), `why` (the code) and,
        when it names ranks, `ranks_of_reason`."""
        out: dict[str, object] = {"reason": self.text, "why": self.code}
        if self.ranks:
            out["ranks_of_reason"] = sorted(self.ranks)
        return out


@dataclass(frozen=True)
class Turn:
    """How a stage ended and why; `path`: the dump's folder (a rename's); `at`: the time of
    the event after which training resumes (a repair's or a scale change's)."""

    end: PhaseEnd
    why: Why | None = None
    path: str | None = None
    at: float | None = None


def done(why: Why | None = None, *, at: float | None = None) -> Turn:
    return Turn(PhaseEnd.DONE, why, at=at)


def failed(code: str, text: str, ranks: tuple[int, ...] | list[int] = ()) -> Turn:
    return Turn(PhaseEnd.FAILED, Why(code, text, tuple(sorted(ranks))))
