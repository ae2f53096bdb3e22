"""The typed orders (`order_types`), results (`results`) and messages (`messages`): the wire
form they had as plain maps, byte for byte, and a clear refusal of every payload that does not
match (pure: no processes)."""

from __future__ import annotations

import queue
from typing import Any

import msgpack
import pytest

from mindspeed_tft.control import ControlConfig, Processor
from mindspeed_tft.control.controller.strategy import Strategy
from mindspeed_tft.control.processor.core import OwnOrder, Run
from mindspeed_tft.control.wire.callbacks import NoRecovery
from mindspeed_tft.control.wire.messages import (
    MESSAGE_TYPES,
    AckMessage,
    ActionMessage,
    BackupMessage,
    ByeMessage,
    ExitedMessage,
    HeartbeatMessage,
    RedirectMessage,
    RegisteredMessage,
    RegisterMessage,
    RejectMessage,
    SyncMessage,
    SyncRow,
)
from mindspeed_tft.control.wire.order_types import (
    ORDER_TYPES,
    CleanOrder,
    DumpOrder,
    DumpShard,
    ExitOrder,
    HoldOrder,
    OrderError,
    PauseOrder,
    Receive,
    RenameOrder,
    RepairOrder,
    ResumeOrder,
    RollbackOrder,
    ScaleInOrder,
    ScaleOutOrder,
    Send,
    StopOrder,
    from_wire,
    to_wire,
)
from mindspeed_tft.control.wire.protocol import (
    ACTIONS,
    PROTOCOL_VERSION,
    MsgType,
    ProtocolError,
    decode,
    encode,
)
from mindspeed_tft.control.wire.results import (
    CleanResult,
    DumpResult,
    EmptyResult,
    HoldResult,
    PauseResult,
    RenameResult,
    RepairResult,
    ReportMessage,
    ResultEnvelope,
    ResultError,
    ResultMessage,
    RollbackResult,
    ScaleResult,
    StopResult,
)

#: each order and the map the controller sent for it before it was typed (key order too)
WIRE: list[tuple[Any, dict[str, Any]]] = [
    (StopOrder(4, 9, {2: "uce", 5: "lost"}),
     {"incident": 4, "lock_step": 9, "faults": {"2": "uce", "5": "lost"}}),
    (RepairOrder(4, "retry", 9, "replica", (2,), (), (Receive("dense", 1, 6),),
                 (Send("dense", 0, 3),), (2, 3, 6)),
     {"incident": 4, "strategy": "retry", "lock_step": 9, "source": "replica", "faulty": [2],
      "new_ranks": [], "receive": [{"optimizer": "dense", "shard": 1, "from": 6}],
      "send": [{"optimizer": "dense", "shard": 0, "to": 3}], "involved": [2, 3, 6]}),
    (RepairOrder(4, "load_checkpoint", 9, "checkpoint", (2,), (5,)),
     {"incident": 4, "strategy": "load_checkpoint", "lock_step": 9, "source": "checkpoint",
      "faulty": [2], "new_ranks": [5], "receive": [], "send": []}),
    (RollbackOrder(4, 9, "recover", (2, 5)),
     {"incident": 4, "step": 9, "strategy": "recover", "params_damaged": [2, 5]}),
    (DumpOrder(4, 9, (DumpShard("dense", 1, (1, 5)),), (0, 1)),
     {"incident": 4, "lock_step": 9, "strategy": "dump",
      "shards": [{"optimizer": "dense", "shard": 1, "holders": [1, 5]}], "writers": [0, 1]}),
    (ExitOrder(75, "dumped"), {"code": 75, "reason": "dumped"}),
    (ExitOrder(75, "dumped", ({"iteration": 8, "lr": None},), logger=3),
     {"code": 75, "reason": "dumped", "iterations": [{"iteration": 8, "lr": None}],
      "logger": 3}),
    # the seven orders typed later, each against the map its sender built before
    (HoldOrder(4), {"incident": 4}),
    (CleanOrder(4, "retry", 9, (2, 5)),
     {"incident": 4, "strategy": "retry", "lock_step": 9, "faulty": [2, 5]}),
    (RenameOrder(4, 9), {"incident": 4, "lock_step": 9}),
    (PauseOrder("operator pause"), {"reason": "operator pause"}),
    (ResumeOrder(4, 9, "retry", False, ({"iteration": 9, "lr": 0.1},)),
     {"incident": 4, "step": 9, "strategy": "retry", "false_alarm": False,
      "iterations": [{"iteration": 9, "lr": 0.1}]}),
    (ResumeOrder(0, 7, "none", True),  # a rank that stopped itself with no incident
     {"incident": 0, "step": 7, "strategy": "none", "false_alarm": True}),
    (ScaleInOrder(4, 9, "/ckpt/dump/iter_0000009", (0, 1, 4, 5)),
     {"incident": 4, "lock_step": 9, "path": "/ckpt/dump/iter_0000009",
      "ranks": [0, 1, 4, 5]}),
    (ScaleOutOrder(5, 9, "/ckpt/dump/iter_0000009", (0, 1, 2, 3), 4),
     {"incident": 5, "lock_step": 9, "path": "/ckpt/dump/iter_0000009",
      "ranks": [0, 1, 2, 3], "dp_size": 4}),
]


