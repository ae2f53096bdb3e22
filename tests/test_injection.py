"""Each TFT_INJECT kind fires in a real 2-rank job at the named rank, step and phase.

(Two ranks: a job here only has to fail in the named way, and each rank's start-up, its
imports of torch and megatron-core, is most of such a job's time on CI's 2 cores.)
High availability is off here, so the job fails the way a Megatron job fails today: the
injected rank dies (kill: SIGKILL) or raises, the other ranks lose their peers, torchrun
tears the job down. What the tests check is that the fault happened exactly where asked.
"""

from __future__ import annotations

import re

import pytest

from tests.jobs import run_tiny_job

TWO_RANKS = {"layout": "dp2"}

pytestmark = pytest.mark.multiproc


def _injected(result, **expected):
    events = result.named("fault_injected")
    assert len(events) == 1, result.describe()
    event = events[0]
    for key, value in expected.items():
        assert event[key] == value, (key, event)
    return event


def _last_iteration(result) -> int:
    return max(result.losses(), default=0)


def _rank_exitcode(output: str, rank: int) -> int:
    match = re.search(rf"rank\s+: {rank} \(local_rank: {rank}\)\s+exitcode\s+: (-?\d+)", output)
    assert match, output[-3000:]
    return int(match.group(1))


def test_kill_at_backward(tmp_path):
    result = run_tiny_job(tmp_path, inject="kill:rank=1,step=2,phase=backward", train_iters=5,
                          **TWO_RANKS)
    assert result.returncode != 0
    _injected(result, rank=1, kind="kill", step=2, phase="backward")
    assert _rank_exitcode(result.output, 1) == -9
    assert _last_iteration(result) == 2  # steps 0 and 1 finished; step 2 never did


def test_raise_at_optimizer(tmp_path):
    result = run_tiny_job(tmp_path, inject="raise:rank=1,step=1,phase=optimizer", train_iters=4,
                          **TWO_RANKS)
    assert result.returncode != 0
    _injected(result, rank=1, kind="raise", step=1, phase="optimizer")
    assert "RuntimeError: TFT_INJECT raise: injected error at rank 1 step 1 phase optimizer" in (
        result.output
    )
    assert _rank_exitcode(result.output, 1) == 1
    assert _last_iteration(result) == 1


def test_comm_at_forward(tmp_path):
    result = run_tiny_job(tmp_path, inject="comm:rank=0,step=3,phase=forward", train_iters=5,
                          **TWO_RANKS)
    assert result.returncode != 0
    _injected(result, rank=0, kind="comm", step=3, phase="forward")
    assert "HCCL OP RETRY FAILED: TFT_INJECT comm: injected communication error at rank 0 " \
        "step 3 phase forward" in result.output
    assert _last_iteration(result) == 3


def test_hang_after_step_blocks_the_rank(tmp_path):
    result = run_tiny_job(
        tmp_path,
        inject="hang:rank=1,step=1,phase=after",
        train_iters=4,
        **TWO_RANKS,
        env={"TFT_INJECT_HANG_SECONDS": "3"},
    )
    assert result.returncode != 0
    event = _injected(result, rank=1, kind="hang", step=1, phase="after")
    assert "TFT_INJECT hang: rank 1 step 1 phase after was not stopped within 3" in result.output
    # Rank 1 logs the loss: it finished step 1 (iteration 2) and then stopped making progress.
    assert _last_iteration(result) == 2
    assert max(e["time"] for e in result.events) >= event["time"]


def test_kill_during_periodic_save_leaves_no_published_checkpoint(tmp_path):
    result = run_tiny_job(
        tmp_path, inject="kill:rank=0,step=3,phase=save", train_iters=6, save_interval=2,
        **TWO_RANKS)
    assert result.returncode != 0
    _injected(result, rank=0, kind="kill", step=3, phase="save")
    ckpt = result.checkpoint_dir
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "iter_0000002").is_dir()
    assert not (ckpt / "iter_0000004").exists()
    assert (ckpt / "iter_0000004_tmp").is_dir()
