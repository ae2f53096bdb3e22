"""The trainer model of a simulated rank: its training thread and its recovery callbacks.

`Trainer` is what runs around the processor's real core (`processor.core.ProcessorCore`)
in a simulated process, in the roles the plugin and `processor.handler` play in a real one:

- the training thread takes steps: compute, an all-reduce with every rank of the current
  world (`Cluster.arrive`), the hold point (the core's `HoldPoint`: pass, wait while
  paused, or a ForceStop once stopped), the update (`UpdateStart` ... `UpdateEnd`), the
  step's end (`Progress`: the hang watchdog), each through the core's one entry point;
- an error of the training thread is reported as the core says (`core.reported_kind`,
  `Failed`), and the thread waits in the fault handler (`InHandler`) for the decision
  (`TakeDecision`): resume re-enters training, exit ends the process;
- the recovery callbacks (`wire.callbacks.RecoveryCallbacks`, called by the core's order
  flow) act on the training state: the stop aborts the communicators (a training thread in
  a collective raises), a repair brings the lock step (from holders or the checkpoint), a
  rollback puts the state back, a dump writes it, a rename publishes it, a scale change
  enters the new world.

What it truly holds (`held`: the step of a complete, undamaged state; None inside an
update, after memory damage or before a restarted process got state) is what the invariants
compare the controller's decisions with (`invariants.Checker.state_used`).
"""

from __future__ import annotations

import random
from typing import Any, Protocol

from ..processor.core import (
    Decision,
    HoldPoint,
    InHandler,
    Input,
    Output,
    ProcessorCore,
    Progress,
    TakeDecision,
    Training,
    UpdateEnd,
    UpdateStart,
    Verdict,
    verdict_of,
)
from ..wire.classify import FaultKind
from ..wire.config import ControlConfig
from ..wire.order_types import (
    CleanOrder,
    DumpOrder,
    ExitOrder,
    PauseOrder,
    RenameOrder,
    RepairOrder,
    ResumeOrder,
    RollbackOrder,
    ScaleInOrder,
    ScaleOutOrder,
    StopOrder,
)
from ..wire.results import (
    CleanResult,
    DumpResult,
    RenameResult,
    RepairResult,
    RollbackResult,
    ScaleResult,
    StopResult,
)
from .invariants import Checker
from .loop import Loop, Network
from .schedule import Fault, Layout


class Process(Protocol):
    """What the trainer needs from its process (`rank.SimRank`)."""

    rank: int
    alive: bool

    def report(self, kind: FaultKind, message: str, detail: dict[str, Any] | None) -> None: ...
    def poke(self) -> None: ...
    def die(self, code: int) -> None: ...
    def disconnect(self, seconds: float) -> None: ...


class Cluster(Protocol):
    """What a simulated rank needs from its job (`job.SimJob`)."""

    loop: Loop
    net: Network
    rng: random.Random
    config: ControlConfig
    layout: Layout
    #: the steps training takes, and the seconds of a step's compute
    steps: int
    compute: float
    checker: Checker

    def to_controller(self, proc: Any, frame: bytes) -> None: ...
    def arrive(self, proc: Any, step: int) -> None: ...
    def exited(self, proc: Any, code: int) -> None: ...
    def order_seen(self, proc: Any, name: str, wire: Any, action_id: int,
                   repeat: bool = False) -> None: ...
    def completed_step(self, step: int) -> None: ...
    def fault_at(self, proc: Any, point: str, step: int) -> Fault | None: ...
    def layout_of(self, rank: int, world: list[int], dp_size: int) -> dict[str, Any]: ...
    def shrunk(self, ranks: list[int]) -> tuple[list[int], int]: ...
    def checkpoint(self, lock_step: int) -> int: ...
    def holds(self, rank: int) -> tuple[int | None, bool]: ...
    def known_damaged(self, frame: bytes) -> frozenset[int]: ...
    def finished(self, proc: Any) -> None: ...
    def published(self, incident: int, lock_step: int) -> None: ...
    def dump_written(self, incident: int, rank: int, shards: list[int]) -> None: ...
    def resumed(self, proc: Any, step: int | None, false_alarm: bool) -> None: ...


class Raised(RuntimeError):
    """A callback found damaged memory, or a transfer from a dead process failed."""


#: seconds of a step's phases (virtual)
COMPUTE, UPDATE = 0.12, 0.03
#: at most this long after the all-reduce a rank reaches its hold point
SKEW = 0.02


