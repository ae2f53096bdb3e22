"""Helpers shared by the benchmarks: free ports, the bench environment, running a job, the
training loop a job runs in (`--host`)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The reference trainer (this repository's pretrain_gpt.py) and Megatron-LM's own loop.
TINY_SCRIPT = REPO / "scripts" / "pretrain_tiny_cpu.sh"
MEGATRON_LM_SCRIPT = REPO / "scripts" / "pretrain_megatron_lm_cpu.sh"
HOSTS = ("reference", "megatron-lm")

#: the folder of the interpreter running the benchmark (a venv's bin/), first on every job's
#: PATH: the jobs' scripts run `python`, `torchrun` and `tft-run`, and Megatron-LM compiles its
#: dataset helpers with the `python3` it finds there, which must import pybind11
BIN = Path(sys.executable).parent

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from mindspeed_tft.events import EVENTS_FILE_ENV  # noqa: E402
from tests.jobs import free_port  # noqa: E402  (one port policy for tests and benchmarks)

#: Environment variables that would change what a benchmark job does behind its flags.
_SCRUBBED_ENV = ("HIGH_AVAILABILITY", "TFT_INJECT", EVENTS_FILE_ENV, "TTP_PORT", "TTP_LOG_PATH")


def bench_env(log_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a benchmark job: one OpenMP thread per rank, no injected faults,
    no HIGH_AVAILABILITY override, the repo importable, this interpreter's folder first on
    PATH (`BIN`: the bench run with a venv's python needs no activated venv), the
    high-availability controller on a free port and its log (TTP_LOG_PATH) in `log_dir`
    rather than ./logs."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env["PATH"] = os.pathsep.join(p for p in (str(BIN), env.get("PATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["TTP_PORT"] = str(free_port())
    env["TTP_LOG_PATH"] = str(log_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra)
    return env


#: the tiny preset's size knobs (configs/models/tiny.sh): option -> (variable, its default)
SIZE_KNOBS = {"layers": ("TINY_NUM_LAYERS", 4), "hidden": ("TINY_HIDDEN_SIZE", 64),
              "ffn": ("TINY_FFN_HIDDEN_SIZE", 176), "seq": ("TINY_SEQ_LENGTH", 64)}


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """`--layers --hidden --ffn --seq`: the model size of every job (default: the preset);
    `--precision`: bf16 (the preset) or fp32 (TINY_PRECISION)."""
    for option, (variable, default) in SIZE_KNOBS.items():
        parser.add_argument(f"--{option}", type=int, default=None,
                            help=f"{variable} ({default})")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="TINY_PRECISION (bf16): fp32 where the CPU has no native bf16 "
                        "(torch.backends.cpu.get_cpu_capability() below AVX512)")


def size_env(opts: argparse.Namespace) -> dict[str, str]:
    """The preset variables for the sizes given on the command line (an error below 1)."""
    env = {}
    for option, (variable, _) in SIZE_KNOBS.items():
        value = getattr(opts, option)
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{option} {value}: allowed: a positive integer")
            env[variable] = str(value)
    if getattr(opts, "precision", None) is not None:
        env["TINY_PRECISION"] = opts.precision
    return env


def torchrun_cmd(nproc: int, script: Path, script_args: list[str]) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`) of `script` on `nproc` local ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()),
        str(script), *script_args,
    ]


@dataclass
class JobOutput:
    returncode: int
    output: str
    seconds: float


def run_job(cmd: list[str], env: dict[str, str], timeout_s: float, log: Path) -> JobOutput:
    """Run `cmd` in its own process group; on timeout kill the whole group. The combined
    output is written to `log` and returned."""
    import time

    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = -9
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return JobOutput(returncode, log.read_text(encoding="utf-8"), time.monotonic() - start)


def tail(text: str, lines: int = 40) -> str:
    """The last `lines` lines of a job's output, preceded by its first Python traceback (the
    root cause is usually there, not in torchrun's summary at the end)."""
    all_lines = text.splitlines()
    first = next((i for i, line in enumerate(all_lines) if "Traceback (most recent" in line), None)
    head = ""
    if first is not None and first < len(all_lines) - lines:
        head = "\n".join(all_lines[first:first + 30]) + "\n[...]\n"
    return head + "\n".join(all_lines[-lines:])


