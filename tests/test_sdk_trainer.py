"""End to end: a trainer whose fault tolerance goes through the `mindio_ttp` API only, in
MindSpeed-LLM's shape (`tests/sdk_compat/trainer.py`: its handlers do the work on CPU gloo),
runs on this project's `mindio_ttp` under `tft-run` and under plain torchrun with the usage
guide's line (`import mindio_ttp.framework_ttp` in the torchrun script). A SIGKILLed rank is
restarted alone and repaired from its replica (ARF), a UCE report is repaired in place from
the replica, and an unknown error ends the job with a dying-gasp checkpoint that a new job
resumes from; every loss equals the fault-free run's, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import REPO, free_port

TRAINER = REPO / "tests" / "sdk_compat" / "trainer.py"
NPROC, ITERATIONS = 2, 10
HA = ["--enable-high-availability", "--enable-hbmfault-repair", "--enable-worker-reboot"]


def guide_torchrun(folder: Path) -> Path:
    """A copy of the installed torchrun script with the usage guide's line after
    `import sys`."""
    original = Path(sys.executable).parent / "torchrun"
    lines = original.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip() == "import sys") + 1
    lines.insert(at, "import mindio_ttp.framework_ttp\n")
    script = folder / "torchrun"
    script.write_text("".join(lines))
    script.chmod(0o755)
    return script


def launcher_command(launcher: str, folder: Path) -> list[str]:
    port = ["--nproc-per-node", str(NPROC), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port())]
    if launcher == "tft-run":
        return [str(Path(sys.executable).parent / "tft-run"), *port]
    if launcher == "guide":
        return [str(guide_torchrun(folder)), *port]
    return [sys.executable, "-m", "torch.distributed.run", *port]


def run_trainer(run_dir: Path, launcher: str, *args: str, timeout: float = 180) -> dict:
    """Run the trainer once; returns exit code, output, losses and handler calls."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTP_", "TFT_"))}
    env.update(PYTHONUNBUFFERED="1", TTP_PORT=str(free_port()),
               TTP_LOG_PATH=str(run_dir / "logs"),
               PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
    if "--save" not in args:  # as every high-availability launch has (tft-run refuses none)
        args = (*args, "--save", str(run_dir / "save"))
    command = [*launcher_command(launcher, run_dir), str(TRAINER), "--out", str(run_dir / "out"),
               "--iterations", str(ITERATIONS), *args]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{launcher} job timed out:\n{output[-6000:]}") from None
    out = run_dir / "out"
    losses: dict[int, str] = {}
    for line in (out / "losses.0.jsonl").read_text().splitlines():
        row = json.loads(line)
        losses[row["iteration"]] = row["loss"]  # a recomputed iteration: the later one
    calls = {rank: [json.loads(line) for line in path.read_text().splitlines()]
             for rank in range(NPROC)
             if (path := out / f"calls.{rank}.jsonl").exists()}
    return {"code": proc.returncode, "output": output, "losses": losses, "calls": calls}


def named(result: dict, rank: int, name: str) -> list[dict]:
    return [c for c in result["calls"].get(rank, []) if c["call"] == name]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fault-free run (plain torchrun; rank 0 hosts the controller)."""
    result = run_trainer(tmp_path_factory.mktemp("sdk-trainer") / "reference", "torchrun", *HA)
    assert result["code"] == 0, result["output"][-6000:]
    assert sorted(result["losses"]) == list(range(1, ITERATIONS + 1))
    return result


LAUNCHERS = ["tft-run", "guide"]


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_killed_rank_is_rebooted(tmp_path, reference, launcher):
    """Rank 1 SIGKILLed at iteration 5: its launcher restarts it alone, the restarted worker
    raises "ARF FINISH", every rank's rebuild handler makes new groups with it (fault ranks
    [1]), rank 0 sends its replica (RT_SEND) and rank 1 receives it (RT_RECV_REPAIR), both
    roll back to 5 and the job ends normally with every loss bit-identical."""
    result = run_trainer(tmp_path / "job", launcher, *HA, "--fault", "kill:1:5")
    assert result["code"] == 0, result["output"][-6000:]
    assert result["losses"] == reference["losses"]
    restarted = [c for c in named(result, 1, "started") if c["reboot"]]
    assert len(restarted) == 1 and not restarted[0]["reboot_again"], result["calls"]
    assert [c["fault_ranks"] for c in named(result, 0, "rebuild_group")] == [[1]]
    assert [c["fault_ranks"] for c in named(result, 1, "rebuild_group")] == [[1]]
    [send] = named(result, 0, "repair")
    [receive] = named(result, 1, "repair")
    assert (send["repair_type"], send["dst"], send["step"]) == ("RT_SEND", [1], 5)
    assert (receive["repair_type"], receive["src"], receive["need_rebuild"]) == \
        ("RT_RECV_REPAIR", [0], False)
    assert [c["step"] for c in named(result, 1, "rollback")] == [5]


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_uce_is_repaired_in_place(tmp_path, reference, launcher):
    """Rank 1's parameters and Adam state are overwritten with NaN and it raises "UCE ERROR"
    at iteration 4: stop (rank 0 leaves its collective), clean (a retry: new groups), rank 1
    repaired from rank 0 (RT_UCE_HIGHLEVEL, rebuild), rollback to 4, the same processes train
    on, every loss bit-identical."""
    result = run_trainer(tmp_path / "job", launcher, *HA, "--fault", "uce:1:4")
    assert result["code"] == 0, result["output"][-6000:]
    assert result["losses"] == reference["losses"]
    assert all(len(named(result, r, "started")) == 1 for r in range(NPROC))
    assert [(c["is_uce_error"], c["repair_type"]) for c in named(result, 1, "clean")] == \
        [(True, "retry")]
    [receive] = named(result, 1, "repair")
    assert (receive["repair_type"], receive["src"], receive["need_rebuild"], receive["step"]) == \
        ("RT_UCE_HIGHLEVEL", [0], True, 4)
    assert [c["step"] for c in named(result, 0, "rollback")] == [4]


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_dump_resumes(tmp_path, reference, launcher):
    """An unknown error on rank 1 at iteration 6: the dump of iteration 6 is saved by one
    writer and renamed, the launcher exits with 75, and a new job loading it trains
    iterations 7..10 with the fault-free run's losses."""
    save = tmp_path / "ckpt"
    result = run_trainer(tmp_path / "job", launcher, *HA, "--save", str(save),
                         "--fault", "unknown:1:6")
    assert result["code"] == 75, result["output"][-6000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (save / "iter_0000006" / "model_optim_rng.pt").is_file()
    saves = [c for r in range(NPROC) for c in named(result, r, "save_ckpt")]
    assert [c["step"] for c in saves] == [6], result["calls"]
    resumed = run_trainer(tmp_path / "resume", launcher, *HA, "--load", str(save))
    assert resumed["code"] == 0, resumed["output"][-6000:]
    assert resumed["losses"] == {i: reference["losses"][i] for i in range(7, ITERATIONS + 1)}
