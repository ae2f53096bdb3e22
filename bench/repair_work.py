"""Repair work per rank, counted: what a worker reboot (ARF) and a UCE repair cost each rank,
in connections, rendezvous-store operations, control messages, process groups and state
bytes, at world sizes W = 4, 8, 16, 32, data-parallel only and with TP = 2.

Every count comes from the code that does the work (`events.work_counts`, written into the events
stream as `work` events at the marks of a repair): the processor's channel (messages and
bytes by type, its connections), the rendezvous-store client the process groups are built on
(`recovery.rebuild.CountingStore`: operations and bytes), the group creation (`groups_created`
for the groups this rank is a member of, `group_calls` for every call torch's API wants),
the connections the process groups opened (`recovery.collectives.count_connections`, from
/proc at the marks), the shard copy, the snapshot and the rollback's param gather (state
bytes). A survivor's counts are the difference between its `stop` mark (the controller
stopped it) and its `resumed` mark (the end of the first step after the repair, so the
connections a lazily connected group makes at its first use are in); the replacement
process of ARF counts from its start to its `resumed` mark (a warm spare's import and
registration included).

Ranks are grouped by where they stand to the fault: the failed rank (ARF: its replacement), its group
peers (the ranks that share a process group smaller than the world with it: its TP group,
its DP group when TP > 1, its optimizer chunk and replica groups) and the ranks outside its
groups. For each group the table gives the largest count of its ranks; the JSON line every
rank's. Control messages leave heartbeats and their acks out (they come every interval,
as many as the repair lasts); they are reported beside (`heartbeats`). Seconds go beside
the counts: the incident (fault to the first iteration completed after it) and the
process-group rebuild (the slowest rank's); on this machine's 2 cores every process of the
job shares them, so seconds grow with W, the counts are what tells how the repair scales.

The jobs: the reference trainer (`scripts/pretrain_tiny_cpu.sh`, tiny preset, fp32, one
micro-batch per rank per step: the global batch is 2 x DP), `--iters` iterations, the fault
at step `--step` (updates done) on rank `--rank`: ARF `kill` in the forward pass under
`tft-run --tft-spares-per-node 1` (the warm spare takes the rank), UCE on the optimizer
state in the backward pass under torchrun.

    python bench/repair_work.py                      # W = 4, 8, 16, 32 x dp, tp2 x arf, uce
    python bench/repair_work.py --worlds 4 8 --layouts dp --cases uce

Output: the table and, as the last line, one JSON object {"jobs": [per job: case, layout,
world, seconds, ranks (failed, peers, outside), counts per rank], "flat": per count, how the
outside ranks' largest count goes with W}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timeline import Job, JobSpec, run_spec  # noqa: E402

from mindspeed_tft.tools.report import WORK_COUNTS, repair_work  # noqa: E402

ARF_ARGS = "--enable-high-availability --enable-worker-reboot"
UCE_ARGS = "--enable-high-availability --enable-hbmfault-repair"
SPARE_LAUNCHER = "tft-run --tft-spares-per-node 1"
LAYOUTS = {"dp": 1, "tp2": 2}  # layout -> TP
CASES = ("arf", "uce")
#: a roomy heartbeat: 33 processes starting on 2 cores must not be taken for lost
JOB_ENV = {"TINY_PRECISION": "fp32", "TTP_HEARTBEAT_INTERVAL": "1",
           "TTP_HEARTBEAT_MISSES": "30"}
def rebuild_seconds(job: Job) -> float | None:
    values = [e["rebuild_s"] for e in job.named("work")
              if e["mark"] == "repaired" and e.get("rebuild_s") is not None]
    return max(values) if values else None


def peers_of(job: Job, failed: int, world: int, tp: int) -> set[int]:
    """The ranks that share a process group smaller than the world with `failed`: its TP
    group, and the DP, optimizer chunk and replica groups of its `replica_layout` event."""
    peers = {r for r in range(world) if r // tp == failed // tp} if tp > 1 else set()
    layout = job.first("replica_layout", rank=failed)
    for key in ("dp_group", "chunk_group", "replica_group", "grad_stats_group"):
        ranks = set((layout or {}).get(key) or [])
        if len(ranks) < world:
            peers |= ranks
    return peers - {failed}


def classify(job: Job, failed: int, world: int, tp: int) -> dict[str, list[int]]:
    peers = peers_of(job, failed, world, tp)
    return {"failed": [failed], "peers": sorted(peers),
            "outside": [r for r in range(world) if r != failed and r not in peers]}


def spec_for(case: str, layout: str, world: int, opts: argparse.Namespace) -> JobSpec:
    tp = LAYOUTS[layout]
    env = {**JOB_ENV, "NPROC": str(world), "TP": str(tp), "GBS": str(2 * world // tp)}
    if case == "arf":
        return JobSpec(f"arf-{layout}-{world}", opts.iters, 1000, ha_args=ARF_ARGS,
                       launcher=SPARE_LAUNCHER, env=env,
                       inject=f"kill:rank={opts.rank},step={opts.step},phase=forward")
    return JobSpec(f"uce-{layout}-{world}", opts.iters, 1000, ha_args=UCE_ARGS, env=env,
                   inject=f"uce:rank={opts.rank},step={opts.step},phase=backward,"
                          "target=optimizer")


def measure(case: str, layout: str, world: int, opts: argparse.Namespace,
            work: Path) -> dict[str, Any]:
    job = run_spec(spec_for(case, layout, world, opts), work, opts.timeout)
    result: dict[str, Any] = {"case": case, "layout": layout, "world": world,
                              "returncode": job.returncode}
    fault = job.first("fault_injected")
    done = job.first_iteration_after_fault() if fault is not None else None
    rows = repair_work(job.events)
    if job.returncode != 0 or done is None or len(rows) != world:
        result["error"] = (f"exit code {job.returncode}, {len(rows)} of {world} ranks "
                           f"counted; see {job.run_dir / 'output.log'} (--keep)")
        print(job.describe(30), file=sys.stderr)
        return result
    ranks = classify(job, opts.rank, world, LAYOUTS[layout])
    result.update({
        "incident_s": round(done["time"] - fault["time"], 3),
        "rebuild_s": rebuild_seconds(job),
        "step_s": round(job.step_s(warmup=1), 3),
        "ranks": ranks,
        "counts": {str(rank): rows[rank] for rank in sorted(rows)},
        "largest": {kind: {name: max(rows[r][name] for r in members)
                           for name in rows[members[0]]}
                    for kind, members in ranks.items() if members},
    })
    return result


def flatness(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per count: the outside ranks' largest value at each W, by case and layout, and a
    verdict: "flat" when equal at every W, else the ratio of the largest W's to the
    smallest's."""
    verdict: dict[str, Any] = {}
    names = [*WORK_COUNTS, "heartbeats"]
    for name in names:
        series = {}
        for r in results:
            outside = r.get("largest", {}).get("outside")
            if outside is not None:
                series.setdefault(f"{r['case']}-{r['layout']}", {})[r["world"]] = outside[name]
        per_case = {}
        for key, by_world in series.items():
            values = [by_world[w] for w in sorted(by_world)]
            per_case[key] = {"by_world": {str(w): by_world[w] for w in sorted(by_world)},
                             "flat": len(set(values)) == 1,
                             "growth": (round(values[-1] / values[0], 2) if values[0] else None)}
        verdict[name] = per_case
    return verdict


