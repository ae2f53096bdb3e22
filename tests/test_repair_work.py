"""A repair's work per rank does not grow with the world size (SPEC 9): the same UCE repair
(optimizer state of rank 1, data parallel only, 2 optimizer replicas) at 8 and at 16 ranks,
counted by the code that does the work (`events.work_counts`, the `work` events of the
repair's marks; `report.repair_work` reads them, as `bench/repair_work.py` does for
W = 4..32). A rank outside the failed rank's groups (its optimizer chunk and its replica
group; the DP group is the world here) pays exactly the same connections, store operations
and bytes, control messages and bytes, process groups and state bytes at both sizes; only
torch's group-creation calls grow (every rank calls `new_group` for every group of the job,
a member or not: a non-member's call returns at once, with no store operation and no
connection).
"""

from __future__ import annotations

import pytest

from mindspeed_tft.tools.report import repair_work
from tests.jobs import HA_ARGS, run_tiny_job

pytestmark = pytest.mark.multiproc

RETRY_ARGS = f"{HA_ARGS} --enable-hbmfault-repair"
FAILED = 1
#: counts that must not depend on the world size (the report's names); heartbeats come
#: every interval, as many as the repair lasts, and group calls are torch's bookkeeping
FLAT = ("connections", "conn_groups", "store_ops", "store_bytes", "groups_created",
        "state_bytes")


def _repair(tmp_path, layout: str, world: int) -> dict[int, dict[str, int]]:
    job = run_tiny_job(tmp_path / layout, layout=layout, train_iters=5, save_interval=100,
                       precision="fp32", ha_args=RETRY_ARGS, env={"GBS": str(2 * world)},
                       inject=f"uce:rank={FAILED},step=3,phase=backward,target=optimizer")
    assert job.returncode == 0, job.describe()
    assert [e["strategy"] for e in job.named("strategy")] == ["retry"]
    rows = repair_work(job.events)
    assert sorted(rows) == list(range(world)), job.describe()
    for rank, row in rows.items():
        row["reports"], row["report_bytes"] = _reports_sent(job.events, rank)
    return rows


def _reports_sent(events: list[dict], rank: int) -> tuple[int, int]:
    """The error reports `rank` sent between the repair's stop and resumed marks (a rank
    whose training thread met the stop's closed connections before the stop itself reports
    that error too: a race)."""
    marks = {e["mark"]: e["counts"] for e in events
             if e["event"] == "work" and e["rank"] == rank and e["mark"] in ("stop", "resumed")}
    start, end = marks.get("stop", {}), marks["resumed"]
    sent, nbytes = ("control_sent.report", "control_sent_bytes.report")
    return (end.get(sent, 0) - start.get(sent, 0), end.get(nbytes, 0) - start.get(nbytes, 0))


def _control(events_rows: dict[int, dict[str, int]], rank: int) -> tuple[int, int]:
    row = events_rows[rank]
    return row["control_msgs"], row["control_bytes"]


def test_an_outside_ranks_repair_work_is_the_same_at_8_and_16_ranks(tmp_path):
    small, large = _repair(tmp_path, "dp8", 8), _repair(tmp_path, "dp16", 16)
    # rank 1's chunk is ranks 0-3 (0-7 at 16 ranks), its replica group {1, 5} ({1, 9}):
    # rank 6 (and 14) is outside both; rank 7 (15) is the logging rank, which also writes
    # the logged iteration to the store
    for name in FLAT:
        assert small[6][name] == large[6][name] == large[14][name], name
    assert small[6]["state_bytes"] == 0
    assert small[6]["conn_groups"] > 0 and small[6]["store_ops"] > 0
    # the control plane: the same orders and results, besides the error report of the race
    # (`_reports_sent`: at most one)
    for rows in (small, large):
        messages, nbytes = _control(rows, 6)
        reports, report_bytes = rows[6]["reports"], rows[6]["report_bytes"]
        assert reports <= 1 and messages - reports == 9, (messages, reports)
        assert 900 < nbytes - report_bytes < 1200, (nbytes, report_bytes)
    # torch's API wants every rank to call new_group for every group: more groups, more calls
    assert large[6]["group_calls"] > small[6]["group_calls"]
    # the failed rank gets its shard back: a smaller shard in a larger chunk
    assert 0 < large[FAILED]["state_bytes"] < small[FAILED]["state_bytes"]
