"""The reference trainer on real multi-process jobs (torchrun, gloo, 4 CPU ranks).

For DP=4 and PP=2 x DP=2: the loss goes down, and a run resumed from the
checkpoint at iteration 5 logs exactly (bit for bit) the losses of the run that never stopped.
"""

from __future__ import annotations

import pytest

from tests.jobs import STANDARD, checkpoint_at, run_tiny_job

pytestmark = pytest.mark.multiproc

ITERS = STANDARD["train_iters"]
SAVE_AT = STANDARD["save_interval"]


def layout_config(layout: str) -> dict:
    return dict(STANDARD)


# TP2 x DP2 resumes bit-exact from a dump in test_dump and in Megatron-LM's loop
@pytest.mark.parametrize("layout", ["dp4", "pp2dp2"])
def test_loss_goes_down_and_resume_is_bit_exact(layout, reference_job, tmp_path):
    reference = reference_job(layout, **layout_config(layout))
    losses = reference.losses()
    assert sorted(losses) == list(range(1, ITERS + 1)), reference.describe()
    assert losses[ITERS] < losses[1] - 0.05, losses
    assert "lm loss:" in reference.output and "tokens per second:" in reference.output
    assert (reference.checkpoint_dir / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)

    load_dir = checkpoint_at(reference.checkpoint_dir, SAVE_AT, tmp_path / "load")
    resumed = run_tiny_job(tmp_path / "resumed", layout=layout, load_dir=load_dir,
                           **layout_config(layout))
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded checkpoint {load_dir} at iteration {SAVE_AT}" in resumed.output
    resumed_losses = resumed.losses()
    assert sorted(resumed_losses) == list(range(SAVE_AT + 1, ITERS + 1))
    for iteration, loss in resumed_losses.items():
        assert loss == losses[iteration], (iteration, loss, losses[iteration])


def test_trains_on_indexed_data_with_llama2_tokenizer(tmp_path):
    """Megatron .bin/.idx data made by scripts/preprocess_data.py from a corpus and a
    sentencepiece model built here, read through GPTDataset with a 949,50,1 split."""
    from tests.corpus import build_tiny_corpus

    corpus = build_tiny_corpus(tmp_path / "corpus")
    result = run_tiny_job(
        tmp_path / "run",
        train_iters=6,
        save_interval=6,
        env={
            "DATA_ARGS": f"--data-path {corpus['prefix']} --split 949,50,1 "
            f"--data-cache-path {tmp_path / 'cache'}",
            "TOKENIZER_ARGS": f"--tokenizer-type Llama2Tokenizer --tokenizer-model {corpus['model']}",
        },
        extra_args=["--eval-interval", "3", "--eval-iters", "1"],
    )
    assert result.returncode == 0, result.describe()
    losses = result.losses()
    assert sorted(losses) == list(range(1, 7))
    # A fresh model predicts uniformly over the 320-token vocabulary: loss ~ ln(320) = 5.77.
    assert 5.5 < losses[1] < 6.0, losses
    assert losses[6] < losses[1] - 0.1, losses
    assert "validation loss at iteration 3" in result.output
    assert "validation loss at iteration 6" in result.output
