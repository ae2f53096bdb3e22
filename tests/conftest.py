"""Shared fixtures: one fault-free reference run per layout and configuration per session.

Tests that compare a faulty or resumed run against a run that never failed ask
`reference_job(layout, **config)` (the reference trainer) or `megatron_reference(layout,
**config)` (Megatron-LM's own loop); the first ask runs the job, later asks reuse it.
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


#: Megatron-LM core_v0.12.1, unmodified: MEGATRON_LM as scripts/test.sh sets it
#: (scripts/megatron_clones.sh finds or fetches it), else shared/ beside the repository
MEGATRON_LM_SOURCE = Path(os.environ.get("MEGATRON_LM") or REPO.parent / "shared" / "megatron-lm")
#: the one line a user adds at the top of their own pretrain_gpt.py
ADAPTOR_LINE = "import mindspeed_tft.megatron_adaptor  # noqa: F401\n"


@pytest.fixture(scope="session")
def megatron_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A writable copy of Megatron-LM for this session (it compiles its dataset helpers into
    its own tree), with `pretrain_gpt_tft.py`: its pretrain_gpt.py plus the one-line import."""
    source = MEGATRON_LM_SOURCE
    assert (source / "pretrain_gpt.py").is_file(), (
        f"Megatron-LM core_v0.12.1 not found at {source}: set MEGATRON_LM to a clone, or run "
        "scripts/megatron_clones.sh (it finds or fetches one)")
    copy = tmp_path_factory.mktemp("megatron-lm") / "Megatron-LM"
    shutil.copytree(source, copy)
    for path in copy.rglob("*"):
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    script = (copy / "pretrain_gpt.py").read_text()
    (copy / "pretrain_gpt_tft.py").write_text(ADAPTOR_LINE + script)
    return copy


@pytest.fixture(scope="session")
def megatron_reference(
    megatron_lm: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., JobResult]:
    """Fault-free runs in Megatron-LM's own loop, one per configuration per session."""
    cache: dict[tuple, JobResult] = {}

    def get(layout: str, **config) -> JobResult:
        # no extra arguments is one configuration, however it is spelled (None, [])
        config = {k: v for k, v in config.items() if not (k == "extra_args" and not v)}
        key = (layout, repr(sorted(config.items())))
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"megatron-reference-{layout}")
            result = run_megatron_job(run_dir, megatron_lm, layout=layout, **config)
            assert result.returncode == 0, result.describe()
            cache[key] = result
        return cache[key]

    return get


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
