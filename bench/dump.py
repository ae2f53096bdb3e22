"""Dying-gasp checkpoint (TTP dump): iterations lost, and the dump's time against a regular
checkpoint save of the same state.

What it measures: `--jobs` runs of a 4-rank CPU job (`scripts/pretrain_tiny_cpu.sh` under
torchrun, `--enable-high-availability`: DP = 4, distributed optimizer, N = 2 optimizer
replicas; a model a bit bigger than the tiny preset, hidden 256 / ffn 704 / 4 layers, about
5 M parameters and a 71 MB checkpoint, so that saves take long enough to compare), each with
a periodic checkpoint every `--save-interval` iterations and one rank SIGKILLed
(`TFT_INJECT=kill:...`) at a step, phase (forward, backward, optimizer) and rank drawn from
`random.Random(--seed)` (printed). The fault hits after at least two periodic saves.

For each job:

- iterations lost: the last iteration any rank finished (the highest `iteration` event)
  minus the dump's iteration (`dump_saved.iteration`), floored at 0: steps completed before
  the fault that the dump does not hold. The step in flight is lost by design when the fault
  hits before its update (forward, backward: dump = k); a fault inside the update is finished
  by the survivors (optimizer: dump = k + 1); the expected dump iteration is checked;
- dump time `dump_s`: `strategy` (dump chosen) -> `dump_saved` (written and published); also
  from the first `fault_detected` and from `fault_injected` (these include the detection of the
  lost rank: under plain torchrun nobody reports the dead process, so its heartbeats must time
  out, TTP_HEARTBEAT_INTERVAL 2 s by default; `--heartbeat` changes it);
- regular save time `save_s`, in the same job: the trainer's `save_checkpoint` timed by
  `bench/_timed_save.py` (a launcher that runs the unchanged trainer with that one function
  wrapped), from the first rank entering to the last rank leaving, for every periodic save
  before the fault; the extra gap between the `iteration` events around each save is printed
  as a cross-check.

The dump is checked to be published (`latest_checkpointed_iteration.txt`, no `_tmp` left).

Output: a table per job, then as the last line one JSON object
`{"lost_iterations": .. (worst job), "dump_s": .. (median), "save_s": .. (median),
"ratio": dump_s / save_s, ...}`. Goals: lost_iterations == 0 (beyond the step in flight),
ratio <= 1.5.

    python bench/dump.py                 # 3 jobs, ~2 min
    python bench/dump.py --quick         # 1 job, 16 iterations
    python bench/dump.py --seed 7 --jobs 5
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _jobs import REPO  # noqa: E402
from _timeline import Job, JobSpec, fmt_s, print_breakdown, run_spec  # noqa: E402

HA_ARGS = "--enable-high-availability"
PHASES = ("forward", "backward", "optimizer")
TIMED_LAUNCHER = REPO / "bench" / "_timed_save.py"
GOAL_RATIO = 1.5
#: The dump's stages timed by bench/_timed_save.py, in the order they run.
DUMP_STAGES = {
    "dump_shard_to_cpu": "optimizer shard copied to CPU",
    "dump_write_shard": "shard file written (copy included)",
    "dump_wait_shards": "all shard files present (assembler waits)",
    "dump_read_shards": "shard files read back",
    "dump_assemble": "parameter state assembled",
    "dump_assemble_and_write": "distrib_optim.pt + model_optim_rng.pt written (read, assemble incl.)",
    "dump_publish": "checked and renamed",
}


@dataclass
class Fault:
    rank: int
    step: int
    phase: str

    @property
    def spec(self) -> str:
        return f"kill:rank={self.rank},step={self.step},phase={self.phase}"

    @property
    def expected_dump(self) -> int:
        return self.step + 1 if self.phase == "optimizer" else self.step


@dataclass
class DumpResult:
    fault: Fault
    job: Job
    last_done: int | None = None
    dump_iteration: int | None = None
    lost: int | None = None
    detect_s: float | None = None
    strategy_s: float | None = None
    dump_s: float | None = None
    from_detect_s: float | None = None
    from_fault_s: float | None = None
    saves: dict[int, float] = field(default_factory=dict)  # iteration -> s (timed)
    save_optimizer_s: dict[int, float] = field(default_factory=dict)  # inside each save
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    save_gaps: dict[int, float] = field(default_factory=dict)  # iteration -> s (event gaps)
    problems: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """dump_s / this job's median save (both measured under the same load)."""
        if self.dump_s is None or not self.saves:
            return None
        return self.dump_s / statistics.median(self.saves.values())


