"""Abandon pending collectives within a bounded time, so a stopped rank's training thread
raises instead of waiting for a peer that will never answer.

When one rank fails, the others block in the next collective that needs it. A dead peer
closes its sockets and gloo raises at once, but a peer that is alive and stuck (it raised
and sits in the fault handler, or it hangs) keeps them blocked until the process-group
timeout, minutes. NCCL (and HCCL) can abort their communicators. gloo cannot: its
`abort()` leaves the connections open, and the wait of some of its operations (every
reduce-scatter) ignores timeouts. What does wake every gloo operation at once is what a
dead peer does: closed connections. `abandon()` therefore shuts down (without closing: the
file descriptors stay valid for gloo) every TCP connection of this process except those of
the rendezvous store and the control plane. Every operation of this rank, and every
operation of a peer waiting on this rank, then fails with "Connection closed by peer"; the
training threads land in the fault handler, where the error counts as a consequence of the
stop. The process lives on: recovery rebuilds the process groups on new connections.

Linux: the connections are found through /proc/self/fd and /proc/self/net/tcp{,6}.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable

import torch.distributed as dist

log = logging.getLogger("mindspeed_tft.recovery")

_LISTEN = "0A"


def _tcp_connections() -> dict[int, tuple[int, int, str]]:
    """socket inode -> (local port, remote port, state) of this process's TCP sockets."""
    table: dict[int, tuple[int, int, str]] = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16),
                            state)
    return table


def _socket_fds() -> Iterable[tuple[int, int]]:
    """(fd, inode) of this process's open sockets."""
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            yield int(name), int(link[8:-1])


def shutdown_connections(keep_ports: Iterable[int]) -> int:
    """Shut down every established TCP connection of this process whose local or remote
    port is not in `keep_ports`; returns how many."""
    keep = set(keep_ports)
    table = _tcp_connections()
    count = 0
    for fd, inode in _socket_fds():
        row = table.get(inode)
        if row is None:
            continue
        local_port, remote_port, state = row
        if state == _LISTEN or local_port in keep or remote_port in keep:
            continue
        try:
            if os.fstat(fd).st_ino != inode:  # closed and reused since it was listed
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # closed by its owner since it was listed
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


def abandon(reason: str, keep_ports: Iterable[int]) -> int:
    """Make every pending and future collective of this process fail now.

    `keep_ports`: the ports of connections that must survive (the rendezvous store, the
    controllers). Returns the number of connections shut down (0 on NCCL, whose
    communicators are aborted instead)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
        log.warning("communicators aborted: %s", reason)
        return 0
    count = shutdown_connections(keep_ports)
    log.warning("%d process-group connections shut down: %s", count, reason)
    return count
