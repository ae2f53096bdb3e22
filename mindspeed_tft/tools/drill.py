"""Fault drill: prove, before a long run, that a training configuration recovers from faults.

    tft-drill [OPTIONS] -- <the launch command, as you run it>
    tft-drill --faults kill,uce:optimizer,hang -- \\
        tft-run --nproc-per-node 8 pretrain_gpt.py ... --enable-high-availability ...

The drill runs the command a few iterations long: a fault-free pass, then one pass per
selected fault (`--faults`; default ``kill,uce:optimizer``; allowed ``kill``, ``raise``,
``hang``, ``comm``, ``uce:optimizer``, ``uce:param``, ``uce:grad``, ``uce:activation``), each
injected with ``TFT_INJECT`` (mindspeed_tft/faults.py) at rank `--rank` (default: the job's
last rank, read from the fault-free pass), step `--step` (default: half-way through the
fault-free pass, at least step 2, before its end) and phase `--phase` (default backward).
It prints a certificate, one row per fault pass: the strategy the controller took, the
outcome (recovered: a ``repaired`` (or ``scale_in``) event and exit 0; dumped: a
``dump_saved`` event or exit 75; failed; timeout), the time to recover (the fault to the
first iteration completed after it), the iterations lost (logged again after a rollback, or
never logged) and whether every loss equals the fault-free pass's bit for bit. A row is OK
when the pass recovered, exited 0 and its losses are identical; otherwise the lines under
the table say why. The last line is the certificate as JSON. Exit code: 0 when every row is
OK, 1 when one falls short (or the fault-free pass fails), 2 for a usage error.

How the drill bounds and observes the user's command, without editing it: each pass runs the
command as given (no shell), in a session of its own, with the caller's environment plus
``TFT_EVENTS_FILE``, a fresh ``TFT_INJECT_STATE_DIR`` (so an item fires once per pass) and,
in a fault pass, ``TFT_INJECT``; and it appends ``--train-iters N`` (`--iters`, default 8;
0: keep the command's own), ``--save PASS_DIR/ckpt`` (the drill never writes into the
user's checkpoint folder; periodic saves, repairs from checkpoints and dumps use this one)
and ``--tft-events-file PASS_DIR/events.jsonl`` to it. Megatron's argparse takes the last
occurrence of a flag, so these override the command's own; the command must therefore pass
trailing arguments on to the training script (torchrun and tft-run do; a shell script must
end its launch line with ``"$@"``, as scripts/pretrain_tiny_cpu.sh does). `--load` is left
as it is: a command that loads a checkpoint of iteration K needs ``--iters`` above K.
Single-node commands only (one launcher: the drill starts one process tree per pass).

Every wait is bounded: a pass that runs longer than `--timeout` seconds has its process
group killed (the workers of torchrun / tft-run die with their launcher, design.md
"Bounded lifetimes") and its row says so.

A hang pass needs hang detection that fires within the pass: for that pass only the drill
sets ``TTP_HANG_TIMEOUT_MIN`` and ``TTP_PARK_TIMEOUT`` to `--hang-timeout` (default 5 s;
the hang timeout is still at least ``TTP_HANG_TIMEOUT_FACTOR`` x the slowest recent step)
and ``TFT_INJECT_HANG_SECONDS`` to half of `--timeout` (an undetected hang then ends the
pass with an error instead of a timeout).

Everything lands in `--workdir` (default: a new temporary folder, kept and printed): per
pass ``NN-NAME/output.log``, ``events.jsonl``, ``ckpt/``, ``inject-state/`` and, for a
fault pass, ``report.txt`` (`tft-report`'s account of the incident).

``python -m mindspeed_tft.drill`` is the same command.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mindspeed_tft.events import EVENTS_FILE_ENV, read_events_if_any
from mindspeed_tft.faults import DEFAULT_PHASE, parse_fault_spec
from mindspeed_tft.goodput import goodput, incidents, losses, steps
from mindspeed_tft.tools.report import describe_goodput, describe_incident

FAULTS = ("kill", "raise", "hang", "comm",
          "uce:optimizer", "uce:param", "uce:grad", "uce:activation")
DEFAULT_FAULTS = "kill,uce:optimizer"
#: phases a drill may inject at (the others need a save, a publish or a scale change)
PHASES = ("forward", "backward", "optimizer", "after")
DEFAULT_ITERS = 8
DUMP_EXIT_CODE = 75
EXIT_OK, EXIT_SHORT, EXIT_USAGE = 0, 1, 2
TAIL_BYTES = 8192


class UsageError(Exception):
    """A drill setting that cannot work (exit code 2)."""


# --- options ---------------------------------------------------------------------------


@dataclass
class DrillOptions:
    """The drill's settings; `rank` and `step` None: chosen from the fault-free pass."""

    command: list[str]
    faults: list[str] = field(default_factory=lambda: DEFAULT_FAULTS.split(","))
    rank: int | None = None
    step: int | None = None
    phase: str = "backward"
    iters: int = DEFAULT_ITERS
    workdir: Path | None = None
    timeout: float = 900.0
    hang_timeout: float = 5.0


