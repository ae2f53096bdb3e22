"""The save folder's file system full, on a test bed of hosts (`tests/bed.py`).

One job of 2 hosts x 2 ranks (DP=4 with 2 optimizer replicas, the reference trainer under
`tft-run` with the guide's multi-node settings, high availability without repair features)
saves into a tmpfs with room for one checkpoint and 40 % of another. The periodic save of
iteration 5 fits; the one of iteration 10 runs out of space while iteration 5 is still the
published checkpoint. A failed save is a fault like any exception: rank 0's line names the
save folder and its free space, the partial `iter_0000010_tmp` is removed, every rank raises,
and the controller orders the dump of the lock step (10), which runs out of space too (its
first file, a shard, holds half the optimizer state and params): the holder's line names
the folder and its free space, the assembler stops waiting for that shard, nothing is
published and the job exits 1 (a failed dump). The save folder then holds iteration 5 alone,
named by the tracker, and `--load` of it resumes bit-exact against the fault-free reference.

The same failed save in Megatron-LM's own loop (its `save_checkpoint` writes `iter_X` in
place with torch's path writer, which reports no errno) runs in one process on a tmpfs:
Megatron-LM's real save, through the plugin's wrapper.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindspeed_tft.recovery import manifest
from mindspeed_tft.recovery.layout import TRACKER_FILENAME
from mindspeed_tft.tools.testbed import small_folder
from tests.bed import Cluster, make_bed, need
from tests.clones import VERSIONS, clone
from tests.jobs import HA_ARGS, REPO, STANDARD, free_port, read_events_if_any, run_tiny_job

pytestmark = pytest.mark.multiproc

CONFIG = {"layout": "dp4", "ha_args": HA_ARGS, **STANDARD}
FAILED_DUMP_EXIT_CODE = 1
#: seconds for the job: start-up, 10 iterations, the failed save and the failed dump
JOB_SECONDS = 240


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _line(what: str, ckpt: Path, iteration: int = 10, last: int = 5) -> str:
    """The one line of a write of `iteration` that ran out of space (a regex: free, total)."""
    kept = re.escape(str(ckpt / f"iter_{last:07d}"))
    return (rf"\[mindspeed-tft\] ERROR: {what} of iteration {iteration} not written: "
            rf"{re.escape(str(ckpt))}: file system full \((\d+) bytes free of (\d+)\); nothing "
            rf"of it was published, the last checkpoint stays iteration {last} \({kept}\)")


def _run_on_a_full_folder(ckpt: Path) -> tuple[dict[int, int], str, list, float]:
    run_dir = ckpt.parent
    started = time.monotonic()
    with make_bed(2) as bed:
        cluster = Cluster(bed, run_dir, nnodes=2, ha_args=HA_ARGS, layout="dp4",
                          train_iters=STANDARD["train_iters"],
                          save_interval=STANDARD["save_interval"],
                          precision=STANDARD["precision"])
        try:
            for node in (0, 1):
                cluster.start(node)
            codes = {node: cluster.wait(node, JOB_SECONDS) for node in (0, 1)}
        finally:
            cluster.end()
    output = "".join(cluster.outputs[node] for node in (0, 1))
    return codes, output, read_events_if_any(cluster.events), time.monotonic() - started


def test_a_full_save_folder_fails_the_save_and_the_dump_and_keeps_the_last_checkpoint(
    reference_job, tmp_path
):
    reference = reference_job(**CONFIG)
    one = _bytes(reference.checkpoint_dir / "iter_0000005")
    size = (one + one * 2 // 5) // 4096 * 4096  # one checkpoint and 40 % of another
    run_dir = tmp_path / "job"
    ckpt = run_dir / "ckpt"
    with small_folder(ckpt, str(size)):
        codes, output, events, seconds = _run_on_a_full_folder(ckpt)
        print(f"\nthe job on a {size}-byte save folder ended in {seconds:.1f} s: {codes}")
        assert codes == {0: FAILED_DUMP_EXIT_CODE, 1: FAILED_DUMP_EXIT_CODE}, output[-6000:]
        named = lambda name: [e for e in events if e["event"] == name]  # noqa: E731

        # the periodic save of 10: one line (rank 0's), the partial files gone, then a fault
        assert [e["iteration"] for e in named("checkpoint_saved")] == [5]
        (save_line,) = re.findall(_line("checkpoint", ckpt), output)
        failed = named("checkpoint_failed")
        assert [(e["what"], e["iteration"], e["rank"], e["reason"], e["path"], e["last"])
                for e in failed][:1] == [("checkpoint", 10, 0, "file system full", str(ckpt), 5)]
        assert failed[0]["total"] == int(save_line[1]) and failed[0]["free"] < one
        # every rank raises rank 0's reason (those after the controller's stop: `normal`)
        faults = [e for e in named("fault_detected") if e["kind"] == "unknown"]
        assert faults and {e["message"] for e in faults} == {
            f"CheckpointWriteError: checkpoint of iteration 10 not written: {ckpt}: "
            "file system full"}

        # the dump of the lock step: one line (the shard holder's), nothing published, exit 1
        assert [(e["strategy"], e["lock_step"]) for e in named("strategy")] == [("dump", 10)]
        (dump_line,) = re.findall(_line("dump", ckpt), output)
        assert [(e["what"], e["iteration"], e["reason"]) for e in failed[1:]] == [
            ("dump", 10, "file system full")]
        assert not named("dump_saved")
        (exit_event,) = named("exit")
        assert exit_event["code"] == FAILED_DUMP_EXIT_CODE
        assert exit_event["reason"].startswith("dump failed (")
        assert f"DumpError: dump of iteration 10 not written: {ckpt}: file system full" in \
            exit_event["reason"]
        # the free space is said once per failed write, in its line
        assert len(re.findall(r"bytes free of", output)) == 2, output[-6000:]

        # the last checkpoint is intact and still the published one
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000005", TRACKER_FILENAME]
        assert (ckpt / TRACKER_FILENAME).read_text() == "5"
        assert manifest.verify_folder(str(ckpt / "iter_0000005" / "mp_rank_00")).verified

        resumed = run_tiny_job(tmp_path / "resumed", load_dir=ckpt, **CONFIG)
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded checkpoint {ckpt} at iteration 5" in resumed.output
    expected = reference.losses()
    assert resumed.losses() == {it: expected[it] for it in range(6, STANDARD["train_iters"] + 1)}


# --- Megatron-LM's own save (in place, torch's path writer), in one process -------------

_MEGATRON_SAVE = r"""
import argparse, sys
import torch
import torch.distributed as dist