class Trainer:
    """The training thread and the recovery callbacks of one rank (module docstring)."""

    def __init__(self, job: Cluster, proc: Process, core: ProcessorCore, world: list[int],
                 step: int, fresh: bool) -> None:
        self.job, self.proc, self.core = job, proc, core
        self.rank = proc.rank
        self.world = list(world)
        #: a restarted process that holds no training state yet (until it resumes)
        self.fresh = fresh
        self.step = step
        #: the step of the state it holds (None: none complete), and whether it is undamaged
        self.held: int | None = None if fresh else step
        self.intact = True
        #: the training thread: compute, allreduce, reduced (past it, not yet at the hold
        #: point), held (at the hold point), update,
        #: parked (in the fault handler), hung, idle (finished)
        self.thread = "parked" if fresh else "compute"
        self._held_at = 0
        #: the stop aborted the communicators: a collective raises until the resume
        self.aborted = False
        self.hang_on_entry = False
        self._epoch = 0  # bumped when the training thread is redirected (stale callbacks)
        #: the incident whose resume restarted its training (collectives of one generation
        #: meet only their own: an all-reduce a stop aborted is not met after the resume)
        self.generation = 0
        #: the ranks the controller knew damaged or gone when it sent the order being run
        self.known: frozenset[int] = frozenset()

    # -- the training thread --------------------------------------------------------------
    def start(self) -> None:
        if self.fresh:  # a restarted process waits for the repair that brings it in
            self._core(InHandler(True))
        else:
            self._enter()

    def _core(self, event: Input) -> list[Output]:
        """The processor's core takes `event` now (its one entry point)."""
        return self.core.handle(event, self.job.loop.now)

    def _later(self, delay: float, fn: Any, *args: Any) -> None:
        self.job.loop.after(delay, self._guarded, self._epoch, fn, args)

    def _guarded(self, epoch: int, fn: Any, args: tuple[Any, ...]) -> None:
        if self.proc.alive and epoch == self._epoch:
            fn(*args)

    def _enter(self) -> None:
        """Into the training function (the plugin's `on_train_start`)."""
        self._core(Training(True))
        self._core(UpdateEnd(self.step))
        self._core(Progress(self.step))
        if self.hang_on_entry:
            self.hang_on_entry = False
            self.thread = "hung"
        elif self.step >= self.job.steps:
            self._finish()
        else:
            self._train()

    def _train(self) -> None:
        """The next step: compute, then the all-reduce."""
        nxt = self.step + 1
        if self._fault(("start",), nxt):
            return
        self.thread = "compute"
        compute = self.job.compute
        self._later(compute * (0.8 + 0.4 * self.job.rng.random()), self._reduce, nxt)

    def _reduce(self, nxt: int) -> None:
        if self._fault(("allreduce",), nxt):
            return
        if self.aborted:  # the stop aborted the communicators
            self.error(FaultKind.COMM, "HCCL communicator aborted by the stop")
            return
        self.thread = "allreduce"
        self.job.arrive(self.proc, nxt)

    def reduced(self, nxt: int) -> None:
        """Every rank of the world reached the all-reduce of `nxt`: each leaves it a little
        apart from the others (a stop may find one still before its update, behind a rank
        that finished it: it catches up)."""
        if self.thread == "allreduce":
            self.thread = "reduced"
            self._later(SKEW * self.job.rng.random(), self._hold_point, nxt)

    def _hold_point(self, nxt: int) -> None:
        verdict = verdict_of(self._core(HoldPoint(nxt)))
        if verdict is Verdict.STOP:
            self.error(FaultKind.NORMAL, f"FORCE STOP: rank {self.rank} stopped by the "
                                         f"controller before update {nxt}")
            return
        if verdict is Verdict.WAIT:  # (the core pauses the hang watchdog meanwhile)
            self.thread, self._held_at = "held", nxt
            return
        if self._fault(("update",), nxt):
            return
        self._core(UpdateStart(nxt))
        self.thread, self.held = "update", None
        self._later(UPDATE, self._updated, nxt)

    def _updated(self, nxt: int) -> None:
        if self._fault(("inside",), nxt):  # inside the update: its state is half-updated
            return
        self._core(UpdateEnd(nxt))
        self.step = self.held = nxt
        self.job.completed_step(nxt)
        self._core(Progress(nxt))
        self.proc.poke()
        if self._fault(("end",), nxt):
            return
        if nxt >= self.job.steps:
            self._finish()
        else:
            self._train()

    def _finish(self) -> None:
        self._core(Training(False))
        self.thread = "idle"
        self.job.finished(self.proc)

    def wake(self) -> None:
        """The core's state changed: a held thread looks again, a parked one takes its
        decision."""
        if not self.proc.alive:
            return
        if self.thread == "held":
            self._hold_point(self._held_at)
        elif self.thread == "parked":
            taken = self._core(TakeDecision())
            if not taken:
                return
            [decision] = taken
            assert isinstance(decision, Decision)
            self._core(InHandler(False))
            self._epoch += 1
            if decision.action == "resume":
                self.thread = "compute"
                self._later(0.001, self._enter)
            else:
                self.thread = "exiting"
                self.job.loop.after(0.01, self.proc.die, decision.code)

    # -- faults ---------------------------------------------------------------------------
    def _fault(self, points: tuple[str, ...], step: int) -> bool:
        for point in points:
            fault = self.job.fault_at(self.proc, point, step)
            if fault is not None and self.strike(fault):
                return True
        return False

    def strike(self, fault: Fault, device: bool = False) -> bool:
        """A fault hits this process now; True when its training thread stops here.
        `device`: it hit an order's callback, not the training thread (reported as what it
        is, not as the consequence of a stop)."""
        kind = fault.kind
        if kind in ("kill", "node", "launcher"):
            self.proc.die(-9)
            return True
        if kind == "hang":
            self.hang()
            return True
        if kind == "net":
            self.proc.disconnect(0.5 + 2 * self.job.rng.random())
            return False
        fk, detail = {"uce": (FaultKind.UCE, {"target": fault.detail}),
                      "comm": (FaultKind.COMM, None),
                      "raise": (FaultKind.UNKNOWN, None)}[kind]
        if kind == "uce" and fault.detail in ("param", "optimizer"):
            self.intact = False
        self.error(fk, f"injected {kind}", detail, device)
        return True

    def hang(self) -> None:
        """The training thread stops making progress (one waiting in the fault handler
        hangs once its decision lets it train again)."""
        if self.thread == "parked":
            self.hang_on_entry = True
        elif self.thread not in ("idle", "exiting"):
            self.thread = "hung"
            self._epoch += 1

    def error(self, kind: FaultKind, message: str, detail: dict[str, Any] | None = None,
              device: bool = False) -> None:
        """The training thread raised: report it (as the core says, unless the `device`
        reports it) and park in the handler (`processor.handler.run_with_fault_tolerance`)."""
        core = self.core
        self._epoch += 1
        if core.status == "updating":
            self.held = None
        self.proc.report(kind if device else core.reported_kind(kind), message, detail)
        self._core(Training(False))
        self.thread = "parked"
        self._core(InHandler(True))
        self.proc.poke()

    def error_comm(self) -> None:
        """Its all-reduce failed: a peer will not come (connection reset)."""
        self.error(FaultKind.COMM, "HCCL OP RETRY FAILED (Connection reset by peer)")

    # -- the recovery callbacks (`wire.callbacks.RecoveryCallbacks`) ----------------------
    def _check(self, what: str, source: int, held: int | None, intact: bool, step: int) -> None:
        """State of `step` taken from `source` (checked: `Checker.state_used`); damaged
        memory raises (the device finds it), a transfer from a dead process fails: the order
        fails."""
        self.job.checker.state_used(self.rank, what, source, held, intact, step,
                                    source in self.known)
        if not intact:
            raise Raised(f"rank {source}'s memory is damaged, or it is gone")

    def stop(self, order: StopOrder) -> StopResult:
        self.aborted = True
        if self.thread in ("compute", "allreduce"):  # its collective raises
            self._epoch += 1
            self._later(0.001, self.error, FaultKind.COMM, "HCCL communicator aborted")
        return StopResult()

    def clean(self, order: CleanOrder) -> CleanResult:
        return CleanResult()

    def repair(self, order: RepairOrder) -> RepairResult:
        if order.source == "checkpoint":
            step = self.job.checkpoint(order.lock_step)
            self.held, self.intact = step, True
            return RepairResult(step)
        for receive in order.receive:
            held, intact = self.job.holds(receive.source)
            self._check("repaired from", receive.source, held, intact, order.lock_step)
        if order.receive:
            self.held, self.intact = order.lock_step, True
        return RepairResult(received=len(order.receive))

    def rollback(self, order: RollbackOrder) -> RollbackResult:
        self._check("rolled back on", self.rank, self.held, self.intact, order.step)
        self.step = self.held = order.step
        return RollbackResult(order.step)

    def dump(self, order: DumpOrder) -> DumpResult:
        if order.shards:
            self._check("dumped from", self.rank, self.held, self.intact, order.lock_step)
            self.job.dump_written(order.incident, self.rank, [s.shard for s in order.shards])
        return DumpResult(tuple(f"/sim/shard_{s.shard}" for s in order.shards))

    def rename(self, order: RenameOrder) -> RenameResult:
        self.job.published(order.incident, order.lock_step)
        return RenameResult(order.lock_step, f"/sim/iter_{order.lock_step:07d}")

    def scale_in(self, order: ScaleInOrder) -> ScaleResult:
        world, dp_size = self.job.shrunk(list(order.ranks))
        if self.rank not in world:
            return ScaleResult(False, dp_size)
        return self._enter_world(world, dp_size, order.lock_step)

    def scale_out(self, order: ScaleOutOrder) -> ScaleResult:
        return self._enter_world(list(order.ranks), order.dp_size, order.lock_step)

    def _enter_world(self, world: list[int], dp_size: int, lock_step: int) -> ScaleResult:
        self.world, self.fresh = world, False
        replica = self.job.layout_of(self.rank, world, dp_size)
        self.step = self.held = lock_step
        self.intact = True
        return ScaleResult(True, dp_size, lock_step, replica, self.job.layout.micro_batches)

    def exit(self, order: ExitOrder) -> None:
        return None

    def pause(self, order: PauseOrder) -> None:
        return None

    def resume(self, order: ResumeOrder) -> None:
        self.fresh = self.aborted = False
        self.job.resumed(self.proc, order.step, order.false_alarm)
        self.generation = max(self.generation, order.incident)
