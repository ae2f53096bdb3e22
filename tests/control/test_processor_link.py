"""The processor's link to its controllers without I/O (`control.processor.link`): exact
outputs for given inputs through its one entry point (`handle(input, now)`) on a virtual
clock, with what it says about the rank read from the real processor core."""

from __future__ import annotations

from typing import Any

from mindspeed_tft.control.processor.core import (
    Action,
    CheckHang,
    Failed,
    ProcessorCore,
    Progress,
    Received,
    Run,
    Send,
    UpdateEnd,
)
from mindspeed_tft.control.processor.link import (
    Accepted,
    Connect,
    Connected,
    FromController,
    GiveUp,
    Identity,
    LinkCore,
    NewReplica,
    Out,
    Refused,
    Tick,
    Transmit,
)
from mindspeed_tft.control.processor.watchdog import ProgressWatchdog
from mindspeed_tft.control.wire.classify import FaultKind
from mindspeed_tft.control.wire.messages import MESSAGE_TYPES
from mindspeed_tft.control.wire.order_types import RollbackOrder
from mindspeed_tft.control.wire.protocol import CONTROLLER, Message, MsgType, message
from mindspeed_tft.control.wire.results import HoldResult, ReportMessage, ResultMessage

A, B = ("10.0.0.1", 29000), ("10.0.0.2", 29000)
STORM = 0.5


def _link() -> tuple[LinkCore, ProcessorCore]:
    core = ProcessorCore(1, park_wait=2.0, failure_exit_code=70, exit_grace=5.0,
                         watchdog=ProgressWatchdog(10.0, 3.0, 30.0))
    link = LinkCore(1, Identity(4, 123, "node1", None, "tok"), addresses=[A, B],
                    interval=1.0, misses=3, controller_lost_timeout=60.0,
                    storm_allowance=STORM)
    assert link.handle(Connected(), 0.0) == []
    return link, core


def _tick(link: LinkCore, core: ProcessorCore, now: float) -> list[Out]:
    return link.handle(Tick(core.state()), now)


def _on(link: LinkCore, core: ProcessorCore, msg: Message, now: float) -> list[Out]:
    return link.handle(FromController(msg, core.state()), now)


HEARTBEAT = {"step": 0, "status": "updated", "progress": 0}


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
    link, core = _link()
    assert link.wait(0.0) == 0.0
    assert _tick(link, core, 0.0) == [_typed(MsgType.REGISTER, REGISTER)]
    assert _tick(link, core, 0.5) == []
    assert _tick(link, core, 1.0) == [_typed(MsgType.REGISTER, REGISTER)]
    assert _on(link, core, _registered(), 1.2) == [Accepted()]
    assert link.join_info is not None and link.join_info.role == "active"
    assert link.registered_here


def test_a_registered_rank_heartbeats_asking_for_an_ack_only_when_it_needs_one() -> None:
    link, core = _link()
    _on(link, core, _registered(), 0.0)
    core.handle(UpdateEnd(5), 0.0)
    core.handle(Progress(5), 0.0)
    hb = {"step": 5, "status": "updated", "progress": 5}
    assert _tick(link, core, 0.1) == [_typed(MsgType.HEARTBEAT, {**hb, "ack": False}),
                                      CheckHang()]
    assert _tick(link, core, 0.5) == [CheckHang()]
    assert _tick(link, core, 1.6) == [_typed(MsgType.HEARTBEAT, {**hb, "ack": True}),
                                      CheckHang()]  # 1.6 >= 1.5
    _on(link, core, _msg(MsgType.ACK, state="normal", epoch=1, role="active"), 1.7)
    assert _tick(link, core, 2.7) == [_typed(MsgType.HEARTBEAT, {**hb, "ack": False}),
                                      CheckHang()]


def test_a_hang_is_checked_only_where_the_rank_is_registered() -> None:
    """The link has the core check for a hang after its heartbeat, on every tick where it is
    registered (the core reports it once: test_processor_core); not while it registers."""
    link, core = _link()
    core.handle(Progress(3), 0.0)
    assert _tick(link, core, 0.0) == [_typed(MsgType.REGISTER, REGISTER)]
    assert _tick(link, core, 0.5) == []
    _on(link, core, _registered(), 0.6)
    assert _tick(link, core, 0.7) == [
        _typed(MsgType.HEARTBEAT, {**HEARTBEAT, "progress": 3, "ack": False}), CheckHang()]
    _on(link, core, _msg(MsgType.ACK, state="normal", epoch=1, role="active"), 34.9)
    assert _tick(link, core, 35.0) == [
        _typed(MsgType.HEARTBEAT, {**HEARTBEAT, "progress": 3, "ack": False}), CheckHang()]
    assert core.handle(CheckHang(), 35.0) == [Send("report", ReportMessage(
        "hang", "rank 1: no training progress for 35.0s (timeout 30.0s) after step 3", 0,
        "updated"))]


