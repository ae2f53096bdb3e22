"""An authenticated control plane: who may register, report, pose as a controller or a backup.

With CURVE, keyless or wrongly keyed peers never complete a handshake, a rank stays bound to
the key it registered with, processors pin the server's public key (a forged controller
never hears from them), and only holders of the server secret are taken for backups.
Without CURVE (loopback only, unless TTP_ALLOW_INSECURE=1) the per-job token decides, and a
refusal never tells anything about the job. Every peer here is a real socket on loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from mindspeed_tft.control import ControlConfig, ControlConfigError, Controller, Processor
from mindspeed_tft.control.wire.keys import generate_keys
from mindspeed_tft.control.wire.protocol import MsgType, decode, encode
from mindspeed_tft.control.wire.transport import REFUSED
from tests.control.ctl_harness import Job, wait_for

INTERVAL = 0.2
MISSES = 3  # a silent rank is lost after 0.6 s
TOKEN = "job-secret-" + "5f1c0e" * 6


def heard_anything(sock: zmq.Socket, seconds: float) -> bool:
    return bool(sock.poll(int(seconds * 1000), zmq.POLLIN))


def intruder(ctx: zmq.Context, port: int, **curve: bytes) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    for opt, value in curve.items():
        s.setsockopt(getattr(zmq, opt), value)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def curve_client(ctx: zmq.Context, port: int, server_public: bytes,
                 pair: tuple[bytes, bytes]) -> zmq.Socket:
    return intruder(ctx, port, CURVE_SERVERKEY=server_public, CURVE_PUBLICKEY=pair[0],
                    CURVE_SECRETKEY=pair[1])


def register(s: zmq.Socket, rank: int, world: int, seq: int = 1, pid: int = 4242,
             **extra: Any) -> None:
    s.send(encode(MsgType.REGISTER, rank, seq, {"world_size": world, "pid": pid,
                                                "host": "peer", **extra}))


def reply(s: zmq.Socket, seconds: float = 5.0) -> Any:
    assert heard_anything(s, seconds), "no reply"
    return decode(s.recv())


def claim_rank_1(s: zmq.Socket) -> None:
    register(s, 1, 4)
    s.send(encode(MsgType.HEARTBEAT, 1, 2, {"step": 0, "status": "updated"}))
    s.send(encode(MsgType.REPORT, 1, 3, {"kind": "uce", "message": "UCE ERROR", "step": 0,
                                         "status": "updated"}))


def row(job: Job, snap: Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s row in the controller's latest snapshot ({} when it has none yet)."""
    return ((job.snapshot(snap) or {}).get("ranks") or {}).get(str(rank), {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_curve_refuses_wrong_keys_and_binds_ranks_to_their_key(tmp_path: Path) -> None:
    keys = generate_keys(str(tmp_path / "keys"))
    assert (os.stat(keys["controller"]["TTP_CURVE_SERVER_KEY"]).st_mode & 0o777) == 0o600
    # a second authorized client key, to show that a rank stays bound to its own key
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_public_file, other_secret_file = zmq.auth.create_certificates(str(other_dir), "other")
    shutil.copy(other_public_file, Path(keys["controller"]["TTP_CURVE_AUTHORIZED_KEYS"]))
    job = Job(tmp_path, 4, interval=INTERVAL, misses=MISSES, env=keys["controller"])
    snap = tmp_path / "snap.json"
    ctx = zmq.Context()
    procs: list[Processor] = []
    try:
        port = job.start_controller(snapshot=snap)
        cfg = ControlConfig.from_env({**keys["processor"], "TTP_PORT": str(port),
                                      "TTP_LOG_PATH": str(tmp_path)},
                                     heartbeat_interval=INTERVAL, heartbeat_misses=MISSES)
        assert cfg.curve
        legit = Processor(0, 4, cfg, hard_exit=False, host="localhost")
        legit.start(timeout=10)  # with the server's PUBLIC key only
        procs.append(legit)
        server_public = zmq.auth.load_certificate(keys["processor"]["TTP_CURVE_SERVER_KEY"])[0]
        client = zmq.auth.load_certificate(keys["processor"]["TTP_CURVE_CLIENT_KEY"])
        other = zmq.auth.load_certificate(other_secret_file)
        intruders = {
            "no key at all": intruder(ctx, port),
            "a wrong client key": curve_client(ctx, port, server_public, zmq.curve_keypair()),
            "a wrong server key": curve_client(ctx, port, zmq.curve_keypair()[0], client),
        }
        for s in intruders.values():
            claim_rank_1(s)
        for name, s in intruders.items():
            assert not heard_anything(s, 0.5), f"a peer with {name} was answered"
        state = job.snapshot(snap)
        assert state["state"] == "INIT" and list(state["ranks"]) == ["0"]
        assert state["dropped_total"] == 0  # nothing they sent even reached the controller's code
        assert state["connections"].get("auth_failed", 0) >= 1
        assert state["connections"].get("handshake_failed", 0) >= 1
        log = (tmp_path / "logs" / "ttp_log.log").read_text()
        assert "CURVE: refused a client key" in log  # the wrong client key was seen and refused
        assert not [e for e in job.events() if e["event"] == "fault_detected"]

        # rank 2 registers with the client key, then goes silent: lost (rank 3 never comes,
        # so the job stays in INIT and nothing else happens)
        holder = curve_client(ctx, port, server_public, client)
        register(holder, 2, 4, pid=1002)
        assert reply(holder).type == MsgType.REGISTERED
        wait_for(lambda: row(job, snap, 2).get("health") == "lost", 10,
                 what="rank 2 lost")
        # another authorized key cannot take the lost rank: a refusal with no job information
        thief = curve_client(ctx, port, server_public, other)
        register(thief, 2, 4, pid=666)
        answer = reply(thief)
        assert answer.type == MsgType.REJECT and answer.payload == REFUSED
        thief.send(encode(MsgType.HEARTBEAT, 2, 2, {"step": 0, "status": "updated"}))
        assert not heard_anything(thief, 0.3)
        state = job.snapshot(snap)
        assert state["ranks"]["2"]["pid"] == 1002 and state["ranks"]["2"]["health"] == "lost"
        assert state["dropped"]["rank_key"] == 1
        # its replacement, holding the same key (a new connection), takes it back
        again = curve_client(ctx, port, server_public, client)
        register(again, 2, 4, pid=1003)
        assert reply(again).type == MsgType.REGISTERED
        wait_for(lambda: (r := row(job, snap, 2)).get("pid") == 1003
                 and r["incarnation"] == 1, 5, what="rank 2 taken back")
        # the right key still works for a real processor
        good = Processor(1, 4, cfg, hard_exit=False, host="localhost")
        good.start(timeout=10)
        procs.append(good)
        assert job.snapshot(snap)["state"] == "INIT"  # rank 3 is still missing
        assert legit.registered and legit.drops.total == 0
    finally:
        for p in procs:
            p.close()
        ctx.destroy(linger=0)
        job.cleanup()


def test_processors_refuse_a_forged_controller(tmp_path: Path) -> None:
    """A ROUTER on an address processors use (first in their list, as a fake controller or
    a backup address a controller named would be), without the server secret: the processor
    never completes a handshake with it, so the fake never hears a frame it could answer
    with orders; the processor fails over and registers with the real controller."""
    keys = generate_keys(str(tmp_path / "keys"))
    job = Job(tmp_path, 1, interval=INTERVAL, misses=MISSES, env=keys["controller"])
    ctx = zmq.Context()
    proc: Processor | None = None
    try:
        port = job.start_controller()
        fake_keyed = ctx.socket(zmq.ROUTER)  # a CURVE server with a key pair of its own
        fake_public, fake_secret = zmq.curve_keypair()
        fake_keyed.setsockopt(zmq.CURVE_SERVER, 1)
        fake_keyed.setsockopt(zmq.CURVE_PUBLICKEY, fake_public)
        fake_keyed.setsockopt(zmq.CURVE_SECRETKEY, fake_secret)
        fake_plain = ctx.socket(zmq.ROUTER)  # no CURVE at all
        fakes = {"keyed": fake_keyed, "plain": fake_plain}
        fake_ports = {name: s.bind_to_random_port("tcp://127.0.0.1") for name, s in fakes.items()}
        cfg = ControlConfig.from_env({**keys["processor"], "TTP_PORT": str(port),
                                      "TTP_LOG_PATH": str(tmp_path)},
                                     heartbeat_interval=INTERVAL, heartbeat_misses=MISSES)
        proc = Processor(0, 1, cfg, hard_exit=False, host="localhost",
                         controllers=[("127.0.0.1", fake_ports["keyed"]),
                                      ("127.0.0.1", fake_ports["plain"]), ("127.0.0.1", port)])
        proc.start(timeout=10)
        assert proc.registered and proc.failovers == 2
        assert proc.join_info is not None and proc.join_info.role == "active"
        assert proc.interval == INTERVAL
        for name, s in fakes.items():
            assert not heard_anything(s, 0.1), f"the {name} fake controller received a frame"
        assert proc.drops.total == 0  # nor did anything from the fakes reach the processor
        for s in fakes.values():
            s.close(0)
    finally:
        if proc is not None:
            proc.close()
        ctx.destroy(linger=0)
        job.cleanup()


def test_only_holders_of_the_server_key_are_taken_for_backups(tmp_path: Path) -> None:
    keys = generate_keys(str(tmp_path / "keys"))
    backup_port = free_port()
    backup_addr = f"127.0.0.1:{backup_port}"
    job = Job(tmp_path, 1, interval=INTERVAL, misses=MISSES, env=keys["controller"])
    snap = tmp_path / "snap.json"
    ctx = zmq.Context()
    try:
        port = job.start_controller(snapshot=snap, backups=backup_addr)
        server_public = zmq.auth.load_certificate(keys["processor"]["TTP_CURVE_SERVER_KEY"])[0]
        client = zmq.auth.load_certificate(keys["processor"]["TTP_CURVE_CLIENT_KEY"])
        # a processor's (authorized) key naming the backup endpoint is no backup
        forged = curve_client(ctx, port, server_public, client)
        for seq in (1, 2, 3):
            forged.send(encode(MsgType.BACKUP, -1, seq, {"endpoint": backup_addr, "index": 0}))
        assert not heard_anything(forged, 1.0), "the forged backup received something"
        state = wait_for(lambda: (s := job.snapshot(snap)) and s["dropped"].get(
            "backup_refused", 0) == 3 and s, 5, what="forged backup refused")
        assert state["backups"] == []
        # the real backup (it holds the server pair) joins and is synced
        job.start_controller(role="backup", port=backup_port, backups=backup_addr,
                             active_port=port)
        wait_for(lambda: (s := job.snapshot(snap)) and s["backups"] == [backup_addr], 10,
                 what="real backup joined")
        assert job.snapshot(snap)["dropped"]["backup_refused"] == 3
    finally:
        ctx.destroy(linger=0)
        job.cleanup()


def non_loopback_address() -> str:
    """An address of this host that is not loopback; the wildcard 0.0.0.0 when none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent, a route is chosen
            addr = s.getsockname()[0]
    except OSError:
        return "0.0.0.0"
    return "0.0.0.0" if ipaddress.ip_address(addr).is_loopback else addr


def test_no_network_bind_without_keys_unless_opted_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    addr = non_loopback_address()
    env = {"CONTROLLER_ADDR": addr, "TTP_PORT": "1", "TTP_LOG_PATH": str(tmp_path)}
    with pytest.raises(ControlConfigError, match="TTP_ALLOW_INSECURE"):
        ControlConfig.from_env({**env, "TTP_ALLOW_INSECURE": "yes"})
    for where in (addr, "0.0.0.0"):  # the wildcard counts as non-loopback too
        refused = Controller(1, ControlConfig.from_env(env, port=0, controller_addr=where))
        with pytest.raises(ControlConfigError,
                           match=f"would listen on {where}, which is not a loopback address, "
                                 "without CURVE keys.*TTP_ALLOW_INSECURE=1"):
            refused.start(timeout=10)
        assert refused.port is None  # nothing was bound
    caplog.set_level(logging.WARNING, logger="mindspeed_tft.control.controller")
    config = ControlConfig.from_env({**env, "TTP_ALLOW_INSECURE": "1"}, port=0)
    assert config.allow_insecure
    for _ in range(2):  # warned on every start
        ctrl = Controller(1, config)
        ctrl.start(timeout=10)
        try:
            assert ctrl.port
        finally:
            ctrl.stop()
    insecure = [r for r in caplog.records if r.getMessage().startswith(
        f"INSECURE: active controller listens on {addr} without CURVE (TTP_ALLOW_INSECURE=1)")]
    assert len(insecure) == 2
    # with CURVE keys a network bind needs no opt-out and warns of nothing
    caplog.clear()
    keys = generate_keys(str(tmp_path / "keys"))
    ctrl = Controller(1, ControlConfig.from_env({**env, **keys["controller"]}, port=0))
    ctrl.start(timeout=10)
    ctrl.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.name == "mindspeed_tft.control.controller"]


def test_job_token_values() -> None:
    config = ControlConfig.from_env({"TTP_JOB_TOKEN": TOKEN})
    assert config.job_token == TOKEN and TOKEN not in repr(config)
    assert ControlConfig.from_env({}).job_token is None
    for bad in ("too-short", " " + TOKEN, "x" * 257, "t\u00f6ken-" * 3):
        with pytest.raises(ControlConfigError,
                           match="TTP_JOB_TOKEN is not 16..256 printable ASCII") as error:
            ControlConfig.from_env({"TTP_JOB_TOKEN": bad})
        assert bad.strip() not in str(error.value)  # a secret is never printed


def test_job_token_guards_registration_and_backups(tmp_path: Path) -> None:
    """Loopback without CURVE: a REGISTER without the job's token is refused with a reply that
    names nothing of the job; a lost rank is taken back only by a peer with the token; a
    backup announcement without the token is ignored."""
    job = Job(tmp_path, 3, interval=INTERVAL, misses=MISSES, env={"TTP_JOB_TOKEN": TOKEN})
    snap = tmp_path / "snap.json"
    ctx = zmq.Context()
    procs: list[Processor] = []
    try:
        port = job.start_controller(snapshot=snap, backups="127.0.0.1:1")
        cfg = ControlConfig(port=port, heartbeat_interval=INTERVAL, heartbeat_misses=MISSES,
                            log_path=str(tmp_path), job_token=TOKEN)
        legit = Processor(0, 3, cfg, hard_exit=False, host="localhost")
        legit.start(timeout=10)
        procs.append(legit)
        forger = intruder(ctx, port)
        wrong = TOKEN[:-1] + ("x" if TOKEN[-1] != "x" else "y")
        attempts = [({}, 3), ({"token": wrong}, 3), ({"token": ""}, 3),
                    ({"token": TOKEN}, 4),  # the right token, a world size this job lacks
                    ({"token": TOKEN, "failover": True}, 2)]
        for seq, (extra, world) in enumerate(attempts, 1):
            register(forger, 1, world, seq=seq, **extra)
            answer = reply(forger)
            assert answer.type == MsgType.REJECT and answer.payload == REFUSED
            assert not any(c.isdigit() for c in answer.payload["reason"])  # no sizes, no ranks
        forger.send(encode(MsgType.HEARTBEAT, 1, 99, {"step": 0, "status": "updated"}))
        assert not heard_anything(forger, 0.3)  # and nothing else, ever
        state = job.snapshot(snap)
        assert list(state["ranks"]) == ["0"]
        assert state["dropped"]["bad_token"] == 3 and state["dropped"]["bad_register"] == 2

        # rank 1 registers with the token, then goes silent: lost (rank 2 never comes)
        holder = intruder(ctx, port)
        register(holder, 1, 3, pid=1001, token=TOKEN)
        assert reply(holder).type == MsgType.REGISTERED
        wait_for(lambda: row(job, snap, 1).get("health") == "lost", 10,
                 what="rank 1 lost")
        for seq, extra in enumerate([{}, {"token": wrong}], 10):
            register(forger, 1, 3, seq=seq, pid=666, **extra)
            assert reply(forger).payload == REFUSED
        assert job.snapshot(snap)["ranks"]["1"]["pid"] == 1001
        replacement = intruder(ctx, port)
        register(replacement, 1, 3, pid=1002, token=TOKEN)
        assert reply(replacement).type == MsgType.REGISTERED
        wait_for(lambda: row(job, snap, 1).get("pid") == 1002, 5,
                 what="rank 1 taken back by its replacement")

        # backups: naming the endpoint is not enough without the token
        fake_backup = intruder(ctx, port)
        fake_backup.send(encode(MsgType.BACKUP, -1, 1, {"endpoint": "127.0.0.1:1", "index": 0}))
        fake_backup.send(encode(MsgType.BACKUP, -1, 2, {"endpoint": "127.0.0.1:1", "index": 0,
                                                        "token": wrong}))
        assert not heard_anything(fake_backup, 0.5)
        backup = intruder(ctx, port)
        backup.send(encode(MsgType.BACKUP, -1, 1, {"endpoint": "127.0.0.1:1", "index": 0,
                                                   "token": TOKEN}))
        assert reply(backup).type == MsgType.SYNC
        state = wait_for(lambda: (s := job.snapshot(snap)) and s["backups"] and s, 5,
                         what="backup joined")
        assert state["dropped"]["backup_refused"] == 2 and state["backups"] == ["127.0.0.1:1"]
        assert state["state"] == "INIT" and not [e for e in job.events()
                                                 if e["event"] == "fault_detected"]
    finally:
        for p in procs:
            p.close()
        ctx.destroy(linger=0)
        job.cleanup()


def _processors(job: Job, port: int, world: int, ranks: tuple[int, ...],
                procs: list[Processor]) -> None:
    """Real processors for `ranks` of the controller on `port` (appended to `procs` as they
    start, so the caller closes every one that started)."""
    cfg = ControlConfig(port=port, heartbeat_interval=INTERVAL, heartbeat_misses=5,
                        log_path=str(job.tmp))
    for r in ranks:
        p = Processor(r, world, cfg, hard_exit=False, host="localhost")
        p.start(timeout=10)
        procs.append(p)


def test_forged_reports_for_a_registered_rank_change_nothing(tmp_path: Path) -> None:
    job = Job(tmp_path, 3, interval=INTERVAL, misses=5)
    snap = tmp_path / "snap.json"
    ctx = zmq.Context()
    procs: list[Processor] = []
    try:
        port = job.start_controller(snapshot=snap)
        _processors(job, port, 3, (0, 1), procs)
        # rank 2 is a raw connection we control: registered for real, then it lies
        liar = intruder(ctx, port)
        liar.send(encode(MsgType.REGISTER, 2, 1, {"world_size": 3, "pid": 7, "host": "liar"}))
        assert heard_anything(liar, 5.0)
        assert decode(liar.recv()).type == MsgType.REGISTERED
        job.wait_state("NORMAL", 10)
        before = wait_for(lambda: (s := job.snapshot(snap)) and s["state"] == "NORMAL" and s, 5)
        stranger = intruder(ctx, port)  # a connection that never registered
        seq = 10**9
        for s in (liar, stranger):
            for victim in (0, 1):
                seq += 1
                s.send(encode(MsgType.REPORT, victim, seq, {
                    "kind": "uce", "message": "UCE ERROR (forged)", "step": 0, "status": "updated"}))
                s.send(encode(MsgType.RESULT, victim, seq + 1, {
                    "id": 1, "action": "stop", "ok": False, "result": {}, "error": "forged"}))
                s.send(encode(MsgType.BYE, victim, seq + 2, {"code": 0}))
                s.send(encode(MsgType.REGISTER, victim, seq + 3, {
                    "world_size": 3, "pid": 7, "host": "forger"}))
                seq += 4
        # a replayed (old sequence number) report from the liar's own rank is dropped too
        liar.send(encode(MsgType.REPORT, 2, 1, {"kind": "unknown", "message": "replay",
                                                "step": 0, "status": "updated"}))
        # and one whose sequence number jumps far ahead (it would make every later message of
        # the rank look replayed): dropped, the counter stays where it was
        liar.send(encode(MsgType.REPORT, 2, 1 << 40, {"kind": "unknown", "message": "jump",
                                                      "step": 0, "status": "updated"}))
        after = wait_for(lambda: (s := job.snapshot(snap)) and s["dropped_total"] >= 18 and s, 10,
                         what="forgeries counted")
        time.sleep(3 * INTERVAL)
        after = job.snapshot(snap)
        assert after["state"] == "NORMAL" and after["incidents"] == 0
        assert {r: after["ranks"][r]["health"] for r in ("0", "1")} == {"0": "alive", "1": "alive"}
        assert after["ranks"]["0"] == before["ranks"]["0"]
        assert after["ranks"]["1"] == before["ranks"]["1"]
        assert after["dropped"]["spoof"] == 8 and after["dropped"]["unregistered"] == 6
        assert after["dropped"]["rank_taken"] == 2 and after["dropped"]["replay"] == 1
        assert after["dropped"]["seq_jump"] == 1
        assert not [e for e in job.events() if e["event"] == "fault_detected"]
        assert all(p.controller_state == "NORMAL" for p in procs)
    finally:
        for p in procs:
            p.close()
        ctx.destroy(linger=0)
        job.cleanup()


def test_a_forged_registration_cannot_take_a_finished_ranks_place(tmp_path: Path) -> None:
    """Between the first rank's bye and the last one's, a finished rank's row is not free: a
    fresh registration for it is refused (`rank_done`), and the job still ends with code 0
    when the other rank finishes (before, the forger became a 'restarted' rank 0 and the job
    never ended)."""
    job = Job(tmp_path, 2, interval=INTERVAL, misses=5)
    snap = tmp_path / "snap.json"
    ctx = zmq.Context()
    procs: list[Processor] = []
    try:
        port = job.start_controller(snapshot=snap)
        _processors(job, port, 2, (0, 1), procs)
        job.wait_state("NORMAL", 10)
        procs[0].stop(0)
        wait_for(lambda: row(job, snap, 0).get("health") == "done", 10, what="rank 0 done")
        forger = intruder(ctx, port)
        register(forger, 0, 2)
        answer = reply(forger)
        assert answer.type == MsgType.REJECT and answer.payload == REFUSED
        procs[1].stop(0)
        job.wait_state("FINAL", 10)
        assert [e["code"] for e in job.events() if e["event"] == "exit"] == [0]
        wait_for(lambda: ((job.snapshot(snap) or {}).get("dropped") or {}).get("rank_done") == 1,
                 5, what="the refusal counted")
    finally:
        for p in procs:
            p.close()
        ctx.destroy(linger=0)
        job.cleanup()
