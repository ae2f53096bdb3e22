"""Launchers heard across nodes: every launcher but node 0's beats in the job's store, and
node 0's launcher tells its controller which one fell silent (`tft-run` on several nodes,
high availability with worker reboot).

A lost worker is restarted by its own node's launcher. When that launcher is gone too (its
host died, or dropped off the network), nobody will restart it, and the controller must not
wait for a restart (`TFT_REPLACEMENT_WAIT`, minutes) before it decides: `NodeWatch` reports
a launcher silent for the control plane's loss time (`TTP_HEARTBEAT_INTERVAL` x
`TTP_HEARTBEAT_MISSES`) with `Controller.report_node_silent`, and one heard again (a link
back, a replacement launcher) with `report_node_back`; `control.controller.nodes` decides.

Each side uses a store client of its own (a store call toward a host that dropped off the
network blocks until its timeout; the launcher's own client is not held up by it). What a
node publishes is read with a type and bounds (anyone who reaches the store can write it):
its beat is a counter (`store.add`), its ranks a JSON list of ranks of the job.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from mindspeed_tft.events import store_refused

log = logging.getLogger("mindspeed_tft.launcher.heartbeat")

#: a node's beat counter, and the ranks its launcher runs
BEAT_KEY = "mindspeed_tft/launcher/beat/{}"
RANKS_KEY = "mindspeed_tft/launcher/ranks/{}"


def _client(addr: str, port: int, timeout: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout),
                    wait_for_workers=False)


def parse_ranks(raw: bytes, key: str, world_size: int) -> tuple[int, ...] | None:
    """A node's ranks from the store, or None (refused: a `store_value_refused` event)."""
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        value = None
    if (isinstance(value, list) and 0 < len(value) <= world_size
            and all(type(r) is int and 0 <= r < world_size for r in value)):
        return tuple(value)
    store_refused(key, raw, f"a JSON list of 1..{world_size} ranks in 0..{world_size - 1}")
    return None


class _Loop(threading.Thread):
    """A daemon thread calling `step` every `interval` seconds until `stop`."""

    def __init__(self, name: str, interval: float) -> None:
        super().__init__(name=name, daemon=True)
        self.interval = interval
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.step()
            except Exception as error:  # the store unreachable: try again next time
                log.debug("%s: %s", self.name, error)
                self.lost()

    def step(self) -> None:
        raise NotImplementedError

    def lost(self) -> None:
        """The store client failed: the next step makes a new one."""


class NodeBeat(_Loop):
    """A launcher of node > 0: its beat, every interval, and its ranks once."""

    def __init__(self, addr: str, port: int, node: int, ranks: list[int],
                 interval: float) -> None:
        super().__init__(f"tft-node-beat-{node}", interval)
        self.addr, self.port, self.node, self.ranks = addr, port, node, ranks
        #: when the last beat reached the store (monotonic)
        self.last_beat = time.monotonic()
        self._store: Any = None

    def step(self) -> None:
        if self._store is None:
            self._store = _client(self.addr, self.port, max(2 * self.interval, 1.0))
            self._store.set(RANKS_KEY.format(self.node), json.dumps(self.ranks))
        self._store.add(BEAT_KEY.format(self.node), 1)
        self.last_beat = time.monotonic()

    def cut_off(self, lost_after: float) -> bool:
        """Whether no beat reached node 0's store for `lost_after` seconds."""
        return time.monotonic() - self.last_beat >= lost_after

    def lost(self) -> None:
        self._store = None


class NodeWatch(_Loop):
    """Node 0's launcher: the other launchers' beats, and who fell silent or came back."""

    def __init__(self, addr: str, port: int, nodes: int, world_size: int, interval: float,
                 lost_after: float, silent: Callable[[int, list[int], float], None],
                 back: Callable[[int], None], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        super().__init__("tft-node-watch", interval)
        self.addr, self.port, self.nodes, self.world_size = addr, port, nodes, world_size
        self.lost_after = lost_after
        self.silent, self.back, self.clock = silent, back, clock
        #: node -> (last beat count, when it changed); a node is watched once it beat
        self.beats: dict[int, tuple[int, float]] = {}
        self.ranks: dict[int, tuple[int, ...]] = {}
        self.reported: set[int] = set()
        self._store: Any = None

    def step(self) -> None:
        if self._store is None:
            self._store = _client(self.addr, self.port, max(2 * self.interval, 1.0))
        now = self.clock()
        for node in range(1, self.nodes):
            count = int(self._store.add(BEAT_KEY.format(node), 0))
            last = self.beats.get(node)
            if count == 0:
                continue
            if last is None or count != last[0]:
                self.beats[node] = (count, now)
                if node in self.reported:
                    self.reported.discard(node)
                    self.back(node)
                continue
            silent_for = now - last[1]
            if silent_for >= self.lost_after and node not in self.reported:
                ranks = self._ranks(node)
                if ranks:
                    self.reported.add(node)
                    self.silent(node, list(ranks), silent_for)

    def _ranks(self, node: int) -> tuple[int, ...] | None:
        if node not in self.ranks:
            key = RANKS_KEY.format(node)
            if not self._store.check([key]):
                return None
            ranks = parse_ranks(self._store.get(key), key, self.world_size)
            if ranks is None:
                return None
            self.ranks[node] = ranks
        return self.ranks[node]

    def lost(self) -> None:
        self._store = None
