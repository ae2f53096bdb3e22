"""One simulated run: the real controller core, W simulated ranks, launchers, a network.

`SimJob(schedule).run()` feeds the core (`controller.core.ControllerCore`) every frame a
rank's link delivers, every launcher command and every tick its `next_deadline` asks for,
at virtual times; delivers the frames it decides over the network; hands its events to the
invariants (`invariants.Checker`) after every input, and time to them after every event.
It ends when the controller is FINAL and every process ended (or a grace after FINAL), and
fails with the first violated invariant, an exception of the controller core or of a rank
(its processor cores), or a job that did not end within its bound (a deadlock or livelock).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import Any

from ...elastic import replica_num_for, shrunk_world
from ...features import Features
from ..controller.core import Command, ControllerCore
from ..controller.states import State
from ..wire.config import ControlConfig
from ..wire.protocol import MsgType
from .controllers import BACKUP_ADDR, SimControllers
from .invariants import Checker, Event, RankTruth, Violation
from .launcher import SimLauncher
from .loop import Loop, Network
from .oracle import ending_of, owed
from .rank import SimRank
from .schedule import Fault, Schedule
from .trainer import COMPUTE

#: seconds a waiter in an all-reduce with a peer that will not come waits before its
#: collective fails (a communication error) or goes on waiting (then only the stop ends it)
COMM_TIMEOUT = 2.0


@dataclass
class Outcome:
    """How a run ended."""

    failure: str | None
    state: str
    exit_code: int | None
    events: int
    time: float


def sim_config(backup: bool = False) -> ControlConfig:
    """The control plane's settings in simulated runs (virtual seconds)."""
    return ControlConfig(heartbeat_interval=1.0, heartbeat_misses=3, action_time_limit=4.0,
                         register_timeout=20.0, replacement_wait=5.0, hang_timeout_min=4.0,
                         hang_initial_timeout=4.0, park_timeout=1.0, exit_grace=1.0,
                         controller_lost_timeout=20.0, log_stdout=False,
                         backups=[BACKUP_ADDR] if backup else [])


