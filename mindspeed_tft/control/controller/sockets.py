"""The controller's sockets: its ROUTER (bound, CURVE-authenticated where configured), the
ROUTER's connection monitor, the ZeroMQ context and the pipe that wakes the loop.

`ControllerSockets` is held by the controller (`Controller.sockets`) and used from its loop
thread only (but `wake`, which any thread may call). It reads input in bounded slices
(`drain`, `drain_router`: supervision runs between slices however busy the input is), counts
connection events and feeds them to admission, admits a connection that showed the job's
token, and sends without ever blocking.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..wire.config import ControlConfig, port_in_use
from ..wire.transport import (
    MONITOR_EVENTS,
    MONITOR_NAMES,
    CurveKeys,
    FdReserve,
    bind_router,
    bound_port,
    check_bind,
    monitor_socket,
    raise_fd_limit,
    start_authenticator,
    storm_allowance,
    user_id,
)
from .admission import FD_RESERVE, PENDING_MARGIN, Admission

log = logging.getLogger("mindspeed_tft.control.controller")

DRAIN_BATCH = 4096
#: after the process ran out of files: seconds before the reserve is taken again (doubling
#: while it keeps running out, up to `OUT_OF_FILES_BACKOFF_MAX`)
OUT_OF_FILES_BACKOFF = 0.1
OUT_OF_FILES_BACKOFF_MAX = 2.0
#: seconds the loop reads input before it supervises again, however much is queued
DRAIN_SLICE = 0.05


class ControllerSockets:
    """The sockets of one controller (see the module docstring)."""

    def __init__(self, config: ControlConfig, admission: Admission) -> None:
        self.config = config
        self.admission = admission
        self.ctx: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.curve: CurveKeys | None = None
        self._auth: Any = None
        #: counts of connection events (handshake failures, disconnects) from the monitor
        self.connections: dict[str, int] = {}
        self.send_errors = 0
        self.wake_r, self.wake_w = os.pipe()
        #: when the last frame was taken (`drain`): liveness is when a frame was read
        self.now = time.monotonic()
        #: files held back for when the process runs out (`_out_of_files`), and when to
        #: take them again
        self.reserve: FdReserve | None = None
        self._refill_at: float | None = None
        self._backoff = OUT_OF_FILES_BACKOFF

    def open(self, world_size: int, bind_addr: str, port: int, role: str) -> int:
        """Bind the ROUTER on `bind_addr:port` (0: any free port) and monitor it; returns
        the port bound."""
        cfg = self.config
        # a connection per rank and pending room; warned about only below one per rank
        files = raise_fd_limit(2 * world_size + PENDING_MARGIN + FD_RESERVE,
                               warn_below=world_size + FD_RESERVE + 64)
        self.admission.files = files
        what = f"{role} controller"
        warning = check_bind(cfg, bind_addr, what)  # no unauthenticated network bind
        if warning is not None:
            log.warning("%s", warning)
        self.ctx = zmq.Context()
        self.curve = CurveKeys.from_config(cfg, server=True)
        if self.curve is not None:  # the ZAP handler admits the authorized client keys
            self._auth = start_authenticator(self.ctx, self.curve)
        # libzmq's handshake interval is a backstop: admission closes a pending one first
        backstop = cfg.admit_deadline + 1 + storm_allowance(self.admission.pending_cap)
        try:
            self.router = bind_router(self.ctx, bind_addr, port,
                                      max_bytes=cfg.max_message_bytes, curve=self.curve,
                                      handshake_ms=int(1000 * backstop),
                                      backlog=min(65535, max(4096, world_size)))
        except zmq.ZMQError as error:  # one line naming the port and what sets it
            if error.errno != zmq.EADDRINUSE:
                raise
            active = role == "active"
            raise port_in_use(bind_addr, port, "the controller" if active else what,
                              "TTP_PORT" if active else "TTP_BACKUP_ADDRS") from None
        self.monitor = monitor_socket(self.router, MONITOR_EVENTS)
        self.reserve = FdReserve()
        return bound_port(self.router)

    def wake(self) -> None:
        """Wake the loop (any thread)."""
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def close(self) -> None:
        if self.reserve is not None:
            self.reserve.close()
        if self.monitor is not None:
            try:
                self.router.disable_monitor()  # type: ignore[union-attr]
            except zmq.ZMQError:
                pass
            self.monitor.close(0)
            self.monitor = None
        if self.router is not None:
            try:
                self.router.setsockopt(zmq.LINGER, 2000)  # let queued exit orders leave
                self.router.close()
            except zmq.ZMQError:
                pass
        self.router = None

    def term(self) -> None:
        """After `close` (and the backups' sockets): the authenticator, context and pipe."""
        if self._auth is not None:
            try:
                self._auth.stop()
            except Exception:
                pass
            self._auth = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.wake_r = self.wake_w = -1

    def drain(self, sock: zmq.Socket, handler: Callable[[list[bytes]], Any],
              budget: float = DRAIN_SLICE) -> int:
        """Handle what `sock` has queued, for at most `budget` seconds (and `DRAIN_BATCH`
        frames): supervision runs between slices however busy the input is. `self.now` is
        stamped as each frame is taken, so liveness is when the frame was read, not when
        the slice began."""
        deadline = time.monotonic() + budget
        for n in range(DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            self.now = now = time.monotonic()
            handler(frames)
            if now > deadline:
                return n + 1
        return DRAIN_BATCH

    def drain_router(self, handler: Callable[[bytes, zmq.Frame, int], Any],
                     budget: float = DRAIN_SLICE) -> int:
        """`drain` for what processors and backups sent: each message is the sender's
        routing id, then its frame as a `zmq.Frame`, which names the connection it came by
        (`zmq.SRCFD`: admission) and, under CURVE, the peer's key (0: the socket is closed)."""
        sock = self.router
        if sock is None:
            return 0
        deadline = time.monotonic() + budget
        for n in range(DRAIN_BATCH):
            try:
                identity = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return n
            part = sock.recv(zmq.NOBLOCK, copy=False)  # a ROUTER's message has one more part
            extra = 0
            while part.more:  # a message of several frames: read to its end, then drop it
                part = sock.recv(zmq.NOBLOCK, copy=False)
                extra += 1
            self.now = now = time.monotonic()
            handler(identity, part, extra)
            if now > deadline:
                return n + 1
        return DRAIN_BATCH

    def on_monitor(self, frames: list[bytes]) -> bool:
        """Connection events: failed handshakes (wrong CURVE key, garbage) and disconnects
        (including peers libzmq cut off for frames far over the size limit). True: an event
        a snapshot shows was counted."""
        try:
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:6], "little")
        except (IndexError, TypeError):
            return False
        name = MONITOR_NAMES.get(event)
        if name is None:
            return False
        self.admission.on_event(event, value, self.now)  # accepted/disconnected: by fd
        n = self.connections.get(name, 0) + 1
        self.connections[name] = n
        if event == zmq.EVENT_ACCEPT_FAILED and value in (errno.EMFILE, errno.ENFILE):
            self._out_of_files(value)
        elif self._refill_at is not None and self.now >= self._refill_at:
            self._refill_at = None if self.reserve is None or self.reserve.refill() else (
                self.now + self._backoff)
            if self._refill_at is None:
                self._backoff = OUT_OF_FILES_BACKOFF
        if name not in ("disconnected", "accepted") and (n <= 10 or n % 1000 == 0):
            log.warning("connection event #%d: %s", n, name)
        # no connection is closed here: the room is made by the loop once the frames queued
        # are read (`Controller.make_room`), so that a rank whose REGISTER is among them is
        # admitted first, never pushed out by the accepts counted before its frame
        return True

    def _out_of_files(self, code: int) -> None:
        """libzmq could not accept a connection: the process (EMFILE) or the system (ENFILE)
        has no file left. The reserve goes back, so that the pending accept (a rank's
        registration) succeeds and admission can judge it; it is taken again after a back-off
        that doubles while this repeats (libzmq retries the accept at once: without files
        freed, it would repeat it in a loop)."""
        freed = self.reserve.release() if self.reserve is not None else 0
        if freed or self._refill_at is None:
            log.warning("out of open files (%s): %d reserved ones given back; taken again in "
                        "%.1f s", errno.errorcode.get(code, code), freed, self._backoff)
            self._refill_at = self.now + self._backoff
            self._backoff = min(2 * self._backoff, OUT_OF_FILES_BACKOFF_MAX)

    def key(self, part: zmq.Frame) -> str | None:
        """CURVE: the sender's public key, the ZAP User-Id of its frame (None without)."""
        return user_id(part) if self.curve is not None else None

    def raw_send(self, identity: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.ZMQError:
            self.send_errors += 1
