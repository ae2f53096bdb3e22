"""Warm spare workers, the launcher's side: start them, know which are ready, hand one a rank.

A `SparePool` keeps `count` spare processes running the training command with
`TFT_SPARE=1` (see `spare` for the worker's side and the channel). It listens on a Unix
socket in a private temporary folder; a spare that connected and said hello is *ready*: its
imports are done and it waits in `wait_for_assignment()`. `take()` sends a ready spare the
environment of the worker it replaces and waits (bounded) for its acknowledgement; the pool
then forgets it (the caller now owns its process handle) and starts a new spare.

The pool has no thread of its own: `poll()` is called from the launcher's monitor loop
(every `--monitor-interval`), and nothing in it blocks except `take()`, bounded by its
timeout. Spares that die before they are used are replaced; after `max_early_deaths`
consecutive deaths the pool stops starting spares and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from .lifetime import TiedSubprocessHandler
from .spare import (
    MAX_MESSAGE_BYTES,
    SPARE_ENV,
    SPARE_ID_ENV,
    SPARE_LAUNCHER_PID_ENV,
    SPARE_SOCKET_ENV,
)


@dataclass
class Spare:
    """One spare process."""

    id: int
    handler: SubprocessHandler
    started: float
    conn: socket.socket | None = None
    #: monotonic time of its hello (None: still importing)
    ready_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.handler.proc.pid

    @property
    def ready(self) -> bool:
        return self.ready_at is not None and self.handler.proc.poll() is None


@dataclass
class _Connection:
    """A spare's connection before its hello arrived."""

    sock: socket.socket
    buffer: bytes = b""


#: seconds after a spare took over a rank before its replacement spare is started
REFILL_DELAY_SECONDS = 10.0


