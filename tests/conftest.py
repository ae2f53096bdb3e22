"""Shared fixtures: one fault-free reference run per layout and configuration per session.

Tests that compare a faulty or resumed run against a run that never failed ask
`reference_job(layout, **config)` (the reference trainer), `megatron_reference(layout,
**config)` (Megatron-LM core_v0.12.1's own loop) or `megatron_reference_016(layout, **config)`
(core_v0.16.1's); the first ask runs the job, later asks reuse it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.clones import clone
from tests.jobs import REPO, JobResult, run_megatron_job, run_tiny_job


@pytest.fixture(scope="session")
def reference_job(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., JobResult]:
    cache: dict[tuple, JobResult] = {}

    def get(layout: str, **config) -> JobResult:
        key = (layout, tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                    for k, v in config.items())))
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"reference-{layout}")
            result = run_tiny_job(run_dir, layout=layout, **config)
            assert result.returncode == 0, result.describe()
            cache[key] = result
        return cache[key]

    return get


#: the one line a user adds at the top of their own pretrain_gpt.py
ADAPTOR_LINE = "import mindspeed_tft.megatron_adaptor  # noqa: F401\n"


def _writable_copy(version: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A writable copy of the Megatron-LM clone of megatron-core `version` for this session
    (it compiles its dataset helpers into its own tree), with `pretrain_gpt_tft.py`: its
    pretrain_gpt.py plus the one-line import."""
    source = clone(version)
    assert not isinstance(source, str), source
    copy = tmp_path_factory.mktemp(f"megatron-lm-{version}") / "Megatron-LM"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path in copy.rglob("*"):
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    script = (copy / "pretrain_gpt.py").read_text()
    (copy / "pretrain_gpt_tft.py").write_text(ADAPTOR_LINE + script)
    return copy


def _reference_runs(megatron_lm: Path, tmp_path_factory: pytest.TempPathFactory,
                    label: str) -> Callable[..., JobResult]:
    cache: dict[tuple, JobResult] = {}

    def get(layout: str, **config) -> JobResult:
        # no extra arguments is one configuration, however it is spelled (None, [])
        config = {k: v for k, v in config.items() if not (k == "extra_args" and not v)}
        key = (layout, repr(sorted(config.items())))
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"{label}-{layout}")
            result = run_megatron_job(run_dir, megatron_lm, layout=layout, **config)
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


#: the extended tier: layout variants of a fault kind x host x launcher cell that another job
#: already covers, and measurements beside the features' own jobs. `./scripts/test.sh` leaves
#: them out (pyproject's `-m "not extended"`) to keep a clean-clone run within CI's budget;
#: `./scripts/test.sh -m extended` runs them, `-m "extended or not extended"` everything.
EXTENDED = frozenset({
    "tests/test_repair_work.py::test_an_outside_ranks_repair_work_is_the_same_at_8_and_16_ranks",
    "tests/test_elastic.py::"
    "test_a_fault_during_the_grow_ends_with_a_dump_that_resumes_at_the_launch_size",
    "tests/test_dump.py::"
    "test_fault_produces_a_dump_that_resumes_bit_exact[tp2dp2-kill-1-7-backward-7-2]",
    "tests/test_megatron_lm.py::"
    "test_worker_reboot_under_tft_run_restarts_only_the_killed_rank[pp2dp2-3-extra1-0]",
    "tests/test_megatron_lm.py::"
    "test_killed_rank_dumps_in_megatron_lm_layout_and_load_resumes_bit_exact[tp2dp2]",
    "tests/test_megatron_lm_016.py::test_reference_trainer_trains_on_megatron_core_016",
    "tests/test_megatron_lm_016.py::test_worker_reboot_under_tft_run_016[warm spare]",
    "tests/test_megatron_lm_016.py::test_elastic_training_shrinks_in_megatron_lm_016s_loop",
    "tests/test_megatron_lm_016.py::test_replica_memory_formula_on_megatron_core_016",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of the extended tier (`EXTENDED`) that this run collected."""
    ids = {item.nodeid: item for item in items}
    for nodeid in EXTENDED:
        if nodeid in ids:
            ids[nodeid].add_marker(pytest.mark.extended)