def draw_faults(seed: int, jobs: int, iters: int, save_interval: int) -> list[Fault]:
    rng = random.Random(seed)
    low, high = 2 * save_interval + 1, iters - 2
    return [Fault(rng.randrange(4), rng.randint(low, high), rng.choice(PHASES))
            for _ in range(jobs)]


def read_records(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Rank -> the timing records `bench/_timed_save.py` wrote for it."""
    records: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.stem[len("rank"):])
        records[rank] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def timed_saves(records: dict[int, list[dict[str, Any]]]) -> dict[int, tuple[float, float]]:
    """Iteration -> (start, end) of the periodic saves every rank finished: from the first
    rank entering save_checkpoint to the last rank leaving it."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for recs in records.values():
        for rec in recs:
            if rec["what"] == "save":
                spans.setdefault(rec["iteration"], []).append((rec["start"], rec["end"]))
    return {
        it: (min(b for b, _ in s), max(e for _, e in s))
        for it, s in sorted(spans.items()) if len(s) == len(records)
    }


def longest(records: dict[int, list[dict[str, Any]]], what: str, start: float,
            end: float = float("inf")) -> float | None:
    """The longest `what` call of any rank within [start, end]."""
    spans = [r["end"] - r["start"] for recs in records.values() for r in recs
             if r["what"] == what and r["start"] >= start and r["end"] <= end]
    return max(spans) if spans else None


def dump_marks(r: DumpResult) -> list[tuple[str, float | None]]:
    """The dump's timeline: events, and every timed stage of every rank after the fault."""
    job = r.job
    t0 = job.fault()["time"]
    marks: list[tuple[str, float | None]] = [
        ("fault detected (first fault_detected)",
         None if (e := job.first("fault_detected", t0)) is None else e["time"]),
        ("lost rank declared, dump chosen (strategy)",
         None if (e := job.first("strategy", t0)) is None else e["time"]),
    ]
    for rank, recs in sorted(r.records.items()):
        for rec in recs:
            if rec["start"] >= t0 and rec["what"] in DUMP_STAGES:
                if rec["what"] == "dump_write_shard":
                    marks.append((f"rank {rank}: dump starts (write_shard called)", rec["start"]))
                marks.append((f"rank {rank}: {DUMP_STAGES[rec['what']]} "
                              f"[{rec['end'] - rec['start']:.3f} s]", rec["end"]))
    marks.append(("dump_saved (published)",
                  None if (e := job.first("dump_saved", t0)) is None else e["time"]))
    return marks


def stage_seconds(results: list[DumpResult]) -> dict[str, float]:
    """Per dump stage: the median over jobs of the longest rank's duration."""
    out = {}
    for what in DUMP_STAGES:
        per_job = []
        for r in results:
            if r.dump_iteration is not None:
                t0 = r.job.fault()["time"]
                if (s := longest(r.records, what, t0)) is not None:
                    per_job.append(s)
        if per_job:
            out[what] = round(statistics.median(per_job), 3)
    return out


def gap_estimates(job: Job, saves: list[int]) -> dict[int, float]:
    """Save time estimated from the events: the gap between the `iteration` events of a
    saved iteration and the next one, minus the median gap of iterations without a save."""
    stamps: dict[int, float] = {}
    for e in job.named("iteration"):
        stamps.setdefault(e["iteration"], e["time"])
    gaps = {it: stamps[it] - stamps[it - 1] for it in stamps if it - 1 in stamps}
    plain = [g for it, g in gaps.items() if it - 1 not in saves and it > 3]
    if not plain:
        return {}
    step = statistics.median(plain)
    return {it: gaps[it + 1] - step for it in saves if it + 1 in gaps}


def measure(fault: Fault, job: Job) -> DumpResult:
    r = DumpResult(fault, job)
    injected = job.first("fault_injected")
    saved = job.first("dump_saved")
    if injected is None:
        r.problems.append("no fault_injected event")
        return r
    t0 = injected["time"]
    detected = job.first("fault_detected", t0)
    strategy = job.first("strategy", t0)
    done = [e["iteration"] for e in job.named("iteration")]
    r.last_done = max(done) if done else 0
    r.detect_s = None if detected is None else detected["time"] - t0
    r.strategy_s = None if strategy is None else strategy["time"] - t0
    if strategy is not None and strategy.get("strategy") != "dump":
        r.problems.append(f"strategy {strategy.get('strategy')}, not dump")
    if saved is None:
        r.problems.append("no dump_saved event")
    else:
        r.dump_iteration = saved["iteration"]
        r.lost = max(0, r.last_done - r.dump_iteration)
        r.from_fault_s = saved["time"] - t0
        if strategy is not None:
            r.dump_s = saved["time"] - strategy["time"]
        if detected is not None:
            r.from_detect_s = saved["time"] - detected["time"]
        if r.dump_iteration != fault.expected_dump:
            r.problems.append(f"dump at iteration {r.dump_iteration}, expected "
                              f"{fault.expected_dump} for phase {fault.phase}")
        ckpt = job.run_dir / "ckpt"
        latest = ckpt / "latest_checkpointed_iteration.txt"
        if not latest.exists() or latest.read_text().strip() != str(r.dump_iteration):
            r.problems.append("latest_checkpointed_iteration.txt does not name the dump")
        if list(ckpt.glob("*_tmp")):
            r.problems.append("a *_tmp directory was left behind")
    r.records = read_records(job.run_dir / "saves")
    spans = timed_saves(r.records)
    r.saves = {it: end - start for it, (start, end) in spans.items()}
    r.save_optimizer_s = {
        it: s for it, (start, end) in spans.items()
        if (s := longest(r.records, "save_optimizer_state", start, end)) is not None
    }
    r.save_gaps = gap_estimates(job, sorted(r.saves))
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault draws")
    parser.add_argument("--jobs", type=int, default=3, help="faulty jobs (one fault each)")
    parser.add_argument("--iters", type=int, default=24, help="iterations per job")
    parser.add_argument("--save-interval", type=int, default=4, help="periodic checkpoint")
    parser.add_argument("--quick", action="store_true", help="1 job of 16 iterations")
    parser.add_argument("--layers", type=int, default=4, help="TINY_NUM_LAYERS")
    parser.add_argument("--hidden", type=int, default=256, help="TINY_HIDDEN_SIZE")
    parser.add_argument("--ffn", type=int, default=704, help="TINY_FFN_HIDDEN_SIZE")
    parser.add_argument("--seq", type=int, default=64, help="TINY_SEQ_LENGTH")
    parser.add_argument("--heartbeat", type=float, default=None,
                        help="TTP_HEARTBEAT_INTERVAL (s) (default: unset, 2 s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument("--keep", type=Path, default=None, help="keep run dirs here")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.jobs, opts.iters = 1, 16
    if opts.iters < 2 * opts.save_interval + 3:
        parser.error("--iters must be at least 2 x --save-interval + 3")

    faults = draw_faults(opts.seed, opts.jobs, opts.iters, opts.save_interval)
    print(f"[dump] seed {opts.seed}: " + "; ".join(f.spec for f in faults),
          file=sys.stderr, flush=True)
    env = {
        "TINY_NUM_LAYERS": str(opts.layers), "TINY_HIDDEN_SIZE": str(opts.hidden),
        "TINY_FFN_HIDDEN_SIZE": str(opts.ffn), "TINY_SEQ_LENGTH": str(opts.seq),
    }
    if opts.heartbeat is not None:
        env["TTP_HEARTBEAT_INTERVAL"] = str(opts.heartbeat)
    work = opts.keep or Path(tempfile.mkdtemp(prefix="tft-bench-dump-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[DumpResult] = []
    try:
        for i, fault in enumerate(faults):
            name = f"job{i}"
            spec = JobSpec(
                name, opts.iters, opts.save_interval, ha_args=HA_ARGS,
                launcher=f"{sys.executable} {TIMED_LAUNCHER}", inject=fault.spec,
                env={**env, "BENCH_SAVE_OUT": str(work / name / "saves")},
            )
            job = run_spec(spec, work, opts.timeout)
            print(f"[dump] {name} ({fault.spec}): exit {job.returncode} in {job.seconds:.0f}s",
                  file=sys.stderr, flush=True)
            results.append(measure(fault, job))
            if opts.keep is None:
                shutil.rmtree(job.run_dir / "ckpt", ignore_errors=True)
    finally:
        if opts.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    print(f"model: {opts.layers} layers, hidden {opts.hidden}, ffn {opts.ffn}, seq {opts.seq}; "
          f"{opts.iters} iterations, periodic checkpoint every {opts.save_interval}; "
          f"seed {opts.seed}")
    head = (f"{'job':>4} {'fault (rank step phase)':>24} {'last it':>7} {'dump it':>7} "
            f"{'lost':>4} | {'detect':>7} {'strategy':>8} {'dump_s':>7} {'det->dump':>9} "
            f"{'fault->dump':>11} | {'ratio':>5} | {'save_s (timed, per save)':<28} {'gap est.':<20}")
    print(head)
    print("-" * len(head))
    for i, r in enumerate(results):
        f = r.fault
        saves = " ".join(f"{s:.3f}" for s in r.saves.values()) or "-"
        gaps = " ".join(f"{s:.3f}" for s in r.save_gaps.values()) or "-"
        print(f"{i:>4} {f'{f.rank} {f.step} {f.phase}':>24} {_i(r.last_done):>7} "
              f"{_i(r.dump_iteration):>7} {_i(r.lost):>4} | {fmt_s(r.detect_s)} "
              f"{fmt_s(r.strategy_s, 8)} {fmt_s(r.dump_s)} {fmt_s(r.from_detect_s, 9)} "
              f"{fmt_s(r.from_fault_s, 11)} | {_f(r.ratio):>5} | {saves:<28} {gaps:<20}")
        for problem in r.problems:
            print(f"     problem: {problem}")
    print("  (s; detect / strategy: since fault_injected; dump_s: strategy -> dump_saved; "
          "ratio: dump_s / the job's median save; gap est.: iteration-event gap after a save "
          "minus the median gap)")

    first = next((r for r in results if r.dump_iteration is not None), None)
    if first is not None:
        print()
        print_breakdown(f"where the dump's time goes, job {results.index(first)} "
                        "(s since the fault, +delta; [duration of the stage]):",
                        first.job.fault()["time"], dump_marks(first))
    stages = stage_seconds(results)
    save_opt = [s for r in results for s in r.save_optimizer_s.values()]
    print("dump stages, median over jobs of the slowest rank (s): " + ", ".join(
        f"{what[len('dump_'):]} {sec:.3f}" for what, sec in stages.items()))
    if save_opt:
        print(f"regular save (s, median): {statistics.median([s for r in results for s in r.saves.values()]):.3f}, "
              f"of which save_parameter_state (gather to DP rank 0 + distrib_optim.pt) "
              f"{statistics.median(save_opt):.3f}; the rest is model_optim_rng.pt, barriers, "
              "publish")
    print()

    lost = [r.lost for r in results if r.lost is not None]
    dumps = [r.dump_s for r in results if r.dump_s is not None]
    saves = [s for r in results for s in r.saves.values()]
    gap_saves = [s for r in results for s in r.save_gaps.values()]
    dump_s = statistics.median(dumps) if dumps else None
    save_s = statistics.median(saves) if saves else None
    ratio = None if dump_s is None or not save_s else dump_s / save_s
    lost_worst = max(lost) if len(lost) == len(results) else None
    ok_lost = lost_worst == 0
    ok_ratio = ratio is not None and ratio <= GOAL_RATIO
    print(f"goal lost_iterations == 0 (beyond the step in flight): {_i(lost_worst)} "
          f"{'(met)' if ok_lost else '(NOT met)'}; goal ratio dump_s / save_s <= {GOAL_RATIO}: "
          f"{_f(dump_s)} / {_f(save_s)} = {_f(ratio)} {'(met)' if ok_ratio else '(NOT met)'}")
    problems = [p for r in results for p in r.problems] + [
        f"job exit {r.job.returncode} without a dump" for r in results
        if r.dump_iteration is None]
    if problems:
        print(f"PROBLEMS: {len(problems)} (see above)")
        for r in results:
            if r.dump_iteration is None:
                print(r.job.describe(30))

    def med(values: list[float | None]) -> float | None:
        kept = [v for v in values if v is not None]
        return round(statistics.median(kept), 3) if kept else None

    summary: dict[str, Any] = {
        "lost_iterations": lost_worst,
        "dump_s": _r(dump_s),
        "save_s": _r(save_s),
        "ratio": _r(ratio, 4),
        "ratio_per_job": [_r(r.ratio, 4) for r in results],
        "save_gap_s": med(list(gap_saves)),
        "detect_s": med([r.detect_s for r in results]),
        "dump_from_detect_s": med([r.from_detect_s for r in results]),
        "dump_from_fault_s": med([r.from_fault_s for r in results]),
        "save_optimizer_state_s": med(list(save_opt)),
        "dump_stages": stages,
        "seed": opts.seed,
        "faults": [f.spec for f in faults],
        "goals_met": {"lost_iterations": ok_lost, "ratio": ok_ratio},
    }
    print(json.dumps(summary))
    return 1 if problems else 0


def _i(value: int | None) -> str:
    return "-" if value is None else str(value)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


if __name__ == "__main__":
    sys.exit(main())
