"""The typed orders (`order_types`): the wire form they had as plain maps, byte for byte,
and a clear refusal of every payload that does not match (pure: no processes)."""

from __future__ import annotations

import queue
from typing import Any

import msgpack
import pytest

from mindspeed_tft.control import ControlConfig, Processor
from mindspeed_tft.control.controller.strategy import Strategy
from mindspeed_tft.control.processor.orders import Order
from mindspeed_tft.control.wire.order_types import (
    DumpOrder,
    DumpShard,
    ExitOrder,
    OrderError,
    Receive,
    RepairOrder,
    RollbackOrder,
    Send,
    StopOrder,
    from_wire,
    to_wire,
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
]


@pytest.mark.parametrize("order,wire", WIRE, ids=lambda v: type(v).__name__)
def test_the_wire_form_is_the_map_sent_before_and_reads_back(order: Any,
                                                            wire: dict[str, Any]) -> None:
    assert msgpack.packb(order.to_wire()) == msgpack.packb(wire)  # byte for byte
    assert to_wire(order) == wire
    name = type(order).KIND
    assert from_wire(name, wire) == order == type(order).from_wire(order.to_wire())


def test_other_orders_stay_maps_and_the_strategies_are_known() -> None:
    assert from_wire("resume", {"step": 3}) == {"step": 3}
    assert to_wire({"reason": "operator pause"}) == {"reason": "operator pause"}
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
     "repair order's receive[0] order: missing 'from'"),
    ("repair", {**WIRE[1][1], "send": [{"optimizer": "dense", "shard": 0, "to": "3"}]},
     "repair order's send[0] order: bad 'to': '3'"),
    ("repair", {**WIRE[1][1], "faulty": [1, -2]}, "repair order: bad 'faulty': [1, -2]"),
    ("rollback", {"incident": 1, "step": True, "strategy": "retry", "params_damaged": []},
     "rollback order: bad 'step': True"),
    ("dump", {**WIRE[4][1], "strategy": "retry"},
     "dump order: bad 'strategy': 'retry' (allowed: one of dump)"),
    ("dump", {**WIRE[4][1], "shards": [{"optimizer": "", "shard": 0, "holders": [0]}]},
     "dump order's shards[0] order: bad 'optimizer': ''"),
    ("exit", {"code": 300}, "exit order: bad 'code': 300 (allowed: an exit code"),
    ("exit", {"code": 1, "iterations": [3]}, "exit order: bad 'iterations': [3]"),
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


def _results(p: Processor) -> queue.Queue[tuple[str, dict[str, Any]]]:
    sent: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    def post(mtype: str, payload: dict[str, Any]) -> None:
        sent.put((mtype, payload))

    # the results this processor would send (it is not connected)
    p._channel.post = post  # type: ignore[method-assign]
    return sent


def test_a_processor_fails_a_bad_order_without_running_its_callback() -> None:
    p = Processor(0, 1, ControlConfig(action_time_limit=4.0), hard_exit=False, host="localhost")
    ran: list[Any] = []
    p.register_callback("rollback", ran.append)
    sent = _results(p)
    try:
        p._run_order(Order(7, "rollback", {"incident": 1, "step": "9", "strategy": "retry",
                                          "params_damaged": []}, 1e18))
        _, result = sent.get(timeout=2)
        assert (result["id"], result["ok"], ran) == (7, False, [])
        assert result["error"].startswith("OrderError: rollback order: bad 'step': '9'")
        p._run_order(Order(8, "rollback", WIRE[3][1], 1e18))
        assert sent.get(timeout=2)[1]["ok"] and ran == [WIRE[3][0]]  # the typed order
    finally:
        p.close()


def test_a_bad_exit_order_still_ends_the_rank_with_the_failure_code() -> None:
    p = Processor(0, 1, ControlConfig(action_time_limit=4.0), hard_exit=False, host="localhost")
    _results(p)
    try:
        p._run_order(Order(3, "exit", {"code": "now"}, 1e18))
        decision = p.wait_decision(2)
        assert (decision.action, decision.code) == ("exit", p.config.failure_exit_code)
        assert "exit order: bad 'code': 'now'" in decision.reason
    finally:
        p.close()