@dataclass(frozen=True)
class Host:
    """The training loop of a benchmark's jobs: the reference trainer
    (`scripts/pretrain_tiny_cpu.sh`) or Megatron-LM's own unchanged `pretrain_gpt.py`
    (`scripts/pretrain_megatron_lm_cpu.sh`) from a writable copy of a Megatron-LM clone."""

    name: str = "reference"
    megatron_lm: Path | None = None  # the clone as given (megatron-lm)
    copy: Path | None = None  # its writable copy the jobs run (prepare_host)

    @property
    def script(self) -> Path:
        return TINY_SCRIPT if self.megatron_lm is None else MEGATRON_LM_SCRIPT

    @property
    def script_args(self) -> list[str]:
        """Flags every job of this host gets. Megatron-LM: its torch checkpoint format, the
        one the plugin picks under high availability (its dump is written in it), for the
        jobs without the plugin's flags too: the same saves in every mode, and Megatron-LM's
        default (torch_dist) needs psutil, which this environment does not install."""
        return [] if self.megatron_lm is None else ["--ckpt-format", "torch"]

    def job_env(self, launcher: str) -> dict[str, str]:
        """The script's knobs for this host: MEGATRON_LM = the writable copy, and how the
        adaptor gets in (ENTRY: `-m mindspeed_tft.megatron`; empty under tft-run, which
        runs a Megatron-LM script through the adaptor itself)."""
        if self.megatron_lm is None:
            return {}
        if self.copy is None:
            raise ValueError("the megatron-lm host needs its writable copy (prepare_host)")
        words = launcher.split()
        tft_run = bool(words) and Path(words[0]).name == "tft-run"
        return {"MEGATRON_LM": str(self.copy), "SCRIPT": "pretrain_gpt.py",
                "ENTRY": "" if tft_run else "-m mindspeed_tft.megatron"}


def add_host_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", nargs="+", metavar=("HOST", "DIR"), default=["reference"],
        help="the training loop: 'reference' (default: this repository's pretrain_gpt.py) or "
        "'megatron-lm DIR' (Megatron-LM's own pretrain_gpt.py from the clone DIR, "
        "core_v0.12.1; copied once into the bench's work dir)",
    )


def parse_host(parser: argparse.ArgumentParser, values: list[str]) -> Host:
    """The `--host` values as a Host; a bad value is a usage error (exit 2)."""
    name, *rest = values
    if name not in HOSTS:
        parser.error(f"--host {name}: unknown host (choose from {', '.join(HOSTS)})")
    if name == "reference":
        if rest:
            parser.error(f"--host reference takes no directory (got {' '.join(rest)})")
        return Host()
    if len(rest) != 1:
        parser.error("--host megatron-lm needs one directory: a Megatron-LM clone")
    clone = Path(rest[0]).expanduser().resolve()
    if not (clone / "pretrain_gpt.py").is_file():
        parser.error(f"--host megatron-lm {rest[0]}: no pretrain_gpt.py there (expected a "
                     "Megatron-LM clone, core_v0.12.1)")
    return Host(name, clone)


def prepare_host(host: Host, work: Path) -> Host:
    """`host` with a writable copy of its Megatron-LM clone in `work` (Megatron-LM compiles
    its dataset helpers into its own tree: one copy, one compile, for every job of the run);
    the reference host as it is."""
    if host.megatron_lm is None:
        return host
    copy = work / "megatron-lm"
    if not copy.exists():
        shutil.copytree(host.megatron_lm, copy, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", ".git"))
        for path in [copy, *copy.rglob("*")]:
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return Host(host.name, host.megatron_lm, copy)
