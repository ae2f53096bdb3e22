"""Admission: hostile connections never keep a rank out, and what they hold is bounded.

`Admission` alone, on real TCP connections: a pending connection is closed at its deadline,
beyond its room the oldest of the source holding the most goes first, a descriptor reused
by another connection is never shut down, and admitted connections are capped. Then a real
controller (NULL and CURVE) while hostile peers hold many more connections than it has
pending room: idle DEALERs that never send anything and raw TCP sockets stuck in the
greeting, both connecting again when dropped. The ranks register at once and are never
disconnected; the hostile peers are closed at their deadline or to make room.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from mindspeed_tft.control import ControlConfig, Controller
from mindspeed_tft.control.controller.admission import FD_RESERVE, Admission
from mindspeed_tft.control.wire.keys import generate_keys
from mindspeed_tft.control.wire.protocol import MsgType, decode, encode
from mindspeed_tft.control.wire.transport import load_cert
from tests.control.ctl_harness import wait_for
from tests.hostile import Greeters, IdleDealers

TOKEN = "admission-test-" + "ab12" * 8


class Conns:
    """Real TCP connections to a listener: `server` ends (as libzmq holds them) by name."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.clients: dict[str, socket.socket] = {}
        self.servers: dict[str, socket.socket] = {}

    def open(self, name: str, source: str = "127.0.0.1") -> int:
        c = socket.socket()
        c.bind((source, 0))
        c.connect(("127.0.0.1", self.port))
        s, _ = self.listener.accept()
        self.clients[name], self.servers[name] = c, s
        return s.fileno()

    def closed(self, name: str) -> bool:
        """Did the server end shut `name` down (its client reads the end of the stream)?"""
        c = self.clients[name]
        c.settimeout(0.2)
        try:
            return c.recv(1) == b""
        except TimeoutError:
            return False

    def close(self) -> None:
        for s in [*self.clients.values(), *self.servers.values(), self.listener]:
            s.close()


@pytest.fixture
def conns():
    c = Conns()
    yield c
    c.close()


def test_pending_connections_close_at_their_deadline(conns: Conns) -> None:
    adm = Admission(rank_cap=8, pending_cap=8, deadline=5.0)
    for i, name in enumerate(("a", "b", "c")):
        adm.on_event(zmq.EVENT_ACCEPTED, conns.open(name), now=100.0 + i)
    assert adm.admit(conns.servers["b"].fileno())
    assert adm.enforce(104.9) == 0 and not adm.due(104.9)
    assert adm.due(105.0) and adm.enforce(105.5) == 1  # "a" at 100 + 5
    # "c" at 102 + 5, plus 1 ms for each of the two connections pending when it came (the
    # handshakes that may have been queued ahead of it); "b" is admitted: kept
    assert adm.enforce(107.0) == 0 and adm.enforce(107.002) == 1
    assert [conns.closed(n) for n in "abc"] == [True, False, True]
    assert adm.view() == {"admitted": 1, "pending": 0, "open": 1, "closed_at_deadline": 2,
                          "closed_for_room": 0, "refused_over_cap": 0}
    adm.on_event(zmq.EVENT_DISCONNECTED, conns.servers["b"].fileno(), now=107.0)
    assert adm.view()["open"] == 0


def test_a_storm_of_connections_gets_time_for_its_handshakes(conns: Conns) -> None:
    """A connection accepted while 2,000 others are pending gets 2 s more: every
    handshake ahead of it may take that long in a registration storm."""
    adm = Admission(rank_cap=8, pending_cap=4000, deadline=5.0)
    for fd in range(100_000, 102_000):  # no such descriptors: nothing to shut down
        adm.on_event(zmq.EVENT_ACCEPTED, fd, now=0.0)
    adm.on_event(zmq.EVENT_ACCEPTED, conns.open("late"), now=1.0)
    assert adm.enforce(5.0) == 1  # the first of the 2,000 (no one pending before it)
    assert adm.enforce(7.99) == 1999  # each 1 ms later than the one before
    assert adm.enforce(7.999) == 0 and not conns.closed("late")
    assert adm.enforce(8.0) == 1 and conns.closed("late")


