"""`events.IterationLog`: every iteration logged exactly once (SPEC 11), on a real
torch.distributed TCPStore: the first run of an iteration is an `iteration` event, a recompute
an `iteration_recomputed` one; after a repair the logging rank (or its replacement, which
reads the highest logged iteration from the store) logs the iterations the stop cut off."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from mindspeed_tft import events
from mindspeed_tft.events import LOGGED_KEY, IterationLog, read_events, validate_record


@pytest.fixture
def events_file(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("TFT_EVENTS_FILE", str(path))
    events.configure_events(str(path))
    yield path
    monkeypatch.delenv("TFT_EVENTS_FILE")
    events.configure_events(None)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10),
                         wait_for_workers=False)


def _fields(i: int) -> dict:
    return {"loss": 10.0 - i / 8, "grad_norm": 1.5, "lr": 1e-4, "consumed_samples": 16 * i}


def _logged(path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    return [(e["event"], e["iteration"]) for e in read_events(str(path))
            if e["event"].startswith("iteration")]


def test_first_runs_are_logged_recomputes_are_not(events_file, store):
    log = IterationLog(store)
    assert [log.record(i, logger=True, **_fields(i)) for i in (1, 2, 3)] == [True] * 3
    assert int(store.get(LOGGED_KEY)) == 3
    # rolled back to iteration 1: 2 and 3 are computed again, then 4 is new
    assert [log.record(i, logger=True, **_fields(i)) for i in (2, 3, 4)] == [False, False, True]
    assert _logged(events_file) == [("iteration", 1), ("iteration", 2), ("iteration", 3),
                                    ("iteration_recomputed", 2), ("iteration_recomputed", 3),
                                    ("iteration", 4)]
    recomputed = [e for e in read_events(str(events_file))
                  if e["event"] == "iteration_recomputed"]
    assert recomputed[0]["loss"] == _fields(2)["loss"] and recomputed[0]["lr"] == 1e-4
    assert int(store.get(LOGGED_KEY)) == 4


def test_a_rank_that_does_not_log_keeps_its_records(events_file, store):
    log = IterationLog(store)
    log.record(5, logger=False, **_fields(5))
    assert not store.check([LOGGED_KEY]) and _logged(events_file) == []
    # the loss of step 5 is known, its update (iteration 6) about to run
    log.prepare(6, loss=_fields(6)["loss"], consumed_samples=96)
    assert [r["iteration"] for r in log.records()] == [5, 6]
    assert log.records()[1] == {"iteration": 6, "loss": _fields(6)["loss"], "grad_norm": None,
                                "lr": None, "consumed_samples": 96}
    log.record(6, logger=False, **_fields(6))
    assert log.records() == [{"iteration": 6, **_fields(6)}]


def test_a_replacement_logger_fills_in_from_the_store(events_file, store, capsys):
    """The logging rank logged 1..3 and died; its replacement logs only 4 and 5 of the
    records the survivors reported, in order, once each, with a line naming the repair."""
    old = IterationLog(store)
    for i in (1, 2, 3):
        old.record(i, logger=True, **_fields(i))
    new = IterationLog(store)
    records = [{"iteration": i, **_fields(i)} for i in (5, 3, 4)]
    assert new.fill(records, logger=True, train_iters=10) == [4, 5]
    assert new.fill(records, logger=True, train_iters=10) == []  # never twice
    assert _logged(events_file) == [("iteration", i) for i in range(1, 6)]
    assert int(store.get(LOGGED_KEY)) == 5
    lines = [line for line in capsys.readouterr().out.splitlines() if "iteration" in line]
    assert len(lines) == 2 and "iteration        4/      10" in lines[0]
    assert f"lm loss: {_fields(4)['loss']:.6E}" in lines[0]
    assert all("logged after the repair" in line for line in lines)
    # training goes on: 5 was logged by the fill, so its recompute is not logged again
    assert new.record(5, logger=True, **_fields(5)) is False
    assert new.record(6, logger=True, **_fields(6)) is True
    assert IterationLog(store).fill(records, logger=False) == []


def test_a_former_logger_that_logs_again_reads_the_store(events_file, store):
    """After scale changes a process that logged before may be the last rank again: the
    iterations another logging process logged meanwhile are not logged twice."""
    former, interim = IterationLog(store), IterationLog(store)
    former.record(1, logger=True, **_fields(1))
    interim.record(1, logger=False, **_fields(1))
    for i in (2, 3):
        interim.record(i, logger=True, **_fields(i))
    assert former.fill([{"iteration": 3, **_fields(3)}], logger=True) == []
    assert former.record(3, logger=True, **_fields(3)) is False
    assert former.record(4, logger=True, **_fields(4)) is True
    assert _logged(events_file) == [*(("iteration", i) for i in (1, 2, 3)),
                                    ("iteration_recomputed", 3), ("iteration", 4)]


@pytest.mark.parametrize("bad", [
    None, [], "x", {"iteration": 3}, {"iteration": "3", "loss": 1.0},
    {"iteration": 0, "loss": 1.0}, {"iteration": True, "loss": 1.0},
    {"iteration": 3, "loss": "1.0"}, {"iteration": 3, "loss": 1.0, "extra": 1},
    {"iteration": 3, "loss": 1.0, "lr": [1]}, {"iteration": 3, "loss": 1.0,
                                                "consumed_samples": 1.5},
])
def test_records_from_the_network_are_checked(bad):
    assert validate_record(bad) is None


def test_a_valid_record_is_kept_whole():
    record = {"iteration": 3, **_fields(3)}
    assert validate_record(record) == record
    assert validate_record({"iteration": 3, "loss": 2}) == {
        "iteration": 3, "loss": 2, "grad_norm": None, "lr": None, "consumed_samples": None}
