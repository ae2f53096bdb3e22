"""ZeroMQ sockets for the control plane: ROUTER on controllers, DEALER per processor.

TCP over IPv4 or IPv6. Processors choose a random 16-byte routing id for their DEALER and
keep it across reconnects, so the controller can bind a rank to one connection: the id is
never sent in a payload, and a second connection cannot take it while the first is alive
without knowing it. Frames over the protocol's size limit are refused (and counted) by
`protocol.peek` from the header alone (per message type); frames over the protocol limit
itself make libzmq drop the sender's connection (ZMQ_MAXMSGSIZE) before any of our code sees
them, which the controller's socket monitor counts as a disconnect. Every socket also bounds
what a peer can hold: a controller queues at most `ROUTER_RCVHWM` frames per connection
(then libzmq stops reading that peer), a peer that never completes the ZMTP handshake is
dropped after `HANDSHAKE_IVL_MS`, and TCP keepalive with a retransmission bound drops the
connection of a dead node (`TCP_KEEPALIVE`, `TCP_MAXRT_MS`: no half-open connection stays
behind).

CURVE (`ControlConfig.curve`): controllers and backups are CURVE servers with the server key
pair; processors are CURVE clients with the client key pair and pin the server's PUBLIC key,
so a peer without the server secret can never pose as a controller (nor as a backup a
controller named). A ZAP handler in each controller process admits the authorized client
public keys plus the server's own public key, which is how backups authenticate to the
active controller: their client pair IS the server pair, held only on controller hosts. The
ZAP handler sets each connection's User-Id to the peer's z85 public key; the controller
reads it per frame (`user_id`) to recognise backups and to bind a rank to the key it
registered with. A peer with a wrong or no key never completes the handshake, so it can
neither send anything that reaches the controller's code nor receive anything. Key files
are ZeroMQ certificates (`python -m mindspeed_tft.control.wire.keys DIR` writes one set per role).

Without CURVE a controller only binds loopback addresses unless `TTP_ALLOW_INSECURE=1`
(`check_bind`); the per-job token (`TTP_JOB_TOKEN`) then authenticates registrations.
Which connections a controller keeps, and for how long, is `admission.py`'s business.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import resource  # at import: a warm spare imports nothing once it takes a rank
import threading
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from .config import ControlConfig, ControlConfigError
from .peers import (  # noqa: F401  (re-exported: the shells' names for them)
    REFUSED,
    REFUSED_FOR_NOW,
    STORM_ALLOWANCE_S,
    hostport,
    is_ipv6,
    storm_allowance,
    token_ok,
)

log = logging.getLogger("mindspeed_tft.control.transport")

ZAP_DOMAIN = "ttp"


def endpoint(addr: str, port: int | str) -> str:
    """`tcp://` endpoint for an address and port (IPv6 in brackets); port `*` = any."""
    addr = addr.strip("[]")
    host = f"[{addr}]" if is_ipv6(addr) else addr
    return f"tcp://{host}:{port}"


def new_routing_id() -> bytes:
    """A random routing id (libzmq reserves ids starting with a zero byte)."""
    rid = bytearray(os.urandom(16))
    rid[0] = rid[0] or 1
    return bytes(rid)


def bound_port(sock: zmq.Socket) -> int:
    """The TCP port a socket is bound to (after binding to port `*`)."""
    last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(last.rsplit(":", 1)[1])


#: the soft open-files limit asked for where the hard limit is unlimited (the kernel's usual
#: ceiling, fs.nr_open)
UNLIMITED_FILES = 1 << 20
#: descriptors `FdReserve` holds for a controller to give back when the process runs out
RESERVE_FILES = 32


def raise_fd_limit(needed: int = 0, warn_below: int | None = None) -> int:
    """Raise this process's open-files soft limit to its hard limit (a store, a controller
    and their peers' connections share it: any local user can open connections to them);
    returns the soft limit now in force, and warns when it is below `warn_below` (default
    `needed`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit to %d: %s", target, e)
    floor = needed if warn_below is None else warn_below
    if soft != resource.RLIM_INFINITY and soft < floor:
        log.warning("open-files limit %d (hard limit %s) is below the %d this process needs",
                    soft, hard, floor)
    return soft


class FdReserve:
    """Open files held back (descriptors of /dev/null) for the moment the process runs out:
    `release` closes them so that a listener's pending accept (a rank's registration) can
    succeed, `refill` takes them again once files are free."""

    def __init__(self, count: int = RESERVE_FILES) -> None:
        self.count = count
        self._fds: list[int] = []
        self.releases = 0
        self.refill()

    def refill(self) -> int:
        """Take the reserve again (as far as files are free); returns how many are held."""
        while len(self._fds) < self.count:
            try:
                self._fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                break
        return len(self._fds)

    def release(self) -> int:
        """Give the reserve back to the process; returns how many files were freed."""
        freed = len(self._fds)
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        if freed:
            self.releases += 1
        return freed

    def close(self) -> None:
        self.release()


def load_cert(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate file."""
    import zmq.auth  # imported here: it pulls in asyncio, which only CURVE users need

    try:
        public, secret = zmq.auth.load_certificate(path)
    except Exception as e:
        raise ControlConfigError(f"cannot read CURVE certificate {path!r}: {e}") from None
    return public, secret


def _authorized_keys(path: str) -> set[bytes]:
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".key")]
    keys = {load_cert(p)[0] for p in paths}
    if not keys:
        raise ControlConfigError(f"no client public keys (*.key) in {path!r}")
    return keys


@dataclass
class CurveKeys:
    """The CURVE keys one process needs (z85-encoded bytes)."""

    server_public: bytes
    server_secret: bytes | None
    client_public: bytes | None
    client_secret: bytes | None
    authorized: frozenset[bytes]

    @property
    def server_user_id(self) -> str:
        """The ZAP User-Id of a peer holding the server key pair (a backup controller)."""
        return self.server_public.decode("ascii")

    def as_backup_client(self) -> CurveKeys:
        """A backup's keys towards the active controller: the server pair as client pair."""
        if self.server_secret is None:
            raise ControlConfigError("a backup controller needs the server's secret key "
                                     "(TTP_CURVE_SERVER_KEY=.../server.key_secret)")
        return CurveKeys(self.server_public, None, self.server_public, self.server_secret,
                         frozenset())

    @classmethod
    def from_config(cls, config: ControlConfig, *, server: bool) -> CurveKeys | None:
        """Keys for a controller (`server=True`) or a processor; None when CURVE is off.

        A controller needs the server SECRET (`TTP_CURVE_SERVER_KEY=.../server.key_secret`);
        a processor needs only the server's public key (`.../server.key`, or the secret file,
        of which it reads the public half) and its client pair (`TTP_CURVE_CLIENT_KEY`)."""
        if not config.curve:
            return None
        assert config.curve_server_key is not None
        server_public, server_secret = load_cert(config.curve_server_key)
        client_public = client_secret = None
        if config.curve_client_key:
            client_public, client_secret = load_cert(config.curve_client_key)
        if server and server_secret is None:
            raise ControlConfigError(
                f"TTP_CURVE_SERVER_KEY={config.curve_server_key!r} holds no secret key; a "
                "controller or backup needs the server's .key_secret file (processors on other "
                "nodes take the public server.key)"
            )
        if not server and client_secret is None:
            raise ControlConfigError(
                "CURVE is on (TTP_CURVE_SERVER_KEY) but TTP_CURVE_CLIENT_KEY "
                f"({config.curve_client_key!r}) does not name a client .key_secret file"
            )
        authorized: set[bytes] = set()
        if server:
            if config.curve_authorized_keys:
                authorized = _authorized_keys(config.curve_authorized_keys)
            elif client_public is not None:
                authorized = {client_public}
            else:
                raise ControlConfigError(
                    "CURVE is on but the controller knows no client key: set "
                    "TTP_CURVE_AUTHORIZED_KEYS or TTP_CURVE_CLIENT_KEY"
                )
            authorized.add(server_public)  # backups authenticate with the server pair
        return cls(server_public, server_secret, client_public, client_secret,
                   frozenset(authorized))


def user_id(frame: Any) -> str | None:
    """The ZAP User-Id (the peer's z85 public key under CURVE) of a received `zmq.Frame`."""
    try:
        value = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return value or None


#: the REJECT payloads: they name what the peer may check on its side, nothing of the job
def check_bind(config: ControlConfig, addr: str, what: str) -> str | None:
    """Refuse an unauthenticated controller on a non-loopback address.

    Without CURVE, a controller reachable from other hosts lets anyone there read the job's
    state and end it, so binding a non-loopback address (a wildcard such as 0.0.0.0 or ::
    counts as non-loopback) needs CURVE keys or the explicit opt-out `TTP_ALLOW_INSECURE=1`.
    Returns the warning to log on every start (opt-out, or loopback without a job token);
    raises ControlConfigError otherwise."""
    if config.curve:
        return None
    ip = ipaddress.ip_address(addr.strip("[]"))
    if ip.is_loopback:
        if config.job_token is None:
            return (f"{what} on {addr} without CURVE keys and without TTP_JOB_TOKEN: any "
                    "process of this host can register ranks and send reports")
        return None
    if not config.allow_insecure:
        raise ControlConfigError(
            f"{what} would listen on {addr}, which is not a loopback address, without CURVE "
            "keys: anyone who reaches it could end the job. Set TTP_CURVE_SERVER_KEY and "
            "TTP_CURVE_AUTHORIZED_KEYS (python -m mindspeed_tft.control.wire.keys DIR), or "
            "TTP_ALLOW_INSECURE=1 to run an unauthenticated control plane anyway"
        )
    return (f"INSECURE: {what} listens on {addr} without CURVE (TTP_ALLOW_INSECURE=1): anyone "
            "who reaches it can read the job's state and end it")


class ZapHandler:
    """The ZAP handler (ZeroMQ RFC 27) of a controller process: admits a CURVE handshake
    only for an authorized client public key, and sets the connection's User-Id to that
    key (z85). A thread of its own answers every queued request at once, in microseconds
    each: pyzmq's ThreadAuthenticator, on asyncio, took ~0.2 ms per request here, 3 s of
    the controller's process during a start-up of 16,000 ranks. `stop` ends it."""

    ENDPOINT = "inproc://zeromq.zap.01"

    def __init__(self, ctx: zmq.Context, authorized: frozenset[bytes]) -> None:
        self.ctx = ctx
        self.authorized = authorized
        #: handshakes admitted and refused
        self.admitted = 0
        self.refused = 0
        self._running = True
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tft-zap", daemon=True)

    def start(self) -> ZapHandler:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        self._running = False
        self._thread.join(5)

    def _run(self) -> None:
        try:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while self._running:
                if not sock.poll(100):
                    continue
                while True:
                    try:
                        request = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = self.answer(request)
                    if reply is not None:
                        sock.send_multipart(reply)
        finally:
            sock.close(0)

    def answer(self, request: list[bytes]) -> list[bytes] | None:
        """The reply to one request ([routing id, b"", version, request id, domain, address,
        identity, mechanism, credentials...]); None for a malformed one."""
        if len(request) < 8 or request[1] != b"" or request[2] != b"1.0":
            return None
        head, request_id = request[:2], request[3]
        domain, mechanism = request[4], request[7]
        key = (z85.encode(request[8])
               if mechanism == b"CURVE" and len(request) == 9 and len(request[8]) == 32
               else None)
        if domain == ZAP_DOMAIN.encode() and key is not None and key in self.authorized:
            self.admitted += 1
            return [*head, b"1.0", request_id, b"200", b"OK", key, b""]
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("CURVE: refused a client key (domain %s; refusal #%d)",
                        domain.decode("ascii", "replace")[:32], self.refused)
        return [*head, b"1.0", request_id, b"400", b"not an authorized key", b"", b""]


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ZapHandler:
    """Run the ZAP handler admitting only the authorized CURVE client keys; stop it on
    close. Only CURVE needs one: without it a connection shows who it is by its REGISTER
    (the job's token), which `admission.Admission` watches."""
    return ZapHandler(ctx, keys.authorized).start()


#: frames a controller's ROUTER queues per connection before libzmq stops reading that
#: connection (TCP back-pressure on that peer alone; a rank sends one heartbeat per interval)
ROUTER_RCVHWM = 64
#: a peer gone without a FIN (a dead node) is found by the kernel: TCP keepalive probes a
#: connection idle for IDLE s every INTVL s and drops it after CNT unanswered probes, and
#: data left unacknowledged for TCP_MAXRT_MS drops it too (TCP_USER_TIMEOUT): ~20 s either
#: way, at no cost to libzmq's I/O thread. ZMTP heartbeats did this before, but a PING and
#: a PONG per connection per interval were two thirds of a controller's CPU at 4,000 ranks
#: (0.15 of 0.18 cores measured here); liveness is the processors' own heartbeats, and
#: connections that never show the job's token are closed by `admission.Admission`.
TCP_KEEPALIVE = (10, 2, 5)  # (IDLE s, INTVL s, CNT)
TCP_MAXRT_MS = 20000
#: a connection that has not completed the ZMTP handshake within this is dropped (a
#: controller gives its own `ControlConfig.admit_deadline`: in a registration storm of
#: thousands of CURVE handshakes, ~0.5 ms of CPU each here, the last ones take seconds,
#: and a handshake cut off by a timeout is work lost and a reconnect more)
HANDSHAKE_IVL_MS = 5000
#: the same on a processor's side: longer than any controller's
DEALER_HANDSHAKE_IVL_MS = 30000
def _common(sock: zmq.Socket, addr: str, max_bytes: int, handshake_ms: int = HANDSHAKE_IVL_MS,
            keepalive: tuple[int, int, int] = TCP_KEEPALIVE, maxrt_ms: int = TCP_MAXRT_MS,
            ) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # libzmq cuts off a peer that sends a frame over the protocol limit before reading it
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, keepalive[0])
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, keepalive[1])
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, keepalive[2])
    sock.setsockopt(zmq.TCP_MAXRT, maxrt_ms)
    if is_ipv6(addr):
        sock.setsockopt(zmq.IPV6, 1)