def parse_faults(text: str) -> list[str]:
    """`--faults`: a comma-separated list of FAULTS, each at most once."""
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if item not in FAULTS:
            raise argparse.ArgumentTypeError(
                f"unknown fault {item!r}; allowed: {', '.join(FAULTS)}")
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"fault {repeated[0]!r} listed twice")
    return items


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"an integer >= {minimum}, got {text!r}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a positive number of seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tft-drill", usage="%(prog)s [options] -- COMMAND ...",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=parse_faults, default=parse_faults(DEFAULT_FAULTS),
                        help=f"comma-separated, from: {', '.join(FAULTS)} "
                             f"(default {DEFAULT_FAULTS})")
    parser.add_argument("--rank", type=_count(0), help="global rank to inject at "
                        "(default: the last rank of the fault-free pass)")
    parser.add_argument("--step", type=_count(0), help="0-based step to inject at (default: "
                        "half-way through the fault-free pass, at least 2, before its end)")
    parser.add_argument("--phase", choices=PHASES, default="backward",
                        help="phase of the step to inject at (default backward)")
    parser.add_argument("--iters", type=_count(0), default=DEFAULT_ITERS,
                        help="--train-iters appended to the command (0: keep its own; "
                             f"default {DEFAULT_ITERS})")
    parser.add_argument("--workdir", type=Path, help="an empty or new folder for the passes "
                        "(default: a new temporary folder, kept)")
    parser.add_argument("--timeout", type=_seconds, default=900.0,
                        help="seconds per pass before its process group is killed (900)")
    parser.add_argument("--hang-timeout", type=_seconds, default=5.0,
                        help="TTP_HANG_TIMEOUT_MIN and TTP_PARK_TIMEOUT of a hang pass (5)")
    return parser


def parse_args(argv: Sequence[str]) -> DrillOptions:
    """The drill's options before `--` and the command after it (argparse errors: exit 2)."""
    parser = build_parser()
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])  # --help works without a command
    if split >= len(argv) - 1:
        parser.error("no command: give the launch command after '--'")
    if args.iters == 1 or (args.iters and args.step is not None and args.step >= args.iters):
        parser.error(f"--step {args.step} must come before the end of --iters {args.iters} "
                     "(and --iters is 0 or at least 2)")
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        parser.error(f"--workdir {args.workdir} is not empty")
    return DrillOptions(argv[split + 1:], args.faults, args.rank, args.step, args.phase,
                        args.iters, args.workdir, args.timeout, args.hang_timeout)


# --- running a pass ----------------------------------------------------------------------


@dataclass
class PassResult:
    """What one run of the command left: exit code (None: killed on timeout), events."""

    returncode: int | None
    events: list[dict[str, Any]]
    output_tail: str = ""
    timed_out: bool = False
    seconds: float = 0.0
    directory: Path | None = None


def inject_spec(fault: str, rank: int, step: int, phase: str = DEFAULT_PHASE) -> str:
    """The `TFT_INJECT` value of one drill fault (validated by faults.parse_fault_spec)."""
    kind, _, target = fault.partition(":")
    spec = f"{kind}:rank={rank},step={step},phase={phase}" + (f",target={target}" if target else "")
    parse_fault_spec(spec)
    return spec


