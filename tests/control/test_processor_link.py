"""The processor's link to its controllers without I/O (`control.processor.link`): exact
outputs for given inputs on a virtual clock, with the real processor core as its view."""

from __future__ import annotations

from typing import Any

from mindspeed_tft.control.processor.core import ProcessorCore, Received, Run
from mindspeed_tft.control.processor.link import (
    Accepted,
    Connect,
    GiveUp,
    Identity,
    LinkCore,
    Refused,
    Transmit,
)
from mindspeed_tft.control.processor.watchdog import ProgressWatchdog
from mindspeed_tft.control.wire.classify import FaultKind
from mindspeed_tft.control.wire.messages import MESSAGE_TYPES
from mindspeed_tft.control.wire.order_types import RollbackOrder
from mindspeed_tft.control.wire.protocol import CONTROLLER, Message, MsgType, message

A, B = ("10.0.0.1", 29000), ("10.0.0.2", 29000)
STORM = 0.5


def _link() -> tuple[LinkCore, ProcessorCore]:
    core = ProcessorCore(1, park_wait=2.0, failure_exit_code=70, exit_grace=5.0,
                         watchdog=ProgressWatchdog(10.0, 3.0, 30.0))
    link = LinkCore(1, Identity(4, 123, "node1", None, "tok"), core, addresses=[A, B],
                    interval=1.0, misses=3, controller_lost_timeout=60.0,
                    storm_allowance=STORM)
    link.connected(0.0)
    return link, core


def _msg(mtype: str, **payload: Any) -> Message:
    return message(mtype, CONTROLLER, 1, payload)


def _typed(mtype: str, wire: dict[str, Any]) -> Transmit:
    """What the link sends: the typed message of the map `wire` (as `decode` reads it)."""
    return Transmit(mtype, MESSAGE_TYPES[mtype].from_wire(wire))


def _registered(role: str = "active", backups: list[str] | None = None) -> Message:
    return _msg(MsgType.REGISTERED, epoch=1, state="normal", interval=1.0, misses=3,
                backups=backups or [], rejoin=False, lock_step=None, role=role)


REGISTER = {"world_size": 4, "pid": 123, "host": "node1", "replica": None, "failover": False,
            "step": 0, "status": "updated", "token": "tok"}


def test_it_registers_every_interval_until_a_controller_answers() -> None:
    link, _ = _link()
    assert link.wait(0.0) == 0.0
    assert link.tick(0.0) == [_typed(MsgType.REGISTER, REGISTER)]
    assert link.tick(0.5) == []
    assert link.tick(1.0) == [_typed(MsgType.REGISTER, REGISTER)]
    assert link.on_message(_registered(), 1.2) == [Accepted()]
    assert link.join_info is not None and link.join_info.role == "active"
    assert link.registered_here


def test_a_registered_rank_heartbeats_asking_for_an_ack_only_when_it_needs_one() -> None:
    link, core = _link()
    link.on_message(_registered(), 0.0)
    core.update_end(5)
    core.progress(5, 0.0)
    hb = {"step": 5, "status": "updated", "progress": 5}
    assert link.tick(0.1) == [_typed(MsgType.HEARTBEAT, {**hb, "ack": False})]
    assert link.tick(0.5) == []
    assert link.tick(1.6) == [_typed(MsgType.HEARTBEAT, {**hb, "ack": True})]  # 1.6 >= 1.5
    link.on_message(_msg(MsgType.ACK, state="normal", epoch=1, role="active"), 1.7)
    assert link.tick(2.7) == [_typed(MsgType.HEARTBEAT, {**hb, "ack": False})]


def test_a_hang_is_reported_once() -> None:
    link, core = _link()
    link.on_message(_registered(), 0.0)
    core.progress(3, 0.0)
    link.tick(0.0)
    link.on_message(_msg(MsgType.ACK, state="normal", epoch=1, role="active"), 29.9)
    link.next_heartbeat = 30.5
    assert link.tick(30.5) == [
        _typed(MsgType.HEARTBEAT, {"step": 0, "status": "updated", "progress": 3,
                                     "ack": False}),
        Transmit(MsgType.REPORT, {"kind": "hang", "message": "rank 1: no training progress "
                                  "for 30.5s (timeout 30.0s) after step 3", "step": 0,
                                  "status": "updated"})]
    assert link.tick(30.6) == []


