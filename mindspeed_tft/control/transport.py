"""ZeroMQ sockets for the control plane: ROUTER on controllers, DEALER per processor.

TCP over IPv4 or IPv6. Processors choose a random 16-byte routing id for their DEALER and
keep it across reconnects, so the controller can bind a rank to one connection: the id is
never sent in a payload, and a second connection cannot take it while the first is alive
without knowing it. Frames over the protocol's size limit are refused (and counted) by
`protocol.decode`; frames over 4x that limit make libzmq drop the sender's connection
(ZMQ_MAXMSGSIZE) before any of our code sees them, which the controller's socket monitor
counts as a disconnect.

Optional CURVE (`ControlConfig.curve`): controllers are CURVE servers with the server key
pair, processors (and backups talking to the active controller) CURVE clients with the
client key pair; a ZAP handler in each controller process admits only the authorized client
public keys. A peer with a wrong or no key never completes the handshake, so it can neither
send anything that reaches the controller's code nor receive anything. Key files are ZeroMQ
certificates (`python -m mindspeed_tft.control.keys DIR` writes a set).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Any

import zmq

from .config import ControlConfig, ControlConfigError

log = logging.getLogger("mindspeed_tft.control.transport")

ZAP_DOMAIN = "ttp"


def is_ipv6(addr: str) -> bool:
    """True for an IPv6 literal."""
    return ipaddress.ip_address(addr.strip("[]")).version == 6


def endpoint(addr: str, port: int | str) -> str:
    """`tcp://` endpoint for an address and port (IPv6 in brackets); port `*` = any."""
    addr = addr.strip("[]")
    host = f"[{addr}]" if is_ipv6(addr) else addr
    return f"tcp://{host}:{port}"


def hostport(addr: str, port: int) -> str:
    """`ip:port` or `[ipv6]:port` (the form `TTP_BACKUP_ADDRS` takes)."""
    addr = addr.strip("[]")
    return f"[{addr}]:{port}" if is_ipv6(addr) else f"{addr}:{port}"


def new_routing_id() -> bytes:
    """A random routing id (libzmq reserves ids starting with a zero byte)."""
    rid = bytearray(os.urandom(16))
    rid[0] = rid[0] or 1
    return bytes(rid)


def bound_port(sock: zmq.Socket) -> int:
    """The TCP port a socket is bound to (after binding to port `*`)."""
    last = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return int(last.rsplit(":", 1)[1])


def raise_fd_limit(needed: int) -> int:
    """Raise this process's open-files soft limit towards `needed` (a controller holds one
    TCP connection per rank); returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed or soft == resource.RLIM_INFINITY:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-files limit to %d: %s", target, e)
    if soft < needed:
        log.warning("open-files limit %d is below the %d this controller may need", soft, needed)
    return soft


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

    @classmethod
    def from_config(cls, config: ControlConfig, *, server: bool) -> CurveKeys | None:
        """Keys for a controller (`server=True`) or a processor; None when CURVE is off."""
        if not config.curve:
            return None
        assert config.curve_server_key is not None
        server_public, server_secret = load_cert(config.curve_server_key)
        client_public = client_secret = None
        if config.curve_client_key:
            client_public, client_secret = load_cert(config.curve_client_key)
        if server and server_secret is None:
            raise ControlConfigError(
                f"TTP_CURVE_SERVER_KEY={config.curve_server_key!r} has no secret key; a "
                "controller needs the server's .key_secret file"
            )
        if not server and client_secret is None:
            raise ControlConfigError(
                "CURVE is on (TTP_CURVE_SERVER_KEY) but TTP_CURVE_CLIENT_KEY does not name a "
                "client .key_secret file"
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
        return cls(server_public, server_secret, client_public, client_secret,
                   frozenset(authorized))


class _KeyCheck:
    """ZAP credentials provider: admit only the authorized client public keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning("CURVE: refused a client key (domain %s)", domain)
        return ok


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> Any:
    """Run a ZAP handler (a ThreadAuthenticator) checking client keys; stop it on close."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("mindspeed_tft.control.zap"))
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_KeyCheck(keys.authorized))
    return auth


def _common(sock: zmq.Socket, addr: str, max_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_bytes)
    if is_ipv6(addr):
        sock.setsockopt(zmq.IPV6, 1)


def bind_router(ctx: zmq.Context, addr: str, port: int, *, max_bytes: int,
                curve: CurveKeys | None = None) -> zmq.Socket:
    """A ROUTER bound to addr:port (port 0: any free port; see `bound_port`)."""
    sock = ctx.socket(zmq.ROUTER)
    _common(sock, addr, max_bytes)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a processor's reconnect keeps its routing id
    sock.setsockopt(zmq.BACKLOG, 4096)  # thousands of ranks connect at once (capped by somaxconn)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.bind(endpoint(addr, port if port else "*"))
    return sock


#: connection events a controller counts (never the per-connection successes: 16k ranks)
MONITOR_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MONITOR_NAMES = {zmq.EVENT_DISCONNECTED: "disconnected",
                 zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
                 zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
                 zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth_failed"}


def connect_dealer(ctx: zmq.Context, addr: str, port: int, *, routing_id: bytes,
                   max_bytes: int, curve: CurveKeys | None = None) -> zmq.Socket:
    """A DEALER connected to a controller, with a fixed routing id."""
    sock = ctx.socket(zmq.DEALER)
    _common(sock, addr, max_bytes)
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
