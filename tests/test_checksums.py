"""Checksummed state: the manifest beside a checkpoint's files (`recovery.manifest`) and the
checksum of a shard copied in a repair (`replica.transfer`).

Unit tests on real torch files: every byte of every tensor is covered, a damaged one is
named by its tensor, a checkpoint without a manifest loads unverified. The multi-process
test injects a damaged shard into a real repair (`TFT_INJECT` kind corrupt): the repair
fails and the job ends in the dump, never training on the damaged state. The `--load` of a
tampered dump is refused in both hosts in tests/test_dump.py and tests/test_megatron_lm.py.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil

import pytest
import torch

from mindspeed_tft.faults import FaultSpecError, check_ranks, parse_fault_spec
from mindspeed_tft.recovery import manifest
from tests.jobs import HA_ARGS, STANDARD, run_tiny_job


def _checkpoint(root, iteration: int = 4) -> str:
    folder = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00")
    os.makedirs(folder)
    torch.manual_seed(iteration)
    state = {"args": argparse.Namespace(iteration=iteration), "iteration": iteration,
             "model": {"embedding.weight": torch.randn(64, 32),
                       "decoder.final_layernorm.weight": torch.ones(32, dtype=torch.bfloat16)},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(300), "step": torch.tensor(4.)}}}}
    torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
    torch.save({"buckets": [torch.randn(1000)]}, os.path.join(folder, "distrib_optim.pt"))
    manifest.write_manifest(folder, iteration)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return folder


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x7F]))


TENSORS = {("model_optim_rng.pt", "model/embedding.weight"),
           ("model_optim_rng.pt", "model/decoder.final_layernorm.weight"),
           ("model_optim_rng.pt", "optimizer/state/0/exp_avg"),
           ("model_optim_rng.pt", "optimizer/state/0/step"),
           ("distrib_optim.pt", "buckets/0")}


def test_a_damaged_byte_of_any_tensor_is_named_by_its_tensor(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt")
    assert manifest.verify_folder(folder) == manifest.FolderVerdict(True)
    pristine = tmp_path / "pristine"
    shutil.copytree(folder, pristine)
    seen = set()
    rng = random.Random(52)
    for name in ("model_optim_rng.pt", "distrib_optim.pt"):
        path = os.path.join(folder, name)
        names = manifest.tensor_names(path)
        for member, paths in names.items():
            record = next(r for r in manifest.file_digests(path)["records"] if r[0] == member)
            _flip(path, record[1] + rng.randrange(record[2]))  # anywhere in its bytes
            verdict = manifest.verify_folder(folder)
            assert verdict.problem == (f"{path}: bytes differ from the manifest in tensor "
                                       f"{paths[0]} (zip member {member})")
            seen.add((name, paths[0]))
            shutil.copy(pristine / name, path)
            assert manifest.verify_folder(folder).verified
    assert seen == TENSORS


def test_damage_outside_the_tensors_truncation_and_strays_are_refused(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt")
    path = os.path.join(folder, "model_optim_rng.pt")
    data = open(path, "rb").read()
    pickled = next(r for r in manifest.file_digests(path)["records"]
                   if r[0].endswith("data.pkl"))
    _flip(path, pickled[1] + pickled[2] // 2)
    problem = manifest.verify_folder(folder).problem
    assert problem is not None and "its pickled structure (model_optim_rng/data.pkl)" in problem
    with open(path, "wb") as f:
        f.write(data[:-100])
    assert manifest.verify_folder(folder).problem == (
        f"{path}: it has {len(data) - 100} bytes, the manifest says {len(data)} (truncated?)")
    with open(path, "wb") as f:
        f.write(data)
    torch.save({}, os.path.join(folder, "planted.pt"))
    assert manifest.verify_folder(folder).problem == (
        f"{os.path.join(folder, 'planted.pt')}: not in its manifest")
    os.remove(os.path.join(folder, "planted.pt"))
    os.remove(os.path.join(folder, "distrib_optim.pt"))
    assert manifest.verify_folder(folder).problem == (
        f"{os.path.join(folder, 'distrib_optim.pt')}: the file is missing")


def test_no_manifest_is_unverified_and_a_mismatch_exits_2_pointing_to_the_previous(
        tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    _checkpoint(root, 2)
    folder = _checkpoint_again(root, 4)
    os.remove(os.path.join(folder, manifest.MANIFEST_FILENAME))
    manifest.verify_for_load(root, "mp_rank_00", True, 0, startup=True)
    assert capsys.readouterr().out == (
        f"[mindspeed-tft] checkpoint {root}/iter_0000004 has no tft_manifest.json in mp_rank_00 "
        "(not written by mindspeed-tft): loaded unverified\n")

    manifest.write_manifest(folder, 4)
    path = os.path.join(folder, "distrib_optim.pt")
    record = next(r for r in manifest.file_digests(path)["records"] if r[0].endswith("data/0"))
    _flip(path, record[1] + 17)
    with pytest.raises(SystemExit) as exited:
        manifest.verify_for_load(root, "mp_rank_00", True, 0, startup=True)
    assert exited.value.code == manifest.CORRUPT_CHECKPOINT_EXIT_CODE == 2
    line = capsys.readouterr().err
    assert line == (
        f"[mindspeed-tft] error: checkpoint {root}/iter_0000004 is corrupt, not loaded: {path}: "
        "bytes differ from the manifest in tensor buckets/0 (zip member distrib_optim/data/0); "
        f"the previous checkpoint is {root}/iter_0000002: to resume from it, write 2 into "
        f"{root}/latest_checkpointed_iteration.txt\n")
    with pytest.raises(manifest.ManifestMismatch):  # a repair fails instead (then: the dump)
        manifest.verify_for_load(root, "mp_rank_00", True, 0, startup=False)
    # a rank that does not verify (data-parallel rank > 0) takes the collective's verdict
    manifest.verify_for_load(root, "mp_rank_00", False, 1, startup=True)
    # Megatron-LM's release checkpoints (tracker "release") are its own to read
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    manifest.verify_for_load(root, "mp_rank_00", True, 0, startup=True)


def _checkpoint_again(root: str, iteration: int) -> str:
    folder = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00")
    shutil.copytree(os.path.join(root, "iter_0000002", "mp_rank_00"), folder)
    manifest.write_manifest(folder, iteration)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return folder


def test_the_placeholder_unpickler_runs_nothing(tmp_path):
    """A pickle naming os.system is read as a placeholder: nothing is imported or run."""
    import pickle
    import zipfile

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("evil/data.pkl", pickle.dumps({"x": Evil()}))
    assert manifest.tensor_names(str(path)) == {}
    assert not marker.exists()


def test_corrupt_goes_with_phase_transfer_and_ranks_stay_inside_the_world():
    (item,) = parse_fault_spec("corrupt:rank=1,step=5,phase=transfer")
    assert (item.kind, item.phase) == ("corrupt", "transfer")
    for spec in ("corrupt:rank=1,step=5", "kill:rank=1,step=5,phase=transfer"):
        with pytest.raises(FaultSpecError, match="kind corrupt goes with phase transfer"):
            parse_fault_spec(spec)
    with pytest.raises(FaultSpecError) as info:
        check_ranks(parse_fault_spec("kill:rank=1,step=3;kill:rank=7,step=3"), 2)
    assert str(info.value) == ("TFT_INJECT item 2 'kill:rank=7,step=3,phase=forward': rank 7 is "
                               "outside the job's 2 ranks; allowed: 0 to 1")
    check_ranks(parse_fault_spec("kill:rank=1,step=3"), 2)


@pytest.mark.multiproc
def test_a_shard_damaged_on_the_way_fails_the_repair_and_the_job_dumps(tmp_path):
    """A UCE in rank 2's optimizer state at step 7: its shard comes back from its replica
    holder, and the holder's copy is damaged on the way (one byte, after its checksum).
    The receiver refuses it: the repair fails, and the job ends in the dump of the lock step,
    written by the holders (never by the rank that holds the damaged bytes). No iteration
    after the lock step is trained."""
    config = {"layout": "dp4", **STANDARD}
    corrupt = ";".join(f"corrupt:rank={r},step=1,phase=transfer" for r in (0, 1, 3))
    job = run_tiny_job(tmp_path, ha_args=f"{HA_ARGS} --enable-hbmfault-repair",
                       inject=f"uce:rank=2,step=7,phase=backward,target=optimizer;{corrupt}",
                       **config)
    assert job.returncode != 0
    assert job.exit_codes() == dict.fromkeys(range(4), 75), job.describe()  # plain torchrun
    fired = [e for e in job.named("fault_injected") if e["kind"] == "corrupt"]
    assert len(fired) == 1 and fired[0]["lock_step"] == 7, job.describe()
    (failed,) = job.named("repair_failed")
    assert failed["reason"].startswith(
        f"repair failed: rank 2: ShardTransferError: the shard from rank {fired[0]['rank']} "
        "arrived damaged: 1 of "), failed
    assert [e["strategy"] for e in job.named("strategy")] == ["retry"], job.describe()
    assert [e["action"] for e in job.named("action")][-2:] == ["dump", "rename"]
    assert not job.named("repaired")
    assert 2 not in {e["rank"] for e in job.named("dump_written")}  # the damaged rank
    assert [e["iteration"] for e in job.named("dump_saved")] == [7]
    assert max(e["iteration"] for e in job.named("iteration")) == 7
    dump = job.checkpoint_dir / "iter_0000007" / "mp_rank_00"
    assert manifest.verify_folder(str(dump)).verified


def test_new_save_folders_are_0750_with_the_save_folders_group(tmp_path):
    from mindspeed_tft.recovery.layout import make_save_dirs, save_file

    old = os.umask(0o022)
    try:
        root = tmp_path / "ckpt"
        make_save_dirs(str(root / "iter_0000004_tmp" / "mp_rank_00"), str(root))
        for folder in (root, root / "iter_0000004_tmp", root / "iter_0000004_tmp" / "mp_rank_00"):
            assert folder.stat().st_mode & 0o777 == 0o750, folder
        # a save folder the user made keeps its mode, and folders in it take it; files and
        # folders take the save folder's group
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o755)
        mine.chmod(0o755)
        group = 100 if os.getuid() == 0 else os.getgid()
        os.chown(mine, -1, group)
        make_save_dirs(str(mine / "iter_0000001"), str(mine))
        save_file({"x": torch.ones(1)}, str(mine / "iter_0000001" / "model_optim_rng.pt"))
        assert (mine / "iter_0000001").stat().st_mode & 0o777 == 0o755
        assert (mine / "iter_0000001").stat().st_gid == group
        assert (mine / "iter_0000001" / "model_optim_rng.pt").stat().st_gid == group
        assert (mine / "iter_0000001" / "model_optim_rng.pt").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


_MEGATRON_LOAD = r"""
import argparse, sys
import torch.distributed as dist
import megatron.training.checkpointing as checkpointing
from megatron.core import parallel_state as ps
from mindspeed_tft import patches

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
ps.initialize_model_parallel()
patches.install("sdk-load-verify")  # what mindio_ttp's tft_init_processor installs
args = argparse.Namespace(ckpt_format="torch", auto_detect_ckpt_format=False,
                          non_persistent_ckpt_type=None, use_dist_ckpt=False,
                          non_persistent_global_ckpt_dir=None, ckpt_step=None,
                          exit_on_missing_checkpoint=False)
