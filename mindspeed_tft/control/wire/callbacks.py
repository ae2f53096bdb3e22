"""The recovery callbacks: one typed Protocol for what a rank does when it is ordered to.

The processor runs the controller's orders; what an order does to the training state is not
its business but the host's: the plugin's `recovery.actions.RecoveryActions`, the
`mindio_ttp` shim's `SdkActions`. Both implement `RecoveryCallbacks`, one method per order
that has a callback, taking the typed order (`order_types`) and returning the typed result
(`results`). `run_callback` dispatches an order to its method by the order's type: no name
of a method is kept anywhere or looked up.

Every method of the Protocol is abstract, and a host names the Protocol as its base: a
host that leaves one out cannot be built (mypy: "Cannot instantiate abstract class";
Python: TypeError), so a forgotten `repair` is never a silent success. A host with nothing
to do for an order says so in that method's own body; nothing is inherited.

`NoRecovery` is the host that does nothing (every order succeeds without touching
anything): the processor's default before a host registers, and tests' base.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from .config import ControlConfig
from .order_types import (
    CleanOrder,
    DumpOrder,
    ExitOrder,
    HoldOrder,
    PauseOrder,
    RenameOrder,
    RepairOrder,
    ResumeOrder,
    RollbackOrder,
    ScaleInOrder,
    ScaleOutOrder,
    StopOrder,
    TypedOrder,
)
from .results import (
    ActionResult,
    CleanResult,
    DumpResult,
    RenameResult,
    RepairResult,
    RollbackResult,
    ScaleResult,
    StopResult,
)


class RecoveryCallbacks(Protocol):
    """What a rank does for each order (called on the processor's order threads)."""

    @abstractmethod
    def stop(self, order: StopOrder) -> StopResult:
        """Make a training thread stuck in a collective raise (the processor holds the
        rank and reports where it is: the result's `step`, `status`, `parked` are its)."""
        ...

    @abstractmethod
    def clean(self, order: CleanOrder) -> CleanResult:
        """Clean the device state before a repair."""
        ...

    @abstractmethod
    def repair(self, order: RepairOrder) -> RepairResult:
        """Bring the rank's state to the lock step (replica shards, or the checkpoint)."""
        ...

    @abstractmethod
    def rollback(self, order: RollbackOrder) -> RollbackResult:
        """Put the training state back to `order.step`."""
        ...

    @abstractmethod
    def dump(self, order: DumpOrder) -> DumpResult:
        """Write this rank's part of the dying-gasp checkpoint."""
        ...

    @abstractmethod
    def rename(self, order: RenameOrder) -> RenameResult:
        """Publish the dump."""
        ...

    @abstractmethod
    def scale_in(self, order: ScaleInOrder) -> ScaleResult:
        """Continue in a smaller world from the dump (elastic training)."""
        ...

    @abstractmethod
    def scale_out(self, order: ScaleOutOrder) -> ScaleResult:
        """Continue in a larger world from the dump (elastic training)."""
        ...

    @abstractmethod
    def exit(self, order: ExitOrder) -> None:
        """Before the process ends (the training thread is let go after it)."""
        ...

    @abstractmethod
    def pause(self, order: PauseOrder) -> None:
        """The rank is held by an operator pause."""
        ...

    @abstractmethod
    def resume(self, order: ResumeOrder) -> None:
        """Before the training thread trains on."""
        ...


class NoRecovery(RecoveryCallbacks):
    """A host with nothing to do for any order (see the module docstring)."""

    def stop(self, order: StopOrder) -> StopResult:
        return StopResult()

    def clean(self, order: CleanOrder) -> CleanResult:
        return CleanResult()

    def repair(self, order: RepairOrder) -> RepairResult:
        return RepairResult()

    def rollback(self, order: RollbackOrder) -> RollbackResult:
        return RollbackResult(order.step)

    def dump(self, order: DumpOrder) -> DumpResult:
        return DumpResult()

    def rename(self, order: RenameOrder) -> RenameResult:
        return RenameResult(order.lock_step)

    def scale_in(self, order: ScaleInOrder) -> ScaleResult:
        raise RuntimeError("this process cannot change the job's scale (no elastic host)")

    def scale_out(self, order: ScaleOutOrder) -> ScaleResult:
        raise RuntimeError("this process cannot change the job's scale (no elastic host)")

    def exit(self, order: ExitOrder) -> None:
        return None

    def pause(self, order: PauseOrder) -> None:
        return None

    def resume(self, order: ResumeOrder) -> None:
        return None


class CallbackHost(Protocol):
    """What a host's recovery callbacks need of the rank's processor (`Processor` is one):
    to be registered as its callbacks, and to run work in the training thread while it
    waits for the decision. Recovery and the processor are peers; this is their seam."""

    config: ControlConfig

    def set_callbacks(self, callbacks: RecoveryCallbacks) -> None:
        """Make `callbacks` what this rank does for each order."""

    def run_in_training_thread(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` in the training thread and return its result (bounded by `timeout`)."""


def run_callback(callbacks: RecoveryCallbacks, order: TypedOrder) -> ActionResult | None:
    """Call the method of `callbacks` for `order`'s type; its result (None: the order has
    no result of the host's: exit, pause, resume). A hold has no callback."""
    match order:
        case StopOrder():
            return callbacks.stop(order)
        case CleanOrder():
            return callbacks.clean(order)
        case RepairOrder():
            return callbacks.repair(order)
        case RollbackOrder():
            return callbacks.rollback(order)
        case DumpOrder():
            return callbacks.dump(order)
        case RenameOrder():
            return callbacks.rename(order)
        case ScaleInOrder():
            return callbacks.scale_in(order)
        case ScaleOutOrder():
            return callbacks.scale_out(order)
        case ExitOrder():
            callbacks.exit(order)
            return None
        case PauseOrder():
            callbacks.pause(order)
            return None
        case ResumeOrder():
            callbacks.resume(order)
            return None
        case HoldOrder():
            raise TypeError("a hold has no callback: the processor answers it")
    raise TypeError(f"not an order: {type(order).__name__}")
