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

`Controller` is a thin shell: every decision is its core's (`core.ControllerCore`,
`self.core`: a state machine without I/O, which the simulator `control.sim` drives too). The
shell owns what does I/O: the ROUTER and its monitor (`sockets.ControllerSockets`), the
admission of connections (`admission.Admission`), a backup's link to the active controller,
/proc watching (`procwatch.LocalProcesses`), the loop thread, the real clock, typed commands
from other threads (`core.Command`), the snapshot file and the metrics endpoint. It feeds
the core each frame, command and tick with the time it was read, then writes the events the
core decided to the events stream and sends its frames.

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
from dataclasses import dataclass, field
from typing import Any

import zmq

from ...events import configure_events, write_record
from ...features import Features
from ..wire import local
from ..wire.config import ControlConfig, ControlConfigError, setup_logging
from ..wire.priority import raise_priority
from ..wire.transport import connect_dealer, hostport, new_routing_id
from .admission import PENDING_MARGIN, Admission
from .backup import SYNC_MAX_BYTES, BackupSync
from .core import ControllerCore
from .flow import IncidentFlow
from .inputs import (
    Command,
    Frame,
    Input,
    NewFeatures,
    NodeBack,
    NodeSilent,
    Pause,
    ProcessExit,
    ProcessGone,
    Resume,
    Start,
    Tick,
    Upstream,
)
from .liveness import LOST_DRAIN
from .outbox import Admit, Outputs
from .procwatch import LocalProcesses
from .ranktable import Health, RankTable
from .sockets import DRAIN_BATCH, DRAIN_SLICE, ControllerSockets
from .states import State, StateMachine
from .strategy import StrategyPlanner

log = logging.getLogger("mindspeed_tft.control.controller")

_BATCH_WAIT = 0.01  # seconds; heartbeats wait at most this long to be read (not during incidents)


@dataclass(frozen=True)
class _Stop:
    """Stop the loop (shell command)."""


