"""Megatron-LM's own training loop hosts the plugin: real multi-process jobs of Megatron-LM
core_v0.12.1's unchanged `pretrain_gpt.py` (`scripts/pretrain_megatron_lm_cpu.sh`, CPU gloo).

The adaptor gets in three ways, each used below: `python -m mindspeed_tft.megatron
pretrain_gpt.py` (the `dp4` references and faults), the one-line import at the top of the
user's script (`pretrain_gpt_tft.py`, the `tp2dp2` jobs), and `tft-run` with no change at all
(worker reboot). Faults are injected into real processes (`TFT_INJECT`): killed ranks,
corrupted memory. Every loss is compared, bit for bit, with a fault-free run in the same loop.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import assert_load_refused, free_port, run_megatron_job, tamper_with_a_tensor

pytestmark = pytest.mark.multiproc

HA = "--enable-high-availability --tft-check-replicas-interval 1"
FOUR_FLAGS = ("--enable-high-availability", "--enable-hbmfault-repair",
              "--enable-worker-reboot", "--distributed-optimizer-no-replica")
DUMP_EXIT_CODE = 75
ITERS = {"train_iters": 8, "save_interval": 4, "precision": "fp32"}  # see tests.jobs.STANDARD
#: (layout, how the adaptor gets in): -m, or the one-line import in the user's script
ROUTES = {
    "dp4": {"layout": "dp4"},
    "tp2dp2": {"layout": "tp2dp2", "entry": "", "script": "pretrain_gpt_tft.py"},
}
#: Megatron-LM's default data loader: 2 worker processes per rank (the jobs' script passes
#: --num-workers 0 otherwise); a reference without them has the same batches
WORKERS = {"NUM_WORKERS": "2"}
#: the guide's Llama2 shape: TP1 PP2, sequence parallel, overlap-grad-reduce, the distributed
#: optimizer (all in the script), loading neither optimizer nor RNG from --load
GUIDE_SHAPE = ["--no-load-optim", "--no-load-rng"]


def _python_env(megatron_lm) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(megatron_lm)
    env.pop("HIGH_AVAILABILITY", None)
    return env


def _start_up(tree: Path, env: dict[str, str], save: Path, *extra: str):
    """Rank 0 of 4 of a tiny Megatron-LM job with high availability, up to its refusal."""
    env = {**env, "WORLD_SIZE": "4", "RANK": "0", "TTP_PORT": str(free_port())}
    args = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 "
            "--train-iters 4 --lr 1e-3 --bf16 --use-distributed-optimizer --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 4096 --transformer-impl local "
            f"--enable-high-availability --save {save} --save-interval 4").split()
    return subprocess.run([sys.executable, "-m", "mindspeed_tft.megatron", "pretrain_gpt.py",
                           *args, *extra], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)


def test_help_lists_the_flags_without_any_change_to_the_script(megatron_lm):
    """`tft-run` runs the unchanged script through the adaptor (the `-m` route and the
    one-line import train in the tests below: dp4 and tp2dp2 of ROUTES)."""
    tft_run = str(Path(sys.executable).parent / "tft-run")
    for command in (
        [tft_run, "--nproc-per-node", "1", "--master-port", str(free_port()),
         "pretrain_gpt.py", "--help"],
    ):
        done = subprocess.run(command, cwd=megatron_lm, env=_python_env(megatron_lm),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Megatron-LM Arguments" in done.stdout
        for flag in FOUR_FLAGS:
            assert flag in done.stdout, (command, flag)


@pytest.mark.parametrize(("extra", "message"), [
    (["--ckpt-format", "torch_dist"],
     "--ckpt-format torch_dist cannot be combined with --enable-high-availability: the "
     "dying-gasp checkpoint is written in Megatron-LM's torch format; allowed: "
     "--ckpt-format torch"),
    (["--exit-signal-handler"],
     "--exit-signal-handler cannot be combined with --enable-high-availability: the plugin "
     "handles SIGTERM itself"),
    (["--optimizer-replica-num", "3"],
     "--optimizer-replica-num 3 does not divide the data-parallel size 4"),
])
def test_a_flag_the_plugin_cannot_serve_stops_at_start_up(megatron_lm, extra, message,
                                                           tmp_path):
    """Refused after Megatron-LM's own validation, before torch.distributed starts: a clear
    error naming the flag and the fix, exit code 2, no traceback."""
    done = _start_up(megatron_lm, _python_env(megatron_lm), tmp_path / "ckpt", *extra)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"[mindspeed-tft] error: {message}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("lacking", ["the venv", "a compiler"])
def test_dataset_helpers_that_cannot_be_built_stop_the_start_naming_the_fix(megatron_lm, lacking,
                                                                           tmp_path):
    """Megatron-LM builds its dataset helpers on rank 0 at start-up (make, g++ and `python3 -m
    pybind11`, from PATH). Run with the venv's python but without the venv on PATH (a bare
    venv's python3 first, no pybind11), or without a C++ compiler on PATH: rank 0 stops
    before Megatron-LM tries, with one line naming the fix, exit 2 (a build left to fail ends
    rank 0 and shows the other ranks' closed gloo connections)."""
    tree = tmp_path / "Megatron-LM"  # nothing built yet: make would compile
    shutil.copytree(megatron_lm, tree,
                    ignore=shutil.ignore_patterns("helpers_cpp*", "__pycache__"))
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "make").symlink_to(shutil.which("make"))
    venv_bin = Path(sys.executable).parent
    if lacking == "the venv":
        (tools / "g++").symlink_to(shutil.which("g++"))
        bare = tmp_path / "bare"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                       timeout=60)
        path = f"{tools}{os.pathsep}{bare / 'bin'}"
        want = (f"the python3 on PATH ({bare / 'bin' / 'python3'}) cannot import pybind11; fix: "
                f"put this Python's folder first on PATH (export PATH={venv_bin}:$PATH)")
    else:
        path = f"{tools}{os.pathsep}{venv_bin}"
        want = ("no C++ compiler on PATH (make runs g++; CXX is unset); fix: install one "
                "(e.g. apt-get install g++) or set CXX to one")
    env = {**_python_env(tree), "PATH": path}
    env.pop("CXX", None)
    done = _start_up(tree, env, tmp_path / "ckpt")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    source = tree / "megatron" / "core" / "datasets" / "helpers.cpp"
    assert (f"[mindspeed-tft] error: Megatron-LM cannot build its dataset helpers ({source}, "
            f"compiled by rank 0 at start-up): {want}") in done.stderr.splitlines()
    assert "Traceback" not in done.stderr
    assert "compiling dataset index builder" not in done.stdout  # Megatron-LM never tried


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_trains_in_megatron_lms_loop_and_the_loss_falls(route, megatron_reference):
    job = megatron_reference(ha_args=HA, **ROUTES[route], **ITERS)
    losses = job.losses()
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]
    assert "iteration        8/       8 |" in job.output  # Megatron-LM's own log line
    assert "high availability on (dying-gasp checkpoint)" in job.output
    assert all(e["match"] for e in job.named("replica_check"))


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_killed_rank_dumps_in_megatron_lm_layout_and_load_resumes_bit_exact(
    route, megatron_lm, megatron_reference, tmp_path
):
    """Data-parallel size 2 (tp2dp2) keeps a replica with the defaults (N = d = 2). Two
    cells of the launch matrix (docs/design.md, "Launch matrix"), both under plain torchrun:
    `torchrun -m mindspeed_tft.megatron` (dp4), and the one-line import with Megatron-LM's
    default data loader (tp2dp2, 2 worker processes per rank, which torchrun's SIGTERM to
    every worker's process group reaches)."""
    config = {**ROUTES[route], **ITERS}
    env = WORKERS if route == "tp2dp2" else None
    reference = megatron_reference(ha_args=HA, **config)
    faulty = run_megatron_job(tmp_path / "faulty", megatron_lm, ha_args=HA, env=env,
                              inject="kill:rank=1,step=5,phase=backward", **config)
    assert faulty.returncode != 0
    assert "DataLoader worker" not in faulty.output  # the stop is no fault of a healthy rank
    assert "unknown" not in {e["kind"] for e in faulty.named("fault_detected")}
    saved = faulty.named("dump_saved")
    iteration_dir = faulty.checkpoint_dir / "iter_0000005"
    assert [(e["iteration"], e["path"]) for e in saved] == [(5, str(iteration_dir))]
    assert (faulty.checkpoint_dir / "latest_checkpointed_iteration.txt").read_text() == "5"
    for tp in range(2 if route == "tp2dp2" else 1):
        for name in ("model_optim_rng.pt", "distrib_optim.pt"):
            assert (iteration_dir / f"mp_rank_{tp:02d}" / name).is_file()
    assert f"exits with code {DUMP_EXIT_CODE}: dying-gasp checkpoint saved" in faulty.output

    resumed = run_megatron_job(tmp_path / "resumed", megatron_lm, ha_args=HA, env=env,
                               load_dir=faulty.checkpoint_dir, **config)
    assert resumed.returncode == 0, resumed.describe()
    assert f"successfully loaded checkpoint from {faulty.checkpoint_dir} " in resumed.output
    assert "] at iteration 5" in resumed.output
    losses, expected = resumed.losses(), reference.losses()
    assert sorted(losses) == [6, 7, 8]
    assert all(losses[it] == expected[it] for it in losses), (losses, expected)
    # the dump carries its manifest (Megatron-LM ignores it); the periodic save of iteration
    # 4 too, written after Megatron-LM's own save
    assert (iteration_dir / "mp_rank_00" / "tft_manifest.json").is_file()
    assert (faulty.checkpoint_dir / "iter_0000004" / "mp_rank_00" / "tft_manifest.json").is_file()
    if route == "dp4":  # one byte of a tensor damaged: Megatron-LM never gets to load it
        tampered = tmp_path / "tampered"
        path, tensor = tamper_with_a_tensor(faulty.checkpoint_dir, 5, tampered)
        refused = run_megatron_job(tmp_path / "refused", megatron_lm, ha_args=HA,
                                   load_dir=tampered, **config)
        assert_load_refused(refused, tampered, 5, path, tensor, previous=4)