@pytest.mark.parametrize("order,wire", WIRE, ids=lambda v: type(v).__name__)
def test_the_wire_form_is_the_map_sent_before_and_reads_back(order: Any,
                                                            wire: dict[str, Any]) -> None:
    assert msgpack.packb(order.to_wire()) == msgpack.packb(wire)  # byte for byte
    assert to_wire(order) == wire
    name = type(order).KIND
    assert from_wire(name, wire) == order == type(order).from_wire(order.to_wire())


def test_every_order_is_typed_and_the_strategies_are_known() -> None:
    assert set(ORDER_TYPES) == set(ACTIONS)
    assert {type(order).KIND for order, _ in WIRE} == set(ACTIONS)
    # the operator's resume: the one order whose keys came in another order before
    # (step, strategy, false_alarm, incident); the same map, now in the type's order
    old = {"step": -1, "strategy": "none", "false_alarm": True, "incident": 0}
    assert ResumeOrder.from_wire(old) == ResumeOrder(0, None, "none", True)
    assert ResumeOrder(0, None, "none", True).to_wire() == old
    RollbackOrder.from_wire({"incident": 1, "step": 2, "strategy": "none",
                             "params_damaged": []})
    for strategy in Strategy:
        RollbackOrder(1, 2, str(strategy)).to_wire()


REFUSED = [
    ("stop", [], "stop order: the payload is list, not a map"),
    ("stop", {"lock_step": 3, "faults": {}}, "stop order: missing 'incident'"),
    ("stop", {"incident": 1, "lock_step": -1, "faults": {}},
     "stop order: bad 'lock_step': -1 (allowed: a step"),
    ("stop", {"incident": 1, "lock_step": 3, "faults": {"x": "uce"}},
     "stop order: bad 'faults': {'x': 'uce'} (allowed: a map of rank"),
    ("stop", {"incident": 1, "lock_step": 3, "faults": {"1": "melted"}},
     "one of uce, comm, normal, unknown, hang, lost)"),
    ("stop", {"incident": 1, "lock_step": 3, "faults": {}, "extra": 1},
     "stop order: unknown key 'extra' (allowed: faults, incident, lock_step)"),
    ("repair", {**WIRE[1][1], "source": "disk"},
     "repair order: bad 'source': 'disk' (allowed: one of replica, checkpoint)"),
    ("repair", {**WIRE[1][1], "strategy": "pray"}, "repair order: bad 'strategy': 'pray'"),
    ("repair", {**WIRE[1][1], "receive": [{"optimizer": "dense", "shard": 1}]},
     "repair order's receive[0]: missing 'from'"),
    ("repair", {**WIRE[1][1], "send": [{"optimizer": "dense", "shard": 0, "to": "3"}]},
     "repair order's send[0]: bad 'to': '3'"),
    ("repair", {**WIRE[1][1], "faulty": [1, -2]}, "repair order: bad 'faulty': [1, -2]"),
    ("rollback", {"incident": 1, "step": True, "strategy": "retry", "params_damaged": []},
     "rollback order: bad 'step': True"),
    ("dump", {**WIRE[4][1], "strategy": "retry"},
     "dump order: bad 'strategy': 'retry' (allowed: one of dump)"),
    ("dump", {**WIRE[4][1], "shards": [{"optimizer": "", "shard": 0, "holders": [0]}]},
     "dump order's shards[0]: bad 'optimizer': ''"),
    ("exit", {"code": 300}, "exit order: bad 'code': 300 (allowed: an exit code"),
    ("exit", {"code": 1, "iterations": [3]}, "exit order: bad 'iterations': [3]"),
    ("hold", {}, "hold order: missing 'incident'"),
    ("clean", {"incident": 1, "strategy": "retry", "lock_step": None, "faulty": []},
     "clean order: bad 'lock_step': None (allowed: a step"),
    ("rename", {"incident": 1, "lock_step": 3, "path": "/x"},
     "rename order: unknown key 'path'"),
    ("pause", {"reason": 3}, "pause order: bad 'reason': 3 (allowed: a string)"),
    ("resume", {"incident": 1, "step": -2, "strategy": "none", "false_alarm": True},
     "resume order: bad 'step': -2 (allowed: a step, or -1"),
    ("resume", {"incident": 1, "step": 3, "strategy": "none", "false_alarm": 1},
     "resume order: bad 'false_alarm': 1 (allowed: true or false)"),
    ("scale_in", {"incident": 1, "lock_step": 3, "path": "", "ranks": [0]},
     "scale_in order: bad 'path': '' (allowed: a path of 1 to 4096 characters)"),
    ("scale_out", {"incident": 1, "lock_step": 3, "path": "/d", "ranks": [0], "dp_size": 0},
     "scale_out order: bad 'dp_size': 0 (allowed: a DP size"),
    ("teleport", {}, "unknown order 'teleport' (allowed: hold, stop"),
]


