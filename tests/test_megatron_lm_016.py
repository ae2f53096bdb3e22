"""Megatron-LM core_v0.16.1, the second host: its unchanged `pretrain_gpt.py`, and megatron-core
0.16.1 under the reference trainer, as on core_v0.12.1 (tests/test_megatron_lm.py).

The clone (tests/clones.py: $MEGATRON_LM_016, else shared/megatron-lm-0.16.1) is copied once per
session (`megatron_lm_016`) and put first on PYTHONPATH, so its `megatron.core` (0.16.1)
shadows the venv's megatron-core wheel (0.12.1). The jobs are the tiny ones of
`scripts/pretrain_megatron_lm_cpu.sh` on 4 CPU ranks (gloo), with faults injected into real
processes (`TFT_INJECT`); every loss is compared, bit for bit, with a fault-free run in the same
loop (`megatron_reference_016`, one per configuration per session).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import run_megatron_job, run_tiny_job

HA = "--enable-high-availability --tft-check-replicas-interval 1"
ITERS = {"train_iters": 8, "save_interval": 4, "precision": "fp32"}  # as test_megatron_lm.py
DP4 = {"layout": "dp4"}
DUMP_EXIT_CODE = 75
#: Megatron-LM's default data loader: 2 worker processes per rank (the jobs' script passes
#: --num-workers 0 otherwise); a reference without them has the same batches
WORKERS = {"NUM_WORKERS": "2"}
RANGE = "supported: 0.12.1 to 0.16.1 (pip install 'megatron-core>=0.12.1,<=0.16.1')"


def _fake_megatron_core(root: Path, version: str) -> Path:
    """A `megatron/core` that says it is `version` (nothing else: it is refused before any of
    it is imported)."""
    major, minor, patch = version.split(".")
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise ImportError('imported before the version check')\n")
    (core / "package_info.py").write_text(
        f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    return core / "package_info.py"


@pytest.mark.parametrize("version", ["0.11.0", "0.17.0"])
@pytest.mark.parametrize("route", ["reference trainer", "Megatron-LM host"])
def test_a_megatron_core_outside_the_range_is_refused_at_start(version, route, tmp_path):
    """The version that `import megatron.core` would import (here a tree first on PYTHONPATH
    that shadows the venv's wheel) is read once at start-up, before megatron-core is imported:
    exit 2 and one line naming it and the range."""
    info = _fake_megatron_core(tmp_path / "tree", version)
    script = tmp_path / "train.py"
    script.write_text("import megatron.training\n")
    command = ([sys.executable, "-c", "import mindspeed_tft.training"]
               if route == "reference trainer"
               else [sys.executable, "-m", "mindspeed_tft.megatron", str(script)])
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "tree")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        f"[mindspeed-tft] error: megatron-core {version} ({info}) is not supported; {RANGE}"]


def _megatron_core_016(megatron_lm_016: Path) -> dict[str, str]:
    """The environment of a process whose megatron-core is the clone's 0.16.1, its dataset
    helpers built as the wheel ships them (megatron-core's own `compile_helpers`, in the
    clone's tree)."""
    env = {**os.environ, "PYTHONPATH": str(megatron_lm_016),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    built = subprocess.run([sys.executable, "-c", "from megatron.core.datasets.utils import "
                            "compile_helpers; compile_helpers()"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert list((megatron_lm_016 / "megatron" / "core" / "datasets").glob("helpers_cpp*"))
    return env


@pytest.mark.multiproc
def test_reference_trainer_trains_on_megatron_core_016(megatron_lm_016, tmp_path):
    """The reference trainer with megatron-core 0.16.1 (`_megatron_core_016`), high
    availability on."""
    _megatron_core_016(megatron_lm_016)
    job = run_tiny_job(tmp_path, layout="dp2", ha_args=HA, train_iters=4, save_interval=2,
                       env={"PYTHONPATH": str(megatron_lm_016)})
    assert job.returncode == 0, job.describe()
    losses = job.losses()
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    assert all(e["match"] for e in job.named("replica_check"))


@pytest.mark.multiproc
def test_trains_in_megatron_lm_016s_loop(megatron_reference_016):
    """Megatron-LM core_v0.16.1's unchanged pretrain_gpt.py through the adaptor
    (`python -m mindspeed_tft.megatron`), fault-free: the loss falls. Its rerun state machine
    is in its default mode (validate_results): the decision in docs/design.md. The runs below
    reproduce its losses bit for bit (each is a second, independent run)."""
    job = megatron_reference_016(ha_args=HA, **DP4, **ITERS)
    losses = job.losses()
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1]
    assert "iteration        8/       8 |" in job.output  # Megatron-LM's own log line
    assert all(e["match"] for e in job.named("replica_check"))


#: what Megatron-LM's `pretrain` still imports after a warm spare took its rank: its dataset
#: helpers, which rank 0 compiles at start-up (a spare may be ready before they exist)
LATE_IMPORTS = {"megatron.core.datasets.helpers", "megatron.core.datasets.helpers_cpp"}


@pytest.mark.multiproc
@pytest.mark.parametrize("spares", [0, 1], ids=["cold", "warm spare"])
def test_worker_reboot_under_tft_run_016(spares, megatron_lm_016, megatron_reference_016,
                                         tmp_path):
    """a 4-rank tiny job in core_v0.16.1's unchanged pretrain_gpt.py
    under `tft-run` (no -m, no import), rank 2 killed in backward of step 5 and replaced (only
    it), every loss equal to the fault-free run's: by a new process (cold), or by the warm
    spare of `--tft-spares-per-node 1`, which did the workers' imports before the fault."""
    reference = megatron_reference_016(ha_args=HA, **DP4, **ITERS)
    launcher = f"tft-run --tft-spares-per-node {spares}" if spares else "tft-run"
    job = run_megatron_job(tmp_path, megatron_lm_016, ha_args=f"{HA} --enable-worker-reboot",
                           entry="", launcher=launcher,
                           inject="kill:rank=2,step=5,phase=backward", **DP4, **ITERS)
    assert job.returncode == 0, job.describe()
    assert "is a Megatron-LM training script: its workers run it through" in job.output
    assert [e["strategy"] for e in job.named("strategy")] == ["recover"]
    pids = job.pids()
    assert {r: len(p) for r, p in pids.items()} == {0: 1, 1: 1, 2: 2, 3: 1}
    if spares:
        spare, late = job.spare_handover(2)
        assert pids[2][1] == spare
        assert set(late.split(", ")) <= LATE_IMPORTS | {"none"}, late
    assert job.losses() == reference.losses()
    assert all(e["match"] for e in job.named("replica_check"))


@pytest.mark.multiproc
def test_uce_on_every_target_is_repaired_in_place_016(megatron_lm_016, megatron_reference_016,
                                                      tmp_path):
    """One job, five faults, each repaired in place: a UCE on rank 1's optimizer state in step
    3, on rank 2's params in step 4, on rank 3's grads in step 5, on rank 0's working
    activation in step 6 (the rank that hosts the controller), and a communication error of
    rank 2 in step 7. The optimizer state and the params come back from their replica; no
    process restarts; every loss equals the fault-free run's. The adaptor comes in by the
    one-line import at the top of the user's script (the third route: `pretrain_gpt_tft.py`,
    the fixture's copy of pretrain_gpt.py with that line)."""
    reference = megatron_reference_016(ha_args=HA, **DP4, **ITERS)
    faults = [(1, 3, "uce", "optimizer"), (2, 4, "uce", "param"), (3, 5, "uce", "grad"),
              (0, 6, "uce", "activation"), (2, 7, "comm", "")]
    inject = ";".join(f"{kind}:rank={rank},step={step},phase=backward"
                      + (f",target={target}" if target else "")
                      for rank, step, kind, target in faults)
    job = run_megatron_job(tmp_path, megatron_lm_016, ha_args=f"{HA} --enable-hbmfault-repair",
                           inject=inject, entry="", script="pretrain_gpt_tft.py", **DP4,
                           **ITERS)
    assert job.returncode == 0, job.describe()
    assert [e["strategy"] for e in job.named("strategy")] == ["retry"] * len(faults)
    detected = [(e["ranks"], e["kind"]) for e in job.named("fault_detected")]
    assert all(([rank], kind) in detected for rank, _, kind, _ in faults), detected
    # the optimizer state and the params come from their replica; grads, activations and the
    # comm error leave nothing to copy (the step is recomputed)
    assert [(e["rank"], e["iteration"]) for e in job.named("shard_received")] == [(1, 3), (2, 4)]
    assert sorted(e["iteration"] for e in job.named("rolled_back")) == sorted(
        [step for _, step, _, _ in faults] * 4)
    pids = job.pids()
    assert sorted(pids) == [0, 1, 2, 3] and all(len(p) == 1 for p in pids.values())
    assert job.losses() == reference.losses()
    assert all(e["match"] for e in job.named("replica_check"))


@pytest.mark.multiproc
def test_dump_then_plain_megatron_lm_016_resumes_bit_exact(megatron_lm_016,
                                                           megatron_reference_016, tmp_path):
    """rank 1 killed in backward of step 5 under plain torchrun, with
    Megatron-LM's default data loader (2 worker processes per rank, which torchrun's SIGTERM
    reaches); the survivors write the dying-gasp checkpoint in Megatron-LM's layout. Megatron-LM
    core_v0.16.1 without the plugin's flags (high availability off: the plugin inactive; the
    format flag because its default is torch_dist) resumes from it with --load, and its losses
    equal the fault-free run's."""
    plain = {"ha_args": "", "extra_args": ["--ckpt-format", "torch"]}
    reference = megatron_reference_016(ha_args=HA, **DP4, **ITERS)
    faulty = run_megatron_job(tmp_path / "faulty", megatron_lm_016, ha_args=HA, env=WORKERS,
                              inject="kill:rank=1,step=5,phase=backward", **DP4, **ITERS)
    assert faulty.returncode != 0
    assert "DataLoader worker" not in faulty.output  # the stop is no fault of a healthy rank
    iteration_dir = faulty.checkpoint_dir / "iter_0000005"
    assert [(e["iteration"], e["path"]) for e in faulty.named("dump_saved")] == [
        (5, str(iteration_dir))]
    assert (faulty.checkpoint_dir / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert f"exits with code {DUMP_EXIT_CODE}: dying-gasp checkpoint saved" in faulty.output
    assert faulty.losses() == {i: reference.losses()[i] for i in faulty.losses()}

    resumed = run_megatron_job(tmp_path / "resumed", megatron_lm_016, **plain,
                               load_dir=faulty.checkpoint_dir, **DP4, **ITERS)
    assert resumed.returncode == 0, resumed.describe()
    assert f"successfully loaded checkpoint from {faulty.checkpoint_dir} " in resumed.output
    losses, expected = resumed.losses(), reference.losses()
    assert sorted(losses) == [6, 7, 8]
    assert all(losses[it] == expected[it] for it in losses), (losses, expected)


@pytest.mark.parametrize(("extra", "message"), [
    (["--inprocess-restart"],
     "--inprocess-restart cannot be combined with --enable-high-availability: "
     "nvidia-resiliency-ext's in-process restart would act on the same faults"),
    (["--log-straggler"],
     "--log-straggler cannot be combined with --enable-high-availability: Megatron's straggler "
     "detector is configured once for the world size at start"),
    (["--rerun-mode", "report_stats"],
     "--rerun-mode report_stats cannot be combined with --enable-high-availability: "
     "Megatron-LM's rerun state machine would run every step twice"),
])
def test_megatrons_own_fault_tolerance_switches_are_decided_at_start_016(
        megatron_lm_016, extra, message, tmp_path):
    """Megatron's switches the plugin cannot work with are refused after Megatron-LM's own
    validation, before torch.distributed starts: exit 2, the flag and the fix, no traceback
    (the decisions: docs/design.md, section 13)."""
    from tests.test_megatron_lm import _python_env, _start_up

    done = _start_up(megatron_lm_016, _python_env(megatron_lm_016), tmp_path / "ckpt", *extra)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"[mindspeed-tft] error: {message}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.multiproc
def test_elastic_training_shrinks_in_megatron_lm_016s_loop(megatron_lm_016,
                                                          megatron_reference_016, tmp_path):
    """A killed rank that gets no replacement: core_v0.16.1's own loop continues at DP2 from the
    dump (its setup_model_and_optimizer and load_checkpoint) and finishes every iteration with
    the fault-free samples and learning rate, losses within tests/test_elastic.py's tolerance
    (exact before the shrink), as on core_v0.12.1."""
    from tests.test_elastic import assert_shrank_dp4_to_dp2

    reference = megatron_reference_016(ha_args=HA, **DP4, **ITERS)
    job = run_megatron_job(tmp_path, megatron_lm_016, entry="", launcher="tft-run",
                           ha_args=f"{HA} --enable-worker-reboot --enable-elastic-training",
                           inject="kill:rank=1,step=4,phase=backward",
                           env={"TFT_MAX_WORKER_RESTARTS": "0"}, **DP4, **ITERS)
    assert_shrank_dp4_to_dp2(job, reference)


@pytest.mark.multiproc
def test_elastic_training_shrinks_and_grows_in_megatron_lm_016s_loop(megatron_lm_016,
                                                                     megatron_reference_016,
                                                                     tmp_path):
    """Rank 1 killed in backward of step 4 under tft-run, its cold restart late (the incident
    waits TFT_REPLACEMENT_WAIT = 1 s for it): core_v0.16.1's own loop shrinks to DP3 from the
    dump (its setup_model_and_optimizer and load_checkpoint), grows back to DP4 when the
    restarted rank registers (from a dump of the lock step), and finishes every iteration with
    the fault-free samples and learning rate, losses within tests/test_elastic.py's tolerance
    (exact before the shrink), as on core_v0.12.1. 24 samples a step: 12 micro-batches, which
    DP3 divides."""
    from tests.test_elastic import assert_the_fault_free_stream

    # 60 steps: the restarted rank's start-up (imports) must end before training does; beside
    # another job it took 9 s once, longer than 26 steps
    config = {**DP4, "train_iters": 60, "save_interval": 20, "precision": "fp32"}
    reference = megatron_reference_016(ha_args=HA, env={"GBS": "24"}, **config)
    job = run_megatron_job(tmp_path, megatron_lm_016, entry="", launcher="tft-run",
                           ha_args=f"{HA} --enable-worker-reboot --enable-elastic-training",
                           inject="kill:rank=1,step=4,phase=backward",
                           env={"GBS": "24", "TFT_REPLACEMENT_WAIT": "1"}, **config)
    assert job.returncode == 0, job.describe()
    (shrink,) = job.named("scale_in")
    assert (shrink["ranks"], shrink["dp_size"], shrink["left"], shrink["step"]) == (
        [0, 2, 3], 3, [1], 4)
    (grow,) = job.named("scale_out")
    assert (grow["ranks"], grow["dp_size"], grow["joined"]) == ([0, 1, 2, 3], 4, [1])
    assert 4 <= grow["step"] < config["train_iters"], grow
    assert_the_fault_free_stream(job, reference, fault_step=4)
    # after the grow: the four ranks hold the replicas again, identical
    checks = [e for e in job.named("replica_check") if e["iteration"] > grow["step"]]
    assert checks and all(e["match"] for e in checks)
    assert {e["rank"] for e in checks} == {0, 1, 2, 3}


@pytest.mark.multiproc
def test_replica_memory_formula_on_megatron_core_016(megatron_lm_016, tmp_path):
    """One job of bench/memory.py on megatron-core 0.16.1 (d = 2, N = 2, fp32 grads): the
    bytes per parameter rank 0 holds equal the formula (6 + 12 N / d = 18) within 1%, as
    tests/test_plan.py checks on 0.12.1."""
    env = _megatron_core_016(megatron_lm_016)
    bench = Path(__file__).resolve().parents[1] / "bench" / "memory.py"
    argv = ["--dims", "2", "--replicas", "2", "--grads", "fp32", "--layers", "2", "--hidden",
            "128", "--ffn", "352", "--seq", "32", "--timeout", "120", "--keep", str(tmp_path)]
    job = subprocess.run([sys.executable, str(bench), *argv], cwd=bench.parents[1], env=env,
                         capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-4000:]
    (row,) = json.loads(job.stdout.splitlines()[-1])["rows"]
    assert (row["d"], row["n"], row["grad"], row["ha"], row["formula"]) == (2, 2, "fp32", "on",
                                                                           18.0)
    assert abs(row["measured"] - row["formula"]) <= 0.01 * row["formula"], row


def test_the_triton_stand_in_refuses_batch_invariant_mode_naming_the_fix(megatron_lm_016):
    """Where Triton does not import, Megatron-LM core_v0.16.1 imports with the stand-in of
    `batch_invariant_kernels` (the `stand-ins` moment): the mode reads as off, and switching
    it on refuses with the fix."""
    program = (
        "from mindspeed_tft import patches\n"
        "from mindspeed_tft.platform import import_megatron_core\n"
        "import_megatron_core(); assert patches.install('stand-ins')\n"
        "import megatron.training.initialize as init\n"
        "from megatron.core.transformer.custom_layers import batch_invariant_kernels as bik\n"
        "assert init.enable_batch_invariant_mode is bik.enable_batch_invariant_mode\n"
        "assert bik.is_batch_invariant_mode_enabled() is False\n"
        "bik.enable_batch_invariant_mode()\n")
    env = {**os.environ, "PYTHONPATH": str(megatron_lm_016), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "RuntimeError: megatron.core.transformer.custom_layers.batch_invariant_kernels needs "
        "triton, which is not installed here (mindspeed-tft stands in for the module so that "
        "Megatron-LM imports without it); fix: pip install triton, or leave "
        "--batch-invariant-mode off")
