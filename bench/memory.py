"""Memory per parameter of the replica distributed optimizer, measured on real jobs.

What it measures: the bytes per model parameter that one rank really holds for training
state - model params + gradient buffers + optimizer state - with N optimizer replicas on a
data-parallel group of size d, against SPEC 2's formula (bf16 params;
`mindspeed_tft.tools.plan.bytes_per_param`, the replica planner's, so the two cannot drift):

    bf16 grads (--bf16 --grad-reduce-in-bf16):  4 + 16 N / d
    fp32 grads (--bf16, Megatron-LM's default): 6 + 12 N / d

How: for every d in --dims and N in {1, 2, d/2, d} (N | d; `--replicas` picks N) and each
grad dtype it
launches a real d-rank CPU job (torchrun, gloo; DP = d, TP = PP = 1) of pretrain_gpt.py's GPT
model through `bench/_memory_worker.py`, which sets the job up with the trainer's own code
(initialize_megatron, TFTPlugin.setup, setup_model_and_optimizer, mock data) and runs real
`train_step`s. After a step, each rank counts the distinct storages (by
`untyped_storage().data_ptr()`, each once) of the DDP buffers' `param_data` and `grad_data`
and of the inner torch optimizer's tensors: fp32 main params, exp_avg, exp_avg_sq, step and
the fp32 main grads the distributed optimizer attaches during `step()` (still attached after
it; with fp32 grads they are views of the grad buffer and cost nothing). The sum is divided
by the rank's (unpadded) model parameter count. N = 1 rows run with high availability off
(megatron-core's native distributed optimizer; "native" in the table); N > 1 rows with
`--enable-high-availability --optimizer-replica-num N`; `--no-replica` adds N = 1 rows with
`--enable-high-availability --distributed-optimizer-no-replica`.

Output: a table, then as the last line one JSON object
`{"rows": [{"d", "n", "grad", "ha", "measured", "formula", "rel_error", "breakdown",
"num_params"}], "max_rel_error": ...}`
(measured and formula in bytes per parameter, from global rank 0; num_params: the model
parameters rank 0 holds, the divisor).

    python bench/memory.py            # d in {2, 4, 8}: 12 jobs, a few minutes on 2 cores
    python bench/memory.py --quick    # d in {2, 4}: 6 jobs
    python bench/memory.py --dims 2 --replicas 2 --grads bf16   # 1 job
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _jobs import REPO, bench_env, run_job, tail, torchrun_cmd  # noqa: E402

from mindspeed_tft.tools.plan import bytes_per_param  # noqa: E402  (_jobs puts REPO on sys.path)

WORKER = REPO / "bench" / "_memory_worker.py"
GRADS = ("bf16", "fp32")


@dataclass(frozen=True)
class Case:
    d: int
    n: int
    grad: str
    no_replica: bool = False  # N = 1 with HA on (--distributed-optimizer-no-replica)

    @property
    def name(self) -> str:
        return f"d{self.d}_n{self.n}_{self.grad}" + ("_noreplica" if self.no_replica else "")

    @property
    def ha(self) -> str:
        if self.no_replica:
            return "no-replica"
        return "on" if self.n > 1 else "off"


def replica_counts(d: int, wanted: list[int] | None = None) -> list[int]:
    """N in {1, 2, d/2, d} with N | d, deduplicated, ascending (N = d: every rank holds the
    whole optimizer state); with `wanted`, the N of it that divide d instead."""
    candidates = (1, 2, d // 2, d) if wanted is None else wanted
    return sorted({n for n in candidates if n >= 1 and d % n == 0})


def model_args(opts: argparse.Namespace) -> list[str]:
    """pretrain_gpt.py flags of the benchmark model (tiny preset's architecture, larger)."""
    return [
        "--use-mcore-models",
        "--num-layers", str(opts.layers),
        "--hidden-size", str(opts.hidden),
        "--ffn-hidden-size", str(opts.ffn),
        "--num-attention-heads", str(opts.heads),
        "--seq-length", str(opts.seq),
        "--max-position-embeddings", str(opts.seq),
        "--make-vocab-size-divisible-by", "1",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--init-method-std", "0.01",
        "--position-embedding-type", "rope",
        "--normalization", "RMSNorm",
        "--swiglu",
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(opts.vocab),
    ]


def job_args(case: Case, opts: argparse.Namespace) -> list[str]:
    args = model_args(opts) + [
        "--micro-batch-size", "1",
        "--global-batch-size", str(case.d),
        "--lr", "1e-3",
        "--min-lr", "1e-4",
        "--lr-decay-style", "cosine",
        "--weight-decay", "0.1",
        "--clip-grad", "1.0",
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--train-iters", str(opts.steps),
        "--eval-iters", "0",
        "--eval-interval", "1000",
        "--mock-data",
        "--seed", "1234",
        "--use-distributed-optimizer",
        "--bf16",
        "--distributed-backend", "gloo",
    ]
    if case.grad == "bf16":
        args.append("--grad-reduce-in-bf16")
    if case.no_replica:
        args += ["--enable-high-availability", "--distributed-optimizer-no-replica"]
    elif case.n > 1:
        args += ["--enable-high-availability", "--optimizer-replica-num", str(case.n)]
    return args


def per_param(step: dict[str, Any]) -> dict[str, float]:
    """Bytes per parameter of each category of one rank's measurement."""
    numel = step["num_params"]
    b = step["bytes"]
    out = {
        "params": b.get("params", 0) / numel,
        "grads": b.get("grads", 0) / numel,
        "optimizer": b.get("optimizer", 0) / numel,
        "main_grads": b.get("main_grads", 0) / numel,
        "other": b.get("other", 0) / numel,
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["main_grads"]
    return out


def run_case(case: Case, opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    out_dir = work / case.name
    env = bench_env(work / f"{case.name}.ttp", BENCH_MEMORY_OUT=str(out_dir))
    args = job_args(case, opts)
    if "--enable-high-availability" in args:  # nothing is dumped here, but HA needs a folder
        args += ["--save", str(out_dir / "ckpt")]
    cmd = torchrun_cmd(case.d, WORKER, args)
    job = run_job(cmd, env, opts.timeout, work / f"{case.name}.log")
    ranks = sorted(out_dir.glob("rank*.json"))
    if job.returncode != 0 or len(ranks) != case.d:
        raise RuntimeError(
            f"{case.name}: job exited {job.returncode} with {len(ranks)}/{case.d} results; "
            f"output tail:\n{tail(job.output)}"
        )
    records = [json.loads(p.read_text()) for p in ranks]
    records.sort(key=lambda r: r["rank"])
    rank0 = records[0]
    if rank0["replica_num"] != case.n:
        raise RuntimeError(f"{case.name}: the job ran with N = {rank0['replica_num']}")
    last = rank0["steps"][-1]
    if last["main_params_with_grad"] != last["main_params"]:
        raise RuntimeError(
            f"{case.name}: only {last['main_params_with_grad']}/{last['main_params']} main "
            "params had a grad when measured"
        )
    totals = [per_param(r["steps"][-1])["total"] for r in records]
    steps_total = [per_param(s)["total"] for s in rank0["steps"]]
    if rank0["high_availability"] != (case.ha != "off"):
        raise RuntimeError(f"{case.name}: high availability is {rank0['high_availability']}")
    return {
        "d": case.d,
        "n": case.n,
        "grad": case.grad,
        "ha": case.ha,
        "measured": round(per_param(last)["total"], 6),
        "formula": bytes_per_param(case.d, case.n, case.grad, case.ha),
        "breakdown": {k: round(v, 6) for k, v in per_param(last).items()},
        "num_params": last["num_params"],
        "buffer_padding": last["buffer_numel"] - last["buffer_numel_unpadded"],
        "ranks_min": round(min(totals), 6),
        "ranks_max": round(max(totals), 6),
        "steps_total": [round(t, 6) for t in steps_total],
        "grad_dtype": last["grad_dtype"],
        "rss_mb": round(last.get("rss_bytes", 0) / 2**20, 1),
        "peak_rss_mb": round(last.get("peak_rss_bytes", 0) / 2**20, 1),
        "job_seconds": round(job.seconds, 1),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    native = {(r["d"], r["grad"]): r["measured"] for r in rows if r["ha"] == "off"}
    head = (
        f"{'d':>2} {'N':>2} {'grad':>4} {'HA':>10} | {'measured':>8} {'formula':>8} {'native':>8} "
        f"{'rel.err':>8} | {'param':>6} {'grad':>6} {'opt':>6} {'mgrad':>6} {'other':>6} | "
        f"{'ranks min..max':>17} {'rss MB':>7} {'peak':>6} {'job s':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        b = r["breakdown"]
        nat = native.get((r["d"], r["grad"]))
        nat_s = f"{nat:8.4f}" if nat is not None else f"{'-':>8}"
        print(
            f"{r['d']:>2} {r['n']:>2} {r['grad']:>4} {r['ha']:>10} | {r['measured']:8.4f} {r['formula']:8.4f} "
            f"{nat_s} {r['rel_error']:8.2e} | {b['params']:6.3f} {b['grads']:6.3f} "
            f"{b['optimizer']:6.3f} {b['main_grads']:6.3f} {b['other']:6.3f} | "
            f"{r['ranks_min']:8.4f}..{r['ranks_max']:<8.4f} {r['rss_mb']:7.0f} "
            f"{r['peak_rss_mb']:6.0f} {r['job_seconds']:6.1f}"
        )
    print(
        "bytes per model parameter on global rank 0. param/grad: DDP param_data/grad_data;"
        " opt: fp32 main params + exp_avg + exp_avg_sq + step; mgrad: fp32 main grads not"
        " aliasing the grad buffer; other: remaining tensors Python can see (not counted);"
        " ranks: measured total on every rank; rss/peak: rank 0's resident set after the"
        " last step / at its peak (whole process, libraries included)."
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_plan.py reads the model flags of a run from it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="2,4,8", help="data-parallel sizes d (comma list)")
    parser.add_argument("--grads", default="bf16,fp32", help="grad dtypes: bf16, fp32")
    parser.add_argument("--quick", action="store_true", help="d in {2, 4} only")
    parser.add_argument("--replicas", default=None,
                        help="replica numbers N (comma list; default 1, 2, d/2, d); each d "
                        "runs those that divide it")
    parser.add_argument("--no-replica", action="store_true",
                        help="also run N = 1 with HA on (--distributed-optimizer-no-replica)")
    parser.add_argument("--steps", type=int, default=1, help="train steps per job (>= 1)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument("--tolerance", type=float, default=0.01, help="goal for max_rel_error")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep job logs and per-rank JSON in this directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    try:
        dims = [2, 4] if opts.quick else [int(x) for x in opts.dims.split(",") if x.strip()]
    except ValueError:
        dims = []
    grads = [g.strip() for g in opts.grads.split(",") if g.strip()]
    if any(g not in GRADS for g in grads) or opts.steps < 1:
        parser.error("--grads takes bf16 and/or fp32; --steps must be >= 1")
    if not dims or any(d < 1 for d in dims):
        parser.error(f"--dims {opts.dims}: allowed: data-parallel sizes >= 1")
    wanted = None
    if opts.replicas is not None:
        try:
            wanted = [int(x) for x in opts.replicas.split(",") if x.strip()]
        except ValueError:
            wanted = []
        if not wanted or any(n < 1 or all(d % n for d in dims) for n in wanted):
            parser.error(f"--replicas {opts.replicas}: allowed: integers N >= 1, each "
                         f"dividing one of --dims {','.join(map(str, dims))}")
    cases = [Case(d, n, g) for d in dims for n in replica_counts(d, wanted) for g in grads]
    if opts.no_replica:
        cases += [Case(d, 1, g, no_replica=True) for d in dims for g in grads]

    work = opts.keep or Path(tempfile.mkdtemp(prefix="tft-bench-memory-"))
    rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            row = run_case(case, opts, work)
            row["rel_error"] = abs(row["measured"] - row["formula"]) / row["formula"]
            rows.append(row)
            print(
                f"[memory] d={case.d} N={case.n} grads={case.grad}: {row['measured']:.4f} B/param"
                f" (formula {row['formula']:.4f}) in {row['job_seconds']:.0f}s",
                file=sys.stderr, flush=True,
            )
    finally:
        if opts.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    max_rel = max(r["rel_error"] for r in rows)
    verdict = "OK" if max_rel <= opts.tolerance else "ABOVE GOAL"
    print(f"max relative error {max_rel:.2e} (goal <= {opts.tolerance}): {verdict}")
    summary = {
        "rows": [
            {
                "d": r["d"], "n": r["n"], "grad": r["grad"], "ha": r["ha"],
                "measured": r["measured"], "formula": r["formula"],
                "rel_error": round(r["rel_error"], 8),
                "breakdown": r["breakdown"],
                "num_params": r["num_params"],
            }
            for r in rows
        ],
        "max_rel_error": round(max_rel, 8),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
