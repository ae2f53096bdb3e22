"""The controller's state machine (SPEC 5) as an explicit transition table.

    INIT     -> NORMAL (all ranks registered) | FINAL (error)
    NORMAL   -> ABNORMAL (fault) | PAUSE | EXIT (training finished: every rank said bye)
    PAUSE    -> NORMAL | ABNORMAL
    ABNORMAL -> ENV_CLEAR (a repair strategy chosen) | DUMP (no repair possible) | NORMAL (false alarm)
    ENV_CLEAR-> REPAIR | DUMP
    REPAIR   -> NORMAL (repaired, rolled back, training resumes) | DUMP (repair failed)
    DUMP     -> EXIT | REPAIR (elastic training: the survivors reload the dump in a smaller world)
    EXIT     -> FINAL

NORMAL -> EXIT is this project's addition to SPEC 5: the way out when training ends without
a fault. Every transition is checked against `TRANSITIONS` and emits a `state` event
(SPEC 11); an illegal one raises `IllegalTransition` (a bug in the controller, never a
consequence of what a peer sent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol

from ...records import CONTROLLER_RANK

log = logging.getLogger("mindspeed_tft.control.states")


class State(str, Enum):
    INIT = "INIT"
    NORMAL = "NORMAL"
    PAUSE = "PAUSE"
    ABNORMAL = "ABNORMAL"
    ENV_CLEAR = "ENV_CLEAR"
    REPAIR = "REPAIR"
    DUMP = "DUMP"
    EXIT = "EXIT"
    FINAL = "FINAL"

    def __str__(self) -> str:
        return self.value


TRANSITIONS: dict[State, frozenset[State]] = {
    State.INIT: frozenset({State.NORMAL, State.FINAL}),
    State.NORMAL: frozenset({State.ABNORMAL, State.PAUSE, State.EXIT}),
    State.PAUSE: frozenset({State.NORMAL, State.ABNORMAL}),
    State.ABNORMAL: frozenset({State.ENV_CLEAR, State.DUMP, State.NORMAL}),
    State.ENV_CLEAR: frozenset({State.REPAIR, State.DUMP}),
    State.REPAIR: frozenset({State.NORMAL, State.DUMP}),
    State.DUMP: frozenset({State.EXIT, State.REPAIR}),
    State.EXIT: frozenset({State.FINAL}),
    State.FINAL: frozenset(),
}

#: states in which a fault starts (or joins) the handling of an incident
FAULT_STATES = frozenset({State.NORMAL, State.PAUSE})
#: states of an incident being handled
INCIDENT_STATES = frozenset({State.ABNORMAL, State.ENV_CLEAR, State.REPAIR, State.DUMP})


class EventSink(Protocol):
    """Where its `state` events go (the controller core's `outbox.Outbox.emit`: the shell
    writes them; `events.emit` writes them at once)."""

    def __call__(self, event: str, rank: int, **fields: Any) -> dict[str, Any]: ...


class IllegalTransition(RuntimeError):
    """A transition not in `TRANSITIONS`."""


class StateMachine:
    """Current state plus checked transitions; listeners run after each transition."""

    def __init__(self, sink: EventSink, initial: State = State.INIT, *,
                 emit_events: bool = True) -> None:
        self._state = initial
        #: where its `state` events go (the controller's core: its outbox)
        self._sink = sink
        self._emit = emit_events
        self.history: list[State] = [initial]
        self.listeners: list[Callable[[State, State, str], None]] = []
        if emit_events:
            self.announce()

    def announce(self, reason: str = "start") -> None:
        """Emit the current state as a `state` event (no transition)."""
        self._sink("state", CONTROLLER_RANK, state=self._state.value, prev=None, reason=reason)

    @property
    def state(self) -> State:
        return self._state

    @property
    def emit_events(self) -> bool:
        return self._emit

    @emit_events.setter
    def emit_events(self, value: bool) -> None:
        self._emit = value

    def can(self, new: State) -> bool:
        return new in TRANSITIONS[self._state]

    def to(self, new: State, reason: str = "") -> None:
        """Move to `new` (raises IllegalTransition when the table does not allow it)."""
        old = self._state
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(f"{old} -> {new} is not a transition of SPEC 5 ({reason})")
        self._state = new
        self.history.append(new)
        log.info("state %s -> %s (%s)", old, new, reason)
        if self._emit:
            self._sink("state", CONTROLLER_RANK, state=new.value, prev=old.value, reason=reason)
        for fn in self.listeners:
            fn(old, new, reason)

    def force(self, new: State, reason: str = "") -> None:
        """Set the state without a transition (a backup taking over a synced state)."""
        old = self._state
        self._state = new
        self.history.append(new)
        log.info("state set %s -> %s (%s)", old, new, reason)
        if self._emit:
            self._sink("state", CONTROLLER_RANK, state=new.value, prev=old.value, reason=reason)
        for fn in self.listeners:
            fn(old, new, reason)