@dataclass(frozen=True)
class _Snapshot:
    """Compute a snapshot in the loop thread (shell command, from another thread)."""

    box: list[dict[str, Any]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class Controller:
    """The control plane's brain: the shell around its core (see the module docstring).

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
                 port: int | None = None, watch_processes: bool = True,
                 absent_ranks_return: bool = True) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if role not in ("active", "backup"):
            raise ValueError(f"role={role!r} must be 'active' or 'backup'")
        self.config = config or ControlConfig.from_env()
        self.world_size = world_size
        self.bind_addr = bind_addr or self.config.controller_addr
        self._port_wanted = self.config.port if port is None else port
        self.port: int | None = None
        #: ranks whose processes run in this pid namespace, watched in /proc
        self.processes = LocalProcesses(watch_processes)
        #: every decision (`core.ControllerCore`)
        self.core = ControllerCore(world_size, self.config,
                                   features=features or Features(high_availability=True),
                                   planner=planner, role=role, backup_index=backup_index,
                                   endpoint=hostport(self.bind_addr, self._port_wanted),
                                   absent_ranks_return=absent_ranks_return)
        #: the ROUTER's connections by class: admitted (showed the job's token; at most a
        #: connection per rank twice over, for replacements while the old connection times
        #: out, two backups and a margin) and pending (their own bound and deadline)
        self.admission = Admission(2 * world_size + 64, world_size + PENDING_MARGIN,
                                   self.config.admit_deadline)
        #: the metrics endpoint (`metrics.MetricsServer`; TFT_METRICS_PORT, active role only)
        self.metrics: Any = None
        #: the ROUTER, its monitor, the context and the wake-up pipe (`sockets`)
        self.sockets = ControllerSockets(self.config, self.admission)
        #: a backup's link to the active controller (None once in charge, or active)
        self.upstream: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        #: the thread running the loop (`start`'s or `run`'s caller), once it started
        self._loop_ident: int | None = None
        self._commands: queue.SimpleQueue[Command | _Stop | _Snapshot] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._final = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._snapshot_path: str | None = None
        #: something the snapshot shows changed since it was last written
        self._dirty = True
        self._next_snapshot = 0.0

    # -- the core's parts, as before the split (tests, launchers, metrics read them) ---------
    @property
    def table(self) -> RankTable:
        return self.core.table

    @property
    def sm(self) -> StateMachine:
        return self.core.sm

    @property
    def backups(self) -> BackupSync:
        return self.core.backups

    @property
    def features(self) -> Features:
        return self.core.features

    def update_features(self, features: Features) -> None:
        """Features learnt later (the SDK's runtime: before training starts); the loop
        thread hands them to the core (`NewFeatures`)."""
        self._command(NewFeatures(features))

    @property
    def planner(self) -> StrategyPlanner:
        return self.core.planner

    @property
    def role(self) -> str:
        return self.core.role

    @property
    def epoch(self) -> int:
        return self.core.epoch

    @property
    def exit_code(self) -> int | None:
        return self.core.exit_code

    @property
    def state(self) -> State:
        return self.core.sm.state

    @property
    def flow(self) -> IncidentFlow | None:
        """The incident under way (`Incidents.flow`)."""
        return self.core.flow

    @property
    def _now(self) -> float:
        """The loop's clock: when the frame being handled was read (`ControllerSockets`)."""
        return self.sockets.now

    @property
    def endpoint(self) -> str:
        """`ip:port` this controller listens on (after `start`)."""
        return hostport(self.bind_addr, self.port or self._port_wanted)

    # -- public API -------------------------------------------------------------------
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
        self._command(_Stop())
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
        self._command(Pause())

    def resume(self) -> None:
        """End an operator pause: PAUSE -> NORMAL."""
        self._command(Resume())

    def report_process_exit(self, rank: int, returncode: int,
                            no_replacement: str | None = None) -> None:
        """A launcher saw `rank`'s process end (thread-safe; returns at once).

        The loop treats the rank as lost right away, exactly as when its heartbeats stop
        (`fault_detected` kind `lost`, the same incident handling), instead of waiting
        interval x misses. Ignored for a rank that is not connected (it said bye, was
        ordered to exit or is already lost) and for returncode 0 (a clean exit is no fault;
        if it never said bye, its silence still gives it away). `no_replacement`: why the
        launcher will not restart it, in the same command, so that the incident knows it
        before it decides."""
        self._command(ProcessExit(int(rank), int(returncode),
                                  None if no_replacement is None else str(no_replacement)))

    def report_node_silent(self, node: int, ranks: list[int], silent_for: float) -> None:
        """Node `node`'s launcher (holding `ranks`) has not been heard for `silent_for`
        seconds (thread-safe; returns at once): its ranks get no restart from it
        (`nodes.Nodes` decides what instead)."""
        self._command(NodeSilent(int(node), tuple(int(r) for r in ranks), float(silent_for)))

    def report_node_back(self, node: int) -> None:
        """Node `node`'s launcher, reported silent, is heard again (thread-safe)."""
        self._command(NodeBack(int(node)))

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
        request = _Snapshot()
        self._command(request)
        deadline = time.monotonic() + timeout
        while not request.done.wait(0.05):
            if self._final.is_set():  # the loop ended before it saw the request
                return self._snapshot()
            if time.monotonic() > deadline:
                raise TimeoutError("controller loop did not answer")
        return request.box[0]

    def write_snapshots(self, path: str) -> None:
        """Write a JSON snapshot to `path` whenever something but heartbeat times changed."""
        self._snapshot_path = path

    # -- loop ---------------------------------------------------------------------------
    def _command(self, cmd: Command | _Stop | _Snapshot) -> None:
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
        # backups hold the server pair: the key they show under CURVE
        server_key = None if self.sockets.curve is None else self.sockets.curve.server_user_id
        self.sockets.now = time.monotonic()
        if self.role == "backup":
            assert self.sockets.ctx is not None
            # CURVE: a backup's client pair is the server pair, which the active controller
            # recognises as a backup's (only controller hosts hold its secret)
            curve = self.sockets.curve
            self.upstream = connect_dealer(
                self.sockets.ctx, cfg.processor_addr, cfg.port, routing_id=new_routing_id(),
                max_bytes=SYNC_MAX_BYTES,
                curve=None if curve is None else curve.as_backup_client())
        log.info("%s controller for %d ranks listening on %s", self.role, self.world_size,
                 self.endpoint)
        self._feed(Start(self.endpoint, server_key, time.time() - time.monotonic()))
        if self.role == "active" and cfg.metrics_port:
            from .metrics import serve  # served from its own threads; it reads `snapshot()`

            self.metrics = serve(self, cfg)
            log.info("metrics endpoint on %s", self.metrics.url)

    def _stop_metrics(self) -> None:
        server, self.metrics = self.metrics, None
        if server is not None:
            server.stop()

    def _close(self) -> None:
        self.sockets.close()
        self._close_upstream()
        self.sockets.term()

    def _close_upstream(self, linger: int = 2000) -> None:
        if self.upstream is not None:
            try:
                self.upstream.setsockopt(zmq.LINGER, linger)
                self.upstream.close()
            except zmq.ZMQError:
                pass
        self.upstream = None

    def _loop(self) -> None:
        socks = self.sockets
        assert socks.router is not None
        poller = zmq.Poller()
        poller.register(socks.router, zmq.POLLIN)
        poller.register(socks.wake_r, zmq.POLLIN)
        if socks.monitor is not None:
            poller.register(socks.monitor, zmq.POLLIN)
        if self.upstream is not None:
            poller.register(self.upstream, zmq.POLLIN)
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
            if self.admission.crowded():
                self.make_room(self.sockets.now)
            if self.upstream is not None and self.upstream in events:
                socks.drain(self.upstream, self._on_upstream)
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

    # -- feeding the core ---------------------------------------------------------------
    def _feed(self, event: Input) -> Outputs:
        """One input to the core at the loop's clock; then its events, then its frames."""
        out = self.core.handle(event, self.sockets.now)
        self._dirty |= out.dirty
        for record in out.events:
            write_record(record)
        for identity, frame in out.frames:
            self.sockets.raw_send(identity, frame)
        if out.upstream and self.upstream is not None:
            for frame in out.upstream:
                try:
                    self.upstream.send(frame, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if out.close_upstream:
            self._close_upstream(0)
        for rank, pid, proc in out.watch:
            self.processes.watch(rank, pid, proc)
        return out

    def _on_frame(self, identity: bytes, part: zmq.Frame, extra: int) -> None:
        try:
            fd: int | None = part.get(zmq.SRCFD)
        except zmq.ZMQError:  # a frame that names no connection (libzmq's small messages)
            fd = None
        out = self._feed(Frame(identity, part.bytes, self.sockets.key(part),
                               fd is None or self._room(fd), extra))
        if out.admit is not None and fd is not None:
            self._admit(fd, out.admit)

    def _on_upstream(self, frames: list[bytes]) -> None:
        self._feed(Upstream(tuple(frames)))

    def drain_router(self, budget: float = DRAIN_SLICE) -> int:
        """Handle what processors and backups sent, for at most `budget` seconds (0: the
        socket is closed)."""
        return self.sockets.drain_router(self._on_frame, budget)

    def process_exit(self, rank: int, returncode: int, source: str) -> None:
        """`procwatch.ProcessEnds`: a bye or report it sent before it ended comes first."""
        self.drain_router()
        self._feed(ProcessExit(rank, returncode, source=source))

    def process_gone(self, rank: int, how: str, source: str) -> None:
        self.drain_router()
        self._feed(ProcessGone(rank, how, source))

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Stop):
                self._stopping = True
            elif isinstance(cmd, _Snapshot):
                cmd.box.append(self._snapshot())
                cmd.done.set()
            else:
                if isinstance(cmd, ProcessExit):
                    self.drain_router()  # a bye or report it sent before it ended comes first
                self._feed(cmd)

    def _tick(self, now: float) -> None:
        if self.role == "active":
            self.processes.poll(now, self.core.table, self)
            if self.core.overdue(now):
                # their heartbeats may be queued behind other input: read it first (bounded)
                self.drain_router(LOST_DRAIN)
            self.sockets.now = now
        self._feed(Tick(time.time() - time.monotonic()))
        if self.sockets.router is not None and self.admission.due(now):
            self.make_room(now)
        self._write_snapshot()

    def make_room(self, now: float) -> None:
        """Close the pending connections past their deadline, and the oldest beyond the
        room (`Admission.enforce`), once the frames queued are read: a REGISTER among them
        admits its connection before it could be picked."""
        self.drain_router(LOST_DRAIN)
        self.admission.enforce(now)

    def _room(self, fd: int) -> bool:
        """Is the connection `fd` admitted, or may it be (the cap not reached)? What a frame's
        input says of its connection (`inputs.Frame.room`)."""
        if fd in self.admission.admitted:
            return True
        self._read_accepts()
        return self.admission.has_room(fd)

    def _read_accepts(self) -> None:
        """Read the monitor's connection events: a frame's connection was announced before
        the frame came, so it is pending (or admitted) once they are read."""
        if self.sockets.monitor is not None:
            self.sockets.drain(self.sockets.monitor, self._on_monitor)  # counts, closes none

    def _admit(self, fd: int, how: Admit) -> None:
        """The core admitted the connection `fd` (`Outputs.admit`)."""
        admission = self.admission
        if how is Admit.KNOWN:  # a registered rank's frame: admitted if still pending
            if admission.pending and admission.is_pending(fd):
                admission.admit(fd)
                # thousands of ranks cost hundreds of wake-ups a second, not thousands
                time.sleep(_BATCH_WAIT)
        else:
            self._read_accepts()  # unannounced, it would stay pending and be closed
            admission.admit(fd)

    def _on_monitor(self, frames: list[bytes]) -> None:
        """Connection events (`ControllerSockets.on_monitor`)."""
        if self.sockets.on_monitor(frames):
            self._dirty = True

    # -- snapshots ------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        core = self.core
        return {
            "state": core.sm.state.value,
            "role": core.role_name(),
            "epoch": core.epoch,
            "world_size": self.world_size,
            "port": self.port,
            "ranks": {str(k): v for k, v in core.table.snapshot().items()},
            "dropped": dict(core.drops.counts),
            "dropped_total": core.drops.total,
            "connections": {**self.sockets.connections, **self.admission.view()},
            "backups": core.backups.joined(),
            "incident": core.incidents.view(),
            "incidents": core.incidents.count,
            "incident_stats": core.incidents.stats.view(),
            # seconds since the longest-silent connected rank was heard from
            "heartbeat_age": core.liveness.heartbeat_age(time.monotonic()),
            "exit_code": core.exit_code,
            "history": [s.value for s in core.sm.history],
        }

    def _write_snapshot(self, force: bool = False) -> None:
        path = self._snapshot_path
        if path is None or not (self._dirty or force) or (
                not force and self._now < self._next_snapshot):
            return
        self._dirty = False
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