import mindspeed_tft.megatron as host

host.install()  # the plugin's patches of Megatron-LM's loop: its save_checkpoint's wrapper
from megatron.core import parallel_state as ps
from megatron.training import training
from megatron.training.global_vars import set_args

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
ps.initialize_model_parallel()
set_args(argparse.Namespace(
    save=sys.argv[1], async_save=False, use_dist_ckpt=False, ckpt_format="torch",
    non_persistent_ckpt_type=None, use_distributed_optimizer=False, no_save_optim=True,
    no_save_rng=False, data_parallel_random_init=False, log_progress=False, rank=0,
    world_size=1, ckpt_fully_parallel_save=False, tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(int(sys.argv[3])))

    def state_dict_for_save_checkpoint(self):
        return self.state_dict()


for iteration in (1, 2):
    try:
        training.save_checkpoint(iteration, [Model()], None, None, 0)
        print(f"saved {iteration}", flush=True)
    except OSError as error:
        print(f"raised {type(error).__name__}: {error}", flush=True)
"""


def _need_root() -> None:
    """A small folder (tmpfs) needs root: elsewhere the test fails with the reason, a skip
    under TFT_TESTBED=off (as the bed's cells)."""
    need("a small folder (a tmpfs mount) needs root" if os.geteuid() != 0 else None)


@pytest.mark.parametrize("version", VERSIONS)
def test_megatron_lms_own_save_on_a_full_folder_keeps_the_last_checkpoint(version, tmp_path):
    """Megatron-LM's `save_checkpoint` (through the plugin's wrapper, as in its loop) of a
    600 kB model into a 1 MiB tmpfs: iteration 1 is saved and published; iteration 2 runs
    out of space in torch's path writer (a RuntimeError without an errno): one line names
    the folder and its free space, the partial `iter_0000002` is removed, the tracker stays
    on iteration 1 and the save raises a `CheckpointWriteError`."""
    _need_root()
    megatron_lm = clone(version)
    if isinstance(megatron_lm, str):
        pytest.fail(megatron_lm, pytrace=False)
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(megatron_lm), str(REPO)]),
           "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    with small_folder(ckpt, "1m"):
        proc = subprocess.run([sys.executable, "-c", _MEGATRON_SAVE, str(ckpt),
                               str(free_port()), str(150_000)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert "saved 1" in proc.stdout and "saved 2" not in proc.stdout, out[-4000:]
        assert (f"raised CheckpointWriteError: checkpoint of iteration 2 not written: {ckpt}: "
                "file system full") in proc.stdout
        (line,) = [x for x in proc.stderr.splitlines() if "bytes free of" in x]
        free, total = map(int, re.fullmatch(_line("checkpoint", ckpt, 2, 1), line).groups())
        assert total == 1 << 20 and 0 < free < 600_000  # the partial file's space is back
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000001", TRACKER_FILENAME]
        assert (ckpt / TRACKER_FILENAME).read_text() == "1"
        assert manifest.verify_folder(str(ckpt / "iter_0000001" / "mp_rank_00")).verified
