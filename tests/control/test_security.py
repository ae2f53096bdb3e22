"""CURVE keeps keyless peers out; without CURVE, nobody can speak for a registered rank."""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq

from mindspeed_tft.control import ControlConfig, Processor
from mindspeed_tft.control.keys import generate_keys
from mindspeed_tft.control.protocol import MsgType, decode, encode
from tests.control.ctl_harness import Job, wait_for

INTERVAL = 0.2


def heard_anything(sock: zmq.Socket, seconds: float) -> bool:
    return bool(sock.poll(int(seconds * 1000), zmq.POLLIN))


def intruder(ctx: zmq.Context, port: int, **curve: bytes) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    for opt, value in curve.items():
        s.setsockopt(getattr(zmq, opt), value)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def claim_rank_1(s: zmq.Socket) -> None:
    s.send(encode(MsgType.REGISTER, 1, 1, {"world_size": 2, "pid": 4242, "host": "evil"}))
    s.send(encode(MsgType.HEARTBEAT, 1, 2, {"step": 0, "status": "updated"}))
    s.send(encode(MsgType.REPORT, 1, 3, {"kind": "uce", "message": "UCE ERROR", "step": 0,
                                         "status": "updated"}))


def test_curve_refuses_peers_without_the_right_key(tmp_path: Path) -> None:
    keys = generate_keys(str(tmp_path / "keys"))
    assert (os.stat(keys["TTP_CURVE_SERVER_KEY"]).st_mode & 0o777) == 0o600
    job = Job(tmp_path, 2, interval=INTERVAL, misses=5, env=keys)
    snap = tmp_path / "snap.json"
    ctx = zmq.Context()
    procs: list[Processor] = []
    try:
        port = job.start_controller(snapshot=snap)
        cfg = ControlConfig.from_env({**keys, "TTP_PORT": str(port), "TTP_LOG_PATH": str(tmp_path)},
                                     heartbeat_interval=INTERVAL, heartbeat_misses=5)
        assert cfg.curve
        legit = Processor(0, 2, cfg, hard_exit=False, host="localhost")
        legit.start(timeout=10)
        procs.append(legit)
        server_public = zmq.auth.load_certificate(keys["TTP_CURVE_SERVER_KEY"])[0]
        client_public, client_secret = zmq.auth.load_certificate(keys["TTP_CURVE_CLIENT_KEY"])
        wrong_public, wrong_secret = zmq.curve_keypair()
        other_server_public, _ = zmq.curve_keypair()
        intruders = {
            "no key at all": intruder(ctx, port),
            "a wrong client key": intruder(ctx, port, CURVE_SERVERKEY=server_public,
                                           CURVE_PUBLICKEY=wrong_public,
                                           CURVE_SECRETKEY=wrong_secret),
            "a wrong server key": intruder(ctx, port, CURVE_SERVERKEY=other_server_public,
                                           CURVE_PUBLICKEY=client_public,
                                           CURVE_SECRETKEY=client_secret),
        }
        for s in intruders.values():
            claim_rank_1(s)
        for name, s in intruders.items():
            assert not heard_anything(s, 1.0), f"a peer with {name} was answered"
        state = job.snapshot(snap)
        assert state["state"] == "INIT" and list(state["ranks"]) == ["0"]
        assert state["dropped_total"] == 0  # nothing they sent even reached the controller's code
        assert state["connections"].get("auth_failed", 0) >= 1
        assert state["connections"].get("handshake_failed", 0) >= 1
        log = (tmp_path / "logs" / "ttp_log.log").read_text()
        assert "CURVE: refused a client key" in log  # the wrong client key was seen and refused
        assert not [e for e in job.events() if e["event"] == "fault_detected"]
        # the right key still works: rank 1 joins and the job starts
        good = Processor(1, 2, cfg, hard_exit=False, host="localhost")
        good.start(timeout=10)
        procs.append(good)
        job.wait_state("NORMAL", 10)
        assert legit.controller_state in ("INIT", "NORMAL")
    finally:
        for p in procs:
            p.close()
        ctx.destroy(linger=0)
        job.cleanup()


def test_forged_reports_for_a_registered_rank_change_nothing(tmp_path: Path) -> None:
    job = Job(tmp_path, 3, interval=INTERVAL, misses=5)
    snap = tmp_path / "snap.json"
    ctx = zmq.Context()
    procs: list[Processor] = []
    try:
        port = job.start_controller(snapshot=snap)
        cfg = ControlConfig(port=port, heartbeat_interval=INTERVAL, heartbeat_misses=5,
                            log_path=str(tmp_path))
        for r in (0, 1):
            p = Processor(r, 3, cfg, hard_exit=False, host="localhost")
            p.start(timeout=10)
            procs.append(p)
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
        after = wait_for(lambda: (s := job.snapshot(snap)) and s["dropped_total"] >= 17 and s, 10,
                         what="forgeries counted")
        time.sleep(3 * INTERVAL)
        after = job.snapshot(snap)
        assert after["state"] == "NORMAL" and after["incidents"] == 0
        assert {r: after["ranks"][r]["health"] for r in ("0", "1")} == {"0": "alive", "1": "alive"}
        assert after["ranks"]["0"] == before["ranks"]["0"]
        assert after["ranks"]["1"] == before["ranks"]["1"]
        assert after["dropped"]["spoof"] == 8 and after["dropped"]["unregistered"] == 6
        assert after["dropped"]["rank_taken"] == 2 and after["dropped"]["replay"] == 1
        assert not [e for e in job.events() if e["event"] == "fault_detected"]
        assert all(p.controller_state == "NORMAL" for p in procs)
    finally:
        for p in procs:
            p.close()
        ctx.destroy(linger=0)
        job.cleanup()
