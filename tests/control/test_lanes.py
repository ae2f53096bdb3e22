"""The lane policy (`control.processor.lanes`), driven directly: which lane an order goes to,
FIFO one at a time, an overdue order abandoned once another waits, its late end starting
nothing. Exact outputs for given inputs on a virtual clock (the processor's worker threads,
`test_orders`, and the simulator drive the same policy)."""

from __future__ import annotations

from mindspeed_tft.control.processor.lanes import LanePolicy, Received, Start, lane_for


def _order(oid: int, name: str, deadline: float) -> Received:
    return Received(oid, name, deadline, None)


def test_exit_and_resume_go_to_the_release_lane_every_other_order_to_work() -> None:
    assert [lane_for(n) for n in ("exit", "resume", "stop", "pause", "clean", "repair",
                                  "rollback", "dump", "rename", "scale_in")] == [
        "release", "release", "work", "work", "work", "work", "work", "work", "work", "work"]


def test_orders_start_one_at_a_time_in_arrival_order() -> None:
    lane = LanePolicy()
    stop, clean, repair = (_order(i, n, 100.0) for i, n in
                           enumerate(("stop", "clean", "repair"), 1))
    assert lane.submit(stop, 0.0) == [Start(stop)]
    assert lane.submit(clean, 0.1) == []  # the stop runs
    assert lane.submit(repair, 0.2) == []
    assert lane.check(50.0) == []  # within its time limit: nothing gives way
    assert lane.finish(stop, 51.0) == [Start(clean)]
    assert lane.finish(clean, 52.0) == [Start(repair)]
    assert lane.finish(repair, 53.0) == [] and lane.current is None
    assert lane.abandoned == 0


def test_an_overdue_order_gives_way_only_once_another_waits() -> None:
    lane = LanePolicy()
    repair, dump, rename = _order(1, "repair", 10.0), _order(2, "dump", 40.0), \
        _order(3, "rename", 90.0)
    assert lane.submit(repair, 0.0) == [Start(repair)]
    assert lane.check(20.0) == []  # overdue, but nothing waits behind it
    assert lane.submit(dump, 10.0) == []  # at its deadline, not past it
    assert lane.check(10.5) == [Start(dump, abandon=repair)]
    assert lane.abandoned == 1 and lane.current is dump
    assert lane.submit(rename, 11.0) == []  # the dump is within its limit
    # the abandoned repair ends late: its result is sent, it starts nothing
    assert lane.finish(repair, 12.0) == [] and lane.current is dump
    assert lane.finish(dump, 13.0) == [Start(rename)]


def test_an_order_that_arrives_behind_an_overdue_one_starts_at_once() -> None:
    lane = LanePolicy()
    stuck, exit_ = _order(1, "resume", 5.0), _order(2, "exit", 60.0)
    lane.submit(stuck, 0.0)
    assert lane.submit(exit_, 6.0) == [Start(exit_, abandon=stuck)]
    assert list(lane.queue) == [] and lane.abandoned == 1
