"""Launch real multi-process training jobs for tests: `scripts/pretrain_tiny_cpu.sh` under
torchrun (or `tft-run`), gloo on CPU, and read back what they did.

`run_tiny_job` runs one job in its own directory and returns a `JobResult`: exit code,
combined output, and the events file (SPEC 11) parsed. Layouts name the parallelism:
`dp2` (2 ranks: for jobs that only have to fail in a given way, half the start-up of 4),
`dp4` (4 ranks, DP=4), `tp2dp2`, `pp2dp2`, `tp2dp4` and `pp2dp4` (8 ranks), `dp16`. Every job has a
timeout; on timeout the whole process group is killed and the test fails with the output so far.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindspeed_tft.events import read_events_if_any

REPO = Path(__file__).resolve().parent.parent
TINY_SCRIPT = REPO / "scripts" / "pretrain_tiny_cpu.sh"
#: the same job in Megatron-LM's own pretrain_gpt.py (MEGATRON_LM names the clone)
MEGATRON_LM_SCRIPT = REPO / "scripts" / "pretrain_megatron_lm_cpu.sh"

LAYOUTS: dict[str, dict[str, int]] = {
    "dp2": {"NPROC": 2, "TP": 1, "PP": 1},
    "dp4": {"NPROC": 4, "TP": 1, "PP": 1},
    "tp2dp2": {"NPROC": 4, "TP": 2, "PP": 1},
    "pp2dp2": {"NPROC": 4, "TP": 1, "PP": 2},
    "pp2dp4": {"NPROC": 8, "TP": 1, "PP": 2},
    "dp8": {"NPROC": 8, "TP": 1, "PP": 1},
    "dp16": {"NPROC": 16, "TP": 1, "PP": 1},
    "tp2dp4": {"NPROC": 8, "TP": 2, "PP": 1},
    "tp2pp2dp2": {"NPROC": 8, "TP": 2, "PP": 2},
}


@dataclass
class JobResult:
    """What a finished job left behind."""

    returncode: int
    output: str
    run_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "ckpt"

    def losses(self) -> dict[int, float]:
        """Iteration -> logged loss (the last one logged for an iteration wins)."""
        return {e["iteration"]: e["loss"] for e in self.events if e["event"] == "iteration"}

    def named(self, name: str) -> list[dict[str, Any]]:
        """Events called `name`, in order."""
        return [e for e in self.events if e["event"] == name]

    def logged_lines(self) -> list[int]:
        """The iterations of the log lines (`--log-interval 1`), in output order."""
        import re

        return [int(i) for i in re.findall(r" iteration +(\d+)/ *\d+ \|", self.output)]

    def assert_logged_once(self, reference: JobResult, train_iters: int) -> None:
        """Every iteration 1..train_iters logged exactly once, in order, in the events and
        the log, with the reference's loss (SPEC 11)."""
        once = list(range(1, train_iters + 1))
        assert [e["iteration"] for e in self.named("iteration")] == once, self.describe()
        assert self.logged_lines() == once, self.describe()
        assert self.losses() == reference.losses()

    def pids(self) -> dict[int, list[int]]:
        """Rank -> the processes that ran it, in order (from each process's
        `replica_layout` event): one for a rank whose process survived everything."""
        pids: dict[int, list[int]] = {}
        for event in self.named("replica_layout"):
            if event["pid"] not in pids.setdefault(event["rank"], []):
                pids[event["rank"]].append(event["pid"])
        return pids

    def spare_handover(self, rank: int) -> tuple[int, str]:
        """The warm spare that took `rank` over (the launcher's hand-over line) and what its
        set-up imported after it took the rank (its `spare.setup_report()` line in the
        plugin's log files): ("none" or a comma list)."""
        import re

        (pid,) = re.findall(rf"handing rank {rank} to warm spare pid (\d+)", self.output)
        logs = "".join(p.read_text() for p in (self.run_dir / "logs").glob("*.log"))
        (late,) = re.findall(rf"rank {rank}: warm spare pid {pid} set up [\d.]+ s after it "
                             r"took its rank; modules imported since: ([^;]*)", logs)
        return int(pid), late

    def exit_codes(self) -> dict[int, int]:
        """Each rank's exit code, as torchrun's failure summary reports it."""
        import re

        pattern = r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)"
        return {int(r): int(c) for r, c in re.findall(pattern, self.output)}

    def describe(self) -> str:
        tail = "\n".join(self.output.splitlines()[-60:])
        return f"job in {self.run_dir} exited {self.returncode}; output tail:\n{tail}"


