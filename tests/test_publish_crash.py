"""Crash-safe checkpoints: a publisher SIGKILLed at any point of publishing leaves the
tracker on a complete checkpoint that loads weights-only and resumes bit-exact; `--load` of
a missing checkpoint follows Megatron-LM's rule; a truncated or malicious file is refused
with an error naming it.

One real 2-rank training run (the reference trainer, high availability on, `--load` of a
folder that does not exist: the warning case) writes periodic checkpoints of iterations 3
and 6 and is the fault-free reference. Every publish crash is a real process killed by
`TFT_INJECT`'s `kill` at a point of `layout.publish_checkpoint` (phase `publish`), forked
from one driver process (one torch import for all of them).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mindspeed_tft.recovery.layout import (
    CHECKPOINT_SAFE_GLOBALS,
    TRACKER_FILENAME,
    CheckpointError,
    exchange_paths,
    load_file,
    resolve_checkpoint,
)
from mindspeed_tft.recovery.manifest import MANIFEST_FILENAME
from tests.jobs import HA_ARGS, REPO, run_tiny_job

CONFIG = {"layout": "dp4", "env": {"NPROC": "2"}, "ha_args": HA_ARGS, "train_iters": 6,
          "save_interval": 3}
ORIGIN = "ORIGIN"  # a file only the new copy of a republished checkpoint has


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The fault-free 2-rank run, started with `--load` of a folder that does not exist."""
    run_dir = tmp_path_factory.mktemp("publish-crash") / "trained"
    result = run_tiny_job(run_dir, load_dir=run_dir / "no-such-dir", **CONFIG)
    assert result.returncode == 0, result.describe()
    return result


def _tree(top: Path) -> dict[str, bytes]:
    return {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*"))
            if p.is_file()}


# --- --load of a missing checkpoint ------------------------------------------------------


@pytest.mark.multiproc
def test_load_of_a_missing_dir_warns_loudly_and_trains_from_scratch(trained):
    missing = trained.run_dir / "no-such-dir"
    lines = trained.output.splitlines()
    warning = [
        f"WARNING: could not find the metadata file {missing}/{TRACKER_FILENAME}",
        "    will not load any checkpoints and will start from random",
        f"[mindspeed-tft] WARNING: --load {missing}: no checkpoint (the folder does not "
        "exist); training starts from iteration 0 (--exit-on-missing-checkpoint makes this "
        "an error)",
    ]
    start = lines.index(warning[0])
    assert lines[start:start + 3] == warning
    assert lines.count(warning[0]) == 1  # rank 0 only
    assert "[mindspeed-tft] training from iteration 0 to 6" in lines
    assert sorted(trained.losses()) == [1, 2, 3, 4, 5, 6]


