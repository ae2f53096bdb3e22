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

With `TFT_METRICS_PORT` set, the active controller also serves its metrics over HTTP
(`metrics.py`: state, ranks, incident counters in `self.stats`, goodput) from threads of
their own, which read it through `snapshot()`.
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

from .. import procfs
from ..events import CONTROLLER_RANK, configure_events, emit
from ..features import Features
from . import local
from .admission import FD_RESERVE, PENDING_MARGIN, Admission
from .backup import BackupSync
from .classify import FaultKind
from .config import ControlConfig, ControlConfigError, port_in_use, setup_logging
from .elasticity import Elasticity
from .incident import Incident, IncidentFlow, IncidentStats
from .order_types import ExitOrder, Payload, to_wire
from .priority import raise_priority
from .protocol import (
    CONTROLLER,
    TO_CONTROLLER,
    DropCounter,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    decode,
    encode,
    peek,
)
from .ranktable import CONNECTED, Health, RankInfo, RankTable
from .states import State, StateMachine
from .strategy import StrategyPlanner
from .transport import (
    MONITOR_EVENTS,
    MONITOR_NAMES,
    REFUSED,
    REFUSED_FOR_NOW,
    CurveKeys,
    bind_router,
    bound_port,
    check_bind,
    hostport,
    monitor_socket,
    raise_fd_limit,
    start_authenticator,
    storm_allowance,
    token_ok,
    user_id,
)

log = logging.getLogger("mindspeed_tft.control.controller")

