"""The processor's link to the controller: one DEALER socket, served by a background I/O thread.

The I/O thread connects, registers (and registers again until a controller answers),
heartbeats with the rank's step and data status, sends the queued reports and results,
reports a hang once the watchdog fires, and fails over to the next controller address
(the backups from `TTP_BACKUP_ADDRS` and from the registration reply) when the controller
has been silent for interval x (misses + 1), or goes back to the first one when a backup
redirects it. A rank that was registered and has heard from no active controller (the
active one, or a backup once in charge) for `controller_lost_timeout` seconds gives up:
the channel calls `on_controller_lost` once (the processor then exits with code 77).
Because heartbeats come from this thread, they keep flowing while the training
thread is stuck. Each order (`action` message) is handed once to the processor's `Orders`
lanes; nothing here waits for the training thread or for a callback.

What the channel reports about the training thread it reads through `RankView` (the
`gate.Gate` implements it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from ... import procfs
from ...events import work_counts
from ..wire.classify import FaultKind
from ..wire.config import ControlConfig, parse_hostport
from ..wire.priority import raise_priority
from ..wire.protocol import CONTROLLER, DropCounter, MsgType, ProtocolError, decode, encode
from ..wire.results import ReportMessage
from ..wire.transport import CurveKeys, connect_dealer, new_routing_id, storm_allowance
from .core import Run, Send
from .orders import Orders

# the processor's parts log as the processor
log = logging.getLogger("mindspeed_tft.control.processor")

_RECV_BATCH = 256


class RankView(Protocol):
    """What the channel reports about the training thread, and where orders go."""

    def position(self) -> tuple[int, str, int]: ...
    def hang(self, now: float) -> tuple[float, float] | None: ...
    def unanswered_report(self) -> ReportMessage | None: ...
    def on_action(self, payload: dict[str, Any], now: float) -> list[Send | Run]: ...


class Channel:
    """Registration, heartbeats, failover and the I/O thread of one rank.

    addresses: controllers to try in order (the backups of the config are added).
    The public attributes say what the controller last told this rank.
    """

    def __init__(self, rank: int, world_size: int, config: ControlConfig, *, view: RankView,
                 orders: Orders, addresses: list[tuple[str, int]],
                 replica: dict[str, Any] | None, host: str,
                 on_controller_lost: Callable[[float], None] | None = None) -> None:
        self.rank = rank
        #: called once (on the I/O thread) with the seconds of silence when no active
        #: controller was heard for `config.controller_lost_timeout`
        self.on_controller_lost = on_controller_lost
        self._last_active = 0.0
        self._gave_up = False
        self.world_size = world_size
        self.config = config
        self.replica = replica
        self.host = host
        self.view = view
        self.orders = orders
        self.addresses = list(addresses)
        for b in config.backups:
            if b not in self.addresses:
                self.addresses.append(b)
        self._curve = CurveKeys.from_config(config, server=False)
        self.drops = DropCounter(log)
        #: one identity for the life of this process: a reconnect to the same controller is
        #: recognised as this rank, not taken for a second process claiming it
        self._routing_id = new_routing_id()
        self._outbox: deque[tuple[str, dict[str, Any]]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._running = False
        self._registered = threading.Event()
        self._ever_registered = False
        #: why the registration was refused (or the I/O thread failed)
        self.reject: str | None = None
        self._addr_index = 0
        self._last_heard = 0.0
        self._sock: zmq.Socket | None = None
        self._switch_to: int | None = None
        self._registered_here = False
        self._next_register = 0.0
        self.controller_state: str | None = None
        self.controller_role: str | None = None
        self.join_info: dict[str, Any] = {}
        self.interval = config.heartbeat_interval
        self.misses = config.heartbeat_misses
        self.last_ack: float | None = None
        self.failovers = 0

    # -- lifecycle --------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._running

    @property
    def registered(self) -> bool:
        return self._registered.is_set() and self.reject is None

    def start(self) -> None:
        """Start the I/O thread (it connects and registers)."""
        self._running = True
        self._thread = threading.Thread(target=self._io_main, name=f"tft-processor-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def wait_registered(self, timeout: float) -> bool:
        """Wait until a controller answered the registration (accepted or refused)."""
        return self._registered.wait(timeout)

    def shutdown(self) -> None:
        """Stop the I/O thread (what is still queued is not sent)."""
        self._running = False
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    # -- outgoing -----------------------------------------------------------------------
    def post(self, mtype: str, payload: dict[str, Any]) -> None:
        """Queue a message for the controller (sent once registered there)."""
        self._outbox.append((mtype, payload))
        self._wake()

    def update_replica(self, replica: dict[str, Any]) -> None:
        """The rank's replica layout, learnt after it registered: registration sends it from
        now on, and a repeated registration tells the controller now."""
        self.replica = replica
        if self._ever_registered:
            self.post(MsgType.REGISTER, self._register_payload())

    def flush(self, timeout: float) -> None:
        """Wait (bounded) until the queued messages left."""
        deadline = time.monotonic() + timeout
        while self._outbox and self._running and time.monotonic() < deadline:
            time.sleep(0.01)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- I/O thread -----------------------------------------------------------------------
    def _io_main(self) -> None:
        # before the ZeroMQ context: its threads inherit it
        raise_priority(self.config.thread_nice, self.config.thread_rtprio)
        ctx = zmq.Context(io_threads=1)
        try:
            self._io_loop(ctx, self._connect(ctx))
        except Exception as e:
            log.exception("processor I/O thread of rank %d failed", self.rank)
            if not self._registered.is_set():  # wake start(): it must not wait for nothing
                self.reject = f"processor I/O thread failed: {type(e).__name__}: {e}"
                self._registered.set()
        finally:
            if self._sock is not None:
                self._sock.close(200)  # let a last bye or result leave
            ctx.term()
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _connect(self, ctx: zmq.Context) -> zmq.Socket:
        if self._sock is not None:
            self._sock.close(0)
        addr, port = self.addresses[self._addr_index]
        self._sock = connect_dealer(ctx, addr, port, routing_id=self._routing_id,
                                    max_bytes=self.config.max_message_bytes, curve=self._curve)
        work_counts.add("connections.control")
        self._last_heard = time.monotonic()
        self._next_register = 0.0
        self.controller_role = None
        self._registered_here = False
        log.info("rank %d connects to controller %s:%d", self.rank, addr, port)
        return self._sock

    def _io_loop(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        next_hb = 0.0
        while self._running:
            now = time.monotonic()
            wait = min(self.interval / 4, 0.25)
            if not self._registered_here and now >= self._next_register:
                wait = 0.0  # the (next) registration is due: send it without a poll first
            events = dict(poller.poll(int(wait * 1000)))
            now = time.monotonic()
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            if self._sock in events:
                self._receive(now)
            if self.reject is not None:
                return
            self.orders.check(now)
            self._check_controller_lost(now)
            switch_to = self._failover_target(now)
            if switch_to is not None:
                self._switch_to = None
                poller.unregister(self._sock)
                self._addr_index = switch_to
                self.failovers += 1
                poller.register(self._connect(ctx), zmq.POLLIN)
                continue
            if self._registered_here:
                next_hb = self._talk(now, next_hb)
            elif now >= self._next_register:
                self._next_register = now + self.interval
                self._send(MsgType.REGISTER, self._register_payload())

    def _receive(self, now: float) -> None:
        for _ in range(_RECV_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.Again:
                return
            self._on_frames(frames, now)

    def _check_controller_lost(self, now: float) -> None:
        """Give up once no active controller was heard for `controller_lost_timeout`."""
        if self._gave_up or not self._ever_registered or self.on_controller_lost is None:
            return
        silent = now - self._last_active
        if silent > self.config.controller_lost_timeout:
            self._gave_up = True
            where = ", ".join(f"{a}:{p}" for a, p in self.addresses)
            log.error("rank %d: no active controller for %.1fs (TTP_CONTROLLER_LOST_TIMEOUT="
                      "%g; tried %s): giving up", self.rank, silent,
                      self.config.controller_lost_timeout, where)
            self.on_controller_lost(silent)

    def _failover_target(self, now: float) -> int | None:
        """The address to switch to: asked for (redirect), or the next after a silence."""
        if self._switch_to is not None:
            return self._switch_to
        # one interval more than a rank gets: acks come every other heartbeat or so; until
        # it is registered there, as long again as every rank's handshake at once may take
        # (a registration storm: a reconnect would throw its handshake's work away)
        patience = self.interval * (self.misses + 1)
        if not self._registered_here:
            patience += storm_allowance(self.world_size)
        if now - self._last_heard > patience:
            log.warning("rank %d: controller %s:%d silent for %.1fs; failing over", self.rank,
                        *self.addresses[self._addr_index], now - self._last_heard)
            return (self._addr_index + 1) % len(self.addresses)
        return None

    def _talk(self, now: float, next_hb: float) -> float:
        """Registered here: send what is queued, a heartbeat when due, a hang report when the
        watchdog fires; returns when the next heartbeat is due."""
        while self._outbox:
            mtype, payload = self._outbox.popleft()
            self._send(mtype, payload)
        if now >= next_hb:
            next_hb = now + self.interval
            step, status, progress = self.view.position()
            # an ack only when needed to know the controller is there: with the default
            # 3 misses, every other heartbeat (half the traffic)
            self._send(MsgType.HEARTBEAT, {
                "step": step, "status": status, "progress": progress,
                "ack": now - self._last_heard >= self.interval * self.misses / 2})
        hung = self.view.hang(now)
        if hung is not None:
            idle, limit = hung
            step, status, progress = self.view.position()
            self._send(MsgType.REPORT, ReportMessage(
                FaultKind.HANG.value,
                f"rank {self.rank}: no training progress for {idle:.1f}s "
                f"(timeout {limit:.1f}s) after step {progress}", step, status).to_wire())
        return next_hb

    def _send(self, mtype: str, payload: dict[str, Any]) -> None:
        self._seq += 1
        frame = encode(mtype, self.rank, self._seq, payload)
        work_counts.add(f"control_sent.{mtype}")
        work_counts.add(f"control_sent_bytes.{mtype}", len(frame))
        try:
            self._sock.send(frame, zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.ZMQError as e:
            log.debug("rank %d could not send %s: %s", self.rank, mtype, e)

    def _register_payload(self) -> dict[str, Any]:
        step, status, _ = self.view.position()
        payload = {"world_size": self.world_size, "pid": os.getpid(), "host": self.host[:255],
                   "replica": self.replica, "failover": self._ever_registered,
                   "step": step, "status": status}
        if self.config.job_token is not None:  # the job's secret (over CURVE: encrypted)
            payload["token"] = self.config.job_token
        proc = procfs.identity()  # a controller in the same pid namespace watches /proc
        if proc is not None:
            payload["proc"] = proc
        return payload

    # -- incoming -------------------------------------------------------------------------
    def _on_frames(self, frames: list[bytes], now: float) -> None:
        if len(frames) != 1:
            self.drops.drop("frames")
            return
        try:
            msg = decode(frames[0], self.config.max_message_bytes)
        except ProtocolError as e:
            self.drops.drop(e.reason, e.detail)
            return
        if msg.sender != CONTROLLER:
            self.drops.drop("spoof", "not from a controller")
            return
        work_counts.add(f"control_received.{msg.type}")
        work_counts.add(f"control_received_bytes.{msg.type}", len(frames[0]))
        self._last_heard = now
        p = msg.payload
        t = msg.type
        if t == MsgType.ACTION or (t in (MsgType.ACK, MsgType.REGISTERED)
                                   and p.get("role") == "active"):
            self._last_active = now
        if t == MsgType.ACK:
            self.last_ack = now
            self.controller_state = p["state"]
            self.controller_role = p["role"]
        elif t == MsgType.ACTION:
            if self._registered_here:
                self._on_action(p, now)
        elif t == MsgType.REGISTERED:
            self._on_registered(p)
        elif t == MsgType.REJECT:
            self._on_reject(p)
        elif t == MsgType.REDIRECT:
            if self._addr_index != 0:
                log.info("rank %d: %s; going back", self.rank, p["reason"])
                self._switch_to = 0
        else:
            self.drops.drop("unexpected_type", t)

    def _on_action(self, p: dict[str, Any], now: float) -> None:
        for out in self.view.on_action(p, now):
            if isinstance(out, Send):  # answered at once (a hold)
                self._outbox.append((out.mtype, out.message.to_wire()))
            else:
                self.orders.submit(out, now)

    def _on_reject(self, p: dict[str, Any]) -> None:
        if p["retry"]:
            log.warning("rank %d: controller says: %s", self.rank, p["reason"])
        else:
            self.reject = p["reason"]
            self._registered.set()

    def _on_registered(self, p: dict[str, Any]) -> None:
        self.controller_state = p["state"]
        self.controller_role = p["role"]
        self.interval = float(p["interval"])
        self.misses = int(p["misses"])
        for b in p["backups"]:
            try:
                hp = parse_hostport(b, "backup from controller")
            except ValueError:
                continue
            if hp not in self.addresses:
                self.addresses.append(hp)
        if not self._registered_here:
            log.info("rank %d registered with %s controller (state %s)", self.rank, p["role"],
                     p["state"])
        self._registered_here = True
        if p["role"] != "active":
            return  # a standby backup: heartbeat here, wait for it to take charge
        first = not self._ever_registered
        self._ever_registered = True
        if first:
            self.join_info = dict(p)
        self._registered.set()
        report = self.view.unanswered_report()
        if report is not None and not first:  # the new controller never saw our error
            self._outbox.append((MsgType.REPORT, report.to_wire()))
