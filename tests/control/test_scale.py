"""The controller-scale bench, small: 1,000 simulated ranks against a real controller, CURVE on.

`bench/controller_scale.py` at K = 1,000 with CURVE (a thousand handshakes through the ZAP
handler, every REGISTER with the job's token): the registration storm, the steady-state CPU,
the hold reaching every rank and a silent rank's detection all meet the bench's goals, so
the bench cannot rot and the goals hold at the small end in CI. A heartbeat interval of 1 s
keeps it short.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.jobs import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("controller_scale",
                                                  REPO / "bench" / "controller_scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["controller_scale"] = module
    spec.loader.exec_module(module)
    return module


def test_controller_scale_bench_meets_its_goals_at_1000_ranks_with_curve(tmp_path: Path) -> None:
    bench = _bench()
    opts = bench.Options(interval=1.0, misses=3, procs=2, window=3.0, curve=True)
    row = bench.run_one(1000, opts, tmp_path)
    print(bench.table([row]))
    assert "skipped" not in row, row
    assert bench.goal_failures(row, opts) == [], row
    # at 1,000 ranks the controller is nearly idle (0.01-0.03 cores measured here)
    assert row["cpu_cores"] <= 0.1, row