def test_uce_on_optimizer_state_and_params_is_repaired_in_place(
    megatron_lm, megatron_reference, tmp_path
):
    reference = megatron_reference(ha_args=HA, **ROUTES["dp4"], **ITERS)
    job = run_megatron_job(
        tmp_path, megatron_lm, ha_args=f"{HA} --enable-hbmfault-repair",
        inject="uce:rank=1,step=3,phase=backward,target=optimizer;"
               "uce:rank=2,step=6,phase=backward,target=param",
        **ROUTES["dp4"], **ITERS)
    assert job.returncode == 0, job.describe()
    assert [e["strategy"] for e in job.named("strategy")] == ["retry", "retry"]
    assert [(e["rank"], e["iteration"]) for e in job.named("shard_received")] == [(1, 3), (2, 6)]
    pids = job.pids()
    assert sorted(pids) == [0, 1, 2, 3] and all(len(p) == 1 for p in pids.values())
    assert job.losses() == reference.losses()
    assert all(e["match"] for e in job.named("replica_check"))


#: what Megatron-LM's `pretrain` still imports after a warm spare took its rank: its dataset
#: helpers, which rank 0 compiles at start-up (a spare may be ready before they exist)
MEGATRON_LM_LATE_IMPORTS = {"megatron.core.datasets.helpers", "megatron.core.datasets.helpers_cpp"}


