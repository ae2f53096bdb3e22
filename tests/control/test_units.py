"""Unit tests of the control plane's pure parts: protocol, config, state table, strategy,
SPEC 7 holder choice, classification, watchdog, key generation."""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgpack
import pytest

from mindspeed_tft.control import ControlConfig, ControlConfigError, Features, ForceStop
from mindspeed_tft.control.controller.flow import Incident
from mindspeed_tft.control.controller.ranktable import Health, RankTable
from mindspeed_tft.control.controller.states import (
    TRANSITIONS,
    IllegalTransition,
    State,
    StateMachine,
)
from mindspeed_tft.control.controller.strategy import (
    PlanError,
    Strategy,
    StrategyPlanner,
    choose_strategy,
)
from mindspeed_tft.control.processor.watchdog import ProgressWatchdog
from mindspeed_tft.control.wire.classify import FaultKind, classify_error
from mindspeed_tft.control.wire.keys import main as keys_main
from mindspeed_tft.control.wire.messages import ByeMessage, HeartbeatMessage
from mindspeed_tft.control.wire.protocol import (
    PROTOCOL_VERSION,
    DropCounter,
    MsgType,
    ProtocolError,
    decode,
    encode,
)
from mindspeed_tft.control.wire.transport import CurveKeys
from mindspeed_tft.events import configure_events, emit, read_events

# -- protocol ---------------------------------------------------------------------------------


def test_round_trip_and_fields() -> None:
    frame = encode(MsgType.HEARTBEAT, 3, 7, {"step": 5, "status": "updating", "progress": 4})
    msg = decode(frame)
    assert msg == (MsgType.HEARTBEAT, 3, 7, {"step": 5, "status": "updating", "progress": 4},
                   HeartbeatMessage(5, "updating", 4, True))
    assert msg.read(HeartbeatMessage).progress == 4
    with pytest.raises(TypeError, match="a hb message holds a HeartbeatMessage, not a "
                                        "ByeMessage"):
        msg.read(ByeMessage)
    assert msgpack.unpackb(frame)[0] == PROTOCOL_VERSION


