"""`tft-run`'s rendezvous store listens on the job's master address only (not every
interface, which is what torch's TCPStore server does on its own)."""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from mindspeed_tft.launcher.store import bind_static_store
from tests.jobs import free_port


def listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net shows them) listening on TCP `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == port:
                    found.add(local.split(":")[0])
    return found


def test_static_store_listens_on_the_master_address_only() -> None:
    plain, bound = free_port(), free_port()
    timeout = datetime.timedelta(seconds=10)
    torch_own = dist.TCPStore("127.0.0.1", plain, 1, True, timeout, wait_for_workers=False)
    assert listening(plain) == {"0" * 32}  # torch alone: [::], every interface
    handler = StaticTCPRendezvous("127.0.0.1", bound, 0, 1, "run", 10)
    assert bind_static_store(handler)
    assert listening(bound) == {"0100007F"}  # 127.0.0.1
    info = handler.next_rendezvous()  # the rendezvous reuses it
    client = dist.TCPStore("127.0.0.1", bound, is_master=False, timeout=timeout)
    client.set("run/key", b"value")
    assert info.store.get("key") == b"value"
    assert not bind_static_store(handler)  # once
    assert not bind_static_store(StaticTCPRendezvous("0.0.0.0", free_port(), 0, 1, "r", 10))
    assert not bind_static_store(StaticTCPRendezvous("127.0.0.1", free_port(), 1, 2, "r", 10))
    del torch_own, client