checkpointing._load_base_checkpoint(sys.argv[1], args, rank0=False)
print("Megatron-LM read the checkpoint", flush=True)
"""


@pytest.mark.parametrize("case", ["tampered", "latest"])
def test_megatron_lms_load_verifies_a_dump_of_the_sdk_route(tmp_path, case):
    """MindSpeed-LLM's route: its save handler writes `iter_X_tmp/mp_rank_00/`, the SDK
    writes the manifest there before the rename handler publishes it
    (`write_dump_manifests`), and Megatron-LM's own `_load_base_checkpoint` (the
    `sdk-load-verify` moment; MindSpeed-LLM loads through it, unchanged) refuses a
    damaged tensor or a bad tracker in one line with exit 2, before reading it."""
    import subprocess
    import sys

    from tests.clones import clone
    from tests.jobs import REPO, free_port

    mlm = clone("0.12.1")
    if isinstance(mlm, str):
        pytest.fail(mlm, pytrace=False)
    root = tmp_path / "save"
    tmp = _checkpoint(str(tmp_path / "written"), 4)  # the save handler's files
    os.makedirs(root / "iter_0000004_tmp")
    shutil.copytree(tmp, root / "iter_0000004_tmp" / "mp_rank_00",
                    ignore=shutil.ignore_patterns(manifest.MANIFEST_FILENAME))
    assert manifest.write_dump_manifests(str(root / "iter_0000004_tmp"), 4) == [
        str(root / "iter_0000004_tmp" / "mp_rank_00" / manifest.MANIFEST_FILENAME)]
    os.rename(root / "iter_0000004_tmp", root / "iter_0000004")  # the rename handler
    tracker = root / "latest_checkpointed_iteration.txt"
    path = root / "iter_0000004" / "mp_rank_00" / "distrib_optim.pt"
    if case == "tampered":
        tracker.write_text("4")
        record = next(r for r in manifest.file_digests(str(path))["records"]
                      if r[0].endswith("data/0"))
        _flip(str(path), record[1] + 5)
        line = (f"checkpoint {root}/iter_0000004 is corrupt, not loaded: {path}: bytes differ "
                "from the manifest in tensor buckets/0 (zip member distrib_optim/data/0); "
                f"there is no earlier checkpoint under {root}")
    else:
        tracker.write_text("latest")
        line = (f"--load {root}: {tracker} holds 'latest': not a checkpoint to load; allowed: "
                "an iteration number above 0 whose iter_XXXXXXX folder exists, or 'release' "
                "(Megatron-LM's release checkpoint)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mlm), str(REPO)]),
           "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _MEGATRON_LOAD, str(root), str(free_port())],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == f"[mindspeed-tft] error: {line}", proc.stderr
    assert "Megatron-LM read the checkpoint" not in proc.stdout