def test_a_silent_controller_is_left_for_the_next_and_a_redirect_sends_the_rank_back() -> None:
    link, core = _link()
    _tick(link, core, 0.0)
    # not registered there yet: patience is interval x (misses + 1) plus the storm allowance
    assert _tick(link, core, 4.0 + STORM) == [_typed(MsgType.REGISTER, REGISTER)]
    assert _tick(link, core, 4.0 + STORM + 0.01) == [Connect(1, B)]
    link.handle(Connected(), 5.0)
    assert link.failovers == 1 and not link.registered_here
    assert _tick(link, core, 5.0) == [_typed(MsgType.REGISTER, REGISTER)]
    _on(link, core, _msg(MsgType.REDIRECT, reason="not in charge"), 5.1)
    assert _tick(link, core, 5.2) == [Connect(0, A)]


def test_backups_named_by_the_controller_are_added_and_a_standby_is_not_an_acceptance(
        ) -> None:
    link, core = _link()
    assert _on(link, core, _registered("standby", ["10.0.0.3:29001"]), 0.0) == []
    assert link.addresses == [A, B, ("10.0.0.3", 29001)]
    assert link.registered_here and not link.ever_registered


def test_a_new_active_controller_is_told_the_unanswered_error() -> None:
    link, core = _link()
    assert _on(link, core, _registered(), 0.0) == [Accepted()]
    core.handle(UpdateEnd(4), 0.0)
    core.handle(Failed(FaultKind.UCE, "RuntimeError: UCE"), 0.0)
    link.handle(Connected(), 10.0)  # failed over
    assert _on(link, core, _registered(), 10.1) == [Transmit(MsgType.REPORT, {
        "kind": "uce", "message": "RuntimeError: UCE", "step": 4, "status": "updated"})]
    assert link.registration(core.state()).to_wire() == {**REGISTER, "failover": True,
                                                         "step": 4}


def test_a_new_layout_told_to_the_same_controller_sends_no_error_again() -> None:
    """An SDK host's shrink registers the rank's new layout with the controller that has the
    rank's error already: its reply is no new controller, and the error is not reported
    twice (a second report arriving during the shrink was taken for a new fault, and the
    job ended with its dump: 8 ranks, 4 shrinks in a row, 1 run in 2). After a failover the
    new controller is told."""
    link, core = _link()
    _on(link, core, _registered(), 0.0)
    core.handle(UpdateEnd(4), 0.0)
    core.handle(Failed(FaultKind.COMM, "RuntimeError: Connection closed by peer"), 0.0)
    layout = {"dense": {"dp_index": 1, "dp_size": 3, "replica_num": 1, "shard": 1,
                        "holders": [1]}}
    assert link.handle(NewReplica(layout, core.state()), 0.05) == [_typed(
        MsgType.REGISTER, {**REGISTER, "replica": layout, "failover": True, "step": 4})]
    assert _on(link, core, _registered(), 0.1) == []
    link.handle(NewReplica(layout, core.state()), 0.2)
    link.handle(Connected(), 10.0)  # failed over before the reply came
    assert _on(link, core, _registered(), 10.1) == [Transmit(MsgType.REPORT, {
        "kind": "comm", "message": "RuntimeError: Connection closed by peer", "step": 4,
        "status": "updated"})]


def test_orders_go_to_the_core_once_registered_and_a_refusal_ends_it() -> None:
    link, core = _link()
    action = _msg(MsgType.ACTION, id=7, name="hold", timeout=5.0, payload={"incident": 1})
    assert _on(link, core, action, 0.0) == []  # not registered: ignored
    _on(link, core, _registered(), 0.1)
    hold = Action(7, "hold", {"incident": 1}, 5.0)
    assert _on(link, core, action, 0.2) == [hold]
    assert core.handle(hold, 0.2) == [Send(MsgType.RESULT, ResultMessage(
        7, "hold", HoldResult(0, "updated")))]
    rollback = RollbackOrder(1, 0, "retry")
    [order] = _on(link, core, _msg(MsgType.ACTION, id=8, name="rollback", timeout=5.0,
                                   payload=rollback.to_wire()), 0.3)
    assert core.handle(order, 0.3) == [  # type: ignore[arg-type]
        Run(Received(8, "rollback", 5.3, rollback), "work")]
    assert _on(link, core, _msg(MsgType.REJECT, reason="bad token", retry=False), 0.4) == [
        Refused("bad token")]


def test_a_message_not_for_a_processor_is_heard_and_ignored() -> None:
    link, core = _link()
    _on(link, core, _registered(), 0.0)
    heartbeat = _msg(MsgType.HEARTBEAT, step=1, status="updated", progress=1)
    assert _on(link, core, heartbeat, 3.9) == []
    assert link.last_heard == 3.9


def test_a_rank_that_hears_no_active_controller_gives_up_once() -> None:
    link, core = _link()
    _on(link, core, _registered(), 0.0)
    for t in range(1, 61):  # a standby answers, nobody active
        _on(link, core, _msg(MsgType.ACK, state="normal", epoch=1, role="standby"), float(t))
        assert GiveUp not in map(type, _tick(link, core, float(t)))
    assert GiveUp(60.5) in _tick(link, core, 60.5)
    assert GiveUp not in map(type, _tick(link, core, 61.0))