def print_table(results: list[dict[str, Any]]) -> None:
    short = {"connections": "conn", "conn_groups": "c.grp", "store_ops": "store",
             "store_bytes": "st.B", "control_msgs": "ctl", "control_bytes": "ctl.B",
             "groups_created": "grp", "group_calls": "calls", "state_bytes": "state.B",
             "heartbeats": "hb"}
    head = "".join(f"{v:>9}" for v in short.values())
    print(f"{'job':<14}{'ranks':<9}{head}{'incident s':>12}{'rebuild s':>10}")
    for r in results:
        name = f"{r['case']}-{r['layout']}-{r['world']}"
        if "error" in r:
            print(f"{name:<14}failed: {r['error']}")
            continue
        for kind in ("failed", "peers", "outside"):
            row = r["largest"].get(kind)
            if row is None:
                continue
            cells = "".join(f"{row[k]:>9}" for k in short)
            extra = (f"{r['incident_s']:>12.2f}{r['rebuild_s'] or 0:>10.2f}"
                     if kind == "failed" else "")
            label = f"{kind}({len(r['ranks'][kind])})"
            print(f"{name if kind == 'failed' else '':<14}{label:<9}{cells}{extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--iters", type=int, default=6, help="iterations per job")
    parser.add_argument("--step", type=int, default=3, help="fault step k (updates done)")
    parser.add_argument("--rank", type=int, default=1, help="the failed rank")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--keep", type=Path, default=None, help="keep run dirs here")
    opts = parser.parse_args(argv)
    if not 0 < opts.step < opts.iters - 1:
        parser.error("--step must be between 1 and --iters - 2")
    for world in opts.worlds:
        if world < 4 or world % 4:
            parser.error(f"--worlds {world}: allowed: multiples of 4 from 4 up (TP 2 x DP "
                         "of at least 2, 2 optimizer replicas)")
    if not 0 <= opts.rank < min(opts.worlds):
        parser.error(f"--rank {opts.rank}: allowed: 0 to {min(opts.worlds) - 1}")
    work = opts.keep or Path(tempfile.mkdtemp(prefix="tft-bench-repair-work-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for case in opts.cases:
            for layout in opts.layouts:
                for world in sorted(opts.worlds):
                    results.append(measure(case, layout, world, opts, work))
                    print(f"[repair_work] {case}-{layout}-{world}: "
                          f"{results[-1].get('error') or 'ok'}", flush=True)
    finally:
        if opts.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    print(json.dumps({"jobs": results, "flat": flatness(results),
                      "fault": {"rank": opts.rank, "step": opts.step}}))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