#: The standard job of the suite: long enough to compare trajectories, periodic checkpoints
#: for resume and no-replica repairs. References are shared across tests per layout.
#: The standard test job: fp32, because this project's CI machines have no native bf16 (bf16
#: matmuls are emulated there: a 20-iteration DP4 job takes 27 s in bf16 and 17 s in fp32).
#: The bf16 paths (fp32 main params beside bf16 model params) keep their own tests: UCE on
#: DP4 (test_uce), the bf16 optimizer layouts (tp2dp2), full replicas and Megatron-LM's loop.
STANDARD = {"train_iters": 14, "save_interval": 5, "precision": "fp32"}
#: The bf16 flagship job (UCE on DP4, the flood): the bf16 optimizer with the distributed
#: optimizer and replicas, as users run it; one reference for both.
BF16 = {"train_iters": 20, "save_interval": 5, "precision": "bf16"}
#: High availability with the default 2 replicas and a replica check after every step.
HA_ARGS = "--enable-high-availability --tft-check-replicas-interval 1"


_issued_ports: set[int] = set()


def free_port() -> int:
    """A free TCP port below the ephemeral range (so connections the job opens cannot take
    it before the job binds it), never handed out twice in this test session; under pytest-xdist
    each worker draws from its own slice of 20000..32000, so two workers never pick the same."""
    import random
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    width = 12000 // max(workers, 1)
    low = 20000 + index * width
    for _ in range(1000):
        port = random.randrange(low, low + width)
        if port in _issued_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _issued_ports.add(port)
        return port
    raise RuntimeError(f"no free port in {low}..{low + width - 1}")


