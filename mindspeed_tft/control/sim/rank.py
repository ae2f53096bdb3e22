"""A simulated rank: one worker process's processor protocol and a model of its trainer.

`SimRank` speaks the real wire protocol (`wire.protocol` frames; orders read with
`wire.order_types.from_wire`) the way `control.processor` does: it registers, heartbeats
every interval, reports errors and hangs, answers each order with a `result`, holds before
an update while held or paused, lets the stop catch it up to the lock step, and exits when
ordered to. Its trainer takes steps: compute, an all-reduce with every rank of the current
world (`Cluster.arrive`), the hold point, the update, the update's end.

What it truly holds (`held`: the step of a complete, undamaged state; None inside an
update, after memory damage or before a restarted process got state) is what the invariants
compare the controller's decisions with (`Cluster.violation`).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Protocol

from ..wire.classify import FaultKind
from ..wire.config import ControlConfig
from ..wire.order_types import (
    DumpOrder,
    ExitOrder,
    RepairOrder,
    RollbackOrder,
    StopOrder,
    from_wire,
)
from ..wire.protocol import MsgType, ProtocolError, decode, encode
from ..wire.results import (
    ActionResult,
    CleanResult,
    DumpResult,
    EmptyResult,
    HoldResult,
    PauseResult,
    RenameResult,
    RepairResult,
    ResultMessage,
    RollbackResult,
    ScaleResult,
    StopResult,
)
from .loop import Loop, Network
from .schedule import Fault, Layout


class Cluster(Protocol):
    """What a simulated rank needs from its job (`job.SimJob`)."""

    loop: Loop
    net: Network
    rng: random.Random
    config: ControlConfig
    layout: Layout
    #: the steps training takes
    steps: int

    def to_controller(self, proc: SimRank, frame: bytes) -> None: ...
    def arrive(self, proc: SimRank, step: int) -> None: ...
    def exited(self, proc: SimRank, code: int) -> None: ...
    def order_seen(self, proc: SimRank, name: str, wire: Any, action_id: int) -> None: ...
    def completed_step(self, step: int) -> None: ...
    def fault_at(self, proc: SimRank, point: str, step: int) -> Fault | None: ...
    def violation(self, what: str) -> None: ...
    def layout_of(self, rank: int, world: list[int], dp_size: int) -> dict[str, Any]: ...
    def shrunk(self, ranks: list[int]) -> tuple[list[int], int]: ...
    def checkpoint(self, lock_step: int) -> int: ...
    def holds(self, rank: int) -> tuple[int | None, bool]: ...
    def known_damaged(self, frame: bytes) -> frozenset[int]: ...
    def finished(self, proc: SimRank) -> None: ...
    def published(self, incident: int, lock_step: int) -> None: ...
    def resumed(self, proc: SimRank, payload: Any) -> None: ...


class _Raised(Exception):
    """An order's callback raised (the device found damaged memory): the order fails."""


#: seconds of a step's phases (virtual)
COMPUTE, UPDATE = 0.12, 0.03


