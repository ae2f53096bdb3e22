"""How a processor runs the controller's orders (`control.processor.orders`): one long-lived worker per
lane, exit and resume never behind a blocked order, a hold at once where it arrives, a stuck
order left behind once overdue."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mindspeed_tft.control import ControlConfig, Processor
from mindspeed_tft.control.processor.core import RELEASE_ORDERS, Received, Run, Send
from mindspeed_tft.control.processor.orders import Orders
from mindspeed_tft.control.wire.callbacks import NoRecovery
from mindspeed_tft.control.wire.messages import ActionMessage
from mindspeed_tft.control.wire.order_types import StopOrder, from_wire
from mindspeed_tft.control.wire.results import HoldResult, ResultMessage, StopResult
from tests.jobs import wait_for


def _order(oid: int, name: str, limit: float = 30.0,
           payload: dict[str, Any] | None = None) -> Run:
    order = None if payload is None else from_wire(name, payload)
    return Run(Received(oid, name, time.monotonic() + limit, order),
               "release" if name in RELEASE_ORDERS else "work")


def _blocking_repairs(unblock: threading.Event,
                      ran: queue.Queue[tuple[str, int]]) -> Callable[[Received], None]:
    """An order runner whose repairs block until `unblock`; it records (name, thread)."""
    def run(order: Received) -> None:
        if order.name == "repair":
            unblock.wait(10)
        ran.put((order.name, threading.get_ident()))

    return run


def test_work_orders_run_in_arrival_order_on_one_thread() -> None:
    seen: queue.Queue[tuple[int, int]] = queue.Queue()
    orders = Orders(0, lambda o: seen.put((o.id, threading.get_ident())))
    try:
        for oid, name in enumerate(("stop", "clean", "repair", "rollback"), 1):
            orders.submit(_order(oid, name))
        got = [seen.get(timeout=5) for _ in range(4)]
        assert [oid for oid, _ in got] == [1, 2, 3, 4]
        assert len({tid for _, tid in got}) == 1
        orders.submit(_order(5, "dump"))
        assert seen.get(timeout=5)[1] == got[0][1]  # the same long-lived worker
    finally:
        orders.close()


def test_exit_and_resume_do_not_queue_behind_a_blocked_order() -> None:
    unblock = threading.Event()
    ran: queue.Queue[str] = queue.Queue()

    def run(order: Received) -> None:
        if order.name == "stop":
            unblock.wait(10)
        ran.put(order.name)

    orders = Orders(0, run)
    try:
        orders.submit(_order(1, "stop"))
        orders.submit(_order(2, "resume"))
        orders.submit(_order(3, "exit"))
        assert [ran.get(timeout=2), ran.get(timeout=2)] == ["resume", "exit"]
        unblock.set()
        assert ran.get(timeout=2) == "stop"
    finally:
        unblock.set()
        orders.close()


def test_a_hold_is_answered_at_once_in_the_receiving_thread() -> None:
    # the hold (the first round of a stop) never waits, so the core answers it where it
    # arrives: no worker's wake-up, and never behind a stuck order of the work lane
    p = _processor()
    unblock = _stuck_stop(p)
    try:
        out = p._gate.on_action(ActionMessage(2, "hold", 5.0, {"incident": 1}),
                                time.monotonic())
        assert out == [Send("result", ResultMessage(2, "hold", HoldResult(0, "updated")))]
        assert p._gate.on_action(ActionMessage(2, "hold", 5.0, {"incident": 1}),
                                 time.monotonic()) == []
    finally:
        unblock.set()
        p.close()


def test_an_order_past_its_time_limit_no_longer_holds_up_its_lane() -> None:
    unblock = threading.Event()
    ran: queue.Queue[tuple[str, int]] = queue.Queue()
    orders = Orders(0, _blocking_repairs(unblock, ran))
    try:
        orders.submit(_order(1, "repair", limit=0.3))
        orders.submit(_order(2, "dump"))
        orders.check(time.monotonic())  # still within its limit: the dump waits
        time.sleep(0.1)
        assert ran.empty() and orders.work.abandoned == 0
        time.sleep(0.3)
        orders.check(time.monotonic())
        name, fresh = ran.get(timeout=2)
        assert name == "dump" and orders.work.abandoned == 1
        unblock.set()
        name, stuck = ran.get(timeout=2)
        assert name == "repair" and stuck != fresh  # finished late, on the abandoned worker
        orders.submit(_order(3, "rename"))
        assert ran.get(timeout=2) == ("rename", fresh)
    finally:
        unblock.set()
        orders.close()


def _processor() -> Processor:
    cfg = ControlConfig(action_time_limit=4.0, park_timeout=1.0)
    return Processor(0, 1, cfg, hard_exit=False, host="localhost")


class _StuckStop(NoRecovery):
    def __init__(self, unblock: threading.Event) -> None:
        self.unblock = unblock

    def stop(self, order: StopOrder) -> StopResult:
        self.unblock.wait(10)
        return StopResult()


def _stuck_stop(p: Processor) -> threading.Event:
    """Rank 0 stopped, its stop callback blocked (its result not sent yet)."""
    unblock = threading.Event()
    p.set_callbacks(_StuckStop(unblock))
    p._orders.submit(_order(1, "stop", payload=StopOrder(1, 3, {}).to_wire()))
    wait_for(lambda: p.stopped, 5, what="the stop")
    return unblock


def test_exit_reaches_the_training_thread_while_the_stop_callback_waits() -> None:
    p = _processor()
    unblock = _stuck_stop(p)
    try:
        p._orders.submit(_order(2, "exit", payload={"code": 3, "reason": "test"}))
        decision = p.wait_decision(3)
        assert (decision.action, decision.code, decision.reason) == ("exit", 3, "test")
    finally:
        unblock.set()
        p.close()


def test_resume_reaches_the_training_thread_while_the_stop_callback_waits() -> None:
    p = _processor()
    unblock = _stuck_stop(p)
    try:
        p._orders.submit(_order(2, "resume", payload={"incident": 1, "step": 7,
                                                      "strategy": "none",
                                                      "false_alarm": False}))
        decision = p.wait_decision(3)
        assert (decision.action, decision.step) == ("resume", 7)
        assert not p.stopped
    finally:
        unblock.set()
        p.close()


def test_the_exit_of_a_rank_without_a_controller_is_obeyed_without_an_answer(caplog) -> None:
    """No active controller for `controller_lost_timeout`: the processor orders itself to
    exit (order id -1). Its result went to `ResultMessage.to_wire`, which refuses id -1, and
    so did the fallback: the order's thread raised ("order exit failed outside its
    handler"). Found by tft-sim --seed 11275 --world 8 (and 16904), where it ended the run."""
    p = _processor()
    try:
        with caplog.at_level(logging.ERROR, logger="mindspeed_tft.control.processor"):
            p._controller_lost(130.0)
            decision = p.wait_decision(3)
            wait_for(lambda: p._orders.release._worker is not None
                     and p._orders.release._worker.current is None, 5, what="the exit order")
        assert (decision.action, decision.code) == ("exit", p.config.controller_lost_exit_code)
        assert [r.getMessage() for r in caplog.records if "outside its handler" in
                r.getMessage()] == []
        assert [m for m, _ in p._channel._outbox if m == "result"] == []
    finally:
        p.close()