@pytest.mark.parametrize("frame,reason", [
    (b"\xc1", "malformed"),
    (msgpack.packb({"a": 1}), "malformed"),
    (msgpack.packb([2, "hb", 0, 1, {"step": 1, "status": "updated"}]), "version"),
    (msgpack.packb([True, "hb", 0, 1, {"step": 1, "status": "updated"}]), "version"),
    (msgpack.packb([1, "zzz", 0, 1, {}]), "unknown_type"),
    (msgpack.packb([1, "hb", 0, 1, {"step": "1", "status": "updated"}]), "schema"),
    (msgpack.packb([1, "hb", 0, 1, {"step": 1, "status": "x"}]), "schema"),
    (msgpack.packb([1, "hb", 0, 1, {"step": 1}]), "schema"),
    (msgpack.packb([1, "hb", 0, 1, {"step": 1, "status": "updated", "evil": 1}]), "schema"),
    (msgpack.packb([1, "hb", -7, 1, {"step": 1, "status": "updated"}]), "schema"),
    (msgpack.packb([1, "hb", 0, -1, {"step": 1, "status": "updated"}]), "schema"),
    (msgpack.packb([1, "hb", 0, 1, [1]]), "schema"),
    (b"\xdd\xff\xff\xff\xff", "malformed"),
    (b"\xdb\xff\xff\xff\xff", "malformed"),
    (b"\x91" * 10_000, "malformed"),
    (b"\xd4\x01\x02", "malformed"),  # an extension type
    (b"\x00" * (2 << 20), "oversized"),
])
def test_bad_frames_are_refused(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.reason == reason


def test_register_replica_schema() -> None:
    ok = {"dense": {"dp_index": 1, "dp_size": 4, "replica_num": 2, "shard": 1, "holders": [1, 3]}}
    decode(encode(MsgType.REGISTER, 1, 1, {"world_size": 4, "pid": 1, "host": "h", "replica": ok}))
    for bad in ({"dense": {**ok["dense"], "dp_index": 4}}, {"dense": {**ok["dense"], "x": 1}},
                {"dense": {**ok["dense"], "holders": []}}, {"dense": 3}):
        with pytest.raises(ProtocolError):
            encode(MsgType.REGISTER, 1, 1, {"world_size": 4, "pid": 1, "host": "h",
                                            "replica": bad})


def test_random_bytes_only_ever_raise_protocol_error() -> None:
    rng = random.Random(7)
    valid = encode(MsgType.REPORT, 1, 2, {"kind": "comm", "message": "m", "step": 1,
                                          "status": "updated"})
    for i in range(5000):
        if i % 2:
            frame = rng.randbytes(rng.randrange(64))
        else:
            b = bytearray(valid)
            b[rng.randrange(len(b))] = rng.randrange(256)
            frame = bytes(b)
        try:
            decode(frame)
        except ProtocolError:
            pass


def test_drop_counter() -> None:
    c = DropCounter()
    for _ in range(3):
        c.drop("malformed")
    c.drop("spoof")
    assert c.counts == {"malformed": 3, "spoof": 1} and c.total == 4


# -- configuration ------------------------------------------------------------------------


def test_config_defaults() -> None:
    c = ControlConfig.from_env({})
    assert (c.controller_addr, c.processor_addr, c.port) == ("127.0.0.1", "127.0.0.1", 8000)
    assert (c.heartbeat_interval, c.heartbeat_misses, c.action_time_limit) == (2.0, 3, 180.0)
    assert (c.log_path, c.log_level, c.log_mode, c.log_stdout) == ("logs", "INFO", "ONLY_ONE",
                                                                   False)
    assert not c.curve and c.warnings == []  # nothing switched off


def test_config_addresses() -> None:
    c = ControlConfig.from_env({"TTP_ADDR": "::1", "TTP_PORT": "9000"})
    assert (c.controller_addr, c.processor_addr, c.port) == ("::1", "::1", 9000)
    c = ControlConfig.from_env({"TTP_ADDR": "10.0.0.5", "CONTROLLER_ADDR": "0.0.0.0",
                                "PROCESSOR_ADDR": "[fd00::5]"})
    assert (c.controller_addr, c.processor_addr) == ("0.0.0.0", "fd00::5")
    for env, words in [({"TTP_ADDR": "controller-0"}, "TTP_ADDR='controller-0'"),
                       ({"TTP_ADDR": "300.1.1.1"}, "not an IPv4 or IPv6"),
                       ({"PROCESSOR_ADDR": "0.0.0.0"}, "wildcard"),
                       ({"TTP_PORT": "http"}, "TTP_PORT='http'"),
                       ({"TTP_PORT": "0"}, "1..65535"),
                       ({"TTP_PORT": "70000"}, "1..65535"),
                       ({"TTP_BACKUP_ADDRS": "::1:80"}, "[addr]:port"),
                       ({"TTP_CURVE_SERVER_KEY": "/no/such/key"}, "no such file")]:
        with pytest.raises(ControlConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            ControlConfig.from_env(env)


BAD_ENV_VALUES = [  # every value the environment may give that cannot be used: no fallback
    ("TTP_HEARTBEAT_INTERVAL", "-1", "is not a number in [0.05, 60] (unset: 2)"),
    ("TTP_HEARTBEAT_INTERVAL", "nan", "is not a number in [0.05, 60] (unset: 2)"),
    ("TTP_HEARTBEAT_INTERVAL", "x", "is not a number in [0.05, 60] (unset: 2)"),
    ("TTP_HEARTBEAT_MISSES", "abc", "is not an integer in [1, 100] (unset: 3)"),
    ("TTP_HEARTBEAT_MISSES", "0", "is not an integer in [1, 100] (unset: 3)"),
    ("TTP_NORMAL_ACTION_TIME_LIMIT", "5", "is not a number in [30, 1800] (unset: 180)"),
    ("TTP_REGISTER_TIMEOUT", "inf", "is not a number in [1, 86400] (unset: 600)"),
    ("TTP_HANG_TIMEOUT_MIN", "0", "is not a number in [0.1, 86400] (unset: 60)"),
    ("TTP_HANG_TIMEOUT_FACTOR", "0.5", "is not a number in [1, 1000] (unset: 5)"),
    ("TTP_HANG_INITIAL_TIMEOUT", "-3", "is not a number in [1, 86400] (unset: 1800)"),
    ("TTP_PARK_TIMEOUT", "0", "is not a number in [0.5, 900] (unset: 30)"),
    ("TTP_EXIT_GRACE", "soon", "is not a number in [0.5, 600] (unset: 10)"),
    ("TTP_LOG_LEVEL", "LOUD", "is not one of DEBUG, INFO, WARNING, ERROR (unset: INFO)"),
    ("TTP_LOG_MODE", "MANY", "is not one of ONLY_ONE, PER_PROC (unset: ONLY_ONE)"),
    ("TTP_LOG_STDOUT", "yes", "is not one of 0, 1 (unset: 0)"),
    ("TFT_CONTROL_NICE", "5", "is not an integer in [-20, 0] (unset: -10)"),
    ("TFT_CONTROL_NICE", "-2.5", "is not an integer in [-20, 0] (unset: -10)"),
    ("TFT_CONTROL_RTPRIO", "100", "is not an integer in [0, 99] (unset: 1)"),
    ("TFT_CONTROL_RTPRIO", "rr", "is not an integer in [0, 99] (unset: 1)"),
]


@pytest.mark.parametrize(("name", "value", "words"), BAD_ENV_VALUES)
def test_config_bad_values_are_errors(name: str, value: str, words: str) -> None:
    with pytest.raises(ControlConfigError) as info:
        ControlConfig.from_env({name: value})
    assert str(info.value) == f"{name}={value!r} {words}"


def test_config_values_in_range() -> None:
    c = ControlConfig.from_env({"TTP_NORMAL_ACTION_TIME_LIMIT": "60", "TTP_LOG_LEVEL": "debug",
                                "TTP_LOG_STDOUT": "1", "TTP_BACKUP_ADDRS": "10.0.0.2:8000,[::1]:9"})
    assert (c.action_time_limit, c.log_level, c.log_stdout) == (60.0, "DEBUG", True)
    assert c.backups == [("10.0.0.2", 8000), ("::1", 9)]
    c = ControlConfig.from_env({"TTP_PARK_TIMEOUT": "2.5", "TTP_EXIT_GRACE": "1",
                                "TTP_HEARTBEAT_MISSES": " 4 "})
    assert (c.park_timeout, c.exit_grace, c.heartbeat_misses) == (2.5, 1.0, 4)
    assert (ControlConfig.from_env({}).thread_nice,
            ControlConfig.from_env({"TFT_CONTROL_NICE": "0"}).thread_nice) == (-10, 0)
    with pytest.raises(ControlConfigError, match=r"thread_nice=1 is out of range"):
        ControlConfig(thread_nice=1)
    assert (ControlConfig.from_env({}).thread_rtprio,
            ControlConfig.from_env({"TFT_CONTROL_RTPRIO": "0"}).thread_rtprio) == (1, 0)
    with pytest.raises(ControlConfigError, match=r"thread_rtprio=-1 is out of range"):
        ControlConfig(thread_rtprio=-1)
    # code (tests) may ask for limits the environment may not
    assert ControlConfig(action_time_limit=1.5).action_time_limit == 1.5
    with pytest.raises(ControlConfigError):
        ControlConfig(heartbeat_interval=0)


# -- state machine --------------------------------------------------------------------------


def test_transition_table_is_spec5() -> None:
    s = State
    assert TRANSITIONS == {
        s.INIT: {s.NORMAL, s.FINAL},
        s.NORMAL: {s.ABNORMAL, s.PAUSE, s.EXIT},  # EXIT: training finished (our addition)
        s.PAUSE: {s.NORMAL, s.ABNORMAL},
        s.ABNORMAL: {s.ENV_CLEAR, s.DUMP, s.NORMAL},
        s.ENV_CLEAR: {s.REPAIR, s.DUMP},
        s.REPAIR: {s.NORMAL, s.DUMP},
        s.DUMP: {s.EXIT, s.REPAIR},  # REPAIR: elastic training shrinks from the dump
        s.EXIT: {s.FINAL},
        s.FINAL: set(),
    }


def test_state_machine_checks_and_emits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ev.jsonl"
    monkeypatch.delenv("TFT_EVENTS_FILE", raising=False)
    configure_events(str(path))
    try:
        sm = StateMachine(emit)
        sm.to(State.NORMAL, "registered")
        with pytest.raises(IllegalTransition):
            sm.to(State.REPAIR)
        sm.to(State.ABNORMAL)
        assert sm.state is State.ABNORMAL
    finally:
        os.environ.pop("TFT_EVENTS_FILE", None)
        configure_events(None)
    states = [(e["state"], e["rank"]) for e in read_events(str(path)) if e["event"] == "state"]
    assert states == [("INIT", -1), ("NORMAL", -1), ("ABNORMAL", -1)]


# -- strategy (SPEC 6) ------------------------------------------------------------------------


@pytest.mark.parametrize("hbm", [False, True])
@pytest.mark.parametrize("reboot", [False, True])
@pytest.mark.parametrize("norep", [False, True])
def test_strategy_table(hbm: bool, reboot: bool, norep: bool) -> None:
    f = Features(True, hbm, reboot, norep)
    repair = (Strategy.LOAD_CHECKPOINT if norep else Strategy.RETRY) if hbm else Strategy.DUMP
    assert choose_strategy([FaultKind.UCE], f) is repair
    assert choose_strategy([FaultKind.COMM], f) is repair
    assert choose_strategy([FaultKind.NORMAL], f) is None
    lost = Strategy.RECOVER if reboot else Strategy.DUMP
    assert choose_strategy([FaultKind.LOST], f) is lost
    assert choose_strategy([FaultKind.HANG], f) is lost
    assert choose_strategy([FaultKind.UNKNOWN], f) is Strategy.DUMP
    # the most conservative strategy of an incident wins
    assert choose_strategy([FaultKind.UCE, FaultKind.UNKNOWN], f) is Strategy.DUMP
    assert choose_strategy([FaultKind.COMM, FaultKind.LOST], f) is (
        Strategy.DUMP if Strategy.DUMP in (repair, lost) else lost)


def test_features_from_args_and_names() -> None:
    class Args:
        enable_high_availability = True
        enable_hbmfault_repair = True
        enable_worker_reboot = False
        distributed_optimizer_no_replica = True
    assert Features.from_args(Args()) == Features(True, True, False, True)
    assert Features.from_names("dump,recover") == Features(True, False, True, False)
    with pytest.raises(ValueError, match="unknown features"):
        Features.from_names("retry,teleport")


# -- SPEC 7 holder choice -----------------------------------------------------------------------


def layout_table(d: int = 4, n: int = 2) -> RankTable:
    t = RankTable(d)
    chunk = d // n
    for r in range(d):
        shard = r % chunk
        t.register(r, bytes([r + 1]), "h", r, 0.0,
                   {"dense": {"dp_index": r, "dp_size": d, "replica_num": n, "shard": shard,
                              "holders": [shard + k * chunk for k in range(n)]}}, step=9)
    return t


def test_dump_holders_first_healthy() -> None:
    planner = StrategyPlanner(Features())
    t = layout_table()
    inc = Incident(1, 0.0, faults={0: FaultKind.UCE}, lock_step=9)
    chosen = planner.dump_holders(inc, t)
    assert {key[1]: r for key, r in chosen.items()} == {0: 2, 1: 1}
    t.get(1).status = "updating"  # inside an update: not consistent
    assert {key[1]: r for key, r in planner.dump_holders(inc, t).items()} == {0: 2, 1: 3}
    t.get(3).step = 8  # behind the lock step
    with pytest.raises(PlanError, match="dense shard 1 .*rank 1 alive step 9 updating.*rank 3"):
        planner.dump_holders(inc, t)
    # a comm fault leaves the data intact; a UCE in activations too (SPEC 8)
    t = layout_table()
    inc = Incident(1, 0.0, faults={0: FaultKind.COMM, 1: FaultKind.UCE}, lock_step=9,
                   details={1: {"target": "activation"}})
    assert sorted(planner.dump_holders(inc, t).values()) == [0, 1]
    payloads, renamer = planner.dump_payloads(inc, t, range(4))
    assert renamer == 0 and payloads[2].shards == ()
    assert payloads[0].to_wire()["shards"][0]["shard"] == 0


def test_stop_counts_an_update_under_way() -> None:
    """A rank reported inside update s + 1 (its report says `updating` at s) has passed every
    collective before it: the stop lets every rank run update s + 1, so that the shard of a
    rank whose update failed half-way has a holder there (SPEC 3, 7)."""
    planner = StrategyPlanner(Features(hbm_repair=True))
    t = layout_table()
    for r in range(4):
        t.get(r).step = 7
    inc = Incident(1, 0.0, faults={2: FaultKind.COMM})
    assert planner.stop_payload(inc, t).lock_step == 7
    t.get(2).status = "updating"
    assert planner.stop_payload(inc, t).lock_step == 8
    assert planner.lock_step(inc, t) == 7  # the lock step itself: only completed updates
    t.get(2).fresh = True  # a restarted process's position does not count
    assert planner.stop_payload(inc, t).lock_step == 7


def test_repair_plan_sources() -> None:
    planner = StrategyPlanner(Features(hbm_repair=True))
    t = layout_table()
    t.get(2).health = Health.LOST
    t.register(2, b"new", "h", 99, 0.0, None)
    t.get(2).fresh = True
    inc = Incident(1, 0.0, faults={2: FaultKind.LOST}, lock_step=9, source="replica",
                   strategy=Strategy.RECOVER, new_ranks={2})
    plan = planner.repair_payloads(inc, t, range(4))
    assert plan[2].to_wire()["receive"] == [{"optimizer": "dense", "shard": 0, "from": 0}]
    assert plan[0].to_wire()["send"] == [{"optimizer": "dense", "shard": 0, "to": 2}]
    assert plan[1].receive == plan[3].receive == ()
    t.get(0).health = Health.LOST
    with pytest.raises(PlanError, match="rank 2 needs dense shard 0"):
        planner.repair_payloads(inc, t, range(1, 4))


# -- classification, watchdog, keys ------------------------------------------------------------------


@pytest.mark.parametrize("exc,kind", [
    (RuntimeError("ACL error: UCE ERROR on device 3"), FaultKind.UCE),
    (RuntimeError("HBM MULTI BIT ECC detected"), FaultKind.UCE),
    (RuntimeError("HCCL OP RETRY FAILED"), FaultKind.COMM),
    (RuntimeError("SUSPECT REMOTE ERROR"), FaultKind.COMM),
    (RuntimeError("UB LINK ERROR"), FaultKind.COMM),
    (RuntimeError("HCCS LINK ERROR"), FaultKind.COMM),
    (RuntimeError("[gloo/pair.cc:534] Connection closed by peer [10.0.0.2]:1234"), FaultKind.COMM),
    (RuntimeError("Read error: Connection reset by peer"), FaultKind.COMM),
    (RuntimeError("NCCL communicator was aborted on rank 3"), FaultKind.COMM),
    (RuntimeError("FORCE STOP"), FaultKind.NORMAL),
    (ForceStop("held"), FaultKind.NORMAL),
    (RuntimeError("CUDA out of memory"), FaultKind.UNKNOWN),
    (ValueError("UCE ERROR"), FaultKind.UNKNOWN),  # SPEC 6 matches RuntimeErrors only
])
def test_classification(exc: BaseException, kind: FaultKind) -> None:
    assert classify_error(exc) is kind


def test_watchdog_timeout_follows_step_times() -> None:
    w = ProgressWatchdog(floor=0.05, factor=3, initial=10)
    assert w.timeout() == 10
    for step in range(1, 5):  # steps of 0.03 s, then one of 0.2 s
        w.progress(step, 100.0 + 0.03 * step)
    w.progress(5, 100.12 + 0.2)
    assert w.timeout() == pytest.approx(3 * 0.2)
    assert w.check(100.32 + 0.6) is None
    assert w.check(100.32 + 5) == pytest.approx((5.0, 0.6))
    assert w.check(100.32 + 6) is None  # once
    w.pause()
    assert w.check(200.0) is None
    w.resume(300.0)
    assert w.timeout() == 10 and w.check(305.0) is None
    assert w.check(310.5) == (10.5, 10)
    with pytest.raises(ValueError):
        ProgressWatchdog(floor=0, factor=2, initial=1)


def test_keys_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_main([str(tmp_path / "k")]) == 0
    out = capsys.readouterr().out
    k = tmp_path / "k"
    # the server secret only in controller/, processors get the server's public key
    assert f"export TTP_CURVE_SERVER_KEY={k}/processor/server.key\n" in out
    assert f"export TTP_CURVE_SERVER_KEY={k}/controller/server.key_secret\n" in out
    assert f"export TTP_CURVE_CLIENT_KEY={k}/processor/client.key_secret\n" in out
    assert sorted(os.listdir(k / "controller")) == ["authorized", "server.key_secret"]
    assert sorted(os.listdir(k / "controller" / "authorized")) == ["client.key"]
    assert sorted(os.listdir(k / "processor")) == ["client.key_secret", "server.key"]
    assert "server.key_secret" not in (k / "processor" / "server.key").read_text()
    assert keys_main([str(k)]) == 1  # no silent overwrite
    proc = ControlConfig.from_env({"TTP_CURVE_SERVER_KEY": str(k / "processor/server.key"),
                                   "TTP_CURVE_CLIENT_KEY": str(k / "processor/client.key_secret")})
    assert proc.curve and CurveKeys.from_config(proc, server=False) is not None
    with pytest.raises(ControlConfigError, match="TTP_CURVE_SERVER_KEY=.*no secret key"):
        CurveKeys.from_config(proc, server=True)  # a controller needs the server secret
    ctrl = ControlConfig.from_env({
        "TTP_CURVE_SERVER_KEY": str(k / "controller/server.key_secret"),
        "TTP_CURVE_AUTHORIZED_KEYS": str(k / "controller/authorized")})
    keys = CurveKeys.from_config(ctrl, server=True)
    assert keys is not None and keys.server_public in keys.authorized  # backups' key