def test_a_silent_controller_is_left_for_the_next_and_a_redirect_sends_the_rank_back() -> None:
    link, _ = _link()
    link.tick(0.0)
    # not registered there yet: patience is interval x (misses + 1) plus the storm allowance
    assert link.tick(4.0 + STORM) == [_typed(MsgType.REGISTER, REGISTER)]  # still there
    assert link.tick(4.0 + STORM + 0.01) == [Connect(1, B)]
    link.connected(5.0)
    assert link.failovers == 1 and not link.registered_here
    assert link.tick(5.0) == [_typed(MsgType.REGISTER, REGISTER)]
    link.on_message(_msg(MsgType.REDIRECT, reason="not in charge"), 5.1)
    assert link.tick(5.2) == [Connect(0, A)]


def test_backups_named_by_the_controller_are_added_and_a_standby_is_not_an_acceptance(
        ) -> None:
    link, _ = _link()
    assert link.on_message(_registered("standby", ["10.0.0.3:29001"]), 0.0) == []
    assert link.addresses == [A, B, ("10.0.0.3", 29001)]
    assert link.registered_here and not link.ever_registered


def test_a_new_active_controller_is_told_the_unanswered_error() -> None:
    link, core = _link()
    assert link.on_message(_registered(), 0.0) == [Accepted()]
    core.update_end(4)
    core.error(FaultKind.UCE, "RuntimeError: UCE")
    link.connected(10.0)  # failed over
    assert link.on_message(_registered(), 10.1) == [Transmit(MsgType.REPORT, {
        "kind": "uce", "message": "RuntimeError: UCE", "step": 4, "status": "updated"})]
    assert link.registration().to_wire() == {**REGISTER, "failover": True, "step": 4}


def test_a_new_layout_told_to_the_same_controller_sends_no_error_again() -> None:
    """An SDK host's shrink registers the rank's new layout with the controller that has the
    rank's error already: its reply is no new controller, and the error is not reported
    twice (a second report arriving during the shrink was taken for a new fault, and the
    job ended with its dump: 8 ranks, 4 shrinks in a row, 1 run in 2). After a failover the
    new controller is told."""
    link, core = _link()
    link.on_message(_registered(), 0.0)
    core.update_end(4)
    core.error(FaultKind.COMM, "RuntimeError: Connection closed by peer")
    layout = {"dense": {"dp_index": 1, "dp_size": 3, "replica_num": 1, "shard": 1,
                        "holders": [1]}}
    assert link.update_replica(layout) == [_typed(MsgType.REGISTER, {
        **REGISTER, "replica": layout, "failover": True, "step": 4})]
    assert link.on_message(_registered(), 0.1) == []
    link.update_replica(layout)
    link.connected(10.0)  # failed over before the reply came
    assert link.on_message(_registered(), 10.1) == [Transmit(MsgType.REPORT, {
        "kind": "comm", "message": "RuntimeError: Connection closed by peer", "step": 4,
        "status": "updated"})]


def test_orders_go_to_the_core_once_registered_and_a_refusal_ends_it() -> None:
    link, _ = _link()
    action = _msg(MsgType.ACTION, id=7, name="hold", timeout=5.0, payload={"incident": 1})
    assert link.on_message(action, 0.0) == []  # not registered: ignored
    link.on_message(_registered(), 0.1)
    assert link.on_message(action, 0.2) == [Transmit(MsgType.RESULT, {
        "id": 7, "action": "hold", "ok": True, "result": {"step": 0, "status": "updated"}})]
    rollback = RollbackOrder(1, 0, "retry")
    assert link.on_message(_msg(MsgType.ACTION, id=8, name="rollback", timeout=5.0,
                                payload=rollback.to_wire()), 0.3) == [
        Run(Received(8, "rollback", 5.3, rollback), "work")]
    assert link.on_message(_msg(MsgType.REJECT, reason="bad token", retry=False), 0.4) == [
        Refused("bad token")]


def test_a_rank_that_hears_no_active_controller_gives_up_once() -> None:
    link, _ = _link()
    link.on_message(_registered(), 0.0)
    for t in range(1, 61):  # a standby answers, nobody active
        link.on_message(_msg(MsgType.ACK, state="normal", epoch=1, role="standby"), float(t))
        assert GiveUp not in map(type, link.tick(float(t)))
    assert GiveUp(60.5) in link.tick(60.5)
    assert GiveUp not in map(type, link.tick(61.0))