def bind_router(ctx: zmq.Context, addr: str, port: int, *, max_bytes: int,
                curve: CurveKeys | None = None, handshake_ms: int = HANDSHAKE_IVL_MS,
                keepalive: tuple[int, int, int] = TCP_KEEPALIVE, maxrt_ms: int = TCP_MAXRT_MS,
                backlog: int = 4096) -> zmq.Socket:
    """A ROUTER bound to addr:port (port 0: any free port; see `bound_port`).

    curve: the server keys (a ZAP handler, `start_authenticator`, checks the client keys);
    handshake_ms: a connection that has not completed the ZMTP handshake by then is dropped;
    keepalive, maxrt_ms: how the kernel finds a dead peer (`TCP_KEEPALIVE`, `TCP_MAXRT_MS`);
    backlog: connections the kernel queues until libzmq accepts them (a registration storm
    of every rank at once; capped by net.core.somaxconn, whose overflow makes a client
    retry its SYN a second later)."""
    sock = ctx.socket(zmq.ROUTER)
    _common(sock, addr, max_bytes, handshake_ms, keepalive, maxrt_ms)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a processor's reconnect keeps its routing id
    sock.setsockopt(zmq.BACKLOG, backlog)
    sock.setsockopt(zmq.RCVHWM, ROUTER_RCVHWM)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.bind(endpoint(addr, port if port else "*"))
    return sock


