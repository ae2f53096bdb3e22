"""Who a peer is, without I/O: addresses and their printed form, the job token's check, the
answers to a refused registration, and what a storm of handshakes may cost.

Pure functions and constants that the controller's and the processor's cores decide with, and
that the shells (`transport`, `config`) use too: `parse_ip`, `parse_port`, `parse_hostport`
(a value and the variable it came from, or `ControlConfigError` naming both), `is_ipv6`,
`hostport`, `token_ok` (a constant-time comparison with `TTP_JOB_TOKEN`), `REFUSED`,
`REFUSED_FOR_NOW`, `storm_allowance`.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any


class ControlConfigError(ValueError):
    """A configuration value that cannot be used (the message names it and what is allowed)."""


def parse_ip(value: str, name: str, *, allow_wildcard: bool = True) -> str:
    """Validate an IPv4/IPv6 literal (brackets allowed around IPv6); returns it unbracketed."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        raise ControlConfigError(
            f"{name}={value!r} is not an IPv4 or IPv6 address (e.g. 127.0.0.1, 10.0.0.5, ::1)"
        ) from None
    if ip.is_unspecified and not allow_wildcard:
        raise ControlConfigError(
            f"{name}={value!r} is a wildcard address; processors need the controller's real address"
        )
    return str(ip)


def parse_port(value: str | int, name: str = "TTP_PORT", *, allow_any: bool = False) -> int:
    """Validate a TCP port (1..65535; 0 = any free port where `allow_any`)."""
    try:
        port = int(str(value).strip())
    except ValueError:
        raise ControlConfigError(f"{name}={value!r} is not an integer port (allowed: 1..65535)") from None
    if not (0 if allow_any else 1) <= port <= 65535:
        raise ControlConfigError(f"{name}={value!r} is out of range (allowed: 1..65535)")
    return port


def is_ipv6(addr: str) -> bool:
    """True for an IPv6 literal."""
    return ipaddress.ip_address(addr.strip("[]")).version == 6


def hostport(addr: str, port: int) -> str:
    """`ip:port` or `[ipv6]:port` (the form `TTP_BACKUP_ADDRS` takes)."""
    addr = addr.strip("[]")
    return f"[{addr}]:{port}" if is_ipv6(addr) else f"{addr}:{port}"


def parse_hostport(value: str, name: str) -> tuple[str, int]:
    """Parse `ip:port` or `[ipv6]:port` into (ip, port)."""
    text = value.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ControlConfigError(f"{name}: {value!r} is not '[ipv6]:port'")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise ControlConfigError(
                f"{name}: {value!r} is not 'ip:port' (write IPv6 as '[addr]:port')"
            )
    return parse_ip(host, name, allow_wildcard=False), parse_port(port, name)


#: seconds of handshake (and registration) work each connection made at the same time may
#: queue ahead of another: a CURVE handshake costs ~0.5 ms of a controller's I/O thread
#: here (3/4 of it libsodium's guarded memory for the keys), a NULL one 0.07 ms. Waits
#: that may cover a registration storm grow by this per rank or pending connection.
STORM_ALLOWANCE_S = 0.001


def storm_allowance(connections: int) -> float:
    """Seconds `connections` handshakes made at once may take beyond the usual."""
    return STORM_ALLOWANCE_S * connections


REFUSED: dict[str, Any] = {
    "reason": "the controller refused this registration (wrong TTP_JOB_TOKEN or CURVE key, "
              "or a rank or world size this job does not have; the controller's log says "
              "which)", "retry": False}
REFUSED_FOR_NOW: dict[str, Any] = {
    "reason": "the controller refused this registration for now (the rank is still held by a "
              "live connection); retrying", "retry": True}


def token_ok(job_token: str | None, given: Any) -> bool:
    """Does a peer's token match the job's `TTP_JOB_TOKEN` (always, when none is set)?"""
    if job_token is None:
        return True
    return type(given) is str and hmac.compare_digest(given.encode(), job_token.encode())
