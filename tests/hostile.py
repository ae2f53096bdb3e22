"""Hostile peers that hold a controller's connections without ever registering.

- `Greeters`: plain TCP sockets that send 9 bytes of the ZMTP greeting (the signature less
  its last byte, so libzmq waits for the rest) and connect again as soon as they are
  dropped: no key and no token needed, CURVE or not.
- `IdleDealers`: ZeroMQ DEALERs with the NULL mechanism that connect and send nothing
  (libzmq connects them again when they are dropped).
- `established(port)`: the TCP connections to `port` in state ESTABLISHED on this host
  (/proc/net/tcp, tcp6), as the controller's side holds them.

`python -m tests.hostile PORT SECONDS OUT [--greeters N] [--dealers N]` runs them in a
process of their own for at most SECONDS (or until SIGTERM) and writes to OUT (JSON) what
they did: connections made and dropped, and `samples`: [unix time, connections to PORT
established] every 0.1 s.
"""

from __future__ import annotations

import argparse
import errno
import json
import selectors
import signal
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import zmq

#: the ZMTP 3 signature (10 bytes) less its last byte
GREETING = b"\xff" + b"\x00" * 8


def established(port: int) -> int:
    """TCP connections in state ESTABLISHED whose local port is `port` (this host)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        count += 1
        except OSError:
            continue
    return count


class Greeters:
    """`n` raw TCP connections to 127.0.0.1:`port` (from `source`), each sending
    `GREETING` and connecting again `retry` s after it is dropped; runs in a thread."""

    def __init__(self, port: int, n: int, source: str = "127.0.0.1", retry: float = 0.1) -> None:
        self.port, self.n, self.source, self.retry = port, n, source, retry
        self.connects = 0
        self.drops = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="greeters", daemon=True)

    def start(self) -> Greeters:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _open(self, sel: selectors.BaseSelector) -> bool:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((self.source, 0))
            err = s.connect_ex(("127.0.0.1", self.port))
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, "connect")
        except OSError:
            s.close()
            return False
        sel.register(s, selectors.EVENT_WRITE, "connecting")
        return True

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        retry_at: deque[float] = deque([0.0] * self.n)  # one per connection not open
        while not self._stop.is_set():
            now = time.monotonic()
            while retry_at and retry_at[0] <= now:
                retry_at.popleft()
                if not self._open(sel):
                    retry_at.append(now + self.retry)
            for key, _ in sel.select(0.05):
                s: socket.socket = key.fileobj  # type: ignore[assignment]
                if key.data == "connecting":
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        try:
                            s.send(GREETING)
                            self.connects += 1
                            sel.modify(s, selectors.EVENT_READ, "open")
                            continue
                        except OSError:
                            pass
                else:
                    try:
                        if s.recv(4096):
                            continue  # the controller's own greeting: ignored
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    self.drops += 1
                sel.unregister(s)
                s.close()
                retry_at.append(time.monotonic() + self.retry)
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()


class IdleDealers:
    """`n` NULL-mechanism DEALERs connected to 127.0.0.1:`port` that send nothing."""

    def __init__(self, port: int, n: int) -> None:
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, n + 64)
        self.socks = []
        for _ in range(n):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(s)

    def stop(self) -> None:
        self.ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.hostile")
    ap.add_argument("port", type=int)
    ap.add_argument("seconds", type=float)
    ap.add_argument("out")
    ap.add_argument("--greeters", type=int, default=0)
    ap.add_argument("--dealers", type=int, default=0)
    args = ap.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    greeters = Greeters(args.port, args.greeters).start() if args.greeters else None
    dealers = IdleDealers(args.port, args.dealers) if args.dealers else None
    samples: list[list[float]] = []
    end = time.monotonic() + args.seconds
    try:
        while not stop.is_set() and time.monotonic() < end:
            samples.append([time.time(), established(args.port)])
            stop.wait(0.1)
    finally:
        if greeters is not None:
            greeters.stop()
        if dealers is not None:
            dealers.stop()
        out: dict[str, Any] = {"samples": samples}
        if greeters is not None:
            out.update(connects=greeters.connects, drops=greeters.drops)
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