_DRAIN_BATCH = 4096
#: how `_watch_local_processes` names its source in a `lost` fault's message
_SEEN_IN_PROC = "seen by the controller in /proc"
#: seconds a rank's process may be gone without a signal before it is lost (its bye first)
_GONE_GRACE = 0.2
_BATCH_WAIT = 0.01  # seconds; heartbeats wait at most this long to be read (not during incidents)
#: seconds the loop reads input before it supervises again, however much is queued
_DRAIN_SLICE = 0.05
#: seconds of queued input read before a silent rank is declared lost (its heartbeats may wait)
_LOST_DRAIN = 0.5
#: types an unregistered connection may send (anything else is dropped before decoding)
_UNBOUND_TYPES = frozenset({MsgType.REGISTER, MsgType.BACKUP})


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
        #: this process' pid namespace: ranks registered from it are watched in /proc
        #: (`_watch_local_processes`); None: nobody is (a launcher reports its workers)
        self._pid_namespace = procfs.namespace() if watch_processes else None
        #: the ranks whose processes run in it (their rows have `start`)
        self._local: set[int] = set()
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
        self.flow: IncidentFlow | None = None
        self.incidents = 0
        #: counters over the incidents that ended (kind/strategy/outcome, recoveries, ...)
        self.stats = IncidentStats()
        #: the metrics endpoint (`metrics.MetricsServer`; TFT_METRICS_PORT, active role only)
        self.metrics: Any = None
        #: elastic training: home replicas, the global batch in micro-batches (scale-out)
        self.elasticity = Elasticity()
        #: elastic training: ranks that left in a shrink and registered again; they wait
        #: (health `left`, outside every incident) until the job can grow by them
        self.returning: set[int] = set()
        self._grow_check = False
        self.exit_code: int | None = None
        self._seq = 0
        self._action_id = 0
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        #: counts of connection events (handshake failures, disconnects) from the monitor
        self.connections: dict[str, int] = {}
        self._auth: Any = None
        self._curve: CurveKeys | None = None
        #: CURVE: the client key each rank first registered with (rank -> z85 key)
        self._rank_keys: dict[int, str] = {}
        self._thread: threading.Thread | None = None
        #: the thread running the loop (`start`'s or `run`'s caller), once it started
        self._loop_ident: int | None = None
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._ready = threading.Event()
        self._final = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._ack_frame: bytes | None = None
        self._started = 0.0
        self._now = time.monotonic()
        self.backups = BackupSync(self, config=self.config, table=self.table, sm=self.sm,
                                  drops=self.drops, world_size=world_size,
                                  backup_index=backup_index)
        self._snapshot_path: str | None = None
        self._snapshot_dirty = True
        self._next_snapshot = 0.0
        self.send_errors = 0
        #: ranks not (or no longer) registered during INIT; NORMAL when it is empty
        self._missing: set[int] = set(range(world_size))

    # -- public API -------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.sm.state

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
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

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
        # a connection per rank and pending room; warned about only below one per rank
        files = raise_fd_limit(2 * self.world_size + PENDING_MARGIN + FD_RESERVE,
                               warn_below=self.world_size + FD_RESERVE + 64)
        self.admission.files = files
        what = f"{self.role} controller"
        warning = check_bind(cfg, self.bind_addr, what)  # no unauthenticated network bind
        if warning is not None:
            log.warning("%s", warning)
        self._ctx = zmq.Context()
        self._curve = CurveKeys.from_config(cfg, server=True)
        if self._curve is not None:  # the ZAP handler admits the authorized client keys
            self._auth = start_authenticator(self._ctx, self._curve)
            self.backups.server_key = self._curve.server_user_id
        # libzmq's handshake interval is a backstop: admission closes a pending one first
        backstop = cfg.admit_deadline + 1 + storm_allowance(self.admission.pending_cap)
        try:
            self._router = bind_router(self._ctx, self.bind_addr, self._port_wanted,
                                       max_bytes=cfg.max_message_bytes, curve=self._curve,
                                       handshake_ms=int(1000 * backstop),
                                       backlog=min(65535, max(4096, self.world_size)))
        except zmq.ZMQError as error:  # one line naming the port and what sets it
            if error.errno != zmq.EADDRINUSE:
                raise
            active = self.role == "active"
            raise port_in_use(self.bind_addr, self._port_wanted,
                              "the controller" if active else what,
                              "TTP_PORT" if active else "TTP_BACKUP_ADDRS") from None
        self.port = bound_port(self._router)
        self._monitor = monitor_socket(self._router, MONITOR_EVENTS)
        self._started = self._now = time.monotonic()
        if self.role == "backup":
            self.backups.connect(self._ctx, self._curve, self._now)
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
        if self._monitor is not None:
            try:
                self._router.disable_monitor()  # type: ignore[union-attr]
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
        if self._router is not None:
            try:
                self._router.setsockopt(zmq.LINGER, 2000)  # let queued exit orders leave
                self._router.close()
            except zmq.ZMQError:
                pass
        self._router = None
        self.backups.close()
        if self._auth is not None:
            try:
                self._auth.stop()
            except Exception:
                pass
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    def _loop(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        upstream = self.backups.upstream
        if upstream is not None:
            poller.register(upstream, zmq.POLLIN)
        tick = min(0.25, self.config.heartbeat_interval / 4)
        next_tick = time.monotonic()
        while not self._stopping:
            timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))
            self._now = time.monotonic()
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
                self._run_commands()
            if self._monitor is not None and self._monitor in events:
                self._drain(self._monitor, self._on_monitor)
            drained = 0
            if self._router in events:
                drained = self._drain_router()
            if self.backups.upstream is not None and self.backups.upstream in events:
                self._drain(self.backups.upstream,
                            lambda frames: self.backups.on_upstream(frames, self._now))
            if self._now >= next_tick:
                self._tick(self._now)
                next_tick = self._now + tick
            if self.sm.state is State.FINAL:  # _final is set once the sockets are flushed
                self._write_snapshot(force=True)
                break
            if 0 < drained < _DRAIN_BATCH // 8 and self.flow is None:
                # a trickle of heartbeats: let a few more arrive before waking up again, so
                # thousands of ranks cost hundreds of wake-ups a second, not thousands
                time.sleep(_BATCH_WAIT)

    def _drain(self, sock: zmq.Socket, handler: Any, budget: float = _DRAIN_SLICE) -> int:
        """Handle what `sock` has queued, for at most `budget` seconds (and `_DRAIN_BATCH`
        frames): supervision runs between slices however busy the input is. `self._now` is
        stamped as each frame is taken, so liveness is when the frame was read, not when
        the slice began."""
        deadline = time.monotonic() + budget
        for n in range(_DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            self._now = now = time.monotonic()
            handler(frames)
            if now > deadline:
                return n + 1
        return _DRAIN_BATCH

    def _drain_router(self, budget: float = _DRAIN_SLICE) -> int:
        """`_drain` for what processors and backups sent: each message is the sender's
        routing id, then its frame as a `zmq.Frame`, which names the connection it came by
        (`zmq.SRCFD`: admission) and, under CURVE, the peer's key."""
        sock = self._router
        assert sock is not None
        deadline = time.monotonic() + budget
        for n in range(_DRAIN_BATCH):
            try:
                identity = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return n
            part = sock.recv(zmq.NOBLOCK, copy=False)  # a ROUTER's message has one more part
            extra = 0
            while part.more:  # a message of several frames: read to its end, then drop it
                part = sock.recv(zmq.NOBLOCK, copy=False)
                extra += 1
            self._now = now = time.monotonic()
            self._on_frame(identity, part, extra)
            if now > deadline:
                return n + 1
        return _DRAIN_BATCH

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
                self.broadcast("pause", {"reason": "operator pause"})
            elif name == "process_exit":
                self._on_process_exit(cmd[1], cmd[2])
            elif name == "no_replacement" and self.flow is not None:
                self.flow.no_replacement(cmd[1], cmd[2])
            elif name == "resume" and self.sm.state is State.PAUSE:
                self.sm.to(State.NORMAL, "operator resume")
                self.broadcast("resume", {"step": -1, "strategy": "none", "false_alarm": True,
                                          "incident": 0})

    def _tick(self, now: float) -> None:
        state = self.sm.state
        if self.role == "active":
            self._supervise(now)
            if self.flow is not None:
                self.flow.tick(now)
            if state is State.INIT and now - self._started > self.config.register_timeout:
                missing = [r for r in range(self.world_size)
                           if (row := self.table.get(r)) is None or not row.connected]
                self._fail_init(f"ranks {missing[:32]} did not register within "
                                f"{self.config.register_timeout:g}s")
            if self._grow_check and self.flow is None and state is State.NORMAL:
                self._grow_check = False
                self._maybe_grow()
            self.backups.tick_active(now)
        else:
            self.backups.standby_tick(now)
        if self._router is not None and self.admission.due(now):
            self._drain_router(_LOST_DRAIN)  # a REGISTER already queued admits its connection
            self.admission.enforce(now)
        self._write_snapshot()

    # -- frames from processors -------------------------------------------------------------
    def _on_frame(self, identity: bytes, part: zmq.Frame, extra: int = 0) -> None:
        """One message from the ROUTER: the sender's routing id and its frame (`extra`:
        how many frames more it had)."""
        if extra:
            self.drops.drop("frames", f"{extra + 1} frames")
            return
        frame = part.bytes
        bound = self.table.lookup(identity)
        try:
            # the type from the header, its size cap, and whether this connection may send
            # it at all, before anything is decoded: a refused frame costs microseconds
            t = peek(frame, self.limits, TO_CONTROLLER)
            if t not in _UNBOUND_TYPES and bound is None:
                raise ProtocolError("unregistered", t)
            msg = decode(frame, limits=self.limits, mtype=t)
        except ProtocolError as e:
            self.drops.drop(e.reason, e.detail)
            self._snapshot_dirty = True
            return
        if bound is not None and self.admission.pending:
            # a registered rank's process, maybe on a new connection (a reconnect keeps its
            # routing id): that connection is admitted
            fd = part.get(zmq.SRCFD)
            if self.admission.is_pending(fd):
                self.admission.admit(fd)
        if t == MsgType.HEARTBEAT:
            self._on_heartbeat(identity, msg)
        elif t == MsgType.REGISTER:
            self._on_register(identity, msg, self._key(part), part)
        elif t == MsgType.REPORT:
            self._on_report(identity, msg)
        elif t == MsgType.RESULT:
            self._on_result(identity, msg)
        elif t == MsgType.BYE:
            self._on_bye(identity, msg)
        elif t == MsgType.BACKUP and self.role == "active":
            key = self._key(part)
            if token_ok(self.config, msg.payload.get("token")) and (
                    self._curve is None or key == self._curve.server_user_id):
                self._admit(part)  # a backup controller: it holds the job's token
            self.backups.on_backup(identity, msg, self._now, key)
        else:
            self.drops.drop("unexpected_type", t)
            self._snapshot_dirty = True

    def _bound(self, identity: bytes, msg: Message) -> RankInfo | None:
        row = self.table.lookup(identity)
        if row is None:
            self.drops.drop("unregistered", msg.type)
        elif row.rank != msg.sender:
            self.drops.drop("spoof", f"{msg.type} claims rank {msg.sender} from rank {row.rank}'s connection")
        elif msg.seq <= row.last_seq:
            self.drops.drop("replay", f"{msg.type} seq {msg.seq} <= {row.last_seq}")
        else:
            row.last_seq = msg.seq
            row.last_seen = self._now
            return row
        self._snapshot_dirty = True
        return None

    def _on_heartbeat(self, identity: bytes, msg: Message) -> None:
        row = self._bound(identity, msg)
        if row is None:
            return
        health = row.health
        if health in CONNECTED:
            p = msg.payload
            row.step = p["step"]
            row.status = p["status"]
            progress = p.get("progress", row.progress)
            if health is Health.HUNG and progress > row.progress and self.flow is not None:
                self.flow.clear_fault(row.rank)
            row.progress = progress
        elif health is Health.LOST:
            if self.sm.state is State.INIT or self.role == "backup":
                row.health = Health.ALIVE
                self._snapshot_dirty = True
                if self.sm.state is State.INIT:
                    self._missing.discard(row.rank)
                    if not self._missing:
                        self.sm.to(State.NORMAL, f"all {self.world_size} ranks registered")
            else:  # declared lost and handled as such: this process must go
                self._send_action(row.rank, self._new_action_id(), "exit",
                                  ExitOrder(self.config.failure_exit_code,
                                            "this rank was declared lost"),
                                  self.config.action_time_limit)
                row.health = Health.EXITING
                return
        if self.role == "backup" and self.backups.active_alive(self._now):
            self._send(identity, MsgType.REDIRECT, {"reason": "the active controller is alive"})
            self.backups.redirected(self._now)
            return
        if not msg.payload.get("ack", True):
            return
        frame = self._ack_frame
        if frame is None:
            frame = self._ack_frame = encode(
                MsgType.ACK, CONTROLLER, self.next_seq(),
                {"state": self.sm.state.value, "epoch": self.epoch, "role": self._role_name()})
        self.raw_send(identity, frame)

    def _key(self, part: zmq.Frame) -> str | None:
        """CURVE: the sender's public key, the ZAP User-Id of its frame (None without)."""
        return user_id(part) if self._curve is not None else None

    def _admit(self, part: zmq.Frame) -> bool:
        """The connection `part` came by showed the job's token: admit it (False: the rank
        cap is reached)."""
        if self._monitor is not None:  # its accept was announced before the frame came
            self._drain(self._monitor, self._on_monitor)
        return self.admission.admit(part.get(zmq.SRCFD))

    def _refused(self, identity: bytes, msg: Message, part: zmq.Frame | None) -> bool:
        """Refuse a registration without the job's token, for a rank or world size this
        job does not have, or beyond the rank cap of admitted connections (True: refused).
        A refusal says nothing about the job (no world size, no rank state): the details
        go to this controller's log only."""
        p, rank = msg.payload, msg.sender
        if not token_ok(self.config, p.get("token")):
            self.drops.drop("bad_token", f"register claiming rank {rank}")
            self._send(identity, MsgType.REJECT, REFUSED)
            return True
        if not (0 <= rank < self.world_size) or p["world_size"] != self.world_size:
            self.drops.drop("bad_register", f"rank {rank} of world size {p['world_size']} "
                            f"(this job: {self.world_size})")
            self._send(identity, MsgType.REJECT, REFUSED)
            return True
        if part is not None and not self._admit(part):  # its connection shows the token
            self.drops.drop("over_cap", f"register claiming rank {rank}")
            self._send(identity, MsgType.REJECT, REFUSED_FOR_NOW)
            return True
        return False

    def _on_register(self, identity: bytes, msg: Message, key: str | None = None,
                     part: zmq.Frame | None = None) -> None:
        """A rank registers; `key`: its CURVE public key (None without CURVE); `part`: the
        frame it came in (its connection is admitted once the token matches)."""
        p, rank, now = msg.payload, msg.sender, self._now
        if self._refused(identity, msg, part):
            return
        bound = self.table.lookup(identity)
        if bound is not None and bound.rank != rank:
            self.drops.drop("spoof", f"connection of rank {bound.rank} registers as {rank}")
            return
        row = self.table.get(rank)
        if row is not None and row.identity == identity:  # a repeated registration
            if msg.seq > row.last_seq:
                row.last_seq = msg.seq
            row.last_seen = now
            if p.get("replica") is not None:  # the layout, known after the registration
                row.replica = p["replica"]
                self.elasticity.note_registration(rank, p["replica"])
                self._snapshot_dirty = True
            if row.health is Health.LOST and (self.sm.state is State.INIT or self.role == "backup"):
                row.health = Health.ALIVE
            self.send_registered(row)
            if self.sm.state is State.INIT and self.role == "active":
                self._missing.discard(rank)
                if not self._missing:
                    self.sm.to(State.NORMAL, f"all {self.world_size} ranks registered")
            return
        failover = bool(p.get("failover", False))
        if row is not None and row.identity and not self._rebindable(row, now):
            self.drops.drop("rank_taken", f"rank {rank} registers from a second connection")
            self._send(identity, MsgType.REJECT, REFUSED_FOR_NOW)
            return
        if row is not None and row.health is Health.DONE and not failover:
            # a rank that finished training is not restarted: only its own process, failing
            # over, reconnects (a fresh registration here would undo the job's end)
            self.drops.drop("rank_done", f"rank {rank} registers after it finished")
            self._send(identity, MsgType.REJECT, REFUSED)
            return
        owner = self._rank_keys.get(rank)
        if key is not None and owner is not None and key != owner:
            # CURVE: a rank is bound to the key it first registered with; only a process
            # holding that key (its replacement) takes it back
            self.drops.drop("rank_key", f"rank {rank} registers with another CURVE key")
            self._send(identity, MsgType.REJECT, REFUSED)
            return
        state = self.sm.state
        fresh = state is not State.INIT and not failover and self.role == "active"
        prev_health = row.health if row is not None else None
        prev_replica = row.replica if row is not None else None
        info = self.table.register(rank, identity, p["host"], p["pid"], now, p.get("replica"),
                                   p.get("step", 0), p.get("status", "updated"))
        info.last_seq = msg.seq
        info.fresh = fresh
        info.start = procfs.local_start(p.get("proc"), p["pid"], self._pid_namespace)
        if info.start is not None:
            self._local.add(rank)
        self.elasticity.note_registration(rank, p.get("replica"))
        if key is not None:
            self._rank_keys.setdefault(rank, key)
        if prev_health in (Health.DONE,) and failover:
            info.health = Health.DONE
        self._snapshot_dirty = True
        log.info("rank %d registered (pid %s on %s%s)", rank, p["pid"], p["host"],
                 ", restarted" if fresh else (", failover" if failover else ""))
        self.send_registered(info)
        if self.role != "active":
            return
        if state is State.INIT:
            self._missing.discard(rank)
            if not self._missing:
                self.sm.to(State.NORMAL, f"all {self.world_size} ranks registered")
        elif fresh and self.features.elastic and (
                prev_health is Health.LEFT or len(self.table.members()) < self.world_size):
            self._returned(info, prev_replica)
        elif fresh:
            if self.flow is not None:
                self.flow.on_registered(rank)
            else:
                self._send_action(rank, self._new_action_id(), "exit", ExitOrder(
                    self.config.failure_exit_code,
                    f"rank {rank} restarted while no recovery was under way"),
                    self.config.action_time_limit)
                info.health = Health.EXITING

    # -- elastic training: growing back ------------------------------------------------------
    def _returned(self, row: RankInfo, replica: dict[str, Any] | None) -> None:
        """A restarted process registered while the job is shrunk (for a rank that left, or
        one lost since: a replacement cannot take a rank's place in a shrunk world, whose
        layout differs from its own). It waits outside the job (health `left`) until its
        replica is complete and the job can grow by it (`_maybe_grow`)."""
        row.health = Health.LEFT
        row.replica = replica  # its place in the job's current layout, until it grows
        self.returning.add(row.rank)
        self._grow_check = True
        log.warning("rank %d came back into a shrunk job: the job grows by it once its "
                    "data-parallel replica is complete", row.rank)
        if self.flow is not None:  # an incident waiting for it does not get it back
            self.flow.no_replacement(row.rank, "it came back into a shrunk job: it rejoins "
                                               "by a scale-out")

    def _maybe_grow(self) -> None:
        """Start a scale-out when the returning ranks let the job grow (loop thread)."""
        lost = self.config.lost_after
        for rank in sorted(self.returning):  # a returning process that went silent is gone
            row = self.table.get(rank)
            if row is None or row.health is not Health.LEFT or self._now - row.last_seen > lost:
                self.returning.discard(rank)
        members = [r for r in self.table.members() if r not in self.returning]
        grown = self.elasticity.grown_world(members, self.returning)
        if grown is None:
            return
        world, dp_size = grown
        joining = [r for r in world if r in self.returning]
        self.returning -= set(joining)
        self.incidents += 1
        self.flow = IncidentFlow(self, Incident(self.incidents, self._now))
        self.flow.begin_scale_out(world, dp_size, joining)

    def _dismiss_returning(self, reason: str) -> None:
        """The job ends: returning ranks still waiting to join exit cleanly."""
        for rank in sorted(self.returning):
            self._send_action(rank, self._new_action_id(), "exit", ExitOrder(0, reason),
                              self.config.action_time_limit)
        self.returning.clear()

    def _rebindable(self, row: RankInfo, now: float) -> bool:
        """May another connection take over this rank's row?"""
        if self.role == "backup":
            return now - row.last_seen > self.config.lost_after
        return row.health not in CONNECTED

    def send_registered(self, row: RankInfo) -> None:
        lock = self.incident_lock_step()
        self._send(row.identity, MsgType.REGISTERED, {
            "epoch": self.epoch, "state": self.sm.state.value,
            "interval": self.config.heartbeat_interval, "misses": self.config.heartbeat_misses,
            "backups": self.backups.addresses(), "rejoin": row.fresh,
            "lock_step": lock, "role": self._role_name()})

    def _on_report(self, identity: bytes, msg: Message) -> None:
        row = self._bound(identity, msg)
        if row is None or self.role != "active":
            return
        p = msg.payload
        kind = FaultKind(p["kind"])
        if row.health in CONNECTED:
            row.step, row.status = p["step"], p["status"]
        if kind is FaultKind.NORMAL:
            if self.flow is None and self.sm.state in (State.NORMAL, State.PAUSE):
                # a rank stopped itself with no incident under way: let it go on
                self._send_action(row.rank, self._new_action_id(), "resume", {
                    "incident": 0, "step": row.step, "strategy": "none", "false_alarm": True},
                    self.config.action_time_limit)
            return
        if row.health not in CONNECTED:
            return
        if kind is FaultKind.HANG and self.flow is not None and row.rank in self.flow.incident.parked:
            return  # a report that crossed the stop: its training thread did come back
        row.health = Health.HUNG if kind is FaultKind.HANG else Health.FAULTY
        self._snapshot_dirty = True
        self.fault(row.rank, kind, p["message"], p.get("detail"))

    def _on_result(self, identity: bytes, msg: Message) -> None:
        row = self._bound(identity, msg)
        if row is not None and self.flow is not None:
            self.flow.on_result(row.rank, msg.payload)

    def _on_bye(self, identity: bytes, msg: Message) -> None:
        row = self._bound(identity, msg)
        if row is None or self.role != "active":
            return
        row.health = Health.DONE
        self._snapshot_dirty = True
        log.info("rank %d finished (code %d)", row.rank, msg.payload["code"])
        if self.flow is not None:
            self.flow.on_gone(row.rank, "finished")
        if self.sm.state is State.NORMAL and all(
                (r := self.table.get(i)) is not None and r.health is Health.DONE
                for i in self.table.members()):
            self.sm.to(State.EXIT, "training finished")
            self._dismiss_returning("training finished before the job could grow by this rank")
            self.exit_code = 0
            emit("exit", CONTROLLER_RANK, code=0, reason="training finished")
            self.sm.to(State.FINAL, "training finished")

    def _on_monitor(self, frames: list[bytes]) -> None:
        """Connection events: failed handshakes (wrong CURVE key, garbage) and disconnects
        (including peers libzmq cut off for frames far over the size limit)."""
        try:
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:6], "little")
        except (IndexError, TypeError):
            return
        name = MONITOR_NAMES.get(event)
        if name is None:
            return
        self.admission.on_event(event, value, self._now)  # accepted/disconnected: by fd
        n = self.connections.get(name, 0) + 1
        self.connections[name] = n
        self._snapshot_dirty = True
        if name not in ("disconnected", "accepted") and (n <= 10 or n % 1000 == 0):
            log.warning("connection event #%d: %s", n, name)
        if event == zmq.EVENT_ACCEPTED and self.admission.crowded():
            self.admission.enforce(self._now)  # the oldest pending make room for the newest

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
            self.incidents += 1
            self.flow = IncidentFlow(self, Incident(self.incidents, self._now))
            if detail:
                self.flow.incident.details[rank] = detail
            self.flow.begin(rank, kind, message)
        elif self.flow is not None:
            self.flow.add_fault(rank, kind, message)

    def _fail_init(self, reason: str) -> None:
        log.error("initialisation failed: %s", reason)
        code = self.config.failure_exit_code
        self.exit_code = code
        emit("exit", CONTROLLER_RANK, code=code, reason=reason)
        self.broadcast("exit", ExitOrder(code, reason))
        self.sm.to(State.FINAL, reason)

    def _supervise(self, now: float) -> None:
        self._watch_local_processes(now)
        overdue = self.table.overdue(now, self.config.lost_after)
        if overdue and self._router is not None:
            # their heartbeats may be queued behind other input: read it first (bounded)
            self._drain_router(_LOST_DRAIN)
            overdue = self.table.overdue(now, self.config.lost_after)  # still silent
        for row in overdue:
            silent = now - row.last_seen
            self._declare_lost(row, f"silent for {silent:.1f}s", f"no heartbeat for {silent:.1f}s")

    def _declare_lost(self, row: RankInfo, during_init: str, message: str) -> None:
        """A connected rank's process is gone (silence or a launcher's report)."""
        row.health = Health.LOST
        self._snapshot_dirty = True
        if self.sm.state is State.INIT:
            log.warning("rank %d %s during registration", row.rank, during_init)
            self._missing.add(row.rank)
            return
        self.fault(row.rank, FaultKind.LOST, message)

    def _watch_local_processes(self, now: float) -> None:
        """Ranks in this pid namespace (`RankInfo.start`; under plain torchrun no launcher
        reports deaths): one whose process a signal is ending is lost now, as a launcher
        would report it; one whose process ended otherwise or is already gone (reaped) is
        lost `_GONE_GRACE` later if it is still connected then (a clean exit's bye, sent
        before it ended, is read first)."""
        for rank in sorted(self._local):  # not every row: thousands of remote ranks, 4 x/s
            row = self.table.get(rank)
            if row is None or row.start is None:
                self._local.discard(rank)
                continue
            if not row.connected:
                continue
            running, code = procfs.process_state(row.pid, row.start)
            if running:
                continue
            if code is not None:
                self._on_process_exit(row.rank, code, _SEEN_IN_PROC)
            elif row.gone_since is None:
                row.gone_since = now
            elif now - row.gone_since >= _GONE_GRACE:
                self._process_gone(row.rank, "ended", _SEEN_IN_PROC)

    def _on_process_exit(self, rank: int, returncode: int,
                         source: str = "reported by its launcher") -> None:
        if self.role != "active" or returncode == 0:
            return
        how = (f"killed by signal {-returncode}" if returncode < 0
               else f"exited with code {returncode}")
        self._process_gone(rank, how, source)

    def _process_gone(self, rank: int, how: str, source: str) -> None:
        """`rank`'s process `how` ("killed by signal 9", ...): lost, unless a bye or report
        it sent before it ended says otherwise."""
        if self._router is not None:  # a bye or report it sent before it ended comes first
            self._drain_router()
        row = self.table.get(rank)
        if row is None or not row.connected:
            log.info("rank %d: process %s, not connected (%s): nothing to do",
                     rank, how, "unregistered" if row is None else row.health)
            return
        log.warning("rank %d: process %s (%s)", rank, how, source)
        self._declare_lost(row, f"process {how}", f"process {how} ({source})")

    # -- FlowHost ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic()

    def new_action_id(self) -> int:
        return self._new_action_id()

    def _new_action_id(self) -> int:
        self._action_id += 1
        return self._action_id

    def send_action(self, rank: int, action_id: int, name: str, payload: Payload,
                    timeout: float) -> None:
        self._send_action(rank, action_id, name, payload, timeout)

    def send_action_many(self, ranks: list[int], action_id: int, name: str,
                         payload: Payload, timeout: float) -> None:
        """The same order to many ranks (encoded once)."""
        frame = encode(MsgType.ACTION, CONTROLLER, self.next_seq(),
                       {"id": action_id, "name": name, "timeout": float(timeout),
                        "payload": to_wire(payload)})
        for rank in ranks:
            row = self.table.get(rank)
            if row is not None and row.identity:
                self.raw_send(row.identity, frame)

    def _send_action(self, rank: int, action_id: int, name: str, payload: Payload,
                     timeout: float) -> None:
        row = self.table.get(rank)
        if row is None or not row.identity:
            return
        self._send(row.identity, MsgType.ACTION,
                   {"id": action_id, "name": name, "timeout": float(timeout),
                    "payload": to_wire(payload)})

    def flow_finished(self, flow: IncidentFlow) -> None:
        if self.flow is flow:
            self.flow = None
        if flow.outcome is not None:
            self.stats.add(flow.outcome)
        if flow.exit_code is not None:
            self.exit_code = flow.exit_code
            self._dismiss_returning(f"the job ended (exit code {flow.exit_code}) before it "
                                    "could grow by this rank")
        self._grow_check = bool(self.returning)
        self._snapshot_dirty = True

    # -- BackupHost (the rest: next_seq, raw_send, broadcast, send_registered, fault) ------
    def incident_lock_step(self) -> int | None:
        """The lock step of the incident under way; None when there is none."""
        return self.flow.incident.lock_step if self.flow is not None else None

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

    def _send(self, identity: bytes, mtype: str, payload: dict[str, Any]) -> None:
        self.raw_send(identity, encode(mtype, CONTROLLER, self.next_seq(), payload))

    def raw_send(self, identity: bytes, frame: bytes) -> None:
        try:
            self._router.send_multipart([identity, frame], zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.ZMQError:
            self.send_errors += 1

    def broadcast(self, name: str, payload: Payload) -> None:
        self.send_action_many([r.rank for r in self.table.connected()], self._new_action_id(),
                              name, payload, self.config.action_time_limit)

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
            "connections": {**self.connections, **self.admission.view()},
            "backups": self.backups.joined(),
            "incident": None if self.flow is None else {
                "id": self.flow.incident.id,
                "faults": {str(r): k.value for r, k in self.flow.incident.faults.items()},
                "strategy": str(self.flow.incident.strategy),
                "lock_step": self.flow.incident.lock_step,
                "phase": self.flow.phase.name if self.flow.phase else None,
            },
            "incidents": self.incidents,
            "incident_stats": self.stats.view(),
            # seconds since the longest-silent connected rank was heard from
            "heartbeat_age": max((time.monotonic() - r.last_seen for r in self.table.connected()),
                                 default=None),
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