def run_rank_programs(program: Path, *args: str, ranks: int = 2,
                      env: dict[str, str] | None = None, timeout: float = 60) -> list[Any]:
    """Run `program RANK PORT *args` once per rank (a free port for their rendezvous) and
    return each rank's last stdout line parsed as JSON, in rank order; a rank that exits
    non-zero fails the test with its stderr."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(program), str(rank), port, *args],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank in range(ranks)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def tiny_job_env(
    run_dir: Path,
    *,
    layout: str = "dp4",
    train_iters: int = 8,
    save_interval: int = 4,
    load_dir: Path | None = None,
    inject: str | None = None,
    ha_args: str = "",
    dist_opt: bool = True,
    env: dict[str, str] | None = None,
    launcher: str = "torchrun",
    precision: str = "bf16",
) -> dict[str, str]:
    """The environment of `scripts/pretrain_tiny_cpu.sh` for one test job in `run_dir`
    (`env` last, so it overrides anything)."""
    job_env = dict(os.environ)
    job_env.pop("TFT_INJECT", None)
    job_env.pop("HIGH_AVAILABILITY", None)
    job_env.update({key: str(value) for key, value in LAYOUTS[layout].items()})
    bin_dir = str(Path(sys.executable).parent)
    job_env.update(
        {
            "PATH": bin_dir + os.pathsep + job_env.get("PATH", ""),
            "TRAIN_ITERS": str(train_iters),
            "SAVE_INTERVAL": str(save_interval),
            "RUN_DIR": str(run_dir),
            "HA_ARGS": ha_args or " ",
            "DIST_OPT_ARGS": "--use-distributed-optimizer" if dist_opt else "",
            "LAUNCHER": launcher,
            "TINY_PRECISION": precision,
            "MASTER_PORT": str(free_port()),
            "TFT_INJECT_STATE_DIR": str(Path(run_dir) / "inject-state"),
            "PYTHONUNBUFFERED": "1",
            # a process killed by a fatal signal (SIGABRT, SIGSEGV) prints its Python stacks
            "PYTHONFAULTHANDLER": "1",
            "TTP_PORT": str(free_port()),
            # A lost rank is declared after 0.5 s x 10 of silence: quick, still real
            # heartbeats, and with room for 8 ranks starting up on 2 cores (a rank's heartbeat
            # thread was seen starved for 3.0 s there, building its mock dataset)
            "TTP_HEARTBEAT_INTERVAL": "0.5",
            "TTP_HEARTBEAT_MISSES": "10",
            "TTP_LOG_PATH": str(Path(run_dir) / "logs"),
        }
    )
    if load_dir is not None:
        job_env["LOAD_DIR"] = str(load_dir)
    if inject:
        job_env["TFT_INJECT"] = inject
    if env:
        job_env.update(env)
    return job_env


def start_tiny_job(job_env: dict[str, str], extra_args: list[str] | None = None,
                   script: Path = TINY_SCRIPT) -> subprocess.Popen:
    """Start `scripts/pretrain_tiny_cpu.sh` (or `script`, which takes the same environment;
    its launcher in a session of its own; output piped, text)."""
    return subprocess.Popen(
        ["bash", str(script), *(extra_args or [])],
        cwd=REPO,
        env=job_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_tiny_job(
    run_dir: Path,
    *,
    extra_args: list[str] | None = None,
    timeout: float = 300.0,
    script: Path = TINY_SCRIPT,
    **options: Any,
) -> JobResult:
    """Run the tiny CPU job once and collect its result (`options`: see `tiny_job_env`;
    `script`: `MEGATRON_LM_SCRIPT` runs it in Megatron-LM's own loop)."""
    run_dir = Path(run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    proc = start_tiny_job(tiny_job_env(run_dir, **options), extra_args, script)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(
            f"job in {run_dir} did not finish within {timeout} s; output tail:\n"
            + "\n".join(output.splitlines()[-60:])
        ) from None
    (run_dir / "output.log").write_text(output)
    return JobResult(proc.returncode, output, run_dir, read_events_if_any(run_dir / "events.jsonl"))


def run_megatron_job(run_dir: Path, megatron_lm: Path, *, entry: str = "-m mindspeed_tft.megatron",
                     script: str = "pretrain_gpt.py", env: dict[str, str] | None = None,
                     **options: Any) -> JobResult:
    """The tiny job in Megatron-LM's own `pretrain_gpt.py` (`scripts/pretrain_megatron_lm_cpu.sh`)
    from the clone `megatron_lm`; `entry` is how the adaptor gets in (empty: the script
    imports it, or `tft-run` runs it through the adaptor itself)."""
    job_env = {"MEGATRON_LM": str(megatron_lm), "ENTRY": entry, "SCRIPT": script, **(env or {})}
    return run_tiny_job(run_dir, script=MEGATRON_LM_SCRIPT, env=job_env, **options)


def checkpoint_at(source_root: Path, iteration: int, destination: Path) -> Path:
    """A copy of `source_root`'s checkpoint at `iteration`, published as the latest there."""
    destination.mkdir(parents=True, exist_ok=True)
    name = f"iter_{iteration:07d}"
    shutil.copytree(source_root / name, destination / name)
    (destination / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return destination


def wait_for(pred: Callable[[], Any], timeout: float, what: str = "condition",
             interval: float = 0.02) -> Any:
    """Poll `pred()` until it returns something truthy and return that; AssertionError
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_event(path: Path | str, pred: Callable[[dict[str, Any]], bool], timeout: float,
               what: str = "event") -> dict[str, Any]:
    """The first event of the file at `path` for which `pred` holds, waiting up to `timeout`."""
    return wait_for(lambda: next((e for e in read_events_if_any(path) if pred(e)), None),
                    timeout, f"{what} in {path}", interval=0.1)


def tamper_with_a_tensor(checkpoint_dir: Path, iteration: int, destination: Path,
                         seed: int = 52) -> tuple[Path, str]:
    """A copy of `checkpoint_dir` in `destination` with one byte of one tensor of the
    checkpoint of `iteration` flipped (a random tensor of `mp_rank_00/distrib_optim.pt`, a
    random byte of it); returns the damaged file and the tensor's name."""
    import random

    from mindspeed_tft.recovery import manifest

    shutil.copytree(checkpoint_dir, destination)
    path = destination / f"iter_{iteration:07d}" / "mp_rank_00" / "distrib_optim.pt"
    names = manifest.tensor_names(str(path))
    rng = random.Random(seed)
    member = rng.choice(sorted(names))
    record = next(r for r in manifest.file_digests(str(path))["records"] if r[0] == member)
    offset = record[1] + rng.randrange(record[2])
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x7F]))
    return path, names[member][0]



def assert_load_refused(result: JobResult, tampered: Path, iteration: int, path: Path,
                        tensor: str, previous: int | None) -> None:
    """`result`, a `--load` of `tampered` (`tamper_with_a_tensor`), stopped at start with
    exit code 2 on every rank and the one line naming file, tensor and checkpoint."""
    codes = result.exit_codes()  # the launcher may stop the others after the first's 2
    assert 2 in codes.values() and set(codes.values()) <= {2, -15}, result.describe()
    assert (f"[mindspeed-tft] error: checkpoint {tampered}/iter_{iteration:07d} is corrupt, not "
            f"loaded: {path}: bytes differ from the manifest in tensor {tensor} (zip member "
            in result.output), result.describe()
    if previous is not None:
        assert (f"the previous checkpoint is {tampered}/iter_{previous:07d}: to resume from it, "
                f"write {previous} into {tampered}/latest_checkpointed_iteration.txt"
                in result.output), result.describe()
    assert not result.named("iteration")
