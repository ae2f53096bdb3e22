"""A simulated rank: the processor's real cores in a shell of virtual time and network.

`SimRank` is to `processor.processor.Processor` what the simulator is to a real job: it runs
the processor's own decision logic, `processor.link.LinkCore` (registration, heartbeats,
hang reports, failover and the redirect back, giving up without an active controller) and
`processor.core.ProcessorCore` (what a rank answers to each order given its training
state), and does their I/O on the simulator's virtual clock (`loop.Loop`) and network
(`loop.Network`): frames go up its connection, the link ticks when its shell would poll,
orders run on the two lanes of the processor's own lane policy (`processor.lanes`: a FIFO
each; an order past its time limit no longer holds its lane up, and runs on to its end),
a wait ends when the training state changes or at its deadline, an exit's hard exit ends a
process whose training thread does not come back. Every input goes to a core through its
one entry point (`handle`), as in the real shells.
The training thread and the recovery callbacks are the trainer model's
(`trainer.Trainer`).

Faults at an order's point strike as the order arrives: a kill ends the process, a hang
stops its training thread (and the order's callback, unless it is a hold or a stop), a
UCE, a communication error or an exception make the order's callback raise (a UCE is
reported too, and the memory it hit stays damaged until repaired).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..processor.core import (
    Action,
    Advance,
    Begin,
    Call,
    Called,
    CheckHang,
    Done,
    Failed,
    OrderRun,
    Output,
    OwnOrder,
    ProcessorCore,
    Received,
    Run,
    Send,
    Wait,
    step_of,
)
from ..processor.lanes import LANES, LanePolicy, Start
from ..processor.link import (
    Accepted,
    Connect,
    Connected,
    FromController,
    GiveUp,
    Identity,
    LinkCore,
    Out,
    Refused,
    Tick,
    Transmit,
)
from ..processor.watchdog import ProgressWatchdog
from ..wire.callbacks import run_callback
from ..wire.classify import FaultKind
from ..wire.fields import Wire, WireError
from ..wire.messages import ActionMessage
from ..wire.order_types import ExitOrder
from ..wire.protocol import MsgType, ProtocolError, decode, encode
from ..wire.results import ResultMessage
from ..wire.transport import storm_allowance
from .trainer import Cluster, Raised, Trainer

#: the active controller's address (the backup's is in `ControlConfig.backups`)
ACTIVE_ADDR = ("127.0.0.1", 9000)
#: orders without a callback a hang could stop
_NO_STUCK = ("hold", "stop")


class SimRank:
    """One worker process (see the module docstring)."""

    def __init__(self, job: Cluster, rank: int, incarnation: int, world: list[int],
                 replica: dict[str, Any], step: int = 0, fresh: bool = False) -> None:
        cfg = job.config
        self.job, self.rank, self.incarnation = job, rank, incarnation
        self.identity = b"r%d.%d" % (rank, incarnation)
        self.alive = True
        self.seq = 0
        self.core = ProcessorCore(
            rank, park_wait=min(cfg.park_timeout, cfg.action_time_limit / 2),
            failure_exit_code=cfg.failure_exit_code, exit_grace=cfg.exit_grace,
            watchdog=ProgressWatchdog(cfg.hang_timeout_min, cfg.hang_timeout_factor,
                                      cfg.hang_initial_timeout))
        self.link = LinkCore(
            rank, Identity(job.layout.world, 1000 + 100 * rank + incarnation, f"node{rank}"),
            addresses=[ACTIVE_ADDR, *cfg.backups], interval=cfg.heartbeat_interval,
            misses=cfg.heartbeat_misses, controller_lost_timeout=cfg.controller_lost_timeout,
            storm_allowance=storm_allowance(job.layout.world), replica=replica)
        #: the connection it talks over (one per controller address it connected to)
        self.conn = self.identity + b"@0"
        self.trainer = Trainer(job, self, self.core, world, step, fresh)
        self.lanes = {name: LanePolicy() for name in LANES}
        #: the orders whose run waits (`Wait`) and their lanes, in the order they began to
        self._waiting: list[tuple[str, OrderRun]] = []
        #: a restarted process joining a recovery (its registration's answer said so)
        self._rejoining = False
        #: per order id: the ranks the controller knew damaged or gone when it sent it, and
        #: the fault that makes its callback raise or hang
        self._known: dict[int, frozenset[int]] = {}
        self._raises: dict[int, str] = {}
        self._stuck: set[int] = set()
        self._tick_at = float("inf")
        self._poked = False

    # -- what the job reads ---------------------------------------------------------------
    @property
    def target(self) -> int:
        """The controller address it talks to (0: the active one's, 1: the backup's)."""
        return self.link.index

    @property
    def fresh(self) -> bool:
        return self.trainer.fresh

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def held(self) -> int | None:
        return self.trainer.held

    @property
    def intact(self) -> bool:
        return self.trainer.intact

    @property
    def thread(self) -> str:
        return self.trainer.thread

    @property
    def generation(self) -> int:
        return self.trainer.generation

    # -- the process ----------------------------------------------------------------------
    def start(self) -> None:
        self.link.handle(Connected(), self.job.loop.now)
        self._tick()
        self.trainer.start()

    def die(self, code: int) -> None:
        if not self.alive:
            return
        self.alive = False
        self.job.exited(self, code)

    def send(self, mtype: str, payload: Wire | dict[str, Any]) -> None:
        if not self.alive:
            return
        self.seq += 1
        self.job.to_controller(self, encode(mtype, self.rank, self.seq, payload))

    def report(self, kind: FaultKind, message: str, detail: dict[str, Any] | None) -> None:
        """The training thread failed (`Processor.report_error`)."""
        for send in self.core.handle(Failed(kind, message, detail), self.job.loop.now):
            assert isinstance(send, Send)
            self.send(send.mtype, send.message.to_wire())

    def disconnect(self, seconds: float) -> None:
        self.job.net.disconnect(self.conn, seconds)

    def poke(self) -> None:
        """The training state changed: waits and the training thread look again (once,
        after the current event)."""
        if not self._poked and self.alive:
            self._poked = True
            self.job.loop.after(0.0, self._wake)

    def _wake(self) -> None:
        self._poked = False
        if not self.alive:
            return
        now = self.job.loop.now
        waiting, self._waiting = self._waiting, []
        for lane, run in waiting:
            self._step(lane, step_of(self.core.handle(Advance(run), now)))
        self.trainer.wake()

    # -- the link (`processor.channel.Channel`) -------------------------------------------
    def _tick(self) -> None:
        if not self.alive:
            return
        now = self.job.loop.now
        if now < self._tick_at and self._tick_at != float("inf"):
            return  # an earlier schedule: the later one ticks
        self._tick_at = float("inf")
        self._outputs(self.link.handle(Tick(self.core.state()), now))
        for name in LANES:
            self._start(name, self.lanes[name].check(now), now)
        self._schedule(now + self.link.wait(now))

    def _schedule(self, when: float) -> None:
        if when < self._tick_at:
            self._tick_at = when
            self.job.loop.at(when, self._tick)

    def deliver(self, frame: bytes) -> None:
        if not self.alive:
            return
        try:
            msg = decode(frame)
        except ProtocolError as e:
            self.job.checker.undecodable(self.rank, e)
            return
        if msg.type == MsgType.ACTION and self.link.registered_here:
            if not self._arrived(msg.read(ActionMessage), frame):
                return
        self._outputs(self.link.handle(FromController(msg, self.core.state()),
                                      self.job.loop.now))
        self._schedule(self.job.loop.now)  # a redirect, an ack: the link looks again
        self.poke()

    def _arrived(self, p: ActionMessage, frame: bytes) -> bool:
        """An order arrives (the I/O thread): the invariants see it, its fault strikes.
        False: the process is gone."""
        aid, name = p.id, p.name
        # (the core would drop a repeat of an action id it saw)
        self.job.order_seen(self, name, p.payload, aid, aid in self.core.seen)
        self._known[aid] = self.job.known_damaged(frame)
        fault = self.job.fault_at(self, name, -1)
        if fault is None:
            return True
        if fault.kind in ("uce", "comm", "raise") and name != "hold":
            # its callback raises; a UCE is the device's, and the rank reports it too
            self._raises[aid] = fault.kind
            if fault.kind == "uce":
                self.trainer.strike(fault, device=True)
            return self.alive
        if fault.kind == "hang" and name not in _NO_STUCK:
            self._stuck.add(aid)  # its callback never returns
        self.trainer.strike(fault)
        return self.alive

    def _outputs(self, outs: Sequence[Out | Output]) -> None:
        """Do what the link or the core decided (`Out`, `core.Output`)."""
        now = self.job.loop.now
        for out in outs:
            if not self.alive:
                return
            if isinstance(out, Transmit):
                self.send(out.mtype, out.payload)
            elif isinstance(out, Send):
                self.send(out.mtype, out.message.to_wire())
            elif isinstance(out, (Action, CheckHang)):  # the processor core's: what it says
                self._outputs(self.core.handle(out, now))
            elif isinstance(out, Run):
                self._submit(out, now)
            elif isinstance(out, Connect):
                self.conn = self.identity + b"@%d" % out.index
                self.link.handle(Connected(), now)
                self._schedule(now)
            elif isinstance(out, Accepted):
                info = self.link.join_info
                self._rejoining = (info is not None and info.rejoin) or self.fresh
            elif isinstance(out, Refused):
                self.job.loop.after(0.01, self.die, 1)
            elif isinstance(out, GiveUp):
                self._give_up(out.silent, now)

    def _give_up(self, silent: float, now: float) -> None:
        """No active controller: exit as an exit order would (`Processor._controller_lost`)."""
        if self.core.exit_ordered is not None:
            return
        cfg = self.job.config
        order = ExitOrder(cfg.controller_lost_exit_code, f"no active controller for "
                                                         f"{silent:.0f}s")
        self._outputs(self.core.handle(OwnOrder(-1, "exit", order.to_wire(),
                                                now + cfg.action_time_limit), now))

    # -- the lanes (`processor.lanes`) and the order flow (`processor.gate.run_order`) ----
    def _submit(self, run: Run, now: float) -> None:
        self._start(run.lane, self.lanes[run.lane].submit(run.order, now), now)

    def _start(self, lane: str, starts: list[Start], now: float) -> None:
        """Run what the lane policy started (an abandoned order runs on by itself)."""
        for start in starts:
            step = step_of(self.core.handle(Begin(start.order, self._rejoining), now))
            self.poke()
            self._step(lane, step)

    def _step(self, lane: str, step: Call | Wait | Done) -> None:
        run = step.run
        if isinstance(step, Done):
            self._answer(run.received, step.result)
            self._start(lane, self.lanes[lane].finish(run.received, self.job.loop.now),
                        self.job.loop.now)
        elif isinstance(step, Wait):
            self._waiting.append((lane, run))
            self.job.loop.at(step.deadline, self._deadline, lane, run)
        else:
            if step.hard_exit is not None:
                code, deadline = step.hard_exit
                self.job.loop.at(deadline, self.die, code)
            if run.received.id in self._stuck:
                return  # the callback never returns
            self.job.loop.after(0.001 + 0.004 * self.job.rng.random(), self._call, lane, step)

    def _deadline(self, lane: str, run: OrderRun) -> None:
        if self.alive and (lane, run) in self._waiting:
            self._waiting.remove((lane, run))
            self._step(lane, step_of(self.core.handle(Advance(run), self.job.loop.now)))

    def _call(self, lane: str, step: Call) -> None:
        """The host's callback (`callbacks.run_callback` with the trainer's callbacks)."""
        if not self.alive:
            return
        run = step.run
        aid = run.received.id
        self.trainer.known = self._known.get(aid, frozenset())
        result, error = None, None
        raises = self._raises.pop(aid, None)
        try:
            if raises is not None:
                raise Raised(f"injected {raises} in the {run.received.name} callback")
            result = run_callback(self.trainer, step.order)
        except Raised as e:  # (any other exception is the simulator's bug: it fails the run)
            error = e
        if not self.alive:
            return
        next_step = step_of(self.core.handle(Called(run, result, error), self.job.loop.now))
        self.poke()
        self._step(lane, next_step)  # an abandoned order runs on: its late result is sent

    def _answer(self, received: Received, send: Send) -> None:
        self._known.pop(received.id, None)
        if received.id < 0:  # the processor's own exit (no active controller): no answer
            return
        try:
            wire = send.message.to_wire()
        except WireError as e:  # a result that does not match its type (`Processor`)
            wire = ResultMessage(received.id, received.name,
                                 error=f"ResultError: {e}").to_wire()
        self.send(send.mtype, wire)
