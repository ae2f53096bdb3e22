"""End to end: a trainer whose fault tolerance goes through the `mindio_ttp` API only, in
MindSpeed-LLM's shape (`tests/sdk_compat/trainer.py`: its handlers do the work on CPU gloo),
runs on this project's `mindio_ttp` under `tft-run` and under plain torchrun with the usage
guide's line (`import mindio_ttp.framework_ttp` in the torchrun script). In one job per
launcher, a UCE report is repaired in place from the replica, then a SIGKILLed rank is
restarted alone and repaired from its replica (ARF), then an unknown error ends the job with
a dying-gasp checkpoint that a new job resumes from; every loss equals the fault-free run's,
bit for bit. With elastic training and MindSpeed-LLM's replica groups (two copies of each
optimizer shard), losing any rank, one after another, shrinks the job to every rank that
stays, and it trains on through the SDK's downgrade handler; losing the last holder of a
shard ends the job naming the shard; a node that comes back grows the job again through
the upgrade handlers.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mindspeed_tft.recovery import manifest
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


def launcher_command(launcher: str, folder: Path, nproc: int = NPROC) -> list[str]:
    port = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port())]
    if launcher == "tft-run":
        return [str(Path(sys.executable).parent / "tft-run"), *port]
    if launcher == "guide":
        return [str(guide_torchrun(folder)), *port]
    return [sys.executable, "-m", "torch.distributed.run", *port]


def trainer_env(run_dir: Path, ttp_port: int, logs: str = "logs") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTP_", "TFT_"))}
    env.update(PYTHONUNBUFFERED="1", TTP_PORT=str(ttp_port), TTP_LOG_PATH=str(run_dir / logs),
               PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
    return env


def read_calls(out: Path, nproc: int) -> dict[int, list[dict]]:
    return {rank: [json.loads(line) for line in path.read_text().splitlines()]
            for rank in range(nproc) if (path := out / f"calls.{rank}.jsonl").exists()}


def run_trainer(run_dir: Path, launcher: str, *args: str, timeout: float = 180,
                nproc: int = NPROC, iterations: int = ITERATIONS,
                env: dict[str, str] | None = None, ttp_port: int | None = None) -> dict:
    """Run the trainer once (on `ttp_port`, default a free one; `env`: more environment);
    returns exit code, output, losses (rank 0's) and handler calls."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = {**trainer_env(run_dir, ttp_port or free_port()), **(env or {})}
    if "--save" not in args:  # as every high-availability launch has (tft-run refuses none)
        args = (*args, "--save", str(run_dir / "save"))
    command = [*launcher_command(launcher, run_dir, nproc), str(TRAINER), "--out",
               str(run_dir / "out"), "--iterations", str(iterations), *args]
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
    path = out / "losses.0.jsonl"
    for line in (path.read_text() if path.exists() else "").splitlines():
        row = json.loads(line)
        losses[row["iteration"]] = row["loss"]  # a recomputed iteration: the later one
    return {"code": proc.returncode, "output": output, "losses": losses,
            "calls": read_calls(out, nproc)}


def only(calls: list[dict], name: str) -> list[dict]:
    """The calls of handler `name` among `calls`."""
    return [c for c in calls if c["call"] == name]


def named(result: dict, rank: int, name: str) -> list[dict]:
    return only(result["calls"].get(rank, []), name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fault-free run (plain torchrun; rank 0 hosts the controller)."""
    result = run_trainer(tmp_path_factory.mktemp("sdk-trainer") / "reference", "torchrun", *HA)
    assert result["code"] == 0, result["output"][-6000:]
    assert sorted(result["losses"]) == list(range(1, ITERATIONS + 1))
    return result


LAUNCHERS = ["tft-run", "guide"]


def split_at(result: dict, rank: int, t: float) -> tuple[list[dict], list[dict]]:
    """`rank`'s handler calls before time `t` and from it on."""
    calls = result["calls"].get(rank, [])
    return [c for c in calls if c["t"] < t], [c for c in calls if c["t"] >= t]


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_uce_and_a_kill_are_repaired_then_an_error_dumps_and_resumes(tmp_path, reference,
                                                                      launcher):
    """Three faults in one job, each handled as the SDK's user expects, every loss
    bit-identical to the fault-free run's:
    - a UCE of rank 1 at iteration 4: its parameters and Adam state are overwritten with NaN
      and it raises "UCE ERROR": stop (rank 0 leaves its collective), clean (a retry: new
      groups), rank 1 repaired from rank 0 (RT_UCE_HIGHLEVEL, rebuild), rollback to 4; the
      same processes train on.
    - a SIGKILL of rank 1 at iteration 7: its launcher restarts it alone, the restarted
      worker raises "ARF FINISH", every rank's rebuild handler makes new groups with it
      (fault ranks [1]), rank 0 sends its replica (RT_SEND) and rank 1 receives it
      (RT_RECV_REPAIR), both roll back to 7.
    - an unknown error of rank 0 at iteration 9: the dump of iteration 9 is saved by one
      writer and renamed, the launcher exits with 75, and a new job loading it trains
      iteration 10 with the fault-free run's loss."""
    save = tmp_path / "ckpt"
    result = run_trainer(tmp_path / "job", launcher, *HA, "--save", str(save), "--fault",
                         "uce:1:4", "--fault", "kill:1:7", "--fault", "unknown:0:9")
    assert result["code"] == 75, result["output"][-6000:]
    assert result["losses"] == {i: reference["losses"][i] for i in range(1, 10)}
    [uce, kill] = named(result, 1, "fault")
    assert (uce["kind"], uce["iteration"], kill["kind"], kill["iteration"]) == \
        ("uce", 4, "kill", 7)
    (uce0, kill0), (uce1, kill1) = (split_at(result, r, kill["t"]) for r in (0, 1))
    # the UCE: the same processes, repaired in place
    assert len(only(uce0, "started")) == len(only(uce1, "started")) == 1
    assert [(c["is_uce_error"], c["repair_type"]) for c in only(uce1, "clean")] == \
        [(True, "retry")]
    [receive] = only(uce1, "repair")
    assert (receive["repair_type"], receive["src"], receive["need_rebuild"], receive["step"]) == \
        ("RT_UCE_HIGHLEVEL", [0], True, 4)
    assert [c["step"] for c in only(uce0, "rollback")] == [4]
    # the kill: rank 1 restarted alone, from rank 0's replica
    assert not only(kill0, "started")
    [restarted] = only(kill1, "started")
    assert restarted["reboot"] and not restarted["reboot_again"], result["calls"]
    assert [c["fault_ranks"] for c in only(kill0, "rebuild_group")] == [[1]]
    assert [c["fault_ranks"] for c in only(kill1, "rebuild_group")] == [[1]]
    [send] = only(kill0, "repair")
    [receive] = only(kill1, "repair")
    assert (send["repair_type"], send["dst"], send["step"]) == ("RT_SEND", [1], 7)
    assert (receive["repair_type"], receive["src"], receive["need_rebuild"]) == \
        ("RT_RECV_REPAIR", [0], False)
    assert [c["step"] for c in only(kill1, "rollback")] == [7]
    # the unknown error: one dump, of iteration 9, and a new job resumes from it
    [error] = named(result, 0, "fault")
    assert (error["kind"], error["iteration"]) == ("unknown", 9)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "9"
    assert (save / "iter_0000009" / "model_optim_rng.pt").is_file()
    # the SDK checksummed what the save handler wrote, before the rename handler published it
    assert manifest.verify_folder(str(save / "iter_0000009")) == manifest.FolderVerdict(True)
    saves = [c for r in range(NPROC) for c in named(result, r, "save_ckpt")]
    assert [c["step"] for c in saves] == [9], result["calls"]
    resumed = run_trainer(tmp_path / "resume", launcher, *HA, "--load", str(save))
    assert resumed["code"] == 0, resumed["output"][-6000:]
    assert resumed["losses"] == {10: reference["losses"][10]}


@pytest.mark.multiproc
def test_a_dumped_job_leaves_no_token_and_the_next_on_its_port_registers(tmp_path):
    """Plain torchrun, rank 0 hosting the controller on TTP_PORT (MindSpeed-LLM's 8000): a
    job that ends with a dump (exit 75, which skips atexit) deletes its token file; the next
    job on the same port, started with an earlier job's token file there (as a SIGKILLed
    controller leaves it), replaces that file, registers every rank, trains to the end and
    deletes its own."""
    from mindio_ttp import _token

    port, save = free_port(), tmp_path / "ckpt"
    path = _token.token_path("127.0.0.1", port)
    try:
        dumped = run_trainer(tmp_path / "dump", "torchrun", *HA, "--save", str(save),
                             "--fault", "unknown:0:3", iterations=4, ttp_port=port)
        # plain torchrun ends with 1 when a worker fails; both ranks exited with 75
        assert dumped["code"] == 1, dumped["output"][-6000:]
        assert all(f"rank {r} exits with code 75: dying-gasp checkpoint saved at iteration 3"
                   in dumped["output"] for r in range(NPROC)), dumped["output"][-6000:]
        assert (save / "latest_checkpointed_iteration.txt").read_text() == "3"
        assert not path.exists(), dumped["output"][-6000:]
        path.write_text("0" * 64)
        path.chmod(0o600)
        resumed = run_trainer(tmp_path / "resume", "torchrun", *HA, "--load", str(save),
                              iterations=4, ttp_port=port)
        assert resumed["code"] == 0, resumed["output"][-6000:]
        assert sorted(resumed["losses"]) == [4]
        assert all(named(resumed, r, "started") for r in range(NPROC)), resumed["calls"]
        assert not path.exists()  # the SDK's destroy after training deleted it
    finally:
        path.unlink(missing_ok=True)


# -- elastic training through the ZIT handlers ------------------------------------------------
ELASTIC_ITERATIONS = 12
#: the shrunk job waits before this iteration until the job grew (the file `grown`)
GATE = 8
#: |loss - fault-free loss| after a shrink: the fp32 sums run over fewer ranks' slices (see
#: tests/test_elastic.py); observed: at most 1 ulp (DP4 and DP8, every rank position)
LOSS_ULPS = 4
#: as MindSpeed-LLM launches it: two copies of each optimizer shard (its replica groups)
ELASTIC = [*HA, "--enable-elastic-training", "--use-distributed-optimizer"]
#: no worker restarts: a killed rank gets no replacement
NO_REPLACEMENT = {"TFT_MAX_WORKER_RESTARTS": "0", "TFT_REPLACEMENT_WAIT": "2"}


@pytest.fixture(scope="module")
def elastic_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict]:
    """The fault-free run of the elastic jobs at `nproc` ranks: {iteration: rank 0's row}."""
    runs: dict[int, dict] = {}

    def reference(nproc: int) -> dict:
        if nproc not in runs:
            run_dir = tmp_path_factory.mktemp("sdk-elastic") / f"reference{nproc}"
            result = run_trainer(run_dir, "torchrun", *ELASTIC, nproc=nproc,
                                 iterations=ELASTIC_ITERATIONS)
            assert result["code"] == 0, result["output"][-6000:]
            runs[nproc] = {row["iteration"]: row for row in _rows(run_dir / "out", 0)}
        return runs[nproc]

    return reference


def assert_trained_like_the_reference(out: Path, nproc: int, worlds: dict[int, list[int]],
                                      reference: dict, first_fault: int) -> None:
    """Every iteration of `worlds` (iteration -> the ranks that trained it) trained once by
    every rank of its world, on the whole global batch (contiguous slices, the first ranks
    one sample more where the world does not divide it), with the fault-free learning rate;
    its loss bit-identical up to `first_fault`, within LOSS_ULPS fp32 ulps after it."""
    by_iteration: dict[int, list[dict]] = {}
    for rank in range(nproc):
        for row in _rows(out, rank):
            by_iteration.setdefault(row["iteration"], []).append({**row, "rank": rank})
    assert sorted(by_iteration) == sorted(worlds)
    for iteration, rows in sorted(by_iteration.items()):
        world = worlds[iteration]
        assert sorted(r["rank"] for r in rows) == world, (iteration, rows)
        assert all(r["world"] == world for r in rows), rows
        slices = sorted(tuple(r["samples"]) for r in rows)
        assert slices[0][0] == 0 and slices[-1][1] == 8, rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(slices)), rows
        assert [b - a for a, b in slices] == sorted((b - a for a, b in slices), reverse=True)
        want = reference[iteration]
        assert {r["lr"] for r in rows} == {want["lr"]}
        assert len({r["loss"] for r in rows}) == 1, rows
        loss, expected = float.fromhex(rows[0]["loss"]), float.fromhex(want["loss"])
        if iteration <= first_fault:
            assert loss == expected, (iteration, loss, expected)
        assert abs(loss - expected) <= LOSS_ULPS * float(np.spacing(np.float32(expected))), \
            (iteration, loss, expected)