class SimRank:
    """One worker process (see the module docstring)."""

    def __init__(self, job: Cluster, rank: int, incarnation: int, world: list[int],
                 replica: dict[str, Any], step: int = 0, fresh: bool = False) -> None:
        self.job, self.rank, self.incarnation = job, rank, incarnation
        self.identity = b"r%d.%d" % (rank, incarnation)
        #: the controller it talks to (0: the active one's address, 1: the backup's), over
        #: which connection (`link`)
        self.target = 0
        self.link = self.identity + b"@0"
        self.last_heard = self.last_active = job.loop.now
        self.registered_here = False
        self.ever_registered = False
        #: the action ids it has seen (as the processor's channel: a repeat is dropped)
        self.seen_actions: deque[int] = deque(maxlen=256)
        self.world = list(world)
        self.replica = replica
        self.alive = True
        #: a restarted process that holds no training state yet (until it resumes)
        self.fresh = fresh
        self.seq = 0
        self.step, self.status, self.progress = step, "updated", step
        #: the step of the state it holds (None: none complete), and whether it is undamaged
        self.held: int | None = None if fresh else step
        self.intact = True
        #: the training thread: idle (waits for a decision), compute, allreduce, held,
        #: update, parked (in the handler), hung
        self.thread = "idle" if fresh else "compute"
        self.paused = self.stopped = False
        self.catch_up: int | None = None
        self.stop_answer: tuple[int, dict[str, Any]] | None = None
        self.exit_code: int | None = None
        self.last_progress = job.loop.now
        self.hang_reported = False
        self._epoch = 0  # bumped when the training thread is redirected (stale callbacks)
        #: the incident whose resume restarted its training (collectives of one generation
        #: meet only their own: an all-reduce a stop aborted is not met after the resume)
        self.generation = 0
        self._known: frozenset[int] = frozenset()
        self._wire: dict[str, Any] = {}

    # -- sending --------------------------------------------------------------------------
    def send(self, mtype: str, payload: dict[str, Any]) -> None:
        if not self.alive:
            return
        self.seq += 1
        self.job.to_controller(self, encode(mtype, self.rank, self.seq, payload))

    def start(self) -> None:
        self.register()
        self.job.loop.after(self.job.config.heartbeat_interval * self.job.rng.random(),
                            self.heartbeat)
        if self.thread == "compute":
            self.train()

    def register(self) -> None:
        if self.registered_here or not self.alive:
            return
        self.job.loop.after(self.job.config.heartbeat_interval, self.register)  # until it is
        self.send(MsgType.REGISTER, {
            "world_size": self.job.layout.world,
            "pid": 1000 + 100 * self.rank + self.incarnation, "host": f"node{self.rank}",
            "replica": self.replica, "failover": self.ever_registered, "step": self.step,
            "status": self.status})

    def heartbeat(self) -> None:
        if not self.alive:
            return
        cfg = self.job.config
        now = self.job.loop.now
        if self.ever_registered and now - self.last_active > cfg.controller_lost_timeout:
            self.die(cfg.controller_lost_exit_code)  # no active controller: give up
            return
        if now - self.last_heard > cfg.heartbeat_interval * (cfg.heartbeat_misses + 1):
            self.switch((self.target + 1) % (1 + len(cfg.backups)))
        if self.registered_here:
            self.send(MsgType.HEARTBEAT, {
                "step": self.step, "status": self.status, "progress": self.progress,
                "ack": now - self.last_heard >= cfg.lost_after / 2})
        if (self.thread in ("compute", "allreduce", "update", "hung") and not self.stopped
                and not self.paused and not self.hang_reported
                and now - self.last_progress > cfg.hang_timeout_min):
            self.hang_reported = True
            self.send(MsgType.REPORT, {
                "kind": FaultKind.HANG.value, "message": f"rank {self.rank}: no progress",
                "step": self.step, "status": self.status})
        self.job.loop.after(cfg.heartbeat_interval, self.heartbeat)

    # -- the trainer ----------------------------------------------------------------------
    def switch(self, target: int) -> None:
        """Fail over to another controller's address (or go back to the active one's)."""
        self.target = target
        self.link = self.identity + b"@%d" % target
        self.registered_here = False
        self.last_heard = self.job.loop.now
        self.register()

    def _later(self, delay: float, fn: Any, *args: Any) -> None:
        self.job.loop.after(delay, self._guarded, self._epoch, fn, args)

    def _guarded(self, epoch: int, fn: Any, args: tuple[Any, ...]) -> None:
        if self.alive and epoch == self._epoch:
            fn(*args)

    def train(self) -> None:
        """The next step: compute, then the all-reduce."""
        nxt = self.step + 1
        if self._fault(("start",), nxt):
            return
        self.thread = "compute"
        self._later(COMPUTE * (0.8 + 0.4 * self.job.rng.random()), self._reduce, nxt)

    def _reduce(self, nxt: int) -> None:
        if self.stopped or self._fault(("allreduce",), nxt):
            if self.stopped:
                self._park()
            return
        self.thread = "allreduce"
        self.job.arrive(self, nxt)

    def reduced(self, nxt: int) -> None:
        """Every rank of the world reached the all-reduce of `nxt`."""
        if self.thread != "allreduce":
            return
        self._hold_point(nxt)

    def _hold_point(self, nxt: int) -> None:
        if self.stopped and not (self.catch_up is not None and nxt <= self.catch_up):
            self._park()
            return
        if self.paused and not self.stopped:
            self.thread = "held"
            self._held_at = nxt
            return
        if self._fault(("update",), nxt):
            return
        self.thread, self.status, self.held = "update", "updating", None
        self._later(UPDATE, self._updated, nxt)

    def _updated(self, nxt: int) -> None:
        self.step, self.status, self.progress = nxt, "updated", nxt
        self.held = nxt
        self.job.completed_step(nxt)
        self.last_progress = self.job.loop.now
        self.hang_reported = False
        if self._fault(("end",), nxt):
            return
        if self.stopped:
            self._park()
        elif nxt >= self.job.steps:
            self.thread = "idle"
            self.job.finished(self)
        else:
            self.train()

    def _park(self) -> None:
        self.thread = "parked"
        if self.stop_answer is not None:
            aid, _ = self.stop_answer
            self.stop_answer = None
            self._result(aid, "stop", StopResult(self.step, self.status, True))

    # -- faults ---------------------------------------------------------------------------
    def _fault(self, points: tuple[str, ...], step: int) -> bool:
        for point in points:
            fault = self.job.fault_at(self, point, step)
            if fault is not None and self.strike(fault):
                return True
        return False

    def strike(self, fault: Fault) -> bool:
        """A fault hits this process now; True when its training thread stops here."""
        kind = fault.kind
        if kind in ("kill", "node", "launcher"):
            self.die(-9)
            return True
        if kind == "hang":
            self.thread = "hung"
            self._epoch += 1
            return True
        if kind == "net":
            self.job.net.disconnect(self.link, 0.5 + 2 * self.job.rng.random())
            return False
        fk, detail = {"uce": (FaultKind.UCE, {"target": fault.detail}),
                      "comm": (FaultKind.COMM, None),
                      "raise": (FaultKind.UNKNOWN, None)}[kind]
        if kind == "uce" and fault.detail in ("params", "optimizer"):
            self.intact = False
        self.error(fk, f"injected {kind}", detail)
        return True

    def error(self, kind: FaultKind, message: str, detail: dict[str, Any] | None = None) -> None:
        """The training thread raised: report it and park in the handler."""
        self._epoch += 1
        if self.status == "updating":
            self.held = None
        self.thread = "parked"
        report: dict[str, Any] = {"kind": kind.value, "message": message, "step": self.step,
                                  "status": self.status}
        if detail:
            report["detail"] = detail
        self.send(MsgType.REPORT, report)
        if self.stop_answer is not None:
            self._park()

    def error_comm(self) -> None:
        """Its all-reduce failed: a peer will not come (connection reset)."""
        self.error(FaultKind.COMM, "HCCL OP RETRY FAILED (Connection reset by peer)")

    def die(self, code: int) -> None:
        if not self.alive:
            return
        self.alive = False
        self._epoch += 1
        self.job.exited(self, code)

    # -- receiving ------------------------------------------------------------------------
    def deliver(self, frame: bytes) -> None:
        if not self.alive:
            return
        try:
            msg = decode(frame)
        except ProtocolError as e:
            self.job.violation(f"rank {self.rank} got an undecodable frame: {e}")
            return
        self.last_heard = self.job.loop.now
        p = msg.payload
        if msg.type == MsgType.ACTION or p.get("role") == "active":
            self.last_active = self.last_heard
        if msg.type == MsgType.REGISTERED:
            self.registered_here = True
            self.ever_registered = self.ever_registered or p["role"] == "active"
        elif msg.type == MsgType.REDIRECT and self.target != 0:
            self.switch(0)
        elif msg.type == MsgType.ACTION and self.registered_here:
            if p["id"] in self.seen_actions:  # as the processor: dropped as a repeat
                self.job.violation(f"rank {self.rank} dropped order {p['name']} as a repeat of "
                                   f"action {p['id']}: an action id was reused")
            self.seen_actions.append(p["id"])
            self.job.loop.after(0.001 + 0.004 * self.job.rng.random(), self._order,
                                p["id"], p["name"], p["payload"], self.job.known_damaged(frame))
        elif msg.type == MsgType.REJECT and not p.get("retry", False):
            self.job.loop.after(0.01, self.die, 1)

    def _result(self, aid: int, name: str, result: ActionResult | None) -> None:
        """Answer order `aid`: its typed result, or (None) a failure of its callback."""
        error = None if result is not None else (
            f"RuntimeError: injected fault in the {name} callback")
        self.send(MsgType.RESULT, ResultMessage(aid, name, result, error).to_wire())

    def _order(self, aid: int, name: str, wire: dict[str, Any], known: frozenset[int]) -> None:
        if not self.alive:
            return
        self.job.order_seen(self, name, wire, aid)
        payload = from_wire(name, wire)
        fault = self.job.fault_at(self, name, -1)
        if fault is not None and fault.kind in ("uce", "comm", "raise"):
            # the order's callback raised: the order fails; a UCE is the device's, and the
            # rank reports it too (the memory it hit stays damaged until repaired)
            self._result(aid, name, None)
            if fault.kind == "uce":
                self.strike(fault)
            return
        if fault is not None:
            self.strike(fault)
            if not self.alive or self.thread == "hung" and name not in ("hold", "stop"):
                return
        self._known = known  # the damaged ranks the controller knew of when it sent this
        handler = getattr(self, f"_do_{name}")  # the simulator's own table of order names
        self._wire = wire  # the order as it travelled (the fields read below by name)
        try:
            out = handler(aid, payload)
        except _Raised:
            self._result(aid, name, None)
            return
        if out is not None and self.alive:
            self._result(aid, name, out)

    def _check(self, what: str, source: int, held: int | None, intact: bool, step: int) -> None:
        """State of `step` taken from `source`: a violation when it does not hold that step,
        or holds it damaged or is gone and the controller knew; else damaged memory raises
        (the device finds it) or the transfer from a dead process fails: the order fails."""
        gone = held is None and not intact  # its process is dead: the transfer fails
        if (held != step and not gone) or (not intact and source in self._known):
            self.job.violation(f"rank {self.rank}: {what} rank {source} at step {step}, which "
                               f"holds {held} ({'intact' if intact else 'damaged or gone'})")
        if not intact:
            raise _Raised(f"rank {source}'s memory is damaged, or it is gone")

    def _do_hold(self, aid: int, payload: Any) -> HoldResult:
        self.paused = True
        return HoldResult(self.step, self.status)

    def _do_pause(self, aid: int, payload: Any) -> PauseResult:
        self.paused = True
        return PauseResult(self.step, self.status)

    def _do_stop(self, aid: int, order: StopOrder) -> StopResult | None:
        self.paused = self.stopped = True
        self.catch_up = order.lock_step
        if self.thread in ("parked", "idle"):
            return StopResult(self.step, self.status, True)
        if self.thread == "hung":
            self.job.loop.after(self.job.config.park_timeout, self._result, aid, "stop",
                                StopResult(self.step, self.status, False))
            return None
        self.stop_answer = (aid, {})
        if self.thread == "held":
            self._hold_point(self._held_at)
        elif self.thread in ("compute", "allreduce"):  # the stop aborts its communicators
            self._epoch += 1
            self._park()
        return None

    def _do_clean(self, aid: int, payload: Any) -> CleanResult:
        return CleanResult()

    def _do_repair(self, aid: int, order: RepairOrder) -> RepairResult:
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

    def _do_rollback(self, aid: int, order: RollbackOrder) -> RollbackResult:
        self._check("rolled back on", self.rank, self.held, self.intact, order.step)
        self.step, self.status, self.progress = order.step, "updated", order.step
        self.held = order.step
        return RollbackResult(order.step)

    def _do_dump(self, aid: int, order: DumpOrder) -> DumpResult:
        if order.shards:
            self._check("dumped from", self.rank, self.held, self.intact, order.lock_step)
        return DumpResult(tuple(f"/sim/shard_{s.shard}" for s in order.shards))

    def _do_rename(self, aid: int, payload: Any) -> RenameResult:
        wire = self._wire
        self.job.published(wire["incident"], wire["lock_step"])
        return RenameResult(wire["lock_step"], f"/sim/iter_{wire['lock_step']:07d}")

    def _do_scale_in(self, aid: int, payload: Any) -> ScaleResult:
        wire = self._wire
        world, dp_size = self.job.shrunk([int(r) for r in wire["ranks"]])
        if self.rank not in world:
            return ScaleResult(False, dp_size)
        return self._enter(world, dp_size, int(wire["lock_step"]))

    def _do_scale_out(self, aid: int, payload: Any) -> ScaleResult:
        wire = self._wire
        return self._enter([int(r) for r in wire["ranks"]], int(wire["dp_size"]),
                           int(wire["lock_step"]))

    def _enter(self, world: list[int], dp_size: int, lock_step: int) -> ScaleResult:
        self.world, self.fresh = world, False
        self.replica = self.job.layout_of(self.rank, world, dp_size)
        self.step, self.status, self.progress = lock_step, "updated", lock_step
        self.held, self.intact = lock_step, True
        return ScaleResult(True, dp_size, lock_step, self.replica,
                           self.job.layout.micro_batches)

    def _do_resume(self, aid: int, payload: Any) -> EmptyResult:
        self.paused = self.stopped = self.fresh = False
        self.catch_up = None
        self.hang_reported = False
        self.last_progress = self.job.loop.now
        self.job.resumed(self, self._wire)
        self.generation = max(self.generation, int(self._wire.get("incident", 0)))
        if self.thread in ("parked", "idle", "held"):
            self._epoch += 1
            if self.step >= self.job.steps:
                self.thread = "idle"
                self.job.finished(self)
            else:
                self.job.loop.after(0.001, self._guarded, self._epoch, self.train, ())
        return EmptyResult()

    def _do_exit(self, aid: int, order: ExitOrder) -> EmptyResult:
        self.exit_code = order.code
        self.job.loop.after(0.01, self.die, order.code)
        return EmptyResult()
