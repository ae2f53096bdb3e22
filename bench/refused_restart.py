"""From a worker's exit that its launcher does not restart to the dump (issue 58, item 5).

A DP4 job of the reference trainer under `tft-run` with worker reboot: rank 1 exits with
code 1 in the backward pass of step 6 (`TFT_INJECT` kind exit), which `tft-run` does not
restart. It prints the strategy the controller chose (and why), and the seconds from the
injected exit (`fault_injected` event) to the decision (`strategy`), to the dump order
(`action` dump) and to the job's end (`exit`), read off the events file; the last line is
one JSON object. `--replacement-wait S` sets `TFT_REPLACEMENT_WAIT` (default: unset, the
action time limit, 180 s): the longest a recover would wait for the restart.

    python bench/refused_restart.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.jobs import HA_ARGS, STANDARD, run_tiny_job  # noqa: E402

INJECT = "exit:rank=1,step=6,phase=backward"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replacement-wait", type=float, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="keep the job's folder here")
    args = ap.parse_args()
    env = {} if args.replacement_wait is None else {
        "TFT_REPLACEMENT_WAIT": f"{args.replacement_wait:g}"}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.keep or Path(tmp) / "job"
        job = run_tiny_job(run_dir, inject=INJECT, launcher="tft-run", timeout=600,
                           ha_args=f"{HA_ARGS} --enable-worker-reboot", env=env, **STANDARD)
    (fault,) = job.named("fault_injected")
    strategy = job.named("strategy")[0]
    dump = next((e for e in job.named("action") if e["action"] == "dump"), None)
    end = job.named("exit")[-1]
    row = {
        "returncode": job.returncode,
        "strategy": strategy["strategy"],
        "reason": strategy.get("reason"),
        "repair_failed": [e["reason"] for e in job.named("repair_failed")],
        "fault_to_strategy_s": round(strategy["time"] - fault["time"], 2),
        "fault_to_dump_s": None if dump is None else round(dump["time"] - fault["time"], 2),
        "fault_to_exit_s": round(end["time"] - fault["time"], 2),
    }
    for key, value in row.items():
        print(f"{key:20} {value}")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
