"""Step bookkeeping (SPEC 3): is this rank's optimizer data consistent, and at which step.

Around every optimizer update the trainer's update bracket reports "start updating" and
"end updating"; `UpdateStatus` records it: `Updating` inside the bracket (the state is being
modified in place and is not consistent), `Updated` outside it, with `step` = completed
updates (Megatron's `iteration`). The control plane reads it (via listeners) to pick the lock
step and the healthy holders of each shard.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass

from mindspeed_tft.training.hooks import TrainerHooks
from mindspeed_tft.training.state import TrainingState


class DataStatus(str, enum.Enum):
    """Whether a rank's optimizer data is consistent."""

    UPDATED = "Updated"
    UPDATING = "Updating"


@dataclass(frozen=True)
class StatusSnapshot:
    status: DataStatus
    step: int


Listener = Callable[[StatusSnapshot], None]


class UpdateStatus:
    """Thread-safe data status of this rank: read from the processor's threads."""

    def __init__(self, step: int = 0) -> None:
        self._lock = threading.Lock()
        self._status = DataStatus.UPDATED
        self._step = step
        self._depth = 0
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(snapshot)` on every change."""
        self._listeners.append(listener)

    def snapshot(self) -> StatusSnapshot:
        with self._lock:
            return StatusSnapshot(self._status, self._step)

    def reset(self, step: int) -> None:
        """Consistent at `step` (after a load or a rollback)."""
        with self._lock:
            self._status, self._step, self._depth = DataStatus.UPDATED, step, 0
            snap = StatusSnapshot(self._status, self._step)
        self._notify(snap)

    def start_updating(self, step: int) -> None:
        """The update of step `step` (completed updates before it) begins."""
        with self._lock:
            self._depth += 1
            self._status = DataStatus.UPDATING
            snap = StatusSnapshot(self._status, self._step)
        self._notify(snap)

    def end_updating(self, step: int) -> None:
        """The update of step `step` ended: `step + 1` updates are complete."""
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._status = DataStatus.UPDATED
                self._step = step + 1
            snap = StatusSnapshot(self._status, self._step)
        self._notify(snap)

    def _notify(self, snapshot: StatusSnapshot) -> None:
        for listener in self._listeners:
            listener(snapshot)


class StepBookkeeping(TrainerHooks):
    """Feeds the trainer's update bracket into an `UpdateStatus`."""

    def __init__(self, status: UpdateStatus) -> None:
        self.status = status

    def on_train_start(self, state: TrainingState) -> None:
        self.status.reset(state.iteration)

    def on_update_start(self, state: TrainingState, step: int) -> None:
        self.status.start_updating(step)

    def on_update_end(self, state: TrainingState, step: int) -> None:
        self.status.end_updating(step)
