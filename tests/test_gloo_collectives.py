"""The gloo stand-ins of `mindspeed_tft.recovery.collectives` in real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.jobs import free_port

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "tests" / "programs" / "gloo_reduce_scatter.py"


def test_reduce_scatter_into_own_slice_runs_in_place():
    """Into a view of the rank's own slice (megatron-core's grad buffers) the all-reduce runs
    on the buffer itself, with no copy of it; into a separate tensor the input is copied
    first and left as it was. Both outputs are the exact sums."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(PROGRAM), str(r), port], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results == [{"view_exact": True, "buffer_reduced_in_place": True,
                        "separate_exact": True, "separate_input_kept": True}] * 2
