"""Shared fixtures: one fault-free reference run per layout and configuration per session.

Tests that compare a faulty or resumed run against a run that never failed ask
`reference_job(layout, **config)`; the first ask runs the job, later asks reuse it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.jobs import JobResult, run_tiny_job


@pytest.fixture(scope="session")
def reference_job(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., JobResult]:
    cache: dict[tuple, JobResult] = {}

    def get(layout: str, **config) -> JobResult:
        key = (layout, tuple(sorted(config.items())))
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"reference-{layout}")
            result = run_tiny_job(run_dir, layout=layout, **config)
            assert result.returncode == 0, result.describe()
            cache[key] = result
        return cache[key]

    return get
