"""The processor's link to the controller: one DEALER socket, served by a background I/O thread.

What to say and to whom is decided by the link's core (`link.LinkCore`, no I/O); this is
its shell. The I/O thread connects, registers (and registers again until a controller answers),
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

What the link says about the training thread it reads from the processor's core (through
the `gate.Gate`, behind its lock) and hands in with each input; the orders the link passes
on (`core.Action`) go to that core, and so does the link's hang check (`core.CheckHang`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from ... import procfs
from ...events import work_counts
from ..wire.config import ControlConfig
from ..wire.fields import Wire
from ..wire.messages import RegisteredMessage
from ..wire.priority import raise_priority
from ..wire.protocol import CONTROLLER, DropCounter, ProtocolError, decode, encode
from ..wire.transport import CurveKeys, connect_dealer, new_routing_id, storm_allowance
from .core import Action, CheckHang, Output, Run, Send
from .gate import Gate
from .link import (
    TO_PROCESSOR,
    Accepted,
    Connect,
    Connected,
    FromController,
    GiveUp,
    Identity,
    LinkCore,
    NewReplica,
    Out,
    Refused,
    Tick,
    Transmit,
)
from .orders import Orders

# the processor's parts log as the processor
log = logging.getLogger("mindspeed_tft.control.processor")

_RECV_BATCH = 256


class Channel:
    """The shell of one rank's `link.LinkCore`: its socket, I/O thread and clock.

    addresses: controllers to try in order (the backups of the config are added).
    The public attributes say what the controller last told this rank.
    """

    def __init__(self, rank: int, world_size: int, config: ControlConfig, *, view: Gate,
                 orders: Orders, addresses: list[tuple[str, int]],
                 replica: dict[str, Any] | None, host: str,
                 on_controller_lost: Callable[[float], None] | None = None) -> None:
        self.rank = rank
        #: called once (on the I/O thread) with the seconds of silence when no active
        #: controller was heard for `config.controller_lost_timeout`
        self.on_controller_lost = on_controller_lost
        self.config = config
        self.view = view
        self.orders = orders
        addresses = list(addresses)
        for b in config.backups:
            if b not in addresses:
                addresses.append(b)
        self.link = LinkCore(
            rank, Identity(world_size, os.getpid(), host, procfs.identity(), config.job_token),
            addresses=addresses, interval=config.heartbeat_interval,
            misses=config.heartbeat_misses,
            controller_lost_timeout=config.controller_lost_timeout,
            storm_allowance=storm_allowance(world_size), replica=replica)
        self._curve = CurveKeys.from_config(config, server=False)
        self.drops = DropCounter(log)
        #: one identity for the life of this process: a reconnect to the same controller is
        #: recognised as this rank, not taken for a second process claiming it
        self._routing_id = new_routing_id()
        self._outbox: deque[tuple[str, Wire | dict[str, Any]]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._running = False
        self._registered = threading.Event()
        #: why the registration was refused (or the I/O thread failed)
        self.reject: str | None = None
        self._sock: zmq.Socket | None = None

    # -- what the controller said (the link's state) ----------------------------------------
    @property
    def addresses(self) -> list[tuple[str, int]]:
        return self.link.addresses

    @property
    def join_info(self) -> RegisteredMessage | None:
        return self.link.join_info

    @property
    def interval(self) -> float:
        return self.link.interval

    @property
    def misses(self) -> int:
        return self.link.misses

    @property
    def failovers(self) -> int:
        return self.link.failovers

    @property
    def controller_state(self) -> str | None:
        return self.link.controller_state

    @property
    def controller_role(self) -> str | None:
        return self.link.controller_role

    @property
    def last_ack(self) -> float | None:
        return self.link.last_ack

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
    def post(self, mtype: str, payload: Wire | dict[str, Any]) -> None:
        """Queue a message for the controller (sent once registered there)."""
        self._outbox.append((mtype, payload))
        self._wake()

    def update_replica(self, replica: dict[str, Any]) -> None:
        """The rank's replica layout, learnt after it registered: registration sends it from
        now on, and a repeated registration tells the controller now."""
        for out in self.link.handle(NewReplica(replica, self.view.state()), time.monotonic()):
            if isinstance(out, Transmit):
                self.post(out.mtype, out.payload)

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
        addr, port = self.link.address
        self._sock = connect_dealer(ctx, addr, port, routing_id=self._routing_id,
                                    max_bytes=self.config.max_message_bytes, curve=self._curve)
        work_counts.add("connections.control")
        self.link.handle(Connected(), time.monotonic())
        log.info("rank %d connects to controller %s:%d", self.rank, addr, port)
        return self._sock

    def _io_loop(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        link = self.link
        while self._running:
            events = dict(poller.poll(int(link.wait(time.monotonic()) * 1000)))
            now = time.monotonic()
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            if self._sock in events:
                self._receive(now)
            if self.reject is not None:
                return
            self.orders.check(now)
            if link.registered_here:
                while self._outbox:
                    self._send(*self._outbox.popleft())
            for out in link.handle(Tick(self.view.state()), now):
                if isinstance(out, Connect):
                    poller.unregister(self._sock)
                    poller.register(self._connect(ctx), zmq.POLLIN)
                else:
                    self._act(out, now)

    def _act(self, out: Out | Output, now: float) -> None:
        """Do what the link or the processor's core decided (anything but a reconnect)."""
        if isinstance(out, Transmit):
            self._send(out.mtype, out.payload)
        elif isinstance(out, Send):
            self._send(out.mtype, out.message.to_wire())
        elif isinstance(out, (Action, CheckHang)):  # the processor core's: what it says
            for answer in self.view.handle(out, now):
                self._act(answer, now)
        elif isinstance(out, Run):
            self.orders.submit(out, now)
        elif isinstance(out, Accepted):
            self._registered.set()
        elif isinstance(out, Refused):
            self.reject = out.reason
            self._registered.set()
        elif isinstance(out, GiveUp) and self.on_controller_lost is not None:
            where = ", ".join(f"{a}:{p}" for a, p in self.link.addresses)
            log.error("rank %d: no active controller for %.1fs (TTP_CONTROLLER_LOST_TIMEOUT="
                      "%g; tried %s): giving up", self.rank, out.silent,
                      self.config.controller_lost_timeout, where)
            self.on_controller_lost(out.silent)

    def _receive(self, now: float) -> None:
        for _ in range(_RECV_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.Again:
                return
            self._on_frames(frames, now)

    def _send(self, mtype: str, payload: Wire | dict[str, Any]) -> None:
        self._seq += 1
        frame = encode(mtype, self.rank, self._seq, payload)
        work_counts.add(f"control_sent.{mtype}")
        work_counts.add(f"control_sent_bytes.{mtype}", len(frame))
        try:
            self._sock.send(frame, zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.ZMQError as e:
            log.debug("rank %d could not send %s: %s", self.rank, mtype, e)

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
        if msg.type not in TO_PROCESSOR:
            self.drops.drop("unexpected_type", msg.type)
        for out in self.link.handle(FromController(msg, self.view.state()), now):
            self._act(out, now)