def pass_command(command: Sequence[str], iters: int, pass_dir: Path) -> list[str]:
    """The command with the drill's overrides appended (the last occurrence wins)."""
    extra = ["--train-iters", str(iters)] if iters else []
    return [*command, *extra, "--save", str(pass_dir / "ckpt"),
            "--tft-events-file", str(pass_dir / "events.jsonl")]


def pass_env(base: dict[str, str], pass_dir: Path, spec: str | None,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one pass: `base` with the drill's variables."""
    env = {key: value for key, value in base.items() if key != "TFT_INJECT"}
    env[EVENTS_FILE_ENV] = str(pass_dir / "events.jsonl")
    env["TFT_INJECT_STATE_DIR"] = str(pass_dir / "inject-state")
    if spec:
        env["TFT_INJECT"] = spec
    env.update(extra or {})
    return env


def hang_env(options: DrillOptions) -> dict[str, str]:
    """What a hang pass sets, for that pass only (see the module docstring)."""
    return {"TTP_HANG_TIMEOUT_MIN": f"{options.hang_timeout:g}",
            "TTP_PARK_TIMEOUT": f"{options.hang_timeout:g}",
            "TFT_INJECT_HANG_SECONDS": f"{max(1.0, options.timeout / 2):g}"}


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
        return f.read().decode(errors="replace")


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for the pass, then kill what is left of its process group: all of it on timeout
    (or an interrupt), stragglers after a normal end. True: it timed out."""
    try:
        proc.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)


def run_pass(command: list[str], env: dict[str, str], pass_dir: Path,
             timeout: float) -> PassResult:
    """Run one pass in `pass_dir` (output in output.log) and collect what it left."""
    pass_dir.mkdir(parents=True)
    log = pass_dir / "output.log"
    start = time.monotonic()
    with open(log, "wb") as out:
        try:
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise UsageError(f"cannot run {command[0]!r}: {e}") from None
        timed_out = _wait(proc, timeout)
    return PassResult(None if timed_out else proc.returncode,
                      read_events_if_any(pass_dir / "events.jsonl"), _tail(log), timed_out,
                      time.monotonic() - start, pass_dir)


# --- the certificate ---------------------------------------------------------------------


@dataclass
class Row:
    """One fault pass in the certificate; OK when `why` is empty."""

    fault: str
    inject: str
    strategy: str
    outcome: str
    returncode: int | None
    recover_seconds: float | None
    iterations_lost: int
    losses: str
    losses_identical: bool
    why: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.why


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


def outcome(result: PassResult) -> str:
    """timeout, recovered (a repair or shrink, exit 0), dumped (a dump or exit 75), failed."""
    if result.timed_out:
        return "timeout"
    if result.returncode == 0 and (_named(result.events, "repaired")
                                   or _named(result.events, "scale_in")):
        return "recovered"
    if _named(result.events, "dump_saved") or result.returncode == DUMP_EXIT_CODE:
        return "dumped"
    return "failed"


def recover_seconds(events: list[dict[str, Any]]) -> float | None:
    """From the first incident's start (the injected fault) to the first iteration logged
    after it; None if none was."""
    found = incidents(events)
    if not found:
        return None
    fault = found[0].events[0]["time"]
    after = [e["time"] for e in events
             if e["event"] in ("iteration", "iteration_recomputed") and e["time"] > fault]
    return min(after) - fault if after else None


def iterations_lost(events: list[dict[str, Any]], reference: dict[int, float]) -> int:
    """Iterations whose results a rollback discarded (`goodput.steps`) plus those of the
    fault-free pass this pass never logged."""
    discarded = sum(1 for step in steps(events) if not step.counts)
    return discarded + len(set(reference) - set(losses(events)))


def _spans(numbers: list[int]) -> str:
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def compare_losses(mine: dict[int, float], reference: dict[int, float]) -> tuple[bool, str]:
    """(identical, description) of this pass's losses against the fault-free pass's."""
    differ = [i for i in mine if i in reference and mine[i] != reference[i]]
    missing = [i for i in reference if i not in mine]
    extra = [i for i in mine if i not in reference]
    if not (differ or missing or extra) and mine:
        return True, "identical"
    parts = [f"differ at {_spans(differ)}" if differ else "",
             f"missing {_spans(missing)}" if missing else "",
             f"extra {_spans(extra)}" if extra else "", "none logged" if not mine else ""]
    return False, "; ".join(p for p in parts if p)


def _error_line(tail: str) -> str:
    """The last line of the output that names an error, else its last line."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "error_file" not in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def _failure_reasons(result: PassResult) -> list[str]:
    """Why the job did not recover: the controller's own words, else the output."""
    reasons = [f"repair failed: {e['reason']}" if not e["reason"].startswith("repair failed")
               else e["reason"] for e in _named(result.events, "repair_failed")]
    reasons += [f"the job exited {e['code']}: {e['reason']}"
                for e in _named(result.events, "exit") if e["code"] != 0]
    if not reasons:
        reasons.append(f"exit code {result.returncode}; output: {_error_line(result.output_tail)}")
    return reasons


def _why(result: PassResult, state: str, timeout: float | None) -> list[str]:
    if state == "timeout":
        limit = f" within {timeout:g} s" if timeout else ""
        return [f"did not finish{limit}: its process group was killed"]
    if not _named(result.events, "fault_injected"):
        return ["the fault never fired (no fault_injected event): is --rank in the job and "
                "--step before its last iteration?"]
    if state == "dumped":
        saved = _named(result.events, "dump_saved")
        where = (f"a dying-gasp checkpoint of iteration {saved[-1]['iteration']} was saved in "
                 f"{saved[-1]['path']}" if saved else "no dump_saved event")
        return [f"dumped, not recovered: {where} (exit {result.returncode}); the job must be "
                "restarted from it"]
    if state == "failed" and result.returncode == 0:
        return ["exited 0 but recorded no repair (no repaired event)"]
    return _failure_reasons(result) if state == "failed" else []


def certify(fault: str, spec: str, result: PassResult, reference: dict[int, float],
            timeout: float | None = None) -> Row:
    """The certificate row of one fault pass against the fault-free pass's losses (its
    strategy: each `strategy` event's, with its source, e.g. recover/replica)."""
    state = outcome(result)
    identical, described = compare_losses(losses(result.events), reference)
    why = _why(result, state, timeout)
    if result.returncode not in (0, None) and not any("exit" in w for w in why):
        why.append(f"exit code {result.returncode}")
    if not identical:
        why.append(f"losses not bit-identical to the fault-free pass: {described}")
    strategies = [e["strategy"] + (f"/{e['source']}" if e.get("source") else "")
                  for e in _named(result.events, "strategy")]
    return Row(fault, spec, "+".join(strategies) or "-", state, result.returncode,
               recover_seconds(result.events), iterations_lost(result.events, reference),
               described, identical, why)


COLUMNS = ("fault", "strategy", "outcome", "exit", "recover", "lost", "losses", "result")


def _cells(row: Row) -> tuple[str, ...]:
    recover = "-" if row.recover_seconds is None else f"{row.recover_seconds:.2f} s"
    code = "-" if row.returncode is None else str(row.returncode)
    return (row.fault, row.strategy, row.outcome, code, recover, str(row.iterations_lost),
            row.losses if len(row.losses) <= 24 else row.losses[:21] + "...",
            "OK" if row.ok else "FAIL")


def format_certificate(rows: list[Row]) -> str:
    """The plain-text table, then why each short row falls short."""
    table = [COLUMNS, *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for row in rows:
        lines += [f"{row.fault} ({row.inject}): {reason}" for reason in row.why]
    return "\n".join(lines)


def certificate_json(rows: list[Row], **extra: Any) -> str:
    """The certificate as one JSON line."""
    return json.dumps({"ok": all(r.ok for r in rows) and bool(rows), **extra,
                       "rows": [{**asdict(r), "ok": r.ok} for r in rows]})


# --- the drill ---------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[drill] {message}", flush=True)


def check_reference(result: PassResult, iters: int) -> str | None:
    """Why the fault-free pass cannot serve as the reference, or None."""
    mine = losses(result.events)
    if result.timed_out or result.returncode != 0:
        code = "timed out" if result.timed_out else f"exited {result.returncode}"
        return f"the fault-free pass {code}: {_error_line(result.output_tail)}"
    if not result.events:
        return ("the fault-free pass wrote no events to the drill's --tft-events-file: does "
                "the command pass trailing arguments on to the training script?")
    if not mine:
        return "the fault-free pass logged no iteration (does it load a later checkpoint?)"
    if iters and max(mine) != iters:
        return (f"the fault-free pass ended at iteration {max(mine)}, not --iters {iters}: "
                "does the command pass trailing arguments on to the training script?")
    return None


def choose_target(options: DrillOptions, reference: PassResult) -> tuple[int, int]:
    """(rank, step) to inject at: the options', else the last rank and half-way."""
    last = max(losses(reference.events))
    ranks = [e["rank"] for e in reference.events if e["rank"] >= 0]
    rank = options.rank if options.rank is not None else max(ranks, default=0)
    step = options.step if options.step is not None else min(max(2, last // 2), last - 1)
    if step >= last:
        raise UsageError(f"--step {step} is not before the fault-free pass's last "
                         f"iteration {last}")
    if ranks and rank > max(ranks):
        raise UsageError(f"--rank {rank}: the job's ranks are 0..{max(ranks)}")
    return rank, step


def _write_report(result: PassResult) -> None:
    lines = [line for incident in incidents(result.events)
             for line in describe_incident(incident)]
    lines += describe_goodput(goodput(result.events))
    if result.directory is not None:
        (result.directory / "report.txt").write_text("\n".join(lines) + "\n")


def run_fault_pass(options: DrillOptions, number: int, fault: str, rank: int, step: int,
                   reference: dict[int, float]) -> Row:
    """Run one fault pass and certify it."""
    spec = inject_spec(fault, rank, step, options.phase)
    assert options.workdir is not None, "run_drill sets the workdir first"
    pass_dir = options.workdir / f"{number:02d}-{fault.replace(':', '-')}"
    extra = hang_env(options) if fault == "hang" else None
    _log(f"pass {number}: TFT_INJECT={spec}"
         + (f" ({' '.join(f'{k}={v}' for k, v in extra.items())})" if extra else ""))
    result = run_pass(pass_command(options.command, options.iters, pass_dir),
                      pass_env(dict(os.environ), pass_dir, spec, extra), pass_dir,
                      options.timeout)
    _write_report(result)
    row = certify(fault, spec, result, reference, options.timeout)
    _log(f"pass {number}: {row.outcome}, exit {row.returncode}, {result.seconds:.1f} s "
         f"(log {pass_dir / 'output.log'})")
    return row


def drill(options: DrillOptions) -> int:
    """Run the passes and print the certificate; the exit code."""
    options.workdir = options.workdir or Path(tempfile.mkdtemp(prefix="tft-drill-"))
    options.workdir.mkdir(parents=True, exist_ok=True)
    _log(f"workdir {options.workdir}")
    pass_dir = options.workdir / "00-fault-free"
    _log("pass 0: fault-free")
    result = run_pass(pass_command(options.command, options.iters, pass_dir),
                      pass_env(dict(os.environ), pass_dir, None), pass_dir, options.timeout)
    _log(f"pass 0: exit {result.returncode}, {result.seconds:.1f} s (log {pass_dir / 'output.log'})")
    problem = check_reference(result, options.iters)
    if problem:
        print(f"drill: {problem}")
        print(json.dumps({"ok": False, "workdir": str(options.workdir), "reference": problem,
                          "rows": []}))
        return EXIT_SHORT
    reference = losses(result.events)
    rank, step = choose_target(options, result)
    rows = [run_fault_pass(options, number, fault, rank, step, reference)
            for number, fault in enumerate(options.faults, 1)]
    print(format_certificate(rows))
    print(certificate_json(rows, workdir=str(options.workdir), command=options.command,
                           rank=rank, step=step, phase=options.phase,
                           iterations=max(reference), final_loss=reference[max(reference)]))
    return EXIT_OK if all(row.ok for row in rows) else EXIT_SHORT


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return drill(options)
    except UsageError as e:
        print(f"drill: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
