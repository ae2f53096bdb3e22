"""Recovery time of a killed worker (ARF) and of an on-chip memory fault (UCE), against what a
user has today (torchrun restarting the whole job from the last periodic checkpoint).

What it measures, on the same 4-rank CPU job (`scripts/pretrain_tiny_cpu.sh`: the tiny
preset, DP = 4, distributed optimizer, 2 optimizer replicas where high availability is on,
mock data, `--iters` iterations, a periodic checkpoint every `--save-interval`), with one fault
injected (`TFT_INJECT`) at step k = `--step` (k updates done, the fault hits step k + 1):

- ARF, warm spare: `--enable-high-availability --enable-worker-reboot` under
  `tft-run --tft-spares-per-node 1`; rank `--rank` is SIGKILLed (`kill`, phase `--phase`) and
  its rank is handed to the warm spare process (`arf_s`);
- ARF, cold: the same under plain `tft-run`: a new worker process is started (`arf_cold_s`);
- baseline: high availability off under `torchrun --max-restarts 1`, with `--load` = `--save`:
  torchrun stops every worker and starts them again, and they resume from the last periodic
  checkpoint (the first launch finds no checkpoint and starts fresh). Torch 2.13's torchrun
  only restarts a gloo job correctly with the c10d rendezvous and its own store
  (`--rdzv-backend c10d`, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`): with the default static
  rendezvous, or a store shared with the agent, the restarted workers read the previous
  attempt's gloo addresses and fail to connect (pytorch/pytorch#135712);
- UCE: `--enable-high-availability --enable-hbmfault-repair` under torchrun, one job per
  `--targets` memory (`uce:rank=--uce-rank,...,phase=backward,target=T`): repaired in place;
- a fault-free reference job (`--enable-high-availability`, torchrun) for the losses.

For each faulty job, from its events file (SPEC 11; unix times), the TTP log and torchrun's
log lines (both stamped with the same clock):

- detection: `fault_injected` -> the first `fault_detected` (baseline: torchrun's first log
  line after the fault, when its agent noticed the dead worker and stopped the others);
- recovery (the figure compared): `fault_injected` -> the `iteration` event of the first
  iteration completed after the fault (the step the fault interrupted, done); with
  `--repeats R` every ARF, baseline and UCE job runs R times and the medians are reported
  (per UCE target; `uce_s` is the slowest target's median);
- iterations recomputed: iterations whose `iteration` event is written twice (steps completed
  before the fault and computed again after it; ARF/UCE: lock step lost beyond the step in
  flight, expected 0; baseline: k - the last periodic checkpoint);
- bit-exact: every loss of the job equals the reference's (ARF and UCE jobs);
- step time (`step_s`): the median of the trainer's "elapsed time per iteration" of the UCE
  jobs (first 3 iterations of a job dropped);
- where the time went: the marks of each recovery (detection, launcher report, restart,
  registration of the restarted rank, process-group rebuild, shard copy, rollback, first step).

Repair cost against the machine's limits: right after each ARF warm-spare and UCE job,
`bench/_limits.py` measures on the same 4 ranks and backend the time of one
torch.distributed send of the bytes of that job's shard copy between its sender and
receiver (the copy's limit, paired with it: the loopback rate here drifts by up to 2x from
one minute to the next); after each size's jobs it measures the same sends once more (the
pooled limit, printed beside), a plain tensor copy of ARF's bytes, and the rollback's param
gather (all-gather, and point-to-point exchanges of the same shards: the faster is the
limit); the shard copy (`shard_received`) and the rollback (`rolled_back`) are reported
beside them with efficiency = limit / measured (the rollback's: its `params` part, which
moves the state; its other parts, scheduler, RNG and data iterator, are a fixed fraction of
a millisecond at every size and are printed beside it).

Output: per size a table, the breakdowns, the repair cost and the goals; with several
`--sizes` a scaling table; as the last line one JSON object
`{"sizes": [per size: "arf_s", "arf_cold_s", "baseline_s", "ratio" (arf_s / baseline_s),
"arf_lost_iterations", "uce_s" (worst target), "step_s", "arf"/"uce" (bytes, copy,
rollback, limits, first step), efficiencies, "goals_met", ...], "goals_met" (all sizes), ...}`.
Goals at every size: ratio <= 0.25, arf_lost_iterations == 0, ARF <= step + 1 and
UCE <= step + 0.5, bit-exact, shard copy and rollback efficiency >= 0.5. The two margins
are held per job, paired: `arf_excess_s` / `uce_excess_s` (slowest target) are the median
over jobs of each job's recovery minus that job's own median step, since step times differ
by 10-25 % from job to job on a shared machine (the pooled figures, `arf_s` against
`arf_step_s` and `uce_s` against `step_s`, are printed beside them).

`--host megatron-lm DIR` runs every job in Megatron-LM's own training loop instead: the
unchanged `pretrain_gpt.py` of the clone DIR (core_v0.12.1; copied once into the work dir)
through `scripts/pretrain_megatron_lm_cpu.sh`, the same tiny preset, flags and cases (the
adaptor comes in by `python -m mindspeed_tft.megatron`, or by tft-run itself). The JSON
line says which loop ran (`"host"`).

    python bench/recovery.py             # 8 jobs, 30 iterations, fault at step 15, ~4 min
    python bench/recovery.py --quick     # 20 iterations, fault at step 8, UCE optimizer only
    python bench/recovery.py --quick --host megatron-lm ../shared/megatron-lm
    python bench/recovery.py --quick --hidden 512 --ffn 1408   # ~17 M parameters
    python bench/recovery.py --quick --precision fp32 --sizes tiny 512x1408 1024x2816

`--layers --hidden --ffn --seq` set the model size of every job (the tiny preset's knobs,
`configs/models/tiny.sh`); the JSON line says which were set (`"sizes"`, e.g.
`{"hidden": 512, "ffn": 1408}`; empty: the preset).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _jobs import (  # noqa: E402
    SIZE_KNOBS,
    add_host_argument,
    add_size_arguments,
    bench_env,
    free_port,
    parse_host,
    prepare_host,
    run_job,
    size_env,
    tail,
    torchrun_cmd,
)
from _timeline import Job, JobSpec, fmt_s, print_breakdown, run_spec  # noqa: E402

REFERENCE_ARGS = "--enable-high-availability"
ARF_ARGS = "--enable-high-availability --enable-worker-reboot"
UCE_ARGS = "--enable-high-availability --enable-hbmfault-repair"
ELASTIC_ARGS = f"{ARF_ARGS} --enable-elastic-training"
#: the elastic job: the incident waits 1 s for the killed rank's replacement, which comes
#: later (a cold restart takes seconds): the job shrinks, then grows back when it registers;
#: 24 samples per step (12 micro-batches: DP3 after a shrink of DP4; the preset's 16 would
#: continue at DP2)
ELASTIC_ENV = {"TFT_REPLACEMENT_WAIT": "1", "GBS": "24"}
#: iterations the elastic job runs beyond --iters, for the late replacement to come back
ELASTIC_EXTRA_ITERS = 40
TARGETS = ("optimizer", "param", "grad", "activation")
SPARE_LAUNCHER = "tft-run --tft-spares-per-node 1"
GOAL_RATIO, GOAL_ARF_MARGIN_S, GOAL_UCE_MARGIN_S, GOAL_EFFICIENCY = 0.25, 1.0, 0.5, 0.5
VOCAB = 4096  # scripts/pretrain_tiny_cpu.sh's NullTokenizer

Marks = list[tuple[str, float | None]]


@dataclass
class Row:
    """One faulty job, measured."""

    case: str
    launcher: str
    job: Job
    detect_s: float | None = None
    recovered_s: float | None = None
    recomputed: list[int] = field(default_factory=list)
    resumed_from: str = "-"
    step_s: float = float("nan")
    bit_exact: bool | None = None
    marks: Marks = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


def _t(event: dict[str, Any] | None) -> float | None:
    return None if event is None else event["time"]


def _no_fault(row: Row) -> bool:
    """Mark a job that left no fault to measure (it failed before) as failed."""
    if row.job.first("fault_injected") is not None:
        return False
    row.error = f"exit code {row.job.returncode}, no fault_injected event (--keep: see output)"
    return True


def _common(row: Row, reference: dict[int, float] | None) -> float:
    """Fill what every case measures the same way; returns the fault time."""
    job = row.job
    fault = job.fault()
    t0 = fault["time"]
    done = job.first_iteration_after_fault()
    row.recovered_s = None if done is None else done["time"] - t0
    row.recomputed = job.relogged()
    row.step_s = job.step_s()
    if reference is not None:
        row.bit_exact = job.losses() == reference
    if job.returncode != 0:
        row.error = f"exit code {job.returncode}"
    return t0


def _repair_decision(row: Row, t0: float, expected: str) -> dict[str, Any] | None:
    """Detection time, lock step and a note when the controller chose another strategy than
    `expected` (ARF and UCE rows); returns the strategy event."""
    job = row.job
    row.detect_s = None if (e := job.first("fault_detected", t0)) is None else e["time"] - t0
    strategy = job.first("strategy", t0)
    if strategy is not None:
        row.resumed_from = f"lock {strategy.get('lock_step')}"
        if strategy.get("strategy") != expected:
            row.notes.append(f"strategy {strategy.get('strategy')}, not {expected}")
    return strategy


def arf_row(case: str, launcher: str, job: Job, rank: int,
            reference: dict[int, float] | None) -> Row:
    row = Row(case, launcher, job)
    if _no_fault(row):
        return row
    t0 = _common(row, reference)
    strategy = _repair_decision(row, t0, "recover")
    restarted = job.first("worker_restarted", t0)
    if restarted is not None and "spare" in launcher:
        if not restarted.get("spare"):
            row.notes.append("the warm spare was not used (not ready?): a cold restart")
    row.marks = [
        ("fault detected (first fault_detected)", _t(job.first("fault_detected", t0))),
        ("lost rank reported by its launcher", _t(job.first("fault_detected", t0, kind="lost"))),
        ("worker restarted by the launcher", _t(restarted)),
        ("strategy recover chosen", _t(strategy)),
        (f"restarted rank {rank} connects to the controller",
         job.ttp_first(rf"rank {rank} connects to controller", t0)),
        (f"restarted rank {rank} registered", job.ttp_first(rf"rank {rank} registered \(.*restarted", t0)),
        ("process groups rebuilt (last rank joined)",
         job.ttp_last(r"joined process-group generation", t0)),
        ("shard copied from its replica holder", _t(_last(job, "shard_received", t0))),
        ("rolled back to the lock step (repaired)", _t(job.first("repaired", t0))),
        ("first step after the fault completed", _t(job.first_iteration_after_fault())),
    ]
    return row


def uce_row(target: str, job: Job, reference: dict[int, float] | None) -> Row:
    row = Row(f"UCE {target}", "torchrun", job)
    if _no_fault(row):
        return row
    t0 = _common(row, reference)
    strategy = _repair_decision(row, t0, "retry")
    row.marks = [
        ("fault detected (first fault_detected)", _t(job.first("fault_detected", t0))),
        ("strategy retry chosen", _t(strategy)),
        ("process groups rebuilt (last rank joined)",
         job.ttp_last(r"joined process-group generation", t0)),
        ("shard copied from its replica holder", _t(_last(job, "shard_received", t0))),
        ("rolled back to the lock step (repaired)", _t(job.first("repaired", t0))),
        ("first step after the fault completed", _t(job.first_iteration_after_fault())),
    ]
    return row


def elastic_row(job: Job) -> tuple[Row, dict[str, Any]]:
    """Elastic training: the shrink (fault -> first step at the smaller size, including the
    1 s replacement wait), the grow when the late replacement registers (its registration
    -> first step at the launch size), and the step time before, between and after (from
    the logging rank's iteration events)."""
    row = Row("elastic (late replacement)", "tft-run, TFT_REPLACEMENT_WAIT=1", job)
    if _no_fault(row):
        return row, {}
    t0 = _common(row, None)  # not bit-exact: gradients summed over fewer ranks
    strategy = _repair_decision(row, t0, "recover")
    shrink = job.first("scale_in", t0)
    if shrink is None:
        row.notes.append("no scale_in event: the job did not shrink")
        return row, {}
    row.resumed_from = f"lock {shrink['step']}"
    row.notes.append(f"continued at DP {shrink['dp_size']} on ranks {shrink['ranks']}")
    row.marks = [
        ("fault detected (first fault_detected)", _t(job.first("fault_detected", t0))),
        ("strategy recover chosen", _t(strategy)),
        ("dump of the lock step saved (no replacement)", _t(job.first("dump_saved", t0))),
        ("smaller world rebuilt, dump reloaded (scale_in)", _t(shrink)),
        ("first step after the fault completed", _t(job.first_iteration_after_fault())),
    ]
    grow_start = job.first("scale_out_started", shrink["time"])
    grow = job.first("scale_out", shrink["time"])
    end_shrunk = grow_start["time"] if grow_start is not None else float("inf")
    times = [(e["iteration"], e["time"]) for e in job.named("iteration")]
    gaps = [(it, b, b - a) for (_, a), (it, b) in zip(times, times[1:], strict=False)]
    before = [g for it, _, g in gaps[2:] if it <= shrink["step"]]
    between = [g for it, t, g in gaps if it > shrink["step"] + 1 and t < end_shrunk]
    after = [g for it, t, g in gaps if grow is not None and it > grow["step"] + 1
             and t > grow["time"]]
    step_before, step_between, step_after = _median(before), _median(between), _median(after)
    figures = {"elastic_s": _round(row.recovered_s), "elastic_dp": shrink["dp_size"],
               "elastic_step_before_s": _round(step_before),
               "elastic_step_after_s": _round(step_between),
               "elastic_step_ratio": _round(_ratio(step_between, step_before), 3)}
    if grow is None or grow_start is None:
        row.notes.append("no scale_out: the replacement did not come back before the end")
        return row, figures
    first_after = next((e for e in job.named("iteration")
                        if e["time"] > grow["time"] and e["iteration"] > grow["step"]), None)
    row.notes.append(f"grew back to DP {grow['dp_size']} at lock {grow['step']}")
    row.marks += [
        ("replacement registered: scale-out begins", _t(grow_start)),
        ("larger world rebuilt, dump reloaded (scale_out)", _t(grow)),
        ("first step after the grow completed", _t(first_after)),
    ]
    figures.update({
        "elastic_grow_s": _round(first_after["time"] - grow_start["time"]
                                 if first_after is not None else None),
        "elastic_grow_dp": grow["dp_size"],
        "elastic_step_after_grow_s": _round(step_after),
        "elastic_step_grow_ratio": _round(_ratio(step_after, step_before), 3)})
    return row, figures


def baseline_row(launcher: str, job: Job, step: int) -> Row:
    row = Row("baseline (restart all)", launcher, job)
    if _no_fault(row):
        return row
    t0 = _common(row, None)
    lines = [(t, msg) for t, msg in job.torchrun_lines() if t >= t0]
    noticed = lines[0][0] if lines else None
    stopped = next((t for t, msg in lines if "failed (exitcode" in msg), None)
    row.detect_s = None if noticed is None else noticed - t0
    loaded = job.loaded_iterations()
    row.resumed_from = f"ckpt {loaded[-1]}" if loaded else "scratch"
    after_stop = stopped if stopped is not None else t0
    first_again = next((e for e in job.named("iteration") if e["time"] > after_stop), None)
    caught_up = next((e for e in job.named("iteration")
                      if e["time"] > after_stop and e["iteration"] == step), None)
    row.marks = [
        ("torchrun notices the dead worker, stops the others", noticed),
        ("all workers stopped (torchrun: failed (exitcode ...))", stopped),
        ("restarted job's first iteration (start, init, load ckpt, 1 step)", _t(first_again)),
        (f"recomputed up to step {step} again", _t(caught_up)),
        ("first step after the fault completed", _t(job.first_iteration_after_fault())),
    ]
    return row


def _last(job: Job, name: str, after: float) -> dict[str, Any] | None:
    found = [e for e in job.named(name) if e["time"] >= after]
    return found[-1] if found else None


def _shard_copy(job: Job) -> dict[str, Any] | None:
    """The `shard_received` event of the repair of `job`'s fault (None without either)."""
    fault = job.first("fault_injected")
    return None if fault is None else _last(job, "shard_received", fault["time"])


def _median_row(rows: list[Row]) -> Row | None:
    """The run whose recovery time is the median one (the lower middle of an even count)."""
    done = sorted((r for r in rows if r.recovered_s is not None), key=lambda r: r.recovered_s)
    return done[(len(done) - 1) // 2] if done else None


def _excess(rows: list[Row]) -> float | None:
    """The median over jobs of each job's recovery minus its own median step (the
    goals' margin: each repair beside the step of the job it happened in)."""
    return _median([r.recovered_s - r.step_s for r in rows
                    if r.recovered_s is not None and r.step_s == r.step_s])


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def print_table(rows: list[Row]) -> None:
    head = (f"{'case':<24} {'detect s':>8} {'recover s':>9} {'recomputed':>10} "
            f"{'resumed':>8} {'step s':>7} {'bit-exact':>9}  launcher")
    print(head)
    print("-" * (len(head) + 24))
    for r in rows:
        status = f"  FAILED ({r.error})" if r.error else ""
        print(f"{r.case:<24} {fmt_s(r.detect_s, 8)} {fmt_s(r.recovered_s, 9)} "
              f"{len(r.recomputed):>10} {r.resumed_from:>8} {r.step_s:7.3f} "
              f"{_yes_no(r.bit_exact):>9}  {r.launcher}{status}")
        for note in r.notes:
            print(f"{'':<24} note: {note}")


def _parse_sizes(parser: argparse.ArgumentParser, values: list[str] | None) -> list[Size]:
    """`--sizes tiny 512x1408 ...`: the preset, or HIDDENxFFN (other knobs as given)."""
    sizes = []
    for value in values or ["tiny"]:
        if value == "tiny":
            sizes.append(Size("tiny", {}))
            continue
        hidden, _, ffn = value.partition("x")
        if not (hidden.isdigit() and ffn.isdigit() and int(hidden) > 0 and int(ffn) > 0):
            parser.error(f"--sizes {value}: allowed: tiny or HIDDENxFFN, e.g. 512x1408")
        sizes.append(Size(value, {"TINY_HIDDEN_SIZE": hidden, "TINY_FFN_HIDDEN_SIZE": ffn}))
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30, help="iterations per job")
    parser.add_argument("--step", type=int, default=15, help="fault step k (updates done)")
    parser.add_argument("--save-interval", type=int, default=10, help="periodic checkpoint")
    parser.add_argument("--rank", type=int, default=1, help="rank killed (ARF, baseline)")
    parser.add_argument("--phase", default="forward", choices=("forward", "backward"),
                        help="phase of the kill")
    parser.add_argument("--uce-rank", type=int, default=2, help="rank of the UCE")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help="UCE targets, comma list (optimizer,param,grad,activation)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each ARF, baseline and UCE job (medians are reported)")
    parser.add_argument("--quick", action="store_true",
                        help="20 iterations, fault at step 8, save every 5, UCE optimizer only")
    parser.add_argument("--heartbeat", type=float, default=None,
                        help="TTP_HEARTBEAT_INTERVAL (s) of the HA jobs (default: unset, 2 s)")
    parser.add_argument("--baseline-rdzv", default="c10d", choices=("c10d", "static"),
                        help="baseline torchrun rendezvous (static fails to restart gloo "
                        "jobs on torch 2.13)")
    add_size_arguments(parser)
    parser.add_argument("--sizes", nargs="+", default=None, metavar="SIZE",
                        help="model sizes of a scaling table: tiny (the preset) or "
                        "HIDDENxFFN, e.g. --sizes tiny 512x1408 1024x2816 (default: tiny, "
                        "i.e. the knobs above alone)")
    parser.add_argument("--no-elastic", action="store_true",
                        help="skip the elastic job (it runs --iters + 40 iterations at 1.5x "
                        "the global batch: long at the largest sizes)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument("--keep", type=Path, default=None, help="keep run dirs here")
    add_host_argument(parser)
    opts = parser.parse_args(argv)
    host = parse_host(parser, opts.host)
    if opts.quick:
        opts.iters, opts.step, opts.save_interval, opts.targets = 20, 8, 5, "optimizer"
    targets = [t for t in opts.targets.split(",") if t]
    if not 0 < opts.step < opts.iters - 1:
        parser.error("--step must be between 1 and --iters - 2")
    if bad := [t for t in targets if t not in TARGETS]:
        parser.error(f"unknown UCE targets {bad}")
    sizes = _parse_sizes(parser, opts.sizes)
    if len(sizes) > 1 and (opts.hidden is not None or opts.ffn is not None):
        parser.error("--sizes sets hidden and ffn per size: drop --hidden/--ffn")

    work = opts.keep or Path(tempfile.mkdtemp(prefix="tft-bench-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        host = prepare_host(host, work)
        for size in sizes:
            size_work = work / size.name if len(sizes) > 1 else work
            size_work.mkdir(parents=True, exist_ok=True)
            results.append(measure_size(opts, host, size, size_work, targets))
    finally:
        if opts.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if len(results) > 1:
        print_scaling(results)
    goals = {name: all(r["goals_met"][name] for r in results) for name in results[0]["goals_met"]}
    print(json.dumps({
        "sizes": results,
        "goals_met": goals,
        "fault": {"rank": opts.rank, "step": opts.step, "phase": opts.phase},
        "repeats": opts.repeats,
        "host": host.name,
        "precision": opts.precision or "bf16",
    }))
    return 0 if all(r["complete"] for r in results) else 1


@dataclass
class Size:
    """One model size of the run: its name and the preset variables it sets."""

    name: str
    env: dict[str, str]


def _knob(env: dict[str, str], option: str) -> int:
    variable, default = SIZE_KNOBS[option]
    return int(env.get(variable, default))


def _params_m(env: dict[str, str]) -> float:
    """Parameters (millions) of the preset at these knobs: untied embeddings and output
    layer (vocab 4096), per layer attention (4 h^2), SwiGLU MLP (3 h f) and two norms, the
    final norm."""
    layers, hidden, ffn = _knob(env, "layers"), _knob(env, "hidden"), _knob(env, "ffn")
    total = 2 * VOCAB * hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn
                                            + 2 * hidden) + hidden
    return total / 1e6


def measure_size(opts: argparse.Namespace, host: Any, size: Size, work: Path,
                 targets: list[str]) -> dict[str, Any]:
    """Every job of one model size, the machine's limits beside them; prints the tables of
    this size and returns its figures (one entry of the JSON line's "sizes")."""
    sizes = {**size_env(opts), **size.env}  # every job, the baseline's included
    ha_env = {**sizes} if opts.heartbeat is None else {
        **sizes, "TTP_HEARTBEAT_INTERVAL": str(opts.heartbeat)}
    kill = f"kill:rank={opts.rank},step={opts.step},phase={opts.phase}"
    base = {"train_iters": opts.iters, "save_interval": opts.save_interval}

    def run(spec: JobSpec) -> Job:
        job = run_spec(spec, work, opts.timeout, host)
        print(f"[recovery] {size.name} {spec.name}: exit {job.returncode} in "
              f"{job.seconds:.0f}s", file=sys.stderr, flush=True)
        if opts.keep is None:
            shutil.rmtree(job.run_dir / "ckpt", ignore_errors=True)
        return job

    paired: dict[str, float | None] = {}  # job name -> the limit measured right after it

    def run_paired(spec: JobSpec) -> Job:
        job = run(spec)
        paired[job.name] = measure_send(job, work, opts.timeout)
        return job

    ref = run(JobSpec("reference", ha_args=REFERENCE_ARGS, env=ha_env, **base))
    if ref.returncode != 0:
        raise RuntimeError(f"the fault-free reference job failed\n{ref.describe()}")
    reference = ref.losses()
    spare_rows, cold_rows, base_rows = [], [], []
    for i in range(opts.repeats):
        spare_rows.append(arf_row(
            "ARF warm spare", SPARE_LAUNCHER,
            run_paired(JobSpec(f"arf_spare{i}", ha_args=ARF_ARGS, launcher=SPARE_LAUNCHER,
                               inject=kill, env=ha_env, **base)), opts.rank, reference))
        cold_rows.append(arf_row(
            "ARF cold restart", "tft-run",
            run(JobSpec(f"arf_cold{i}", ha_args=ARF_ARGS, launcher="tft-run",
                        inject=kill, env=ha_env, **base)), opts.rank, reference))
        if opts.baseline_rdzv == "c10d":
            launcher = (f"{sys.executable} -m torch.distributed.run --max-restarts 1 "
                        f"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{free_port()}")
            env = {**sizes, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            shown = "torchrun --max-restarts 1 (c10d rdzv)"
        else:
            launcher = f"{sys.executable} -m torch.distributed.run --max-restarts 1"
            env, shown = {**sizes}, "torchrun --max-restarts 1"
        base_rows.append(baseline_row(shown, run(JobSpec(
            f"baseline{i}", launcher=launcher, inject=kill, load=True, env=env, **base)),
            opts.step))
    uce_runs = {t: [uce_row(t, run_paired(JobSpec(
        f"uce_{t}{i}", ha_args=UCE_ARGS, env=ha_env, **base,
        inject=f"uce:rank={opts.uce_rank},step={opts.step},phase=backward,target={t}")),
        reference) for i in range(opts.repeats)] for t in targets}
    uce_rows = [r for runs in uce_runs.values() for r in runs]
    # per target the median of its runs; the goal holds the slowest target to it
    uce_by_target = {t: _median([r.recovered_s for r in runs]) for t, runs in uce_runs.items()}
    elastic, elastic_figures = (None, {}) if opts.no_elastic else elastic_row(run(JobSpec(
        "elastic", ha_args=ELASTIC_ARGS, launcher="tft-run", inject=kill,
        env={**ha_env, **ELASTIC_ENV},
        **{**base, "train_iters": base["train_iters"] + ELASTIC_EXTRA_ITERS})))
    moved = _state_moved([*spare_rows, *uce_rows], paired)
    limits = measure_limits(moved, work, opts.timeout) if moved else None

    rows = [*spare_rows, *cold_rows, *base_rows, *uce_rows, *([elastic] if elastic else [])]
    print(f"size {size.name} ({_params_m(sizes):.1f} M parameters); host: {host.name}"
          + (f" ({host.megatron_lm})" if host.megatron_lm else "")
          + f"; fault: {kill} (UCE: rank {opts.uce_rank}, phase backward); {opts.iters} "
          f"iterations, periodic checkpoint every {opts.save_interval}; fault-free step "
          f"{ref.step_s():.3f} s (reference job)")
    print_table(rows)
    print()
    for title, group in (("ARF warm spare", spare_rows), ("ARF cold restart", cold_rows),
                         ("baseline", base_rows)):
        r = group[0]
        if not r.marks:
            continue
        print_breakdown(f"where the time goes, {title} (s since the fault, +delta):",
                        r.job.fault()["time"], r.marks)
    if elastic is not None and elastic.marks:
        print_breakdown("where the time goes, elastic shrink and grow (s since the fault, "
                        "+delta):", elastic.job.fault()["time"], elastic.marks)
        ratio_text = _fmt(elastic_figures.get("elastic_step_ratio"))
        print(f"    step {_fmt(elastic_figures.get('elastic_step_before_s'))} s at DP 4, "
              f"{_fmt(elastic_figures.get('elastic_step_after_s'))} s at DP "
              f"{elastic_figures.get('elastic_dp')} (after/before {ratio_text}; the same global "
              "batch on fewer ranks: d/(d-1) where each rank has its own core)")
        if "elastic_grow_s" in elastic_figures:
            print(f"    grown back to DP {elastic_figures['elastic_grow_dp']}: step "
                  f"{_fmt(elastic_figures.get('elastic_step_after_grow_s'))} s (after/before "
                  f"{_fmt(elastic_figures.get('elastic_step_grow_ratio'))}); registration -> "
                  f"first step at DP {elastic_figures['elastic_grow_dp']}: "
                  f"{_fmt(elastic_figures['elastic_grow_s'])} s")
    worst_target = max((t for t, v in uce_by_target.items() if v is not None),
                       key=lambda t: uce_by_target[t] or 0.0, default=None)
    worst_uce = None if worst_target is None else _median_row(uce_runs[worst_target])
    if worst_uce is not None:
        print_breakdown(f"where the time goes, {worst_uce.case} (slowest UCE target):",
                        worst_uce.job.fault()["time"], worst_uce.marks)
    print()

    arf_s = _median([r.recovered_s for r in spare_rows])
    arf_cold_s = _median([r.recovered_s for r in cold_rows])
    baseline_s = _median([r.recovered_s for r in base_rows])
    ratio = None if arf_s is None or not baseline_s else arf_s / baseline_s
    arf_lost = max(len(r.recomputed) for r in [*spare_rows, *cold_rows])
    baseline_lost = max(len(r.recomputed) for r in base_rows)
    uce_s = None if worst_target is None else uce_by_target[worst_target]
    uce_step_s = [s for r in uce_rows for s in r.job.step_times_s()]
    step_s = statistics.median(uce_step_s) if uce_step_s else ref.step_s()
    # ARF is held to its own jobs' step: steps differ by 10-25 % from job to job here
    arf_step_times = [s for r in spare_rows for s in r.job.step_times_s()]
    arf_step_s = statistics.median(arf_step_times) if arf_step_times else step_s
    # the goals compare each job's recovery with its own step, paired (job medians spread
    # by 10-25 % here: a fast job's steps against a slow job's recovery says nothing)
    arf_excess_s = _excess(spare_rows)
    uce_excess = {t: _excess(runs) for t, runs in uce_runs.items()}
    uce_excess_s = max((v for v in uce_excess.values() if v is not None), default=None)
    bit_exact = all(r.bit_exact for r in [*spare_rows, *cold_rows, *uce_rows])
    cost = _repair_cost(moved, limits)
    print(f"bit-exact: {'yes' if bit_exact else 'no'} (losses of every ARF and UCE job vs the "
          "fault-free reference)")
    print_cost(cost)
    goals = {
        "ratio": ratio is not None and ratio <= GOAL_RATIO,
        "arf_lost_iterations": arf_lost == 0,
        "arf_s": arf_excess_s is not None and arf_excess_s <= GOAL_ARF_MARGIN_S,
        "uce_s": uce_excess_s is not None and uce_excess_s <= GOAL_UCE_MARGIN_S,
        "bit_exact": bit_exact,
        "efficiency": all(v is not None and v >= GOAL_EFFICIENCY
                          for k, v in cost.items() if k.endswith("_efficiency")),
    }
    print(f"goal ratio <= {GOAL_RATIO}: {_fmt(ratio)} {_met(goals['ratio'])}; "
          f"goal arf_lost_iterations == 0: {arf_lost} {_met(goals['arf_lost_iterations'])}; "
          f"goal ARF <= its job's step + {GOAL_ARF_MARGIN_S:g}: median excess "
          f"{_fmt(arf_excess_s)} {_met(goals['arf_s'])} (pooled: arf_s {_fmt(arf_s)}, "
          f"arf_step_s + {GOAL_ARF_MARGIN_S:g} {arf_step_s + GOAL_ARF_MARGIN_S:.3f}); "
          f"goal UCE <= its job's step + {GOAL_UCE_MARGIN_S:g}: median excess "
          f"{_fmt(uce_excess_s)} {_met(goals['uce_s'])} (pooled: uce_s {_fmt(uce_s)}, "
          f"step_s + {GOAL_UCE_MARGIN_S:g} {step_s + GOAL_UCE_MARGIN_S:.3f}); "
          f"goal efficiency >= {GOAL_EFFICIENCY:g} {_met(goals['efficiency'])}")
    for r in rows:
        if r.error:
            print(f"{r.case} FAILED ({r.error}); its output:\n{r.job.describe(30)}")
    print()
    return {
        "size": size.name,
        "params_m": round(_params_m(sizes), 2),
        "arf_s": _round(arf_s),
        "arf_cold_s": _round(arf_cold_s),
        "baseline_s": _round(baseline_s),
        "ratio": _round(ratio, 4),
        "arf_lost_iterations": arf_lost,
        "baseline_lost_iterations": baseline_lost,
        "detect_s": _round(_median([r.detect_s for r in spare_rows])),
        "uce_s": _round(uce_s),
        "step_s": _round(step_s),
        "arf_step_s": _round(arf_step_s),
        "arf_excess_s": _round(arf_excess_s),
        "uce_excess_s": _round(uce_excess_s),
        "arf_cold_lost_iterations": max(len(r.recomputed) for r in cold_rows),
        "arf_cold_detect_s": _round(_median([r.detect_s for r in cold_rows])),
        "baseline_detect_s": _round(_median([r.detect_s for r in base_rows])),
        "uce": {t: _round(v) for t, v in uce_by_target.items()},
        "uce_lost_iterations": max((len(r.recomputed) for r in uce_rows), default=0),
        "bit_exact": bit_exact,
        **elastic_figures,
        **cost,
        "goals_met": goals,
        "knobs": {option: getattr(opts, option) for option in SIZE_KNOBS
                  if getattr(opts, option) is not None} | {
            k: int(v) for k, v in size.env.items()},
        "complete": not any(r.error for r in rows),
    }


LIMITS_WORKER = Path(__file__).resolve().parent / "_limits.py"
#: runs of each limit after its warm-up (medians): one send of the tiny shard's 4.2 MiB took
#: 1.1 to 2.9 ms here from one run of 3 to the next
LIMIT_REPEATS = 9
#: the jobs' layout (scripts/pretrain_tiny_cpu.sh): DP 4, 2 replicas, chunks of d / N ranks
WORLD, REPLICAS = 4, 2


def _state_moved(rows: list[Row],
                 paired: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Per repair case (ARF, UCE): bytes the shard copy moved, its two ranks and its time
    on the receiver (`shard_received`: from the moment both holders were in the copy), each
    job's copy beside the limit measured right after that job (`paired`, by job name), the
    rollback's time (`rolled_back` seconds summed, on the rank that entered it last: the
    rollback is collective, so the other ranks' extra time is waiting for that one to
    arrive, which the breakdown's marks count), the bytes its param all-gather moves, and
    the first step's time after the repair. With `--repeats`, the median job's copy and
    the median job's rollback."""
    cases: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.error or row.job.first("fault_injected") is None:
            continue
        t0 = row.job.fault()["time"]
        received = _shard_copy(row.job)
        rolled = [e for e in row.job.named("rolled_back") if e["time"] >= t0]
        repaired = row.job.first("repaired", t0)
        done = row.job.first_iteration_after_fault()
        if received is None or not rolled or repaired is None:
            continue
        key = "arf" if row.case.startswith("ARF") else "uce"
        cases.setdefault(key, []).append({
            "bytes": received["bytes"], "copy_s": received["seconds"],
            "shard_bytes": received["bytes"] - received.get("param_bytes", 0),
            "src": received["source"], "dst": received["rank"],
            "rollback_s": min(sum(e["seconds"].values()) for e in rolled),
            "rollback_parts": min((e["seconds"] for e in rolled),
                                  key=lambda parts: sum(parts.values())),
            "param_bytes": rolled[0]["param_bytes"],
            "params_gathered": any(e.get("params_gathered", True) for e in rolled),
            "first_step_s": None if done is None else done["time"] - repaired["time"],
            "paired": [received["seconds"], paired.get(row.job.name)],
        })
    moved = {}
    for key, entries in cases.items():
        copy = sorted(entries, key=lambda e: e["copy_s"])[len(entries) // 2]
        back = sorted(entries, key=lambda e: e["rollback_s"])[len(entries) // 2]
        moved[key] = {**back, **{k: copy[k]
                                 for k in ("bytes", "shard_bytes", "copy_s", "src", "dst")},
                      "paired": [e["paired"] for e in entries]}
    return moved


def measure_limits(moved: dict[str, dict[str, Any]], work: Path,
                   timeout: float) -> dict[str, float]:
    """This machine's limits for the same bytes, on the same backend and number of ranks
    (bench/_limits.py under torchrun)."""
    case = moved.get("arf") or next(iter(moved.values()))
    chunk = WORLD // REPLICAS
    spec = {"sends": {name: {k: m[k] for k in ("bytes", "src", "dst")}
                      for name, m in moved.items()},
            "copy_bytes": case["bytes"], "copy_rank": case["dst"],
            "gather_bytes": case["param_bytes"],
            "gather_groups": [list(range(i, i + chunk)) for i in range(0, WORLD, chunk)],
            "repeats": LIMIT_REPEATS}
    return {**_run_limits(spec, work / "limits", timeout), "bytes": case["bytes"],
            "param_bytes": case["param_bytes"]}


def measure_send(job: Job, work: Path, timeout: float) -> float | None:
    """The limit of `job`'s shard copy, measured right after the job: one send of the same
    bytes between the same two ranks (None when no copy followed its fault). The machine's
    loopback rate drifts by up to 2x over minutes here, so each copy is held to a limit of
    its own moment rather than to one measured after every job of its size."""
    copy = _shard_copy(job)
    if copy is None:
        return None
    spec = {"sends": {"copy": {"bytes": copy["bytes"], "src": copy["source"],
                               "dst": copy["rank"]}}, "repeats": LIMIT_REPEATS}
    return _run_limits(spec, work / f"{job.name}_limit", timeout)["p2p_s"]["copy"]


def _run_limits(spec: dict[str, Any], run_dir: Path, timeout: float) -> dict[str, Any]:
    out = run_job(torchrun_cmd(WORLD, LIMITS_WORKER, [json.dumps(spec)]),
                  bench_env(run_dir), timeout, run_dir / "output.log")
    lines = [line for line in out.output.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the limits job failed (exit {out.returncode}):\n"
                           f"{tail(out.output)}")
    return json.loads(lines[-1])


def _repair_cost(moved: dict[str, dict[str, Any]],
                 limits: dict[str, float] | None) -> dict[str, Any]:
    """Shard copy and rollback of each case beside the limits: efficiency = limit / measured
    (for the rollback, measured = its `params` part: the part that moves the state).
    Shard copy's limit: one torch.distributed send of the same bytes (the shard, and the
    model params where they travelled with it to a new process), between the same two ranks
    as that case's copy, measured right after each job (`measure_send`); its efficiency is
    the median over jobs of each job's limit / its copy, paired as the recovery margins are
    (the pooled figure, the median copy against the send measured after every job of the
    size, is reported beside it: `copy_pooled_efficiency`). Rollback's: a plain
    copy of the main params' bytes (a third of the shard: main param, exp_avg, exp_avg_sq)
    into the model params plus their gather in each chunk (the faster of an all-gather and
    point-to-point exchanges of the same shards), where the rollback moved the params.
    After a fault that left every rank's params those of the lock step it moves nothing
    (no copy, no gather: `params_gathered` false) and has no efficiency."""
    cost: dict[str, Any] = {}
    if limits is not None:
        cost["limits"] = limits
    for case, m in moved.items():
        pairs = [(copy, limit) for copy, limit in m["paired"] if copy and limit is not None]
        pooled_limit = None if limits is None else limits["p2p_s"][case]
        rollback_limit = None if limits is None or not m["params_gathered"] else (
            limits["copy_s"] * (m["shard_bytes"] / 3) / limits["bytes"] + limits["gather_s"])
        cost[case] = {
            "state_bytes": m["bytes"], "sent_param_bytes": m["bytes"] - m["shard_bytes"],
            "copy_s": m["copy_s"],
            "copy_limit_s": _round(_median([limit for _, limit in pairs]), 5),
            "copy_paired": [[round(copy, 5), round(limit, 5)] for copy, limit in pairs],
            "copy_pooled_limit_s": _round(pooled_limit, 5),
            "copy_pooled_efficiency": _ratio(pooled_limit, m["copy_s"]),
            "rollback_s": round(m["rollback_s"], 4), "rollback_parts": m["rollback_parts"],
            "rollback_limit_s": _round(rollback_limit, 4),
            "params_gathered": m["params_gathered"],
            "first_step_s": _round(m["first_step_s"]),
        }
        cost[f"{case}_copy_efficiency"] = _round(_median([limit / copy
                                                          for copy, limit in pairs]))
        # the rollback's state part (params); scheduler, RNG and data iterator are a fixed
        # fraction of a millisecond at every size, shown in rollback_parts
        if m["params_gathered"]:
            cost[f"{case}_rollback_efficiency"] = _ratio(rollback_limit,
                                                         m["rollback_parts"].get("params"))
    return cost


def _ratio(limit: float | None, measured: float | None) -> float | None:
    if limit is None or not measured:
        return None
    return round(limit / measured, 3)


def print_cost(cost: dict[str, Any]) -> None:
    limits = cost.get("limits")
    if limits is not None:
        sends = ", ".join(f"{case.upper()} {cost[case]['state_bytes'] / 2**20:.1f} MiB {s:.4f} s"
                          for case, s in limits["p2p_s"].items())
        print(f"limits on this machine (bench/_limits.py, same ranks and backend): send "
              f"({sends}), plain copy of {limits['bytes'] / 2**20:.1f} MiB "
              f"{limits['copy_s']:.4f} s, param gather of {limits['param_bytes'] / 2**20:.1f}"
              f" MiB in each chunk {limits['gather_s']:.4f} s (all-gather "
              f"{limits.get('all_gather_s', float('nan')):.4f} s, point-to-point exchange "
              f"{limits.get('exchange_s', float('nan')):.4f} s)")
    for case in ("arf", "uce"):
        c = cost.get(case)
        if c is None:
            continue
        parts = ", ".join(f"{k} {v:.3f}" for k, v in c["rollback_parts"].items())
        with_params = (f" (of it {c['sent_param_bytes'] / 2**20:.1f} MiB model params)"
                       if c["sent_param_bytes"] else "")
        pairs = ", ".join(f"{copy:.4f}/{limit:.4f}" for copy, limit in c["copy_paired"])
        print(f"{case.upper()}: shard copy {c['state_bytes'] / 2**20:.1f} MiB{with_params} in "
              f"{c['copy_s']:.4f} s (each job's copy/limit measured right after it: {pairs}; "
              f"efficiency {_fmt(cost[f'{case}_copy_efficiency'])}, the median of theirs; "
              f"pooled: limit {_fmt(c['copy_pooled_limit_s'])}, efficiency "
              f"{_fmt(c['copy_pooled_efficiency'])}); rollback {c['rollback_s']:.4f} s "
              f"({parts}; " + (f"params gathered; limit {_fmt(c['rollback_limit_s'])}, "
                               f"efficiency {_fmt(cost[f'{case}_rollback_efficiency'])}"
                               if c["params_gathered"] else "no params moved: no rank needed "
                               "them") + f"); first step after it {_fmt(c['first_step_s'])} s")


def print_scaling(results: list[dict[str, Any]]) -> None:
    """One row per size: what grows with the state and what the machine allows for it."""
    head = (f"{'size':>10} {'params M':>8} {'step s':>7} {'MiB':>7} {'copy s':>7} "
            f"{'limit':>7} {'eff':>5} {'rollbk s':>8} {'limit':>7} {'eff':>5} "
            f"{'1st step':>8} {'ARF s':>6} {'+step':>6} {'UCE s':>6} {'+step':>6} {'ratio':>6}")
    print("scaling (ARF with a warm spare; copy and rollback of the ARF repair; UCE optimizer; "
          f"+step: recovery minus its job's step, goals {GOAL_ARF_MARGIN_S:g} and "
          f"{GOAL_UCE_MARGIN_S:g})")
    print(head)
    print("-" * len(head))
    for r in results:
        a = r.get("arf") or {}
        print(f"{r['size']:>10} {r['params_m']:8.2f} {r['step_s']:7.3f} "
              f"{a.get('state_bytes', 0) / 2**20:7.1f} {_fmt(a.get('copy_s')):>7} "
              f"{_fmt(a.get('copy_limit_s')):>7} {_fmt(r.get('arf_copy_efficiency')):>5} "
              f"{_fmt(a.get('rollback_s')):>8} {_fmt(a.get('rollback_limit_s')):>7} "
              f"{_fmt(r.get('arf_rollback_efficiency')):>5} {_fmt(a.get('first_step_s')):>8} "
              f"{_fmt(r['arf_s']):>6} {_fmt(r.get('arf_excess_s')):>6} "
              f"{_fmt(r['uce_s']):>6} {_fmt(r.get('uce_excess_s')):>6} "
              f"{_fmt(r['ratio']):>6}")
    print()


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _met(ok: bool) -> str:
    return "(met)" if ok else "(NOT met)"


if __name__ == "__main__":
    sys.exit(main())