@pytest.mark.parametrize(("layout", "rank", "extra", "spares"), [
    ("dp4", 1, [], 1),
    ("pp2dp2", 3, GUIDE_SHAPE, 0),
])
def test_worker_reboot_under_tft_run_restarts_only_the_killed_rank(
    layout, rank, extra, spares, megatron_lm, megatron_reference, tmp_path
):
    """`tft-run` runs the unchanged script through the adaptor by itself (no -m, no import);
    on dp4 with a warm spare, which takes the killed rank over (a spare does the workers'
    imports and less: it is ready before their first step). pp2dp2 with Megatron-LM's default
    data loader (2 worker processes per rank): a cell of the launch matrix
    (docs/design.md, "Launch matrix")."""
    arf = f"{HA} --enable-worker-reboot"
    # the switch changes no arithmetic: the plain HA run is the reference
    reference = megatron_reference(layout=layout, ha_args=HA, extra_args=extra, **ITERS)
    launcher = f"tft-run --tft-spares-per-node {spares}" if spares else "tft-run"
    job = run_megatron_job(tmp_path, megatron_lm, layout=layout, ha_args=arf, entry="",
                           launcher=launcher, extra_args=extra,
                           env=None if spares else WORKERS,
                           inject=f"kill:rank={rank},step=4,phase=backward", **ITERS)
    assert job.returncode == 0, job.describe()
    if spares:
        spare, late = job.spare_handover(rank)
        assert job.pids()[rank][1] == spare
        assert set(late.split(", ")) <= MEGATRON_LM_LATE_IMPORTS | {"none"}, late
    assert "is a Megatron-LM training script: its workers run it through" in job.output
    assert [e["strategy"] for e in job.named("strategy")] == ["recover"]
    pids = job.pids()
    assert sorted(pids) == [0, 1, 2, 3]
    assert {r: len(p) for r, p in pids.items()} == {r: 2 if r == rank else 1 for r in range(4)}
    assert job.losses() == reference.losses()
    assert all(e["match"] for e in job.named("replica_check"))