@pytest.mark.parametrize("name,payload,error", REFUSED)
def test_a_bad_payload_is_refused_naming_the_field(name: str, payload: Any,
                                                   error: str) -> None:
    with pytest.raises(OrderError) as refused:
        from_wire(name, payload)
    assert error in str(refused.value)


def test_to_wire_checks_what_it_sends() -> None:
    with pytest.raises(OrderError, match="rollback order: bad 'strategy': 'later'"):
        RollbackOrder(1, 2, "later").to_wire()
    with pytest.raises(OrderError, match="exit order: bad 'code': -1"):
        ExitOrder(-1).to_wire()


#: each result (and report) a rank sends, and the map it sent before it was typed
RESULTS: list[tuple[Any, dict[str, Any]]] = [
    (HoldResult(9, "updating"), {"step": 9, "status": "updating"}),
    (PauseResult(9, "updated"), {"step": 9, "status": "updated"}),
    (StopResult(9, "updated", True, 3, ({"iteration": 9},)),  # the plugin's stop
     {"connections_closed": 3, "iterations": [{"iteration": 9}], "step": 9,
      "status": "updated", "parked": True}),
    (StopResult(9, "updating", None),  # the SDK's stop: no training function seen
     {"step": 9, "status": "updating", "parked": None}),
    (CleanResult(), {}),
    (CleanResult(spared=True), {"detail": {"target": "spared"}}),
    (RepairResult(received=1, sent=0), {"received": 1, "sent": 0}),
    (RepairResult(step=8), {"step": 8}),
    (RollbackResult(9, ({"iteration": 9},)), {"step": 9, "iterations": [{"iteration": 9}]}),
    (RollbackResult(9), {"step": 9}),
    (DumpResult(("/c/shard_001.pt",), "/c/iter_0000009"),
     {"written": ["/c/shard_001.pt"], "assembled": "/c/iter_0000009"}),
    (DumpResult(((0, 4),)), {"written": [[0, 4]]}),  # the SDK's: the ranks of each shard
    (RenameResult(9, "/c/iter_0000009"), {"path": "/c/iter_0000009", "iteration": 9}),
    (ScaleResult(False, 2), {"stays": False, "dp_size": 2}),
    (ScaleResult(True, 2, 9, {"dense": {"dp_index": 1, "dp_size": 2, "replica_num": 1,
                                        "shard": 1, "holders": [5]}}, 8),
     {"stays": True, "dp_size": 2, "iteration": 9,
      "replica": {"dense": {"dp_index": 1, "dp_size": 2, "replica_num": 1, "shard": 1,
                            "holders": [5]}}, "micro_batches": 8}),
    (EmptyResult(), {}),
    (ResultMessage(7, "rollback", RollbackResult(9)),
     {"id": 7, "action": "rollback", "ok": True, "result": {"step": 9}}),
    (ResultMessage(7, "stop", error="RuntimeError: no"),
     {"id": 7, "action": "stop", "ok": False, "result": {}, "error": "RuntimeError: no"}),
    (ReportMessage("uce", "RuntimeError: UCE", 9, "updating", {"target": "activation"}),
     {"kind": "uce", "message": "RuntimeError: UCE", "step": 9, "status": "updating",
      "detail": {"target": "activation"}}),
    (ReportMessage("hang", "no progress", 9, "updated"),
     {"kind": "hang", "message": "no progress", "step": 9, "status": "updated"}),
]