class SimJob:
    """One run of one schedule (see the module docstring)."""

    def __init__(self, schedule: Schedule) -> None:
        lay = schedule.layout
        self.schedule, self.layout, self.steps = schedule, lay, schedule.steps
        self.compute = schedule.extra.get("compute", COMPUTE)
        self.rng = random.Random(schedule.seed)
        self.loop = Loop()
        self.net = Network(self.loop, self.rng, schedule.delay)
        self.config = sim_config(lay.backup)
        features = Features(high_availability=True, hbm_repair=lay.hbm_repair,
                            worker_reboot=lay.worker_reboot, no_replica=lay.replicas == 1,
                            replica_num=lay.replicas, elastic=lay.elastic)
        #: the active controller (node 0's launcher) and maybe a backup (node 1's)
        self.ctl = SimControllers(self, lay.world, self.config, features, lay.backup)
        self.checker = Checker(lay.world, lay.micro_batches, self.config.dump_exit_code,
                               schedule.steps)
        self.procs: dict[int, SimRank] = {}
        self.by_identity: dict[bytes, SimRank] = {}
        self.launchers = [SimLauncher(self, n, (schedule.replacement or ("restart",))[
            n % max(1, len(schedule.replacement))]) for n in range(lay.nodes)]
        self.world = list(range(lay.world))
        self.members = set(self.world)
        self.dp_size = lay.dp
        self.arrivals: dict[tuple[int, int], set[int]] = {}
        self.fired: set[int] = set()
        self._all_registered = False
        #: the faults in the order they struck (the oracle's input)
        self.struck: list[Fault] = []
        self.struck_at: list[float] = []
        #: those that struck before every rank had registered
        self.early: list[Fault] = []
        self.completed = 0
        self.events: list[dict[str, Any]] = []
        self.final_at: float | None = None
        #: per frame sent: the ranks whose data the controller knew damaged, or whose
        #: process it knew gone, then (the frames are kept so that their ids stay theirs)
        self._knowledge: dict[int, tuple[bytes, frozenset[int]]] = {}

    @property
    def core(self) -> ControllerCore:
        """The controller in charge."""
        return self.ctl.core

    # -- the layout -----------------------------------------------------------------------
    def layout_of(self, rank: int, world: list[int], dp_size: int) -> dict[str, Any]:
        lay = self.layout
        i = world.index(rank)
        tp_i, dp_i, pp_i = i % lay.tp, (i // lay.tp) % dp_size, i // (lay.tp * dp_size)
        chunk = dp_size // replica_num_for(dp_size, lay.replicas)
        shard = dp_i % chunk
        holders = [world[tp_i + lay.tp * (d + dp_size * pp_i)] for d in range(dp_size)
                   if d % chunk == shard]
        return {"dense": {"dp_index": dp_i, "dp_size": dp_size,
                          "replica_num": dp_size // chunk, "group": tp_i + lay.tp * pp_i,
                          "shard": shard, "holders": holders}}

    def node_of(self, rank: int) -> int:
        return rank // self.layout.ranks_per_node

    def shrunk(self, ranks: list[int]) -> tuple[list[int], int]:
        home = {r: i for i, r in enumerate(self.world)}
        return shrunk_world(ranks, lambda r: (home[r] // self.layout.tp) % self.dp_size,
                            self.layout.micro_batches, 1)

    def checkpoint(self, lock_step: int) -> int:
        every = self.layout.checkpoint_every
        return lock_step // every * every

    def known_damaged(self, frame: bytes) -> frozenset[int]:
        kept = self._knowledge.get(id(frame))
        return kept[1] if kept is not None else frozenset()

    def holds(self, rank: int) -> tuple[int | None, bool]:
        proc = self.procs.get(rank)
        if proc is None or not proc.alive:
            return None, False
        return proc.held, proc.intact

    # -- processes ------------------------------------------------------------------------
    def spawn(self, rank: int, first: bool = False) -> None:
        old = self.procs.get(rank)
        incarnation = 0 if old is None else old.incarnation + 1
        full = list(range(self.layout.world))
        proc = SimRank(self, rank, incarnation, full, self.layout_of(rank, full, self.layout.dp),
                       fresh=not first)
        self.procs[rank] = proc
        self.by_identity[proc.identity] = proc
        proc.start()

    def exited(self, proc: SimRank, code: int) -> None:
        for waiting in self.arrivals.values():
            waiting.discard(proc.rank)
        launcher = self.launchers[self.node_of(proc.rank)]
        launcher.worker_ended(proc.rank, code, self.job_over)
        self._peers_notice(proc.rank)

    def job_over(self) -> bool:
        return self.core.state in (State.EXIT, State.FINAL)

    def finished(self, proc: SimRank) -> None:
        proc.send(MsgType.BYE, {"code": 0})
        self.loop.after(0.02, proc.die, 0)

    def completed_step(self, step: int) -> None:
        self.completed = max(self.completed, step)

    # -- the all-reduce -------------------------------------------------------------------
    def arrive(self, proc: SimRank, step: int) -> None:
        key = (proc.generation, step)
        waiting = self.arrivals.setdefault(key, set())
        waiting.add(proc.rank)
        if waiting >= self.members:
            del self.arrivals[key]
            for rank in sorted(waiting):
                peer = self.procs.get(rank)
                if peer is not None and peer.alive:
                    peer.trainer.reduced(step)
            return
        self.loop.after(COMM_TIMEOUT, self._comm_check, proc, step)

    def _blocked(self, rank: int) -> bool:
        peer = self.procs.get(rank)
        return peer is None or not peer.alive or peer.thread in ("parked", "hung", "idle", "exiting")

    def _comm_check(self, proc: SimRank, step: int) -> None:
        if not proc.alive or proc.thread != "allreduce" or proc.step + 1 != step:
            return
        if any(self._blocked(r) for r in self.members if r != proc.rank):
            if self.rng.random() < 0.5:
                proc.trainer.error_comm()

    def _peers_notice(self, rank: int) -> None:
        for peer in list(self.procs.values()):
            if peer.alive and peer.thread == "allreduce":
                self.loop.after(COMM_TIMEOUT * self.rng.random(), self._comm_check, peer,
                                peer.step + 1)

    # -- faults ---------------------------------------------------------------------------
    def fault_at(self, proc: SimRank, point: str, step: int) -> Fault | None:
        incident = self.core.incidents.count
        for i, fault in enumerate(self.schedule.faults):
            if i in self.fired or fault.point != point:
                continue
            if step >= 0 and fault.step != step or step < 0 and fault.incident != incident:
                continue
            node_kind = fault.kind in ("node", "launcher")
            if (self.node_of(proc.rank) if node_kind else proc.rank) != fault.target:
                continue
            self.fired.add(i)
            self.struck.append(fault)
            self.struck_at.append(self.loop.now)
            self.checker.struck(self.loop.now)
            if len(self.fired) == len(self.schedule.faults):
                self.net.heal()  # the last fault: nothing more is injected, links come back
            if not self._all_registered:
                self._all_registered = all(p.link.registered_here for p in self.procs.values()
                                           ) and len(self.procs) == self.layout.world
                if not self._all_registered:
                    self.early.append(fault)
            if node_kind:
                self.lose_node(fault.target, fault.kind)
            return fault
        return None

    def lose_node(self, node: int, kind: str) -> None:
        """A node lost (its launcher with it), or its launcher dead (its workers with it)."""
        self.launchers[node].alive = False
        if self.layout.backup:  # the controllers run in the launchers of nodes 0 and 1
            self.ctl.kill(node)
        for proc in list(self.procs.values()):
            if proc.alive and self.node_of(proc.rank) == node:
                if kind == "node":
                    self.net.disconnect(proc.conn, 1e9)
                proc.die(-9)

    # -- what the ranks saw ---------------------------------------------------------------
    def order_seen(self, proc: SimRank, name: str, wire: Any, action_id: int,
                   repeat: bool = False) -> None:
        self.checker.on_order(proc.rank, name, wire, action_id, self.members, repeat)

    def resumed(self, proc: SimRank, step: int | None, false_alarm: bool) -> None:
        for waiting in self.arrivals.values():
            waiting.discard(proc.rank)
        self.checker.resumed_at(proc.rank, proc.held, -1 if step is None else step,
                                false_alarm)

    def _group_shard(self, rank: int) -> tuple[int, int]:
        dense = self.layout_of(rank, self.world, self.dp_size)["dense"]
        return int(dense["group"]), int(dense["shard"])

    def dump_written(self, incident: int, rank: int, shards: list[int]) -> None:
        """`rank` wrote `shards` of its own group into the dump of `incident`."""
        if rank in self.members:
            group = self._group_shard(rank)[0]
            self.checker.dump_written(self.core.epoch, incident, {(group, s) for s in shards})

    def published(self, incident: int, lock_step: int) -> None:
        # the controller in charge ordered the rename; the dump holds the job's every shard
        self.checker.dump_published(self.core.epoch, incident, lock_step,
                                    {self._group_shard(r) for r in self.world})

    # -- the controllers --------------------------------------------------------------------
    def to_controller(self, proc: SimRank, frame: bytes) -> None:
        self.net.up(proc.conn, partial(self.ctl.frame_from_rank, proc.target, proc.identity),
                    frame)

    def command(self, cmd: Command) -> None:
        self.ctl.command(cmd)

    def deliver_to_rank(self, identity: bytes, frame: bytes, index: int,
                        core: ControllerCore) -> None:
        proc = self.by_identity.get(identity)
        if proc is None or not proc.alive or proc.target != index:
            return  # a rank hears only the controller it is connected to
        flow = core.flow
        known = frozenset(core.planner.faulty(flow.incident) if flow else ()) | {
            r.rank for r in core.table.all() if not r.connected}
        self._knowledge[id(frame)] = (frame, known)
        self.net.down(proc.conn, proc.deliver, frame)

    def on_events(self, events: list[dict[str, Any]], core: ControllerCore) -> None:
        for e in events:
            self.events.append(e)
            ev = Event.of(e)
            live = [p.step for p in self.procs.values() if p.alive and not p.fresh
                    and p.rank in self.members] if ev.name == "strategy" else []
            self.checker.on_event(ev, core.epoch, self.completed, live)
            if ev.name in ("scale_in", "scale_out"):
                self.world = list(ev.ranks)
                self.members = set(self.world)
                self.dp_size = ev.dp_size or self.dp_size
            if ev.name == "repair_failed" and ev.gone:
                self.checker.gone_for_real(ev, self.truths(core))
            if ev.name == "state" and ev.state == "FINAL" and self.final_at is None:
                self.final_at = self.loop.now

    def truths(self, core: ControllerCore | None = None) -> dict[int, RankTruth]:
        """What each rank truly is now (`registered`: its current process is the one the
        controller's table names)."""
        out = {}
        for rank, p in self.procs.items():
            row = core.table.get(rank) if core is not None else None
            out[rank] = RankTruth(rank, p.alive, rank in self.members,
                                  row is not None and row.identity == p.identity, p.fresh,
                                  p.step)
        return out

    # -- the run --------------------------------------------------------------------------
    def run(self) -> Outcome:
        self.ctl.start()
        for rank in range(self.layout.world):
            self.loop.at(0.2 * self.rng.random(), self.spawn, rank, True)
        checker, loop, ctl = self.checker, self.loop, self.ctl
        try:
            while loop:
                if loop.next_time() > checker.deadline_at:
                    loop.now = checker.deadline_at
                    checker.no_progress(loop.now, self.core.state.value)
                loop.step()
                if (self.final_at is not None or ctl.dead) and self._over():
                    break
            if checker.failure is None:
                checker.judge(owed(self.schedule, self.struck, self.early), ending_of(
                    self.core.exit_code, len(self.members) < self.layout.world,
                    self.config.dump_exit_code), self.truths())
        except Violation:
            pass
        except Exception as e:  # a bug of a rank's cores (or of the simulator): a crash
            try:
                checker.crashed(f"at {self.loop.now:.3f}s", e)
            except Violation:
                pass
        return Outcome(checker.failure, self.core.state.value, self.core.exit_code,
                       len(self.events), self.loop.now)

    def _over(self) -> bool:
        if self.ctl.dead:  # no controller left: the ranks give up
            self.checker.orphaned = True
            return not any(p.alive for p in self.procs.values())
        if self.final_at is None:
            return False
        grace = self.loop.now - self.final_at > 2 * self.config.lost_after
        return grace or not any(p.alive for p in self.procs.values())