def test_beyond_its_room_the_biggest_source_makes_room(conns: Conns) -> None:
    adm = Admission(rank_cap=8, pending_cap=4, deadline=60.0)
    names = [f"x{i}" for i in range(5)] + ["y0", "y1"]
    for i, name in enumerate(names):
        source = "127.0.0.2" if name[0] == "x" else "127.0.0.3"
        adm.on_event(zmq.EVENT_ACCEPTED, conns.open(name, source), now=float(i))
    assert adm.crowded()
    assert adm.enforce(10.0) == 3  # 7 pending, room 4: the three oldest of 127.0.0.2
    assert [n for n in names if conns.closed(n)] == ["x0", "x1", "x2"]
    assert adm.view()["closed_for_room"] == 3 and not adm.crowded()


def test_young_connections_get_their_grace(conns: Conns) -> None:
    """Beyond the room, a connection younger than its grace (1 s) is not pushed out, so
    peers connecting again the moment they are dropped cannot rotate a rank's connection
    out before its handshake; beyond the open files' limit the oldest goes all the same."""
    adm = Admission(rank_cap=8, pending_cap=4, deadline=60.0)
    for i in range(6):
        adm.on_event(zmq.EVENT_ACCEPTED, conns.open(f"x{i}"), now=10.0 + i / 4)
    assert adm.crowded() and adm.grace == 1.0
    assert adm.enforce(10.9) == 0  # the oldest came at 10.0: 0.9 s ago
    assert adm.enforce(11.3) == 2  # 6 pending, room 4: x0 and x1, both past their grace
    assert [n for n in conns.clients if conns.closed(n)] == ["x0", "x1"]
    adm.files = FD_RESERVE + 5  # room for 5 pending connections in all
    for i in range(6, 9):
        adm.on_event(zmq.EVENT_ACCEPTED, conns.open(f"x{i}"), now=11.5)
    assert len(adm.pending) == 7 and adm.limit() == 5
    assert adm.enforce(11.6) == 2  # x2 past its grace; beyond the limit x3, young
    assert [n for n in conns.clients if conns.closed(n)] == ["x0", "x1", "x2", "x3"]


def test_a_reused_descriptor_is_never_shut_down(conns: Conns) -> None:
    adm = Admission(rank_cap=8, pending_cap=8, deadline=1.0)
    fd = conns.open("old")
    adm.on_event(zmq.EVENT_ACCEPTED, fd, now=0.0)
    # the old connection goes and a new one takes its descriptor number before the monitor
    # tells (the new one's peer port differs)
    client = socket.create_connection(("127.0.0.1", conns.port))
    conns.servers.pop("old").close()
    server, _ = conns.listener.accept()
    conns.clients["new"], conns.servers["new"] = client, server
    assert server.fileno() == fd
    assert adm.enforce(5.0) == 1  # its record goes ...
    assert not conns.closed("new")  # ... but the new connection is left alone


def test_admitted_connections_are_capped(conns: Conns) -> None:
    adm = Admission(rank_cap=2, pending_cap=8, deadline=60.0)
    fds = [conns.open(f"r{i}") for i in range(3)]
    for fd in fds:
        adm.on_event(zmq.EVENT_ACCEPTED, fd, now=0.0)
    assert adm.admit(fds[0]) and adm.admit(fds[1]) and adm.admit(fds[1])
    assert not adm.admit(fds[2]) and adm.view()["refused_over_cap"] == 1
    adm.on_event(zmq.EVENT_DISCONNECTED, fds[0], now=1.0)
    assert adm.admit(fds[2])  # room again
    # open files run short: pending room shrinks to what the admitted ones leave
    adm.pending_cap = 1000
    adm.files = 256 + 2 + 100
    assert adm.room() == 100
    adm.files = 256 + 2 + 3
    assert adm.room() == 64  # never below 64


