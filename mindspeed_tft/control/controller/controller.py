"""The controller: rank table, heartbeat supervision, state machine and fault handling.

One `Controller` is active per job; up to two more run as backups on other nodes. It owns a
ROUTER socket and a single loop thread that does everything: decode and check frames
(`protocol`), bind each rank to the connection it registered from, supervise heartbeats
(a rank silent for interval x misses is lost), take error and hang reports, and hand every
fault to an `IncidentFlow` that runs the SPEC 5 sequence with per-action deadlines. No
callback or peer can block the loop: sockets never block, every wait is a deadline.

Where it runs: a background thread of rank 0's training process under plain torchrun
(`Controller(...).start()`), the launcher of node 0 under `tft-run`, or standalone:

    python -m mindspeed_tft.control.controller --world-size 8 [--port 8000] ...

Backups (`role="backup"`) stay in sync with the active controller and take charge when it
disappears, but only with more than half of the ranks alive: every controller holds a
`backup.BackupSync` for that (`self.backups`), which reaches back into the controller only
through the `BackupHost` methods below.

The controller is the loop, its commands and its ticks; the rest it holds, each reaching back
only through a small protocol of its own: `sockets.ControllerSockets` (`self.sockets`),
`inbox.Inbox` (`self.inbox`: each message, `InboxHost`), `registration.Registration`
(`self.registration`: `RegistrationHost`), `liveness.Liveness` (`self.liveness`: silent ranks
and ended processes, `LivenessHost`) and `incidents.Incidents` (`self.incidents`: the
incident under way, the orders it sends, its counters; `IncidentsHost`).

With `TFT_METRICS_PORT` set, the active controller also serves its metrics over HTTP
(`metrics.py`: state, ranks, incident counters in `self.incidents.stats`, goodput) from
threads of their own, which read it through `snapshot()`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

import zmq

from ...events import CONTROLLER_RANK, configure_events, emit
from ...features import Features
from ..wire import local
from ..wire.classify import FaultKind
from ..wire.config import ControlConfig, ControlConfigError, setup_logging
from ..wire.order_types import ExitOrder, PauseOrder, Payload, ResumeOrder
from ..wire.priority import raise_priority
from ..wire.protocol import (
    CONTROLLER,
    DropCounter,
    Limits,
    MsgType,
    encode,
)
from ..wire.transport import (
    hostport,
)
from .admission import PENDING_MARGIN, Admission
from .backup import BackupSync
from .elasticity import Elasticity
from .inbox import Inbox
from .incident import IncidentFlow
from .incidents import Incidents
from .liveness import LOST_DRAIN, Liveness
from .ranktable import Health, RankInfo, RankTable
from .registration import Registration
from .sockets import DRAIN_BATCH, DRAIN_SLICE, ControllerSockets
from .states import State, StateMachine
from .strategy import StrategyPlanner

log = logging.getLogger("mindspeed_tft.control.controller")

_BATCH_WAIT = 0.01  # seconds; heartbeats wait at most this long to be read (not during incidents)


class Controller:
    """The control plane's brain (see the module docstring).

    world_size: number of training ranks. config: addresses, timing, CURVE (default
    `ControlConfig.from_env()`). features/planner: strategy choice and action payloads.
    role: "active" or "backup"; a backup binds `bind_addr:port` and syncs from the active
    controller at `config.processor_addr:config.port`. port 0 binds any free port.
    watch_processes: a rank whose process runs in this process' pid namespace is lost as
    soon as a signal ends it (seen in /proc); False where a launcher reports its workers'
    deaths (`report_process_exit`: `tft-run`).
    """

    def __init__(self, world_size: int, config: ControlConfig | None = None, *,
                 features: Features | None = None, planner: StrategyPlanner | None = None,
                 role: str = "active", backup_index: int = 0, bind_addr: str | None = None,
                 port: int | None = None, watch_processes: bool = True) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if role not in ("active", "backup"):
            raise ValueError(f"role={role!r} must be 'active' or 'backup'")
        self.config = config or ControlConfig.from_env()
        self.world_size = world_size
        self.features = features or Features(high_availability=True)
        self.planner = planner or StrategyPlanner(self.features)
        self.role = role
        self.backup_index = backup_index
        self.bind_addr = bind_addr or self.config.controller_addr
        self._port_wanted = self.config.port if port is None else port
        self.port: int | None = None
        self.table = RankTable(world_size)
        self.sm = StateMachine(State.INIT, emit_events=False)  # INIT is announced on start
        self.sm.listeners.append(self._on_transition)
        self.drops = DropCounter(log)
        #: per-type frame caps and msgpack limits for this world size (protocol.Limits)
        self.limits = Limits.for_world(world_size, self.config.max_message_bytes)
        #: the ROUTER's connections by class: admitted (showed the job's token; at most a
        #: connection per rank twice over, for replacements while the old connection times
        #: out, two backups and a margin) and pending (their own bound and deadline)
        self.admission = Admission(2 * world_size + 64, world_size + PENDING_MARGIN,
                                   self.config.admit_deadline)
        self.epoch = 0
        #: the metrics endpoint (`metrics.MetricsServer`; TFT_METRICS_PORT, active role only)
        self.metrics: Any = None
        #: elastic training: home replicas, the global batch in micro-batches (scale-out)
        self.elasticity = Elasticity()
        self.exit_code: int | None = None
        self._seq = 0
        #: the ROUTER, its monitor, the context and the wake-up pipe (`sockets`)
        self.sockets = ControllerSockets(self.config, self.admission)
        self._thread: threading.Thread | None = None
        #: the thread running the loop (`start`'s or `run`'s caller), once it started
        self._loop_ident: int | None = None
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._final = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._ack_frame: bytes | None = None
        self._started = 0.0
        self.backups = BackupSync(self, config=self.config, table=self.table, sm=self.sm,
                                  drops=self.drops, world_size=world_size,
                                  backup_index=backup_index)
        self._snapshot_path: str | None = None
        self._snapshot_dirty = True
        self._next_snapshot = 0.0
        #: silent ranks and ended processes (`liveness.Liveness`, through `LivenessHost`)
        self.liveness = Liveness(self, config=self.config, table=self.table, sm=self.sm,
                                 watch_processes=watch_processes)
        #: registrations and the INIT roll call (`registration.Registration`)
        self.registration = Registration(
            self, config=self.config, world_size=world_size, table=self.table, sm=self.sm,
            drops=self.drops, elasticity=self.elasticity, watch=self.liveness)
        #: the incident under way, the orders it sends, its counters (`incidents.Incidents`)
        self.incidents = Incidents(self, config=self.config, table=self.table, sm=self.sm,
                                   planner=self.planner, elasticity=self.elasticity)
        #: what processors and backups send (`inbox.Inbox`)
        self.inbox = Inbox(self, config=self.config, table=self.table, sm=self.sm,
                           drops=self.drops, limits=self.limits, admission=self.admission,
                           sockets=self.sockets, registration=self.registration,
                           backups=self.backups)

    # -- public API -------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.sm.state

    @property
    def flow(self) -> IncidentFlow | None:
        """The incident under way (`Incidents.flow`)."""
        return self.incidents.flow

    @property
    def _now(self) -> float:
        """The loop's clock: when the frame being handled was read (`ControllerSockets`)."""
        return self.sockets.now

    @property
    def endpoint(self) -> str:
        """`ip:port` this controller listens on (after `start`)."""
        return hostport(self.bind_addr, self.port or self._port_wanted)

    def start(self, timeout: float = 30.0) -> None:
        """Bind and run the loop in a background thread (returns once bound)."""
        if self._thread is not None:
            raise RuntimeError("controller already started")
        self._thread = threading.Thread(target=self._main, name=f"tft-controller-{self.role}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"controller did not bind within {timeout}s")
        if self._error is not None:
            raise self._error
        local.register(self)

    def run(self) -> int:
        """Run the loop in this thread until FINAL or `stop()`; returns the exit code decided."""
        self._main()
        if self._error is not None:
            raise self._error
        return self.exit_code or 0

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and close the sockets (and the metrics endpoint)."""
        self._command("stop")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._stop_metrics()
        local.unregister(self)

    def wait_final(self, timeout: float | None = None) -> bool:
        """Wait until the controller reached FINAL (or stopped)."""
        return self._final.wait(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def pause(self) -> None:
        """Operator pause: NORMAL -> PAUSE, ranks hold before their next update."""
        self._command("pause")

    def resume(self) -> None:
        """End an operator pause: PAUSE -> NORMAL."""
        self._command("resume")

    def report_process_exit(self, rank: int, returncode: int) -> None:
        """A launcher saw `rank`'s process end (thread-safe; returns at once).

        The loop treats the rank as lost right away, exactly as when its heartbeats stop
        (`fault_detected` kind `lost`, the same incident handling), instead of waiting
        interval x misses. Ignored for a rank that is not connected (it said bye, was
        ordered to exit or is already lost) and for returncode 0 (a clean exit is no fault;
        if it never said bye, its silence still gives it away)."""
        self._command("process_exit", int(rank), int(returncode))

    def report_no_replacement(self, rank: int, why: str) -> None:
        """A launcher will not restart lost `rank` (thread-safe; returns at once): the
        incident stops waiting for it (a dump, or with elastic training a shrink)."""
        self._command("no_replacement", int(rank), str(why))

    def has_left(self, rank: int) -> bool:
        """Whether elastic training shrank the job without `rank` (any thread)."""
        row = self.table.get(rank)
        return row is not None and row.health is Health.LEFT

    def snapshot(self, timeout: float = 5.0) -> dict[str, Any]:
        """State, rank table, drop counters (computed in the loop thread when running, in
        `start`'s thread or in `run`'s: any other thread, e.g. the metrics endpoint's, asks
        the loop)."""
        if (self._loop_ident is None or self._final.is_set()
                or threading.get_ident() == self._loop_ident):
            return self._snapshot()
        box: list[dict[str, Any]] = []
        done = threading.Event()
        self._command("snapshot", box, done)
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            if self._final.is_set():  # the loop ended before it saw the request
                return self._snapshot()
            if time.monotonic() > deadline:
                raise TimeoutError("controller loop did not answer")
        return box[0]

    def write_snapshots(self, path: str) -> None:
        """Write a JSON snapshot to `path` whenever something but heartbeat times changed."""
        self._snapshot_path = path

    # -- loop ---------------------------------------------------------------------------
    def _command(self, *cmd: Any) -> None:
        self._commands.put(cmd)
        self.sockets.wake()

    def _main(self) -> None:
        self._loop_ident = threading.get_ident()
        # before the ZeroMQ context: its threads inherit it
        raise_priority(self.config.thread_nice, self.config.thread_rtprio)
        try:
            self._setup()
        except BaseException as e:
            self._error = e
            self._ready.set()
            self._final.set()
            self._close()
            self._stop_metrics()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # a bug: log it loudly, never leave processors hanging
            self._error = e
            log.exception("controller loop failed")
        finally:
            self._close()
            self._final.set()

    def _setup(self) -> None:
        cfg = self.config
        self.port = self.sockets.open(self.world_size, self.bind_addr, self._port_wanted,
                                      self.role)
        if self.sockets.curve is not None:  # backups hold the server pair
            self.backups.server_key = self.sockets.curve.server_user_id
        self._started = self.sockets.now = time.monotonic()
        if self.role == "backup":
            assert self.sockets.ctx is not None
            self.backups.connect(self.sockets.ctx, self.sockets.curve, self._now)
        log.info("%s controller for %d ranks listening on %s", self.role, self.world_size,
                 self.endpoint)
        if self.role == "active":
            self.sm.emit_events = True
            self.sm.announce("controller started")
            if cfg.metrics_port:  # served from its own threads; it reads `snapshot()`
                from .metrics import serve

                self.metrics = serve(self, cfg)
                log.info("metrics endpoint on %s", self.metrics.url)

    def _stop_metrics(self) -> None:
        server, self.metrics = self.metrics, None
        if server is not None:
            server.stop()

    def _close(self) -> None:
        self.sockets.close()
        self.backups.close()
        self.sockets.term()

    def _loop(self) -> None:
        socks = self.sockets
        assert socks.router is not None
        poller = zmq.Poller()
        poller.register(socks.router, zmq.POLLIN)
        poller.register(socks.wake_r, zmq.POLLIN)
        if socks.monitor is not None:
            poller.register(socks.monitor, zmq.POLLIN)
        upstream = self.backups.upstream
        if upstream is not None:
            poller.register(upstream, zmq.POLLIN)
        tick = min(0.25, self.config.heartbeat_interval / 4)
        next_tick = time.monotonic()
        while not self._stopping:
            timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))
            self.sockets.now = time.monotonic()
            if socks.wake_r in events:
                os.read(socks.wake_r, 4096)
                self._run_commands()
            if socks.monitor is not None and socks.monitor in events:
                socks.drain(socks.monitor, self._on_monitor)
            drained = 0
            if socks.router in events:
                drained = self.drain_router()
            if self.backups.upstream is not None and self.backups.upstream in events:
                socks.drain(self.backups.upstream,
                            lambda frames: self.backups.on_upstream(frames, self._now))
            if self._now >= next_tick:
                self._tick(self._now)
                next_tick = self._now + tick
            if self.sm.state is State.FINAL:  # _final is set once the sockets are flushed
                self._write_snapshot(force=True)
                break
            if 0 < drained < DRAIN_BATCH // 8 and self.flow is None:
                # a trickle of heartbeats: let a few more arrive before waking up again, so
                # thousands of ranks cost hundreds of wake-ups a second, not thousands
                time.sleep(_BATCH_WAIT)

    def drain_router(self, budget: float = DRAIN_SLICE) -> int:
        """Handle what processors and backups sent, for at most `budget` seconds (0: the
        socket is closed)."""
        return self.sockets.drain_router(self.inbox.on_frame, budget)

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            name = cmd[0]
            if name == "stop":
                self._stopping = True
            elif name == "snapshot":
                cmd[1].append(self._snapshot())
                cmd[2].set()
            elif name == "pause" and self.sm.state is State.NORMAL and self.role == "active":
                self.sm.to(State.PAUSE, "operator pause")
                self.broadcast("pause", PauseOrder("operator pause"))
            elif name == "process_exit":
                self.liveness.on_process_exit(cmd[1], cmd[2])
            elif name == "no_replacement" and self.flow is not None:
                self.flow.no_replacement(cmd[1], cmd[2])
            elif name == "resume" and self.sm.state is State.PAUSE:
                self.sm.to(State.NORMAL, "operator resume")
                self.broadcast("resume", ResumeOrder(0, None, "none", True))

    def _tick(self, now: float) -> None:
        state = self.sm.state
        if self.role == "active":
            self.liveness.supervise(now)
            if self.flow is not None:
                self.flow.tick(now)
            if state is State.INIT and (late := self.registration.overdue(now, self._started)):
                self._fail_init(late)
            if self.incidents.grow_check and self.flow is None and state is State.NORMAL:
                self.incidents.grow_check = False
                self.incidents.maybe_grow(self._now)
            self.backups.tick_active(now)
        else:
            self.backups.standby_tick(now)
        if self.sockets.router is not None and self.admission.due(now):
            self.drain_router(LOST_DRAIN)  # a REGISTER already queued admits its connection
            self.admission.enforce(now)
        self._write_snapshot()

    # -- InboxHost, RegistrationHost, LivenessHost (and fault, mark_dirty, send, raw_send) --
    def admit(self, part: zmq.Frame) -> bool:
        """The connection `part` came by showed the job's token: admit it (False: the rank
        cap is reached)."""
        if self.sockets.monitor is not None:  # its accept was announced before the frame came
            self.sockets.drain(self.sockets.monitor, self._on_monitor)
        return self.admission.admit(part.get(zmq.SRCFD))

    def rank_restarted(self, row: RankInfo) -> None:
        self.incidents.rank_restarted(row)

    def rank_returned(self, row: RankInfo, replica: dict[str, Any] | None) -> None:
        self.incidents.rank_returned(row, replica)

    def order(self, rank: int, name: str, payload: Payload) -> None:
        self.incidents.order(rank, name, payload)

    def ack_frame(self) -> bytes:
        """The answer to a heartbeat (encoded once per state, epoch and role)."""
        frame = self._ack_frame
        if frame is None:
            frame = self._ack_frame = encode(
                MsgType.ACK, CONTROLLER, self.next_seq(),
                {"state": self.sm.state.value, "epoch": self.epoch, "role": self._role_name()})
        return frame

    def training_finished(self) -> None:
        """Every member said bye: the job ends with code 0."""
        self.sm.to(State.EXIT, "training finished")
        self.incidents.dismiss_returning("training finished before the job could grow by "
                                         "this rank")
        self.exit_code = 0
        emit("exit", CONTROLLER_RANK, code=0, reason="training finished")
        self.sm.to(State.FINAL, "training finished")

    def rank_missing(self, rank: int) -> None:
        """A rank was lost during INIT: the roll call waits for it again."""
        self.registration.missing.add(rank)

    def send_registered(self, row: RankInfo) -> None:
        lock = self.incident_lock_step()
        self.send(row.identity, MsgType.REGISTERED, {
            "epoch": self.epoch, "state": self.sm.state.value,
            "interval": self.config.heartbeat_interval, "misses": self.config.heartbeat_misses,
            "backups": self.backups.addresses(), "rejoin": row.fresh,
            "lock_step": lock, "role": self._role_name()})

    def _on_monitor(self, frames: list[bytes]) -> None:
        """Connection events (`ControllerSockets.on_monitor`)."""
        if self.sockets.on_monitor(frames):
            self._snapshot_dirty = True

    # -- faults -----------------------------------------------------------------------------
    def fault(self, rank: int, kind: FaultKind, message: str,
              detail: dict[str, Any] | None = None) -> None:
        """A fault on `rank`: starts an incident, joins the one under way, or ends INIT."""
        state = self.sm.state
        if detail and self.flow is not None:
            self.flow.incident.details[rank] = detail
        if state is State.INIT:
            emit("fault_detected", CONTROLLER_RANK, ranks=[rank], kind=kind.value,
                 message=message[:500])
            self._fail_init(f"{kind} on rank {rank} before all ranks registered: {message[:200]}")
        elif self.flow is None and state in (State.NORMAL, State.PAUSE):
            self.incidents.open(rank, kind, message, detail, self._now)
        elif self.flow is not None:
            self.flow.add_fault(rank, kind, message)

    def _fail_init(self, reason: str) -> None:
        log.error("initialisation failed: %s", reason)
        code = self.config.failure_exit_code
        self.exit_code = code
        emit("exit", CONTROLLER_RANK, code=code, reason=reason)
        self.broadcast("exit", ExitOrder(code, reason))
        self.sm.to(State.FINAL, reason)

    # -- BackupHost (the rest: next_seq, raw_send, broadcast, send_registered, fault) ------
    def incident_lock_step(self) -> int | None:
        """The lock step of the incident under way; None when there is none."""
        return self.incidents.lock_step()

    def adopt(self, epoch: int, features: Features) -> None:
        """A backup takes the active controller's epoch and features (sync)."""
        self.epoch = epoch
        self.features = features
        self.planner.features = features

    def become_active(self) -> None:
        """A backup takes charge: a new epoch, and its transitions are events from now on."""
        self.role = "active"
        self.epoch += 1
        self.sm.emit_events = True
        self._ack_frame = None

    def mark_dirty(self) -> None:
        """Something a snapshot shows changed."""
        self._snapshot_dirty = True

    # -- sending ----------------------------------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def send(self, identity: bytes, mtype: str, payload: dict[str, Any]) -> None:
        self.raw_send(identity, encode(mtype, CONTROLLER, self.next_seq(), payload))

    def raw_send(self, identity: bytes, frame: bytes) -> None:
        self.sockets.raw_send(identity, frame)

    def broadcast(self, name: str, payload: Payload) -> None:
        self.incidents.send_action_many([r.rank for r in self.table.connected()],
                                        self.incidents.new_action_id(), name, payload,
                                        self.config.action_time_limit)

    def _role_name(self) -> str:
        return "active" if self.role == "active" else "standby"

    def _on_transition(self, old: State, new: State, reason: str) -> None:
        self._ack_frame = None
        self._snapshot_dirty = True
        self.backups.sync_soon()

    # -- snapshots ------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        return {
            "state": self.sm.state.value,
            "role": self._role_name(),
            "epoch": self.epoch,
            "world_size": self.world_size,
            "port": self.port,
            "ranks": {str(k): v for k, v in self.table.snapshot().items()},
            "dropped": dict(self.drops.counts),
            "dropped_total": self.drops.total,
            "connections": {**self.sockets.connections, **self.admission.view()},
            "backups": self.backups.joined(),
            "incident": self.incidents.view(),
            "incidents": self.incidents.count,
            "incident_stats": self.incidents.stats.view(),
            # seconds since the longest-silent connected rank was heard from
            "heartbeat_age": self.liveness.heartbeat_age(time.monotonic()),
            "exit_code": self.exit_code,
            "history": [s.value for s in self.sm.history],
        }

    def _write_snapshot(self, force: bool = False) -> None:
        path = self._snapshot_path
        if path is None or not (self._snapshot_dirty or force) or (
                not force and self._now < self._next_snapshot):
            return
        self._snapshot_dirty = False
        self._next_snapshot = self._now + 0.1
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._snapshot(), f)
        os.replace(tmp, path)