#: (launch ranks, the kills in turn (rank, iterations done), the worlds after each kill)
KILLS_IN_TURN = {
    "dp4-rank-0-then-3": (4, [(0, 3), (3, 6)], [[1, 2, 3], [1, 2]]),
    "dp4-rank-1-then-2": (4, [(1, 3), (2, 6)], [[0, 2, 3], [0, 3]]),
    "dp8-ranks-0-to-3": (8, [(0, 2), (1, 4), (2, 6), (3, 8)],
                         [[1, 2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7],
                          [4, 5, 6, 7]]),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", sorted(KILLS_IN_TURN))
def test_any_lost_rank_shrinks_the_job_to_every_rank_that_stays(tmp_path, elastic_reference,
                                                                case):
    """MindSpeed-LLM's replica groups (DP4: [0, 1] and [2, 3]; shard s held by the s-th rank
    of each), elastic training under `tft-run`, no replacements: every rank position of DP4
    and the first half of DP8's is killed, one after another. Each loss shrinks the job to
    every rank that stays (the SDK's controller keeps the same), through
    `zit_downgrade_rebuild(new_dp_ranks, new_world_ranks)` on each of them, whose checks
    (tests/sdk_compat/trainer.py) are what MindSpeed-LLM's scale-in takes for granted: its
    DP group without exactly the lost ranks, a holder of every shard among who stays. The
    job trains every iteration on the whole global batch. In DP8, rank 4 killed last holds
    the last copy of shard 0: the job ends with code 1 naming the shard, its last dump (of
    the iteration before) published."""
    nproc, kills, worlds = KILLS_IN_TURN[case]
    last = nproc == 8
    if last:
        kills = [*kills, (4, 10)]
    iterations = kills[-1][1] if last else ELASTIC_ITERATIONS
    run_dir = tmp_path / "job"
    result = run_trainer(run_dir, "tft-run", *ELASTIC, *(a for r, at in kills for a in (
        "--fault", f"kill:{r}:{at}")), nproc=nproc, iterations=ELASTIC_ITERATIONS,
        env=NO_REPLACEMENT, timeout=300)
    assert result["code"] == (1 if last else 0), result["output"][-6000:]
    # (iterations done, the world after) of each shrink
    shrinks = [(at, world) for (_, at), world in zip(kills[:len(worlds)], worlds, strict=True)]
    for rank in range(nproc):
        calls = named(result, rank, "zit_downgrade_rebuild")
        expected = [(at, w) for at, w in shrinks if rank in w]
        assert [(c["iteration"], c["new_dp_ranks"]) for c in calls] == expected, (rank, calls)
        assert [c["new_world_ranks"] for c in calls] == [w for _, w in expected]
    world_at, current = {}, list(range(nproc))
    for iteration in range(1, iterations + 1):
        current = next((w for at, w in shrinks if at == iteration - 1), current)
        world_at[iteration] = current
    assert_trained_like_the_reference(run_dir / "out", nproc, world_at,
                                      elastic_reference(nproc), first_fault=kills[0][1])
    if last:
        assert "dump impossible: no healthy holder for dense shard 0 at lock step 10" in \
            result["output"]
        assert (run_dir / "save" / "latest_checkpointed_iteration.txt").read_text() == "8"


def _start_node(run_dir: Path, node_rank: int, ports: tuple[int, int], args: list[str],
                logs: str) -> subprocess.Popen:
    """One of two `tft-run` launchers (2 ranks each) of the job in `run_dir`."""
    master_port, ttp_port = ports
    env = {**trainer_env(run_dir, ttp_port, logs), "TFT_MAX_WORKER_RESTARTS": "0",
           "TFT_REPLACEMENT_WAIT": "2"}
    command = [str(Path(sys.executable).parent / "tft-run"), "--nnodes", "2", "--node-rank",
               str(node_rank), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(master_port), str(TRAINER), "--out", str(run_dir / "out"),
               "--iterations", str(ELASTIC_ITERATIONS), *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _rows(out: Path, rank: int) -> list[dict]:
    path = out / f"losses.{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _grown(out: Path) -> bool:
    """Every rank ran its upgrade rollback."""
    calls = read_calls(out, 4)
    return all(any(c["call"] == "zit_upgrade_rollback" for c in calls.get(r, []))
               for r in range(4))


@pytest.mark.multiproc
def test_a_lost_node_shrinks_the_job_and_its_return_grows_it(tmp_path, elastic_reference):
    """DP4 over two launchers (ranks 2 and 3 on node 1), MindSpeed-LLM's replica groups, no
    restarts allowed: node 1's ranks are SIGKILLed, rank 3 at iteration 3, rank 2 at 5, and
    get no replacement. The job shrinks to ranks 0, 1 and 2, then to 0 and 1 (holding shards
    0 and 1), through `zit_downgrade_rebuild`, and trains on from memory. A replacement
    launcher brings ranks 2 and 3 back: at the
    next step boundary every rank calls `zit_upgrade_rebuild([2, 3])`, ranks 0 and 1 send
    their shard's state to 2 and 3, the other holders of shards 0 and 1 (`zit_upgrade_repair`,
    RT_SEND / RT_RECV_REPAIR), all roll back to the lock step (`zit_upgrade_rollback`) and
    the job finishes at DP4. Every iteration is trained once, on the whole global batch,
    with the fault-free learning rate; losses bit-identical up to the kill, within LOSS_ULPS
    fp32 ulps after it."""
    ref_rows = elastic_reference(4)
    run_dir = tmp_path / "job"
    out = run_dir / "out"
    ports = (free_port(), free_port())
    args = [*ELASTIC, "--save", str(run_dir / "save"), "--fault", "kill:3:3",
            "--fault", "kill:2:5", "--gate", f"{GATE}:{run_dir / 'grown'}"]
    node0 = _start_node(run_dir, 0, ports, args, "logs0")
    node1 = _start_node(run_dir, 1, ports, args, "logs1")
    replacement = None
    try:
        # ranks 2 and 3 killed: node 1's launcher ends (with their failure, as in
        # tests/test_elastic.py)
        output1, _ = node1.communicate(timeout=180)
        replacement = _start_node(run_dir, 1, ports, args, "logs1b")  # the node returns
        deadline = time.monotonic() + 180
        while not _grown(out):
            assert node0.poll() is None and time.monotonic() < deadline, "no grow"
            time.sleep(0.2)
        (run_dir / "grown").touch()
        output0, _ = node0.communicate(timeout=180)
        output1b, _ = replacement.communicate(timeout=60)
    finally:
        for proc in (node0, node1, replacement):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    assert node0.returncode == 0, output0[-6000:]
    assert replacement.returncode == 0, output1b[-3000:]
    calls = read_calls(out, 4)

    # the shrink: stop and clean, the dump of the lock step, the downgrade on the ranks
    # that stay
    both = [([0, 1, 2], [0, 1, 2], 3), ([0, 1], [0, 1], 5)]
    for rank, expected in {0: both, 1: both, 2: both[:1]}.items():
        shrinks = only(calls[rank], "zit_downgrade_rebuild")
        assert [(c["new_dp_ranks"], c["new_world_ranks"], c["iteration"]) for c in shrinks] \
            == expected
        assert {json.loads(c["params"])["scale-in-strategy"] for c in shrinks} == {"DP"}
        assert [c["call"] for c in calls[rank]].index("clean") < calls[rank].index(shrinks[0])
    # the grow: rebuild, repair, rollback on every rank, in that order
    sources = {0: ("RT_SEND", [0], [2]), 1: ("RT_SEND", [1], [3]),
               2: ("RT_RECV_REPAIR", [0], [2]), 3: ("RT_RECV_REPAIR", [1], [3])}
    for rank in range(4):
        [up] = only(calls[rank], "zit_upgrade_rebuild")
        assert up["rank_list"] == [2, 3] and json.loads(up["params"]) == \
            {"scale-out-strategy": "DP"}
        [repair] = [c for c in only(calls[rank], "repair") if c["t"] > up["t"]]
        assert (repair["repair_type"], repair["src"], repair["dst"], repair["step"],
                repair["need_rebuild"]) == (*sources[rank], GATE, False)
        [rollback] = only(calls[rank], "zit_upgrade_rollback")
        assert rollback["step"] == GATE
        order = [calls[rank].index(c) for c in (up, repair, rollback)]
        assert order == sorted(order), calls[rank]
    # each dump written by one holder of each shard
    assert sorted(c["step"] for r in range(4) for c in only(calls[r], "save_ckpt")) == \
        [3, 3, 5, 5, GATE, GATE]
    worlds = {i: [0, 1, 2] if 3 < i <= 5 else [0, 1] if 5 < i <= GATE else [0, 1, 2, 3]
              for i in range(1, ELASTIC_ITERATIONS + 1)}
    assert_trained_like_the_reference(out, 4, worlds, ref_rows, first_fault=3)