@pytest.mark.parametrize("result,wire", RESULTS, ids=lambda v: type(v).__name__)
def test_a_result_is_the_map_sent_before_and_reads_back(result: Any,
                                                        wire: dict[str, Any]) -> None:
    assert msgpack.packb(result.to_wire()) == msgpack.packb(wire)  # byte for byte
    assert type(result).from_wire(wire) == result


BAD_RESULTS = [
    (StopResult, {"step": 9, "status": "halted", "parked": True},
     "stop result: bad 'status': 'halted' (allowed: one of updated, updating)"),
    (StopResult, {"step": 9, "status": "updated"}, "stop result: missing 'parked'"),
    (RepairResult, {"sent": -1}, "repair result: bad 'sent': -1 (allowed: a count)"),
    (CleanResult, {"detail": {"target": "optimizer"}}, "clean result: bad 'detail'"),
    (ScaleResult, {"stays": True, "dp_size": 2, "iteration": 9, "replica": {"dense": {}},
                   "micro_batches": 8}, "scale result: bad 'replica'"),
    (ResultMessage, {"id": 1, "action": "stop", "ok": True,
                     "result": {"step": 1, "status": "updated"}},
     "stop result: missing 'parked'"),
    (ResultMessage, {"id": 1, "action": "fly", "ok": True, "result": {}},
     "result: bad 'action': 'fly'"),
    (ReportMessage, {"kind": "uce", "message": "x", "step": 1, "status": "updated",
                     "extra": 1}, "report: unknown key 'extra'"),
]


@pytest.mark.parametrize("kind,wire,error", BAD_RESULTS)
def test_a_bad_result_is_refused_naming_the_field(kind: Any, wire: dict[str, Any],
                                                  error: str) -> None:
    with pytest.raises(ResultError) as refused:
        kind.from_wire(wire)
    assert error in str(refused.value)


def _results(p: Processor) -> queue.Queue[tuple[str, dict[str, Any]]]:
    sent: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    def post(mtype: str, payload: dict[str, Any]) -> None:
        sent.put((mtype, payload))

    # the results this processor would send (it is not connected)
    p._channel.post = post  # type: ignore[method-assign]
    return sent


def _run(p: Processor, aid: int, name: str, wire: Any) -> None:
    """Receive and run one order on this thread (as an order lane would)."""
    [run] = p._gate.handle(OwnOrder(aid, name, wire, 1e18))
    assert isinstance(run, Run)
    p._run_order(run.order)


class _Rollbacks(NoRecovery):
    def __init__(self) -> None:
        self.ran: list[RollbackOrder] = []

    def rollback(self, order: RollbackOrder) -> RollbackResult:
        self.ran.append(order)
        return RollbackResult(order.step)


def test_a_processor_fails_a_bad_order_without_running_its_callback() -> None:
    p = Processor(0, 1, ControlConfig(action_time_limit=4.0), hard_exit=False, host="localhost")
    host = _Rollbacks()
    p.set_callbacks(host)
    sent = _results(p)
    try:
        _run(p, 7, "rollback", {"incident": 1, "step": "9", "strategy": "retry",
                                "params_damaged": []})
        _, result = sent.get(timeout=2)
        assert (result["id"], result["ok"], host.ran) == (7, False, [])
        assert result["error"].startswith("OrderError: rollback order: bad 'step': '9'")
        _run(p, 8, "rollback", WIRE[3][1])
        assert sent.get(timeout=2)[1]["ok"] and host.ran == [WIRE[3][0]]  # the typed order
    finally:
        p.close()