@pytest.mark.multiproc
def test_exit_on_missing_checkpoint_stops_every_rank_with_code_1(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_tiny_job(tmp_path / "run", load_dir=empty,
                          extra_args=["--exit-on-missing-checkpoint"], **CONFIG)
    assert result.returncode == 1, result.describe()
    # each rank exits 1 by itself, unless torchrun's agent SIGTERMed it first, once a peer
    # had exited 1 (plain torchrun stops the group at the first failure)
    codes = result.exit_codes()
    assert sorted(codes) == [0, 1] and set(codes.values()) <= {1, -15}, result.describe()
    root_cause = result.output.split("Root Cause (first observed failure):")[1]
    assert re.search(r"exitcode\s+: 1 \(pid", root_cause), result.describe()
    lines = result.output.splitlines()
    assert f"WARNING: could not find the metadata file {empty}/{TRACKER_FILENAME}" in lines
    assert ">> '--exit-on-missing-checkpoint' set ... exiting. <<" in lines
    assert (f"[mindspeed-tft] ERROR: --load {empty}: no checkpoint (it has no {TRACKER_FILENAME}"
            "); exiting with code 1 (--exit-on-missing-checkpoint)") in lines
    assert not result.named("iteration")
    assert "will start from random" not in result.output


# --- publishing killed at each point -----------------------------------------------------

DRIVER = textwrap.dedent("""
    import json, os, sys
    from mindspeed_tft.recovery import layout

    results = []
    for case in json.loads(sys.argv[1]):
        pid = os.fork()
        if pid == 0:
            os.environ["TFT_INJECT"] = case["inject"]
            os.environ["TFT_EVENTS_FILE"] = case["events"]
            layout.USE_EXCHANGE = case["exchange"]
            layout.publish_checkpoint(case["root"], case["iteration"])
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        results.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                       else os.WEXITSTATUS(status))
    print(json.dumps(results))
""")

POINTS = ("written", "synced", "aside", "renamed", "tracker")
# (scenario, point) -> (what the publisher does, iteration the tracker names afterwards,
# which copy of it is published): "new" publishes iteration 6 beside the published 3;
# "replace" republishes iteration 3 over itself (a dump of the lock step of the last periodic
# save) with RENAME_EXCHANGE, "replace-no-exchange" without it (two renames).
EXPECTED = {
    ("new", "written"): (-9, 3, "old"), ("new", "synced"): (-9, 3, "old"),
    ("new", "aside"): (0, 6, "new"),  # never reached: there was no iter_6 to move aside
    ("new", "renamed"): (-9, 3, "old"), ("new", "tracker"): (-9, 6, "new"),
    ("replace", "written"): (-9, 3, "old"), ("replace", "synced"): (-9, 3, "old"),
    ("replace", "aside"): (0, 3, "new"),  # never reached: the exchange is one step
    ("replace", "renamed"): (-9, 3, "new"), ("replace", "tracker"): (-9, 3, "new"),
    ("replace-no-exchange", "written"): (-9, 3, "old"),
    ("replace-no-exchange", "synced"): (-9, 3, "old"),
    ("replace-no-exchange", "aside"): (-9, 3, "old"),  # iter_3 is put back from iter_3_old
    ("replace-no-exchange", "renamed"): (-9, 3, "new"),
    ("replace-no-exchange", "tracker"): (-9, 3, "new"),
}


def _exchange_supported(where: Path) -> bool:
    a, b = where / "probe-a", where / "probe-b"
    a.mkdir()
    b.mkdir()
    try:
        return exchange_paths(str(a), str(b))
    finally:
        shutil.rmtree(a)
        shutil.rmtree(b)


def _prepare(root: Path, source: Path, scenario: str) -> int:
    """`root` with iteration 3 published and a complete `iter_X_tmp` to publish; returns X."""
    shutil.copytree(source / "iter_0000003", root / "iter_0000003")
    (root / TRACKER_FILENAME).write_text("3")
    iteration = 6 if scenario == "new" else 3
    tmp = root / f"iter_{iteration:07d}_tmp"
    shutil.copytree(source / f"iter_{iteration:07d}", tmp)
    (tmp / ORIGIN).write_text("new")
    return iteration


def _published(root: Path, source: Path) -> tuple[int, str]:
    """What `latest` names under `root` (through the loaders' `resolve_checkpoint`), checked
    complete: the files of the reference run's checkpoint of that iteration, byte for byte,
    each loading weights-only. Returns (iteration, which copy: old or new)."""
    found = resolve_checkpoint(str(root))
    assert found is not None
    iteration, directory = found
    files = _tree(Path(directory))
    origin = files.pop(ORIGIN, b"old").decode()
    assert files == _tree(source / f"iter_{iteration:07d}"), (root, sorted(files))
    for name in files:
        if name.endswith(MANIFEST_FILENAME):  # JSON beside the tensors: compared byte for byte
            continue
        loaded = load_file(os.path.join(directory, name), CHECKPOINT_SAFE_GLOBALS)
        assert isinstance(loaded, dict)
    return iteration, origin


@pytest.fixture(scope="module")
def crashed(trained, tmp_path_factory):
    """Every (scenario, point) publish, killed there: case -> (root, exit status, events)."""
    source = trained.checkpoint_dir
    base = tmp_path_factory.mktemp("crashes")
    scenarios = ["new", "replace-no-exchange"]
    if _exchange_supported(base):
        scenarios.insert(1, "replace")
    cases, roots = [], {}
    for scenario in scenarios:
        for point in POINTS:
            root = base / f"{scenario}-{point}"
            root.mkdir()
            iteration = _prepare(root, source, scenario)
            roots[scenario, point] = root
            cases.append({"root": str(root), "iteration": iteration,
                          "exchange": scenario == "replace",
                          "events": str(root.parent / f"{root.name}.events"),
                          "inject": f"kill:rank=0,step={iteration - 1},phase=publish,"
                                    f"point={point}"})
    env = {k: v for k, v in os.environ.items() if k not in ("TFT_INJECT", "RANK")}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    statuses = json.loads(proc.stdout.splitlines()[-1])
    # the state a kill between two renames leaves, before any loader repaired it
    shutil.copytree(roots["replace-no-exchange", "aside"], base / "between-renames")
    outcome = {}
    for case, key, status in zip(cases, roots, statuses, strict=True):
        events_file = Path(case["events"])
        events = ([json.loads(line) for line in events_file.read_text().splitlines()]
                  if events_file.exists() else [])
        outcome[key] = (roots[key], status, events)
    return outcome


@pytest.mark.multiproc
@pytest.mark.parametrize(("scenario", "point"), sorted(EXPECTED))
def test_publish_killed_at_a_point_leaves_latest_on_a_complete_checkpoint(
    scenario, point, crashed, trained
):
    if (scenario, point) not in crashed:
        pytest.skip("this file system cannot exchange two names atomically")
    root, status, events = crashed[scenario, point]
    code, iteration, origin = EXPECTED[scenario, point]
    assert status == code
    fired = [(e["event"], e["phase"], e["point"], e["kind"]) for e in events]
    assert fired == ([("fault_injected", "publish", point, "kill")] if code else [])
    assert _published(root, trained.checkpoint_dir) == (iteration, origin)
    if scenario == "replace-no-exchange" and point == "aside":
        # the one state a crash between two renames leaves: put back by the loader
        assert sorted(p.name for p in (root.parent / "between-renames").iterdir()) == [
            "iter_0000003_old", "iter_0000003_tmp", TRACKER_FILENAME]
        assert not (root / "iter_0000003_old").exists()


@pytest.mark.multiproc
def test_resume_from_a_publish_killed_between_its_renames_is_bit_exact(
    crashed, trained, tmp_path
):
    """The tracker names 3, `iter_3` was moved aside and the new copy not yet renamed in:
    the reference trainer's `--load` puts it back and resumes like the fault-free run."""
    root, status, _ = crashed["replace-no-exchange", "aside"]
    assert status == -signal.SIGKILL
    crashed_copy = tmp_path / "crashed"
    shutil.copytree(root.parent / "between-renames", crashed_copy)
    assert sorted(p.name for p in crashed_copy.iterdir()) == [
        "iter_0000003_old", "iter_0000003_tmp", TRACKER_FILENAME]
    resumed = run_tiny_job(tmp_path / "resumed", load_dir=crashed_copy, **CONFIG)
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded checkpoint {crashed_copy} at iteration 3" in resumed.output
    expected = trained.losses()
    assert resumed.losses() == {it: expected[it] for it in (4, 5, 6)}


# --- corrupt, truncated and malicious files ----------------------------------------------


def test_truncated_checkpoint_file_names_its_path(trained, tmp_path):
    source = trained.checkpoint_dir / "iter_0000006" / "mp_rank_00"
    for name in ("model_optim_rng.pt", "distrib_optim.pt"):
        data = (source / name).read_bytes()
        path = tmp_path / name
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError) as info:
            load_file(str(path), CHECKPOINT_SAFE_GLOBALS)
        assert str(info.value).startswith(f"{path} cannot be read (truncated or corrupt?): ")