class SparePool:
    """`count` warm spares of `entrypoint args` (see the module docstring)."""

    def __init__(self, count: int, entrypoint: str, args: tuple[Any, ...], *,
                 say: Callable[[str], None], max_early_deaths: int = 3) -> None:
        if count < 0:
            raise ValueError(f"count={count} must be >= 0")
        self.count = count
        self.entrypoint = entrypoint
        self.args = tuple(args)
        self.say = say
        self.max_early_deaths = max_early_deaths
        self.spares: list[Spare] = []
        self.started_total = 0
        self._early_deaths = 0
        self._dir: str | None = None
        self._listener: socket.socket | None = None
        self._pending: list[_Connection] = []
        self.path = ""

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Listen on the channel and start the spares."""
        self._dir = tempfile.mkdtemp(prefix="tft-spares-")
        self.path = os.path.join(self._dir, "channel.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(max(8, 2 * self.count))
        listener.setblocking(False)
        self._listener = listener
        self._top_up()

    def close(self, timeout: float = 5.0) -> None:
        """End every spare still waiting (they see the channel close and exit; stragglers are
        terminated, then killed) and remove the channel."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for pending in self._pending:
            pending.sock.close()
        self._pending = []
        for spare in self.spares:
            if spare.conn is not None:
                spare.conn.close()
                spare.conn = None
        deadline = time.monotonic() + timeout
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for spare in self.spares:
                if spare.handler.proc.poll() is None:
                    try:
                        spare.handler.close(death_sig=sig)
                    except ProcessLookupError:
                        pass
            for spare in self.spares:
                try:
                    spare.handler.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            deadline = time.monotonic() + timeout
        self.spares = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- monitoring -------------------------------------------------------------------------
    def poll(self) -> None:
        """Accept spares that connected, read their hellos, replace the dead ones."""
        self._accept()
        self._read_hellos()
        self._reap()
        self._top_up()

    def ready(self) -> list[Spare]:
        """Spares waiting for an assignment, oldest first."""
        return [s for s in self.spares if s.ready]

    def take(self, env: dict[str, str], stdout: str = "", stderr: str = "",
             timeout: float = 10.0) -> Spare | None:
        """Hand `env` (and the worker's log paths) to a ready spare; returns it once it
        acknowledged, or None when no ready spare took it within `timeout` seconds."""
        self.poll()
        message = json.dumps({"env": env, "stdout": stdout, "stderr": stderr}).encode() + b"\n"
        for spare in self.ready():
            if self._assign(spare, message, timeout):
                self.spares.remove(spare)
                # The new spare's imports would compete for the CPUs with the repair the
                # taken spare is joining: start it a little later.
                self._refill_at = time.monotonic() + REFILL_DELAY_SECONDS
                return spare
            self.say(f"spare pid {spare.pid} did not take its assignment; ending it")
            self._discard(spare)
        return None

    # -- internals --------------------------------------------------------------------------
    def _spawn(self) -> None:
        self.started_total += 1
        spare_id = self.started_total
        env = {SPARE_ENV: "1", SPARE_SOCKET_ENV: self.path, SPARE_ID_ENV: str(spare_id),
               SPARE_LAUNCHER_PID_ENV: str(os.getpid())}
        # a spare dies with its launcher, even while it still imports (`lifetime`)
        handler = TiedSubprocessHandler(entrypoint=self.entrypoint, args=self.args, env=env,
                                        stdout="", stderr="", local_rank_id=0,
                                        numa_options=None)
        self.spares.append(Spare(spare_id, handler, time.monotonic()))

    _refill_at = 0.0

    def _top_up(self) -> None:
        if self._listener is None or time.monotonic() < self._refill_at:
            return
        while len(self.spares) < self.count and self._early_deaths < self.max_early_deaths:
            self._spawn()

    def _accept(self) -> None:
        if self._listener is None:
            return
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            self._pending.append(_Connection(conn))  # whose it is: known from its hello

    def _read_hellos(self) -> None:
        still: list[_Connection] = []
        for pending in self._pending:
            try:
                chunk = pending.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                still.append(pending)
                continue
            except OSError:
                chunk = b""
            pending.buffer += chunk
            if chunk and b"\n" not in pending.buffer and len(pending.buffer) <= MAX_MESSAGE_BYTES:
                still.append(pending)
                continue
            owner = self._owner(pending.buffer) if chunk else None
            if owner is None:  # closed, garbage, or not one of ours
                pending.sock.close()
                continue
            owner.conn = pending.sock
            owner.ready_at = time.monotonic()
            owner.extra["import_seconds"] = owner.ready_at - owner.started
            self._early_deaths = 0
            self.say(f"warm spare pid {owner.pid} is ready "
                     f"({owner.extra['import_seconds']:.1f}s after its start)")
        self._pending = still

    def _owner(self, buffer: bytes) -> Spare | None:
        try:
            pid = int(json.loads(buffer.split(b"\n", 1)[0])["pid"])
        except (ValueError, KeyError, TypeError):
            return None
        return next((s for s in self.spares if s.pid == pid and s.conn is None), None)

    def _reap(self) -> None:
        for spare in list(self.spares):
            code = spare.handler.proc.poll()
            if code is None:
                continue
            self.spares.remove(spare)
            if spare.conn is not None:
                spare.conn.close()
                spare.conn = None
            if spare.ready_at is None:
                self._early_deaths += 1
            what = "before it was ready" if spare.ready_at is None else "while waiting"
            self.say(f"spare pid {spare.pid} exited with code {code} {what}"
                     + ("; no more spares will be started"
                        if self._early_deaths >= self.max_early_deaths else "; replacing it"))

    def _assign(self, spare: Spare, message: bytes, timeout: float) -> bool:
        conn = spare.conn
        if conn is None:
            return False
        deadline = time.monotonic() + timeout
        try:
            conn.setblocking(True)
            conn.settimeout(timeout)
            conn.sendall(message)
            buffer = b""
            while b"\n" not in buffer:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = conn.recv(4096)
                if not chunk:
                    return False
                buffer += chunk
            reply = json.loads(buffer.split(b"\n", 1)[0])
            return bool(reply.get("ok"))
        except (OSError, ValueError, AttributeError):
            return False
        finally:
            conn.close()
            spare.conn = None

    def _discard(self, spare: Spare) -> None:
        if spare in self.spares:
            self.spares.remove(spare)
        try:
            spare.handler.close(death_sig=signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            spare.handler.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