#: connection events a controller counts (accepted and disconnected carry the connection's
#: file descriptor: `admission.Admission`)
MONITOR_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MONITOR_NAMES: dict[int, str] = {
                 zmq.EVENT_ACCEPTED: "accepted", zmq.EVENT_DISCONNECTED: "disconnected",
                 zmq.EVENT_ACCEPT_FAILED: "accept_failed",
                 zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
                 zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
                 zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth_failed"}


def monitor_socket(sock: zmq.Socket, events: int = MONITOR_EVENTS) -> zmq.Socket:
    """A PAIR socket receiving `sock`'s monitor events, with no queue limit: libzmq drops
    the events that do not fit (1,000 by default), and a registration storm of thousands
    of connections makes several events each, which `admission.Admission` must all see."""
    addr = f"inproc://monitor.{sock.underlying:x}"
    sock.monitor(addr, events)
    pair = sock.context.socket(zmq.PAIR)
    pair.setsockopt(zmq.RCVHWM, 0)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(addr)
    return pair


def connect_dealer(ctx: zmq.Context, addr: str, port: int, *, routing_id: bytes,
                   max_bytes: int, curve: CurveKeys | None = None) -> zmq.Socket:
    """A DEALER connected to a controller, with a fixed routing id."""
    sock = ctx.socket(zmq.DEALER)
    _common(sock, addr, max_bytes, DEALER_HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    if curve is not None:
        if curve.client_secret is None or curve.client_public is None:
            raise ControlConfigError("CURVE is on but no client key pair was given")
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.client_secret)
    sock.connect(endpoint(addr, port))
    return sock