def _rank(ctx: zmq.Context, port: int, curve: dict[str, bytes] | None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.setsockopt(zmq.CURVE_SERVERKEY, curve["server"])
        s.setsockopt(zmq.CURVE_PUBLICKEY, curve["public"])
        s.setsockopt(zmq.CURVE_SECRETKEY, curve["secret"])
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _config(tmp_path: Path, curve: bool) -> tuple[ControlConfig, dict[str, bytes] | None]:
    extra: dict[str, Any] = {}
    keys = None
    if curve:
        env = generate_keys(str(tmp_path / "keys"))
        extra = {"curve_server_key": env["controller"]["TTP_CURVE_SERVER_KEY"],
                 "curve_authorized_keys": env["controller"]["TTP_CURVE_AUTHORIZED_KEYS"]}
        public, secret = load_cert(env["processor"]["TTP_CURVE_CLIENT_KEY"])
        assert secret is not None
        keys = {"server": load_cert(env["processor"]["TTP_CURVE_SERVER_KEY"])[0],
                "public": public, "secret": secret}
    cfg = ControlConfig(port=0, heartbeat_interval=0.2, heartbeat_misses=5, job_token=TOKEN,
                        admit_deadline=1.0, log_path=str(tmp_path / "logs"), **extra)
    return cfg, keys


@pytest.mark.parametrize("curve", [False, True], ids=["null", "curve"])
def test_hostile_connections_never_keep_a_rank_out(curve: bool, tmp_path: Path) -> None:
    """A controller of 2 ranks with room for 64 pending connections and a 1 s deadline.
    Hostile peers hold 50 connections (NULL: 25 idle DEALERs and 25 raw greeters; CURVE: 50
    greeters), and a burst of 150 more greeters overflows the room while the ranks register:
    both register on their first connection, which is never dropped (the room is made by
    pushing out the unregistered past their 0.5 s grace once the queued frames are read,
    never the rank: its connection's monitor sees no disconnect); the burst is pushed out,
    the others are closed at their deadline, and all of them come back. (The time to
    register is printed, not bounded: it is this machine's.)"""
    cfg, keys = _config(tmp_path, curve)
    ctrl = Controller(2, cfg)
    ctrl.admission.pending_cap = 64
    ctrl.start(timeout=10)
    ctx = zmq.Context()
    greeters = Greeters(ctrl.port, 50 if curve else 25).start()  # type: ignore[arg-type]
    dealers = None if curve else IdleDealers(ctrl.port, 25)  # type: ignore[arg-type]
    burst = Greeters(ctrl.port, 150).start()  # type: ignore[arg-type]
    try:
        wait_for(lambda: ctrl.snapshot()["connections"].get("closed_for_room", 0) > 0, 10,
                 what="hostile peers overflowing the pending room")
        ranks = [_rank(ctx, ctrl.port, keys) for _ in range(2)]  # type: ignore[arg-type]
        monitors = [s.get_monitor_socket(zmq.EVENT_DISCONNECTED) for s in ranks]
        start = time.monotonic()
        for r, s in enumerate(ranks):
            s.send(encode(MsgType.REGISTER, r, 1, {"world_size": 2, "pid": 100 + r,
                                                   "host": "peer", "token": TOKEN}))
        for s in ranks:  # bounded by 10 deadlines: a rank kept out would be dropped first
            assert s.poll(10_000), "no reply to a registration"
            assert decode(s.recv()).type == MsgType.REGISTERED
        registered_s = time.monotonic() - start
        burst.stop()
        seq, end = 1, time.monotonic() + 2.5  # two and a half deadlines of heartbeats
        while time.monotonic() < end:
            seq += 1
            for r, s in enumerate(ranks):
                s.send(encode(MsgType.HEARTBEAT, r, seq, {"step": 1, "status": "updated"}))
                while s.poll(0):
                    s.recv()
            time.sleep(0.1)
        snap = ctrl.snapshot()
        conn = snap["connections"]
        print(f"registered in {registered_s:.3f}s; connections {conn}; greeters "
              f"{greeters.connects} connects, {greeters.drops} drops")
        assert snap["state"] == "NORMAL"
        assert {r["health"] for r in snap["ranks"].values()} == {"alive"}
        assert conn["admitted"] == 2 and conn["pending"] <= 64, conn
        assert conn["closed_at_deadline"] > 0 and conn["closed_for_room"] > 0, conn
        assert greeters.drops > 0 and greeters.connects > greeters.drops  # they came back
        assert not any(m.poll(0) for m in monitors), "a rank's connection was dropped"
    finally:
        greeters.stop()
        burst.stop()
        if dealers is not None:
            dealers.stop()
        ctx.destroy(linger=0)
        ctrl.stop()
