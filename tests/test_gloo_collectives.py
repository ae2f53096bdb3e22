"""The gloo stand-ins of `mindspeed_tft.recovery.collectives` in real processes."""

from __future__ import annotations

from pathlib import Path

from tests.jobs import run_rank_programs

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "tests" / "programs" / "gloo_reduce_scatter.py"


def test_reduce_scatter_into_own_slice_runs_in_place():
    """Into a view of the rank's own slice (megatron-core's grad buffers) the all-reduce runs
    on the buffer itself, with no copy of it; into a separate tensor the input is copied
    first and left as it was. Both outputs are the exact sums."""
    results = run_rank_programs(PROGRAM)
    assert results == [{"view_exact": True, "buffer_reduced_in_place": True,
                        "separate_exact": True, "separate_input_kept": True}] * 2


def test_the_rollbacks_gather_goes_around_the_ring():
    """The rollback's param gather on gloo (`rollback._ring_gather`) gives every rank
    torch's all-gather of the shards, bit for bit, and connects a rank (its group lazily
    connected) to its two ring neighbours only: the gather's connections do not grow with
    the group."""
    results = run_rank_programs(REPO / "tests" / "programs" / "ring_gather.py", ranks=4)
    assert results == [{"exact": True, "connections": 2}] * 4