def test_model_file_needs_the_allow_list_and_nothing_more(trained):
    path = trained.checkpoint_dir / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_file(str(path), CHECKPOINT_SAFE_GLOBALS)
    assert sorted(state) == ["args", "checkpoint_version", "iteration", "model",
                             "opt_param_scheduler", "optimizer", "rng_state"]
    assert state["iteration"] == 6 and state["args"].consumed_train_samples == 6 * 16
    with pytest.raises(CheckpointError) as info:
        load_file(str(path))
    assert str(info.value) == (
        f"{path} was refused: it holds something other than tensors and the allowed types "
        "(weights-only load, nothing in it was run): WeightsUnpickler error: Unsupported "
        "global: GLOBAL argparse.Namespace was not an allowed global by default")


class _Planted:
    """Unpickling this calls `os.system`: what a planted shard file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_shard_file_is_refused_without_running_it(tmp_path):
    """A shard file planted in the save directory: the assembling rank's read of it
    (`dump._read_shards`) refuses it and runs nothing."""
    from mindspeed_tft.recovery.dump import DumpError, _read_shards

    marker = tmp_path / "pwned"
    shards = tmp_path / "iter_0000007_tmp" / "mp_rank_00" / "tft_shards"
    shards.mkdir(parents=True)
    path = shards / "shard_001.pt"
    torch.save({"iteration": 7, "shard": 1, "optimizers": [_Planted(marker)]}, path)
    with pytest.raises(DumpError) as info:
        _read_shards(str(shards), 2, 7, in_memory={0: {"iteration": 7, "shard": 0}})
    assert not marker.exists()
    assert str(info.value).startswith(
        f"shard 1 cannot be assembled: {path} was refused: it holds something other than "
        "tensors and the allowed types (weights-only load, nothing in it was run): ")
    assert "GLOBAL posix.system" in str(info.value)
    with pytest.raises(pickle.UnpicklingError):  # what torch says, for the record
        torch.load(path, weights_only=True)
    assert not marker.exists()
    # the same file loaded the old way runs the planted command: the test is real
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_everything_is_fsynced_before_it_is_published(tmp_path, monkeypatch):
    """The order of fsyncs and renames in one publish over an existing `iter_X` (what a
    killed process cannot show: durability across power loss)."""
    from mindspeed_tft.recovery import layout

    root = tmp_path / "save"
    for name in ("iter_0000004", "iter_0000004_tmp"):
        (root / name / "mp_rank_00").mkdir(parents=True)
        for file in ("model_optim_rng.pt", "distrib_optim.pt"):
            (root / name / "mp_rank_00" / file).write_bytes(name.encode())
    (root / TRACKER_FILENAME).write_text("4")
    tmp = root / "iter_0000004_tmp"
    expected_synced = {str(p) for p in tmp.rglob("*")} | {str(tmp)}
    log: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        log.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(layout, "USE_EXCHANGE", False)  # renames only: all visible to os.replace
    layout.publish_checkpoint(str(root), 4)
    renames = [i for i, entry in enumerate(log) if entry[0] == "replace"]
    synced_first = {entry[1] for entry in log[:renames[0]]}
    assert expected_synced <= synced_first
    tracker_tmp = str(root / f".{TRACKER_FILENAME}.tmp")
    final, old = str(root / "iter_0000004"), str(root / "iter_0000004_old")
    assert [log[i][1:] for i in renames] == [
        (final, old), (str(tmp), final), (tracker_tmp, str(root / TRACKER_FILENAME))]
    between = log[renames[1] + 1:renames[2]]
    assert ("fsync", str(root)) in between and ("fsync", tracker_tmp) in between
    assert log[renames[2] + 1:] == [("fsync", str(root))]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", TRACKER_FILENAME]


def test_tracker_naming_a_missing_folder_is_an_error_until_a_publish_replaces_it(tmp_path):
    from mindspeed_tft.recovery.layout import publish_checkpoint

    (tmp_path / TRACKER_FILENAME).write_text("9")
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint(str(tmp_path))
    assert str(info.value) == (
        f"{tmp_path}/{TRACKER_FILENAME} names iteration 9, but {tmp_path}/iter_0000009 does "
        "not exist: the checkpoint directory was damaged or moved")
    (tmp_path / "iter_0000009_tmp" / "mp_rank_00").mkdir(parents=True)
    publish_checkpoint(str(tmp_path), 9)
    assert resolve_checkpoint(str(tmp_path)) == (9, f"{tmp_path}/iter_0000009")


# --- a bad tracker: refused in one line, exit 2 ------------------------------------------

_NOT_A_CHECKPOINT = ("not a checkpoint to load; allowed: an iteration number above 0 whose "
                     "iter_XXXXXXX folder exists, or 'release' (Megatron-LM's release "
                     "checkpoint)")


@pytest.mark.parametrize("text", ["latest", "-4", "0", "9"])
def test_a_bad_tracker_is_refused_in_one_line_with_exit_2(tmp_path, capsys, text):
    """What both hosts' `--load` runs before reading any checkpoint (`verify_for_load`: the
    Megatron-LM adaptor's `manifest.before_load`; the reference trainer's `load_checkpoint`
    goes through the same `resolve_for_load`): one line naming the tracker and what it
    holds, and exit 2; in a repair the error is raised (the repair fails, the job dumps)."""
    from mindspeed_tft.recovery import manifest

    tracker = tmp_path / TRACKER_FILENAME
    tracker.write_text(text + "\n")
    why = (f"{tracker} names iteration 9, but {tmp_path}/iter_0000009 does not exist: the "
           "checkpoint directory was damaged or moved") if text == "9" else \
        f"{tracker} holds {text!r}: {_NOT_A_CHECKPOINT}"
    with pytest.raises(SystemExit) as exited:
        manifest.verify_for_load(str(tmp_path), "mp_rank_00", True, 0, startup=True)
    assert exited.value.code == manifest.CORRUPT_CHECKPOINT_EXIT_CODE == 2
    assert capsys.readouterr().err == f"[mindspeed-tft] error: --load {tmp_path}: {why}\n"
    with pytest.raises(CheckpointError) as raised:
        manifest.verify_for_load(str(tmp_path), "mp_rank_00", True, 0, startup=False)
    assert str(raised.value) == why
    tracker.write_text("release")  # Megatron-LM's own: passed to its loader
    manifest.verify_for_load(str(tmp_path), "mp_rank_00", True, 0, startup=True)


@pytest.mark.multiproc
def test_the_reference_trainer_refuses_a_bad_tracker_with_exit_2(tmp_path):
    """A real 2-rank start of the reference trainer with `--load` of a folder whose tracker
    holds `latest`: every rank stops with code 2 and its one line, no traceback of its own
    (plain torchrun reports its failed children with one of its own)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / TRACKER_FILENAME).write_text("latest\n")
    result = run_tiny_job(tmp_path / "run", load_dir=bad, **CONFIG)
    codes = result.exit_codes()
    assert 2 in codes.values() and set(codes.values()) <= {2, -15}, result.describe()
    line = (f"[mindspeed-tft] error: --load {bad}: {bad}/{TRACKER_FILENAME} holds 'latest': "
            f"{_NOT_A_CHECKPOINT}")
    lines = result.output.splitlines()
    assert lines.count(line) == list(codes.values()).count(2), result.describe()
    assert "Error:" not in result.output.split("ChildFailedError")[0], result.describe()
    assert not result.named("iteration")