# -- command line -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mindspeed_tft.control.controller",
        description="Run a mindspeed-tft controller (active or backup) in this process.")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--addr", default=None, help="address to bind (default CONTROLLER_ADDR/TTP_ADDR)")
    parser.add_argument("--port", type=int, default=None, help="port (default TTP_PORT; 0 = any)")
    parser.add_argument("--role", choices=("active", "backup"), default="active")
    parser.add_argument("--backup-index", type=int, default=0)
    parser.add_argument("--features", default="dump",
                        help="comma list of dump, retry, recover, no_replica")
    parser.add_argument("--interval", type=float, default=None, help="heartbeat interval (s)")
    parser.add_argument("--misses", type=int, default=None, help="missed heartbeats before lost")
    parser.add_argument("--action-time-limit", type=float, default=None)
    parser.add_argument("--register-timeout", type=float, default=None)
    parser.add_argument("--events", default=None, help="events file (default TFT_EVENTS_FILE)")
    parser.add_argument("--ready-file", default=None,
                        help="write {port, pid} here once listening")
    parser.add_argument("--snapshot", default=None, help="keep a JSON snapshot in this file")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for name, key in (("interval", "heartbeat_interval"), ("misses", "heartbeat_misses"),
                      ("action_time_limit", "action_time_limit"),
                      ("register_timeout", "register_timeout")):
        if getattr(args, name) is not None:
            overrides[key] = getattr(args, name)
    try:
        config = ControlConfig.from_env(**overrides)
        features = Features.from_names(args.features)
    except ValueError as error:  # ControlConfigError names the variable; a bad --features
        parser.error(str(error))
    setup_logging(config)
    configure_events(args.events)
    ctrl = Controller(args.world_size, config, features=features,
                      role=args.role, backup_index=args.backup_index, bind_addr=args.addr,
                      port=args.port)
    if args.snapshot:
        ctrl.write_snapshots(args.snapshot)

    def _term(signum: int, frame: Any) -> None:
        ctrl.stop(timeout=0)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    if args.ready_file:
        def _announce() -> None:
            if ctrl.wait_ready(60) and ctrl.port:
                tmp = args.ready_file + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump({"port": ctrl.port, "pid": os.getpid()}, f)
                os.replace(tmp, args.ready_file)
        threading.Thread(target=_announce, daemon=True).start()
    try:
        return ctrl.run()
    except ControlConfigError as error:  # at start: e.g. a network bind without CURVE keys
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
