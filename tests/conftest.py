"""Shared fixtures: one fault-free reference run per layout and configuration per session.

Tests that compare a faulty or resumed run against a run that never failed ask
`reference_job(layout, **config)` (the reference trainer), `megatron_reference(layout,
**config)` (Megatron-LM core_v0.12.1's own loop) or `megatron_reference_016(layout, **config)`
(core_v0.16.1's); the first ask runs the job, later asks reuse it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mindspeed_tft.events import read_events_if_any
from tests.clones import clone
from tests.jobs import REPO, JobResult, run_megatron_job, run_tiny_job


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory that every pytest-xdist worker of this session shares (without xdist: the
    session's own temporary directory)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _run_once(tmp_path_factory: pytest.TempPathFactory, label: str, key: str,
              run: Callable[[Path], JobResult]) -> JobResult:
    """The job `run(run_dir)` of configuration `key`, run once per session by whichever worker
    asks first (a file lock in the workers' shared directory, held for at most 30 minutes);
    the others read its exit code, output and events back from its directory."""
    from filelock import FileLock

    root = _shared_root(tmp_path_factory) / "references"
    root.mkdir(exist_ok=True)
    name = f"{label}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    run_dir, code = root / name, root / f"{name}.returncode"
    with FileLock(str(root / f"{name}.lock"), timeout=1800):
        if not code.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir()
            result = run(run_dir)
            code.write_text(str(result.returncode))
            return result
    return JobResult(int(code.read_text()), (run_dir / "output.log").read_text(), run_dir,
                     read_events_if_any(run_dir / "events.jsonl"))


@pytest.fixture(scope="session")
def reference_job(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., JobResult]:
    cache: dict[str, JobResult] = {}

    def get(layout: str, **config) -> JobResult:
        key = repr((layout, sorted((k, sorted(v.items()) if isinstance(v, dict) else v)
                                   for k, v in config.items())))
        if key not in cache:
            result = _run_once(tmp_path_factory, f"reference-{layout}", key,
                               lambda run_dir: run_tiny_job(run_dir, layout=layout, **config))
            assert result.returncode == 0, result.describe()
            cache[key] = result
        return cache[key]

    return get


#: the one line a user adds at the top of their own pretrain_gpt.py
ADAPTOR_LINE = "import mindspeed_tft.megatron_adaptor  # noqa: F401\n"


def _writable_copy(version: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A writable copy of the Megatron-LM clone of megatron-core `version`, one per session
    for every pytest-xdist worker (made under a file lock in their shared directory), with its
    dataset helpers compiled (Megatron-LM's rank 0 runs `make` in its own tree at start-up: on
    a built tree that is a no-op, so two workers' jobs can share it) and
    `pretrain_gpt_tft.py`: its pretrain_gpt.py plus the one-line import."""
    from filelock import FileLock

    source = clone(version)
    assert not isinstance(source, str), source
    root = _shared_root(tmp_path_factory)
    copy, ready = root / f"megatron-lm-{version}" / "Megatron-LM", root / f"megatron-lm-{version}.ready"
    with FileLock(str(root / f"megatron-lm-{version}.lock"), timeout=1800):
        if not ready.exists():
            shutil.rmtree(copy.parent, ignore_errors=True)
            shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
            for path in copy.rglob("*"):
                path.chmod(path.stat().st_mode | stat.S_IWUSR)
            script = (copy / "pretrain_gpt.py").read_text()
            (copy / "pretrain_gpt_tft.py").write_text(ADAPTOR_LINE + script)
            path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            done = subprocess.run(["make", "-C", str(copy / "megatron" / "core" / "datasets")],
                                  env={**os.environ, "PATH": path}, capture_output=True,
                                  text=True, timeout=600)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            byte_compile(copy / "megatron")
            ready.write_text(version)
    return copy


def byte_compile(*trees: Path) -> None:
    """Write the bytecode of every module under `trees` now, once, so that no process of a
    job compiles it again (each rank imports hundreds of modules, 0.8 s of CPU for
    Megatron-LM's alone; with PYTHONDONTWRITEBYTECODE set, as CI machines often have it,
    Python would compile them in every process and keep nothing)."""
    import compileall
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron-LM's legacy code has SyntaxWarnings
        for tree in trees:
            compileall.compile_dir(str(tree), quiet=2)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Before any test (in the main process only, not in each xdist worker): the bytecode of
    this checkout's modules that jobs import."""
    if not hasattr(session.config, "workerinput"):
        byte_compile(REPO / "mindspeed_tft", REPO / "sdk", REPO / "tests")


def _reference_runs(megatron_lm: Path, tmp_path_factory: pytest.TempPathFactory,
                    label: str) -> Callable[..., JobResult]:
    cache: dict[str, JobResult] = {}

    def get(layout: str, **config) -> JobResult:
        # no extra arguments is one configuration, however it is spelled (None, [])
        config = {k: v for k, v in config.items() if not (k == "extra_args" and not v)}
        key = repr((layout, sorted(config.items())))
        if key not in cache:
            result = _run_once(tmp_path_factory, f"{label}-{layout}", key,
                               lambda run_dir: run_megatron_job(run_dir, megatron_lm,
                                                                layout=layout, **config))
            assert result.returncode == 0, result.describe()
            cache[key] = result
        return cache[key]

    return get


@pytest.fixture(scope="session")
def megatron_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Megatron-LM core_v0.12.1 ($MEGATRON_LM, else shared/megatron-lm beside the checkout),
    a writable copy (see `_writable_copy`)."""
    return _writable_copy("0.12.1", tmp_path_factory)


@pytest.fixture(scope="session")
def megatron_reference(
    megatron_lm: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., JobResult]:
    """Fault-free runs in Megatron-LM's own loop, one per configuration per session."""
    return _reference_runs(megatron_lm, tmp_path_factory, "megatron-reference")


@pytest.fixture(scope="session")
def megatron_lm_016(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Megatron-LM core_v0.16.1 ($MEGATRON_LM_016, else shared/megatron-lm-0.16.1 beside the
    checkout), a writable copy (see `_writable_copy`); first on PYTHONPATH, its megatron.core
    (0.16.1) shadows the venv's megatron-core wheel."""
    return _writable_copy("0.16.1", tmp_path_factory)


@pytest.fixture(scope="session")
def megatron_reference_016(
    megatron_lm_016: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., JobResult]:
    """Fault-free runs in Megatron-LM core_v0.16.1's own loop, one per configuration per
    session."""
    return _reference_runs(megatron_lm_016, tmp_path_factory, "megatron-016-reference")


@pytest.fixture(scope="session")
def hooked_torchrun(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the venv's `torchrun` with the guide's one-line hook
    (`scripts/patch_torchrun.sh apply`): the launch route 'torchrun, patched'."""
    copy = tmp_path_factory.mktemp("hooked-torchrun") / "torchrun"
    shutil.copy2(Path(sys.executable).parent / "torchrun", copy)
    done = subprocess.run(["bash", str(REPO / "scripts" / "patch_torchrun.sh"), "apply"],
                          env={**os.environ, "TORCHRUN": str(copy)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return str(copy)


#: the extended tier: variants of a fault kind x host x launcher cell that another job of the
#: default run already covers (another layout, replica count or fault point; the protocol's
#: orderings are the simulator's), and measurements beside the features' own jobs.
#: `./scripts/test.sh` leaves them out (pyproject's `-m "not extended"`) to keep a clean-clone
#: run within CI's budget; `./scripts/test.sh -m extended` runs them, `-m "extended or not
#: extended"` everything. tests/README.md says which default job covers each cell.
EXTENDED = frozenset({
    # the replacement launcher on loopback with node 0's metrics scraped all along (the cell
    # itself, a host replaced, runs on the test bed: test_hosts.py)
    "tests/test_worker_reboot.py::test_a_lost_node_is_replaced_by_a_new_launcher",
    # layouts: the same cell in tp2dp2, pp2dp2 or dp8
    "tests/test_dump.py::"
    "test_fault_produces_a_dump_that_resumes_bit_exact[tp2dp2-kill-1-7-backward-7-2]",
    "tests/test_megatron_lm.py::"
    "test_worker_reboot_under_tft_run_restarts_only_the_killed_rank[pp2dp2-3-extra1-0]",
    "tests/test_megatron_lm.py::"
    "test_killed_rank_dumps_in_megatron_lm_layout_and_load_resumes_bit_exact[tp2dp2]",
    "tests/test_megatron_lm.py::test_trains_in_megatron_lms_loop_and_the_loss_falls[tp2dp2]",
    "tests/test_elastic.py::test_kill_without_replacement_shrinks_and_finishes_every_iteration"
    "[tp2dp2-16-ranks0-1-left0]",
    "tests/test_uce.py::test_repaired_in_place_and_bit_exact[tp2dp2-uce:optimizer+comm]",
    "tests/test_uce.py::test_pipeline_uce_logs_every_iteration_once",
    "tests/test_training.py::test_loss_goes_down_and_resume_is_bit_exact[pp2dp2]",
    "tests/test_replicas.py::test_replicas_are_identical_after_every_step[dp8-4]",
    "tests/test_replicas.py::test_ha_on_losses_match_ha_off[dp8-4]",
    # fault points and configurations beside a covered cell
    "tests/test_dump.py::test_fault_produces_a_dump_that_resumes_bit_exact[dp4-kill-3-7-optimizer-8-0]",
    "tests/test_dump.py::test_kill_during_a_periodic_save_never_publishes_the_half_written_one",
    "tests/test_elastic.py::test_a_fault_during_the_shrink_ends_with_the_dump",
    "tests/test_elastic.py::"
    "test_a_fault_during_the_grow_ends_with_a_dump_that_resumes_at_the_launch_size",
    "tests/test_worker_reboot.py::test_two_faults_at_different_steps_are_both_repaired",
    "tests/test_worker_reboot.py::test_no_replica_reloads_the_periodic_checkpoint",
    "tests/test_full_replicas.py::test_killed_worker_is_replaced_from_the_other_full_replica",
    "tests/test_flood.py::test_hostile_connections_never_keep_a_restarted_worker_out[curve]",
    "tests/test_drill.py::test_drill_fails_a_configuration_that_cannot_recover",
    "tests/test_drill.py::test_drill_certifies_a_configuration_that_recovers",
    # the grow through a replacement launcher is the SDK's ZIT job's (two launchers) and
    # core_v0.16.1's (Megatron-LM's loop); this one adds a second shrink before it
    "tests/test_elastic.py::test_two_shrinks_then_the_node_comes_back_and_the_job_grows",
    # the grow in core_v0.16.1's loop by a late cold restart: 60 steps of a longer reference
    "tests/test_megatron_lm_016.py::"
    "test_elastic_training_shrinks_and_grows_in_megatron_lm_016s_loop",
    "tests/test_megatron_lm.py::test_megatron_training_on_the_megatron_core_wheel",
    "tests/test_uce.py::test_uce_without_hbmfault_repair_dumps",
    # TFT_INJECT's kill, raise and comm with high availability off (each fires at its rank,
    # step and phase in the default run's fault jobs too; hang and a kill during a save stay)
    "tests/test_injection.py::test_kill_at_backward",
    "tests/test_injection.py::test_raise_at_optimizer",
    "tests/test_injection.py::test_comm_at_forward",
    # start-up refusals whose check test_arguments.py runs in-process; each host keeps a real
    # refusal of a flag (high availability without --save) and of its port (in use)
    "tests/test_refusals.py::test_high_availability_without_save_is_refused[elastic-reference]",
    "tests/test_refusals.py::"
    "test_high_availability_without_save_is_refused[elastic-megatron-lm]",
    "tests/test_refusals.py::test_an_unwritable_save_is_refused[reference]",
    "tests/test_refusals.py::test_an_unwritable_save_is_refused[megatron-lm]",
    "tests/test_refusals.py::test_worker_reboot_under_plain_torchrun_is_refused[reference]",
    "tests/test_refusals.py::test_worker_reboot_under_plain_torchrun_is_refused[megatron-lm]",
    # variants whose path a default job takes too: a fault inside the update (the params
    # all-gathered: the tft-run kill of the hostile-peer job), a hang injected with high
    # availability off (the hung-worker job), a warm spare (Megatron-LM's tft-run jobs, both
    # versions), a replacement launcher (the lost-node job), and the trainer's indexed-data
    # path and rank 0's dataset cache across real ranks (in-process in test_data.py)
    "tests/test_uce.py::test_a_fault_inside_the_update_rolls_back_with_the_params_all_gathered",
    "tests/test_injection.py::test_hang_after_step_blocks_the_rank",
    "tests/test_launcher.py::test_spare_takes_over_a_failed_worker",
    "tests/test_launcher.py::test_replacement_launcher_rejoins_a_running_job",
    "tests/test_training.py::test_trains_on_indexed_data_with_llama2_tokenizer",
    "tests/test_data.py::test_torch_distributed_rank0_builds_the_cache_first",
    # elastic x reference trainer x tft-run is the shrunk job's UCE (test_elastic.py); this
    # one waits out the exit grace for a replacement that comes after the end
    "tests/test_elastic.py::"
    "test_a_replacement_that_comes_after_the_end_is_stopped_and_the_job_succeeds",
    # measurements
    "tests/test_plan.py::test_plan_matches_bench_memory",
    "tests/test_repair_work.py::test_an_outside_ranks_repair_work_is_the_same_at_8_and_16_ranks",
})


#: the session fixtures that run or prepare real jobs (with `multiproc`: what makes a test heavy)
JOB_FIXTURES = frozenset({"reference_job", "megatron_lm", "megatron_reference", "megatron_lm_016",
                          "megatron_reference_016", "hooked_torchrun"})


#: files whose protocol timers are short (a 1 s admission deadline, heartbeats of 0.2 s) or
#: that time a process's end: marked `timed`; `./scripts/test.sh` runs them first, in one
#: process with nothing beside them, then the rest on two workers
TIMED_FILES = frozenset({"tests/control/test_admission.py", "tests/control/test_priority.py",
                         "tests/test_lifetimes.py", "tests/test_data_workers.py"})


def heavy(item: pytest.Item) -> bool:
    """Whether `item` runs a real multi-process job: marked `multiproc`, or asking a fixture of
    `JOB_FIXTURES`."""
    return bool(item.get_closest_marker("multiproc")
                or JOB_FIXTURES & set(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of the extended tier (`EXTENDED`) that this run collected, and order the
    files: those of `TIMED_FILES` first (they run beside each other, not beside a job), then
    by how many real jobs they run, most first. pyproject's addopts spread the files over two
    pytest-xdist workers (`-n 2 --dist loadfile --no-loadscope-reorder`) in this order, so
    the long files start early and the short ones fill the end."""
    ids = {item.nodeid: item for item in items}
    for nodeid in EXTENDED:
        if nodeid in ids:
            ids[nodeid].add_marker(pytest.mark.extended)
    for item in items:
        if item.nodeid.split("::")[0] in TIMED_FILES:
            item.add_marker(pytest.mark.timed)
    weight: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        weight[path] = weight.get(path, 0) + (heavy(item) and not item.get_closest_marker(
            "extended"))
    items.sort(key=lambda item: (item.nodeid.split("::")[0] not in TIMED_FILES,
                                 -weight[item.nodeid.split("::")[0]]))