def test_a_bad_exit_order_still_ends_the_rank_with_the_failure_code() -> None:
    p = Processor(0, 1, ControlConfig(action_time_limit=4.0), hard_exit=False, host="localhost")
    _results(p)
    try:
        _run(p, 3, "exit", {"code": "now"})
        decision = p.wait_decision(2)
        assert (decision.action, decision.code) == ("exit", p.config.failure_exit_code)
        assert "exit order: bad 'code': 'now'" in decision.reason
    finally:
        p.close()


# -- the messages (`messages`): every type's payload typed, checked by one system ----------

LAYOUT = {"dense": {"dp_index": 1, "dp_size": 2, "replica_num": 2, "shard": 0,
                    "holders": [0, 1], "group": 3}}
#: each message, its type and the map its sender built before it was typed (key order too)
MESSAGES: list[tuple[str, Any, dict[str, Any]]] = [
    # `LinkCore.registration`, with and without the job's token and /proc identity
    (MsgType.REGISTER, RegisterMessage(4, 77, "node-1", LAYOUT, True, 9, "updating", "s3cret",
                                       "77:1234"),
     {"world_size": 4, "pid": 77, "host": "node-1", "replica": LAYOUT, "failover": True,
      "step": 9, "status": "updating", "token": "s3cret", "proc": "77:1234"}),
    (MsgType.REGISTER, RegisterMessage(4, 77, "node-1"),
     {"world_size": 4, "pid": 77, "host": "node-1", "replica": None, "failover": False,
      "step": 0, "status": "updated"}),
    # `LinkCore._talk`
    (MsgType.HEARTBEAT, HeartbeatMessage(9, "updating", 8, False),
     {"step": 9, "status": "updating", "progress": 8, "ack": False}),
    # `BackupSync._hello_payload`, with and without the job's token
    (MsgType.BACKUP, BackupMessage("[::1]:8001", 1, "s3cret"),
     {"endpoint": "[::1]:8001", "index": 1, "token": "s3cret"}),
    (MsgType.BACKUP, BackupMessage("10.0.0.2:8001", 0), {"endpoint": "10.0.0.2:8001", "index": 0}),
    # `BackupSync._sync_payload`
    (MsgType.SYNC, SyncMessage("RECOVER", 2, 2, {"dump": True},
                               (SyncRow(0, 9, "updated", "alive", LAYOUT),
                                SyncRow(1, 8, "updating", "lost", None)), ("[::1]:8001",), 9),
     {"state": "RECOVER", "epoch": 2, "world_size": 2, "features": {"dump": True},
      "ranks": [[0, 9, "updated", "alive", LAYOUT], [1, 8, "updating", "lost", None]],
      "backups": ["[::1]:8001"], "lock_step": 9}),
    # the rest, as their senders build them
    (MsgType.BYE, ByeMessage(0), {"code": 0}),
    (MsgType.EXITED, ExitedMessage(77, -9, "s3cret", "no budget"),
     {"pid": 77, "code": -9, "token": "s3cret", "no_replacement": "no budget"}),
    (MsgType.REGISTERED, RegisteredMessage(3, "NORMAL", 2.0, 3, ("[::1]:8001",), True, None,
                                           "active"),
     {"epoch": 3, "state": "NORMAL", "interval": 2.0, "misses": 3, "backups": ["[::1]:8001"],
      "rejoin": True, "lock_step": None, "role": "active"}),
    (MsgType.ACK, AckMessage("NORMAL", 3, "standby"),
     {"state": "NORMAL", "epoch": 3, "role": "standby"}),
    (MsgType.ACTION, ActionMessage(7, "hold", 180.0, {"incident": 4}),
     {"id": 7, "name": "hold", "timeout": 180.0, "payload": {"incident": 4}}),
    (MsgType.REJECT, RejectMessage("refused", False), {"reason": "refused", "retry": False}),
    (MsgType.REDIRECT, RedirectMessage("the active controller is alive"),
     {"reason": "the active controller is alive"}),
    (MsgType.REPORT, ReportMessage("comm", "HCCL timeout", 9, "updated"),
     {"kind": "comm", "message": "HCCL timeout", "step": 9, "status": "updated"}),
    (MsgType.RESULT, ResultEnvelope(7, "rollback", True, {"step": 9}),
     {"id": 7, "action": "rollback", "ok": True, "result": {"step": 9}}),
]


