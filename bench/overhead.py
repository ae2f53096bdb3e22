"""Step-time overhead of optimizer replicas: high availability on (N = 2) vs off.

What it measures: the median training step time of the same 4-rank CPU job (torchrun, gloo;
DP = 4, TP = PP = 1, distributed optimizer, bf16, mock data) with high availability off
(megatron-core's native distributed optimizer) and on (`--enable-high-availability`, N = 2
optimizer replicas: reduce-scatter inside each chunk of d/N ranks plus an all-reduce across
the N chunks, and an optimizer shard twice as large; the "on" jobs also run the rest of the
plugin that flag switches on: controller, processors, interruptible collectives, step
snapshots). `--ha-args="--enable-high-availability --distributed-optimizer-no-replica"`
measures that rest alone (N = 1).

How: it runs `scripts/pretrain_tiny_cpu.sh` (the tiny Llama-shaped preset; `--hidden` etc.
make it bigger) as complete jobs, alternating the two modes in one run, in ABBA order
(off, on, on, off, off, on, ...) so that slow drifts of a shared machine hit both modes
alike. Each job trains `--iters` iterations with `--log-interval 1`; the per-iteration
times are the trainer's own "elapsed time per iteration (ms)" (perf_counter around
`train_step`), the first `--warmup` of each job are dropped, and the median over all kept
iterations of a mode is its step time. The gaps between consecutive `iteration` events of the
events file (SPEC 11) give a cross-check. OMP_NUM_THREADS=1.

`--host megatron-lm DIR` measures the same inside Megatron-LM's own training loop: the
unchanged `pretrain_gpt.py` of the clone DIR (core_v0.12.1; copied once into the work dir)
through `scripts/pretrain_megatron_lm_cpu.sh`, same preset and flags; "off" is Megatron-LM
without the plugin's flags (still started through the adaptor, `python -m
mindspeed_tft.megatron`, which is what lets Megatron-LM run on CPU; with the flags off the
plugin stays off, as in the reference host's "off" jobs, and only the `iteration` events are
written), "on" adds `--ha-args`. The per-iteration times are Megatron-LM's own "elapsed time per iteration"
(`--log-interval 1`).

Output: a table, then as the last line one JSON object
`{"step_ms_off": ..., "step_ms_on": ..., "ratio": ..., "host": ...}` (ratio = on / off).

    python bench/overhead.py             # 6 rounds x 2 jobs x 40 iterations, ~4 min
    python bench/overhead.py --quick     # 2 rounds x 2 jobs x 25 iterations
    python bench/overhead.py --profile   # the same, plus where the time of a step goes
    python bench/overhead.py --quick --host megatron-lm ../shared/megatron-lm
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _jobs import (  # noqa: E402
    REPO,
    SIZE_KNOBS,
    Host,
    add_host_argument,
    add_size_arguments,
    bench_env,
    free_port,
    parse_host,
    prepare_host,
    run_job,
    size_env,
    tail,
)

from mindspeed_tft.events import read_events_if_any  # noqa: E402

PROFILE_LAUNCHER = REPO / "bench" / "_profile_launch.py"
#: Components timed by `--profile` (see bench/_profile_worker.py), in display order.
COMPONENTS = (
    "iteration", "train_step", "plugin_hooks", "forward_backward", "grad_sync", "optimizer_step", "prepare_grads",
    "grad_norm", "clip", "count_zeros", "local_update", "adam", "param_gather",
)
#: CPU time of the rank's threads by group (bench/_profile_worker.py), summed over a group's
#: threads: the main thread (the trainer), the control plane, gloo, the rest.
THREAD_GROUPS = ("threads_main", "threads_control", "threads_gloo", "threads_other")
ITER_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
)
MODES = ("off", "on")


@dataclass
class JobTimes:
    mode: str
    round: int
    step_ms: dict[int, float] = field(default_factory=dict)  # iteration -> ms (log)
    event_ms: dict[int, float] = field(default_factory=dict)  # iteration -> ms (event gaps)
    losses: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    #: --profile: per rank, per iteration (1-based), component -> [wall ms, cpu ms]
    profile: list[list[dict[str, list[float]]]] = field(default_factory=list)


def job_env(mode: str, run_dir: Path, opts: argparse.Namespace, host: Host) -> dict[str, str]:
    ha_args = opts.ha_args if mode == "on" else " "  # a blank value turns the default off
    launcher = (
        f"{sys.executable} {PROFILE_LAUNCHER}" if opts.profile
        else f"{sys.executable} -m torch.distributed.run"
    )
    env = bench_env(
        run_dir / "ttp_logs",
        NPROC=str(opts.nproc),
        TRAIN_ITERS=str(opts.iters),
        SAVE_INTERVAL=str(opts.iters + 1000),  # no periodic save inside the timed loop
        GBS=str(opts.gbs),
        RUN_DIR=str(run_dir),
        CKPT_DIR=str(run_dir / "ckpt"),
        EVENTS=str(run_dir / "events.jsonl"),
        HA_ARGS=ha_args,
        LAUNCHER=launcher,
        **host.job_env(launcher),
        BENCH_PROFILE_OUT=str(run_dir / "profile"),
        MASTER_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
    )
    env.update(size_env(opts))
    return env


def run_one(mode: str, rnd: int, opts: argparse.Namespace, work: Path, host: Host) -> JobTimes:
    run_dir = work / f"r{rnd}_{mode}"
    cmd = ["bash", str(host.script), *host.script_args, *opts.extra]
    job = run_job(cmd, job_env(mode, run_dir, opts, host), opts.timeout,
                  run_dir / "output.log")
    if job.returncode != 0:
        raise RuntimeError(
            f"round {rnd} mode {mode}: job exited {job.returncode}; output tail:\n"
            f"{tail(job.output)}"
        )
    times = JobTimes(mode, rnd, seconds=job.seconds)
    for match in ITER_LINE.finditer(job.output):
        times.step_ms[int(match.group(1))] = float(match.group(2))
    events = read_events_if_any(run_dir / "events.jsonl")
    if events:
        stamps = {e["iteration"]: e["time"] for e in events if e.get("event") == "iteration"}
        times.losses = {
            e["iteration"]: e["loss"] for e in events if e.get("event") == "iteration"
        }
        for it, stamp in stamps.items():
            if it - 1 in stamps:
                times.event_ms[it] = (stamp - stamps[it - 1]) * 1000.0
    if len(times.step_ms) < opts.iters:
        raise RuntimeError(
            f"round {rnd} mode {mode}: found {len(times.step_ms)}/{opts.iters} iteration log "
            f"lines; output tail:\n{tail(job.output)}"
        )
    if opts.profile:
        files = sorted((run_dir / "profile").glob("rank*.json"),
                       key=lambda p: int(p.stem[len("rank"):]))
        times.profile = [json.loads(p.read_text()) for p in files]
    if opts.keep is None:
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    return times


def profile_table(jobs: list[JobTimes], opts: argparse.Namespace) -> dict[str, Any]:
    """Per-iteration ms of each component and mode, averaged over ranks first: the median
    over kept iterations for COMPONENTS, the mean for THREAD_GROUPS (CPU time that comes in
    bursts, such as the control plane's heartbeats, costs its mean, which a median hides)."""
    table: dict[str, Any] = {}
    for mode in MODES:
        per_component: dict[str, list[tuple[float, float]]] = {
            c: [] for c in (*COMPONENTS, *THREAD_GROUPS)}
        for job in (j for j in jobs if j.mode == mode):
            if not job.profile:
                continue
            iterations = min(len(r) for r in job.profile)
            for it in range(opts.warmup, iterations):
                for comp in per_component:
                    walls = [r[it].get(comp, [0.0, 0.0])[0] for r in job.profile]
                    cpus = [r[it].get(comp, [0.0, 0.0])[1] for r in job.profile]
                    per_component[comp].append(
                        (statistics.fmean(walls), statistics.fmean(cpus))
                    )
        table[mode] = {}
        for comp, vals in per_component.items():
            average = statistics.fmean if comp in THREAD_GROUPS else statistics.median
            table[mode][comp] = (
                average(w for w, _ in vals) if vals else float("nan"),
                average(c for _, c in vals) if vals else float("nan"),
            )
    return table


def print_profile(table: dict[str, Any]) -> None:
    print("per-iteration component times, ms (median over kept iterations of the mean over"
          " ranks; wall / process CPU)")
    head = (f"{'component':>16} | {'off wall':>8} {'on wall':>8} {'delta':>7} | "
            f"{'off cpu':>8} {'on cpu':>8} {'delta':>7}")
    print(head)
    print("-" * len(head))
    for comp in COMPONENTS:
        (ow, oc), (nw, nc) = table["off"][comp], table["on"][comp]
        print(f"{comp:>16} | {ow:8.2f} {nw:8.2f} {nw - ow:+7.2f} | "
              f"{oc:8.2f} {nc:8.2f} {nc - oc:+7.2f}")
    print("CPU time by thread, ms per iteration (mean over kept iterations of the mean over "
          "ranks)")
    print(f"{'threads':>16} | {'off':>8} {'on':>8} {'delta':>7}")
    for group in THREAD_GROUPS:
        off, on = table["off"][group][1], table["on"][group][1]
        print(f"{group[len('threads_'):]:>16} | {off:8.2f} {on:8.2f} {on - off:+7.2f}")


#: HA's extra step time, by cause (on - off wall time of the components, ms per step):
#: the replicas' redundant optimizer update is inherent (N times the elements per rank);
#: the rest is what the plugin adds and must stay <= GOAL_REST_FRACTION of the step.
ATTRIBUTION = (
    ("replica update (Adam on N/d of the params instead of 1/d): inherent", ("adam",)),
    ("rest of the local update (main -> model param copy of the larger shard)",
     ("local_update", "-adam")),
    ("grad reduction (gloo: all-reduce standing in for reduce-scatter, + across replicas)",
     ("grad_sync",)),
    ("param all-gather inside the chunk", ("param_gather",)),
    ("grad norm, clipping, zero count", ("grad_norm", "clip", "prepare_grads", "count_zeros")),
    ("plugin hooks (update bracket, step snapshots, processor reports)", ("plugin_hooks",)),
    ("everything else in the loop (forward/backward compute, logging, events)",
     ("iteration", "-local_update", "-grad_sync", "-param_gather", "-grad_norm",
      "-clip", "-prepare_grads", "-count_zeros", "-plugin_hooks")),
)
GOAL_RATIO, GOAL_RATIO_UPPER, GOAL_REST_FRACTION = 1.03, 1.05, 0.01


def attribution(table: dict[str, Any]) -> list[dict[str, Any]]:
    """The on - off wall time of each cause of ATTRIBUTION, in ms and as a fraction of the
    off iteration; the rows add up to the iteration's delta. Components nest: local_update
    holds adam, forward_backward holds grad_sync, optimizer_step holds local_update,
    param_gather, grad_norm, clip, count_zeros and prepare_grads; a "-" term is subtracted, and each
    component is subtracted from "iteration" once, at its outermost level."""
    off_iteration = table["off"]["iteration"][0]
    rows = []
    for name, terms in ATTRIBUTION:
        delta = 0.0
        for term in terms:
            sign, comp = (-1.0, term[1:]) if term.startswith("-") else (1.0, term)
            delta += sign * (table["on"][comp][0] - table["off"][comp][0])
        rows.append({"cause": name, "ms": round(delta, 3),
                     "fraction": round(delta / off_iteration, 4),
                     "inherent": name.endswith("inherent")})
    return rows


def print_attribution(rows: list[dict[str, Any]]) -> None:
    print("HA's extra time per step, by cause (on - off, ms and % of the HA-off iteration)")
    for r in rows:
        print(f"  {r['ms']:+8.2f} ms {100 * r['fraction']:+6.2f} %  {r['cause']}")
    rest = sum(r["fraction"] for r in rows if not r["inherent"])
    print(f"  all but the inherent replica update: {100 * rest:+.2f} % "
          f"(goal <= {100 * GOAL_REST_FRACTION:g} %)")


def kept(values: dict[int, float], warmup: int) -> list[float]:
    return [ms for it, ms in sorted(values.items()) if it > warmup]


def summarize(jobs: list[JobTimes], opts: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for mode in MODES:
        mine = [j for j in jobs if j.mode == mode]
        log_ms = [ms for j in mine for ms in kept(j.step_ms, opts.warmup)]
        ev_ms = [ms for j in mine for ms in kept(j.event_ms, opts.warmup)]
        result[mode] = {
            "median": statistics.median(log_ms),
            "mean": statistics.fmean(log_ms),
            "n": len(log_ms),
            "events_median": statistics.median(ev_ms) if ev_ms else float("nan"),
            "job_medians": [statistics.median(kept(j.step_ms, opts.warmup)) for j in mine],
        }
    return result


def bootstrap_ratio(
    jobs: list[JobTimes], warmup: int, samples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """5th and 95th percentiles of the on/off ratio of pooled medians when whole rounds are
    resampled with replacement. A round's two jobs ran back to back (ABBA order), so the
    slow drifts of a shared machine hit both alike: the round, not the job, is the
    independent unit of this paired design (resampling each mode's jobs on their own would
    count a drift that raised both jobs of a round as disagreement between the modes)."""
    import random

    rng = random.Random(seed)
    rounds = sorted({j.round for j in jobs})
    by_round = {r: {j.mode: kept(j.step_ms, warmup) for j in jobs if j.round == r}
                for r in rounds}
    ratios = []
    for _ in range(samples):
        chosen = [rng.choice(rounds) for _ in rounds]
        med = {mode: statistics.median([ms for r in chosen for ms in by_round[r][mode]])
               for mode in MODES}
        ratios.append(med["on"] / med["off"])
    ratios.sort()
    return ratios[int(0.05 * samples)], ratios[int(0.95 * samples) - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds K (one job per mode)")
    parser.add_argument("--iters", type=int, default=40, help="iterations M per job")
    parser.add_argument("--warmup", type=int, default=5, help="first iterations dropped per job")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 25 iterations")
    parser.add_argument("--nproc", type=int, default=4, help="ranks (DP size)")
    parser.add_argument("--gbs", type=int, default=16, help="global batch size")
    add_size_arguments(parser)
    parser.add_argument(
        "--ha-args", default="--enable-high-availability --optimizer-replica-num 2",
        help="flags of the 'on' mode",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per job")
    parser.add_argument(
        "--profile", action="store_true",
        help="run the jobs with timing wrappers (bench/_profile_worker.py) and print where "
        "the time of a step goes in each mode",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep run dirs here")
    add_host_argument(parser)
    parser.add_argument("extra", nargs="*", help="extra pretrain_gpt.py flags (after --)")
    opts = parser.parse_args(argv)
    host = parse_host(parser, opts.host)
    if opts.profile and host.megatron_lm is not None:
        parser.error("--profile times the reference trainer's functions; it cannot be "
                     "combined with --host megatron-lm")
    if opts.quick:
        opts.rounds, opts.iters = 2, 25
    if opts.iters <= opts.warmup:
        parser.error("--iters must be larger than --warmup")

    work = opts.keep or Path(tempfile.mkdtemp(prefix="tft-bench-overhead-"))
    jobs: list[JobTimes] = []
    try:
        host = prepare_host(host, work)
        for rnd in range(opts.rounds):
            order = MODES if rnd % 2 == 0 else MODES[::-1]
            for mode in order:
                job = run_one(mode, rnd, opts, work, host)
                jobs.append(job)
                med = statistics.median(kept(job.step_ms, opts.warmup))
                print(
                    f"[overhead] round {rnd} HA {mode:>3}: median {med:7.1f} ms/iter over "
                    f"{len(kept(job.step_ms, opts.warmup))} iterations (job {job.seconds:.0f}s)",
                    file=sys.stderr, flush=True,
                )
    finally:
        if opts.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    s = summarize(jobs, opts)
    off, on = s["off"], s["on"]
    ratio = on["median"] / off["median"]
    # Loss agreement between the modes (same data and seed: only reduction order differs).
    off_losses = next(j.losses for j in jobs if j.mode == "off")
    on_losses = next(j.losses for j in jobs if j.mode == "on")
    common = sorted(set(off_losses) & set(on_losses))
    max_loss_diff = max((abs(off_losses[i] - on_losses[i]) for i in common), default=float("nan"))

    print(f"host: {host.name}" + (f" ({host.megatron_lm})" if host.megatron_lm else ""))
    print(f"{'mode':>4} | {'median ms':>9} {'mean ms':>8} {'iters':>5} {'events med':>10} | "
          "per-job medians (ms)")
    print("-" * 78)
    for mode in MODES:
        r = s[mode]
        jm = " ".join(f"{m:.1f}" for m in r["job_medians"])
        print(f"{mode:>4} | {r['median']:9.2f} {r['mean']:8.2f} {r['n']:5d} "
              f"{r['events_median']:10.2f} | {jm}")
    pair_ratios = [
        on_m / off_m for on_m, off_m in zip(on["job_medians"], off["job_medians"], strict=True)
    ]
    low, high = bootstrap_ratio(jobs, opts.warmup)
    print(f"ratio on/off of the pooled medians: {ratio:.4f} (goal <= {GOAL_RATIO}); "
          f"90% bootstrap interval over rounds: {low:.3f} .. {high:.3f} (goal: upper end <= "
          f"{GOAL_RATIO_UPPER})")
    print("  per round (adjacent jobs): " + " ".join(f"{r:.3f}" for r in pair_ratios)
          + f"; median {statistics.median(pair_ratios):.4f}")
    print(f"  least-disturbed jobs (min of job medians): "
          f"{min(on['job_medians']) / min(off['job_medians']):.4f}")
    print(f"events-gap ratio: {on['events_median'] / off['events_median']:.4f}; "
          f"max |loss off - loss on| over {len(common)} iterations: {max_loss_diff:.3e}")
    result: dict[str, Any] = {
        "step_ms_off": round(off["median"], 3),
        "step_ms_on": round(on["median"], 3),
        "ratio": round(ratio, 4),
        "ratio_interval_90": [round(low, 4), round(high, 4)],
        "host": host.name,
        "precision": opts.precision or "bf16",
        "knobs": {option: getattr(opts, option) for option in SIZE_KNOBS
                  if getattr(opts, option) is not None},
        "rounds": opts.rounds, "iters": opts.iters,
    }
    goals = {"ratio": ratio <= GOAL_RATIO, "ratio_upper": high <= GOAL_RATIO_UPPER}
    if opts.profile:
        table = profile_table(jobs, opts)
        print_profile(table)
        rows = attribution(table)
        print_attribution(rows)
        rest = sum(r["fraction"] for r in rows if not r["inherent"])
        result["attribution"] = rows
        result["thread_cpu_ms"] = {
            mode: {g[len("threads_"):]: round(table[mode][g][1], 3) for g in THREAD_GROUPS}
            for mode in MODES}
        goals["rest"] = rest <= GOAL_REST_FRACTION
    result["goals_met"] = goals
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
