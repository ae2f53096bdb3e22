"""The job's rendezvous store (torch's TCPStore) listening on the job's address only.

torch's `TCPStore(host, port, is_master=True)` ignores `host` for its server: it listens on
every interface (`[::]`, dual-stack), in torch 2.13 with either backend (libuv or legacy),
and torch offers no bind-address argument. It does take an already listening socket
(`master_listen_fd`, honoured by the default libuv backend), so `tft-run`'s node 0 creates
the static rendezvous' store itself on a socket bound to `--master-addr` (e.g. 127.0.0.1 on
one node, the node's cluster address on several): the store that the rendezvous, the
workers, process-group rebuilds (`recovery.rebuild`) and replacement launchers use is then
reachable on that address alone. A wildcard master address (0.0.0.0, ::) keeps torch's
behaviour. Plain `torchrun` creates its store itself and still listens everywhere.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any

log = logging.getLogger("mindspeed_tft.launcher.store")


def listen_socket(addr: str, port: int) -> socket.socket | None:
    """A TCP socket listening on `addr:port` (the first address `addr` resolves to); None for
    a wildcard address (then torch listens everywhere, as it would anyway)."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    if ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_unspecified:
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def bind_static_store(handler: Any) -> bool:
    """Node 0 of a static rendezvous: create its TCPStore server now, listening on the master
    address only (`next_rendezvous` then reuses it). Returns True when it did; False for
    other rendezvous backends, other nodes, a store already made, or a wildcard address."""
    from torch.distributed import TCPStore

    if (handler.get_backend() != "static" or handler.rank != 0
            or getattr(handler, "_store", None) is not None):
        return False
    sock = listen_socket(handler.master_addr, handler.master_port)
    if sock is None:
        return False
    handler._store = TCPStore(handler.master_addr, handler.master_port, handler.world_size,
                              True, handler.timeout, multi_tenant=True,
                              master_listen_fd=sock.fileno())
    handler._tft_listen_socket = sock  # the store serves on this socket: keep it open
    log.info("rendezvous store listens on %s:%d only", handler.master_addr,
             handler.master_port)
    return True