@pytest.mark.parametrize("mtype,body,wire", MESSAGES, ids=lambda v: type(v).__name__)
def test_a_message_is_the_frame_sent_before_and_decodes_typed(mtype: str, body: Any,
                                                              wire: dict[str, Any]) -> None:
    before = msgpack.packb([PROTOCOL_VERSION, mtype, 3, 11, wire], use_bin_type=True)
    assert encode(mtype, 3, 11, body) == encode(mtype, 3, 11, wire) == before  # byte for byte
    assert list(body.to_wire()) == list(wire)  # the key order too
    assert decode(before) == (mtype, 3, 11, wire, body)
    assert MESSAGE_TYPES[mtype] is type(body) and type(body).TYPE == mtype


def test_every_message_type_has_its_class() -> None:
    types = {v for k, v in vars(MsgType).items() if not k.startswith("_")}
    assert set(MESSAGE_TYPES) == types and len(types) == 13
    assert {mtype for mtype, _, _ in MESSAGES} == types


BAD_MESSAGES = [
    (MsgType.REGISTER, {"world_size": "4", "pid": 1, "host": "h"},
     "register message: bad 'world_size': '4' (allowed: a world size: an integer in "
     "[1, 16777216])"),
    (MsgType.REGISTER, {"world_size": 4, "pid": 1, "host": "h", "replica": {"dense": 3}},
     "register message: bad 'replica': {'dense': 3} (allowed: a replica layout: "),
    (MsgType.HEARTBEAT, {"step": 1, "status": "x"},
     "hb message: bad 'status': 'x' (allowed: one of updated, updating)"),
    (MsgType.HEARTBEAT, {"step": 1}, "hb message: missing 'status' (one of updated, updating)"),
    (MsgType.HEARTBEAT, {"step": 1, "status": "updated", "evil": 1},
     "hb message: unknown key 'evil' (allowed: ack, progress, status, step)"),
    (MsgType.BACKUP, {"endpoint": "[::1]:8001", "index": 8},
     "backup message: bad 'index': 8 (allowed: an integer in [0, 7])"),
    (MsgType.SYNC, {"state": "NORMAL", "epoch": 0, "world_size": 2, "features": {},
                    "ranks": [[0, 1, "updated", "alive"]], "backups": [], "lock_step": None},
     "sync message: bad 'ranks': [[0, 1, 'updated', 'alive']] (allowed: a list of [rank, "
     "step, status, health, replica layout or nil])"),
    (MsgType.ACK, [1], "ack message: the payload is list, not a map"),
    (MsgType.RESULT, {"id": 1, "action": "fly", "ok": True, "result": {}},
     "result message: bad 'action': 'fly' (allowed: one of pause, "),
]


@pytest.mark.parametrize("mtype,wire,error", BAD_MESSAGES)
def test_a_bad_message_is_dropped_naming_the_field(mtype: str, wire: Any, error: str) -> None:
    frame = msgpack.packb([PROTOCOL_VERSION, mtype, 0, 1, wire], use_bin_type=True)
    with pytest.raises(ProtocolError) as dropped:
        decode(frame)
    assert dropped.value.reason == "schema"
    assert dropped.value.detail.startswith(error), dropped.value.detail
    with pytest.raises(ProtocolError):  # a sender's bug fails at the sender
        encode(mtype, 0, 1, wire)


def test_a_message_of_another_type_is_not_sent() -> None:
    with pytest.raises(ProtocolError, match="hb message: a ByeMessage"):
        encode(MsgType.HEARTBEAT, 0, 1, ByeMessage(0))
    with pytest.raises(ProtocolError, match="hb message: bad 'step': -1"):
        encode(MsgType.HEARTBEAT, 0, 1, HeartbeatMessage(-1, "updated"))


def test_a_result_that_does_not_match_its_order_reaches_the_controller() -> None:
    """The frame of a result is checked as an envelope: the order's own result is read by
    its type afterwards, so a mismatch fails that order instead of dropping the frame."""
    wire = {"id": 7, "action": "rollback", "ok": True, "result": {"iteration": 9}}
    envelope = decode(encode(MsgType.RESULT, 1, 2, wire)).read(ResultEnvelope)
    with pytest.raises(ResultError, match="rollback result: missing 'step'"):
        envelope.typed()
    assert envelope.failed("ResultError: x") == ResultMessage(7, "rollback", error="ResultError: x")
    assert ResultEnvelope(7, "stop", False, {}, "boom").typed() == ResultMessage(
        7, "stop", error="boom")