def test_elastic_training_shrinks_in_megatron_lms_loop(megatron_lm, megatron_reference,
                                                      tmp_path):
    """A killed rank that gets no replacement: Megatron-LM's own loop continues at DP2 (8
    micro-batches per step split over 2 ranks, not 3) from the dump, with Megatron-LM's
    setup_model_and_optimizer and load_checkpoint, and finishes every iteration with the
    fault-free samples and learning rate (losses within tests/test_elastic.py's tolerance)."""
    from tests.test_elastic import assert_shrank_dp4_to_dp2

    reference = megatron_reference(layout="dp4", ha_args=HA, **ITERS)
    job = run_megatron_job(tmp_path, megatron_lm, layout="dp4", entry="", launcher="tft-run",
                           ha_args=f"{HA} --enable-worker-reboot --enable-elastic-training",
                           inject="kill:rank=1,step=4,phase=backward",
                           env={"TFT_MAX_WORKER_RESTARTS": "0"}, **ITERS)
    assert_shrank_dp4_to_dp2(job, reference)


def test_no_replica_worker_reboot_reloads_the_periodic_checkpoint(
    megatron_lm, megatron_reference, hooked_torchrun, tmp_path
):
    """N = 1: the killed rank has no replica; every rank reloads the periodic checkpoint of
    iteration 4 with Megatron-LM's load_checkpoint (survivors in place) and goes on exactly
    like a run without the plugin (the same optimizer layout: one instance). Launched by
    torchrun with the guide's hook (`scripts/patch_torchrun.sh`), the unchanged script: a
    cell of the launch matrix (docs/design.md, "Launch matrix")."""
    # without the plugin's flags Megatron-LM's default format is torch_dist: ask for torch
    plain = megatron_reference(ha_args="", extra_args=["--ckpt-format", "torch"],
                               **ROUTES["dp4"], **ITERS)
    job = run_megatron_job(
        tmp_path, megatron_lm, ha_args=f"{HA} --enable-worker-reboot "
        "--distributed-optimizer-no-replica", launcher=hooked_torchrun, entry="",
        inject="kill:rank=3,step=6,phase=backward", **ROUTES["dp4"], **ITERS)
    assert job.returncode == 0, job.describe()
    assert sorted(e["rank"] for e in job.named("rolled_back")) == [0, 1, 2, 3]
    assert {e["iteration"] for e in job.named("rolled_back")} == {4}
    assert [len(p) for _, p in sorted(job.pids().items())] == [1, 1, 1, 2]
    assert job.losses() == plain.losses()
    # the restarted logging rank recomputes iterations 5 and 6, logged before the fault: their
    # events and Megatron-LM's own log lines appear once
    assert [e["iteration"] for e in job.named("iteration_recomputed")] == [5, 6]
    lines = [int(n) for n in re.findall(r" iteration +(\d+)/ +\d+ \|", job.output)]
    assert sorted(lines) == list(range(1, ITERS["train_iters"] + 1)), lines


def test_megatron_training_on_the_megatron_core_wheel(megatron_lm, megatron_reference, tmp_path):
    """Megatron-LM's `megatron/training` and `megatron/legacy` with the megatron-core wheel's
    `megatron.core` (the wheel ships the dataset helpers built, without their Makefile):
    trains with the plugin, with the same losses as the full clone."""
    tree = tmp_path / "Megatron-LM-without-core"
    shutil.copytree(megatron_lm, tree, ignore=lambda folder, names: (
        ["core"] if Path(folder).name == "megatron" else []))
    where = subprocess.run(
        [sys.executable, "-c", "import megatron.core, megatron.training as t; "
         "print(megatron.core.__file__); print(t.__file__)"],
        env=_python_env(tree), capture_output=True, text=True, timeout=120)
    core_file, training_file = where.stdout.split()
    assert "site-packages" in core_file and training_file.startswith(str(tree))
    reference = megatron_reference(ha_args=HA, **ROUTES["dp4"], **ITERS)
    job = run_megatron_job(tmp_path / "run", tree, ha_args=HA, **ROUTES["dp4"], **ITERS)
    assert job.returncode == 0, job.describe()
    assert job.losses() == reference.losses()
