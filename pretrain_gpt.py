"""Pretrain a GPT model on megatron-core: the Megatron-LM entry point, with mindspeed-tft.

Launch it as Megatron-LM's `pretrain_gpt.py`, with torchrun (or `tft-run`) and Megatron-LM's
flags; add `--enable-high-availability` and friends to switch on fault tolerance::

    torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 2 ... --enable-high-availability

See scripts/pretrain_llama2_7b_ptd.sh and scripts/pretrain_tiny_cpu.sh.
"""

from __future__ import annotations

from functools import partial

from mindspeed_tft.startup import defer_gc

defer_gc()  # until pretrain() begins: see mindspeed_tft.startup

import torch  # noqa: E402

from mindspeed_tft.platform import import_megatron_core  # noqa: E402

import_megatron_core()  # first: on CPU, megatron-core's fused helpers stay eager

from megatron.core import parallel_state as ps  # noqa: E402

from mindspeed_tft.arguments import add_tft_args, validate_tft_args  # noqa: E402
from mindspeed_tft.control.processor.termination import exit_without_teardown  # noqa: E402
from mindspeed_tft.training import pretrain  # noqa: E402
from mindspeed_tft.training.data import build_train_valid_test_datasets  # noqa: E402
from mindspeed_tft.training.global_vars import get_args, get_tokenizer  # noqa: E402
from mindspeed_tft.training.model import gpt_model_provider  # noqa: E402


def model_provider(pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
    """Build the GPT model chunk of this pipeline stage."""
    return gpt_model_provider(get_args(), pre_process, post_process)


def get_batch(data_iterator):
    """Tokens, labels, loss mask, attention mask and position ids of one micro-batch.

    Middle pipeline stages take their input from the previous stage and read no data."""
    if not (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
        return None, None, None, None, None
    batch = next(data_iterator)
    return (
        batch["tokens"],
        batch["labels"],
        batch["loss_mask"],
        batch.get("attention_mask"),
        batch["position_ids"],
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-averaged language-model loss; the logged value is reduced over data parallel."""
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    total_tokens = loss_mask.sum()
    loss = torch.cat([torch.sum(losses.view(-1) * loss_mask).view(1), total_tokens.view(1)])
    reporting_loss = loss.clone().detach()
    torch.distributed.all_reduce(reporting_loss, group=ps.get_data_parallel_group())
    local_num_tokens = loss[1].clone().detach().to(torch.int)
    return loss[0], local_num_tokens, {"lm loss": (reporting_loss[0], reporting_loss[1])}


def forward_step(data_iterator, model: torch.nn.Module):
    """Forward one micro-batch; return the output and the loss function to apply to it."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int]):
    """Build the train, validation and test datasets (Megatron's GPTDataset or mock data)."""
    return build_train_valid_test_datasets(get_args(), get_tokenizer())


if __name__ == "__main__":
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        forward_step,
        extra_args_provider=add_tft_args,
        extra_args_validator=validate_tft_args,
    )
    exit_without_teardown(0)  # training finished and was reported: skip interpreter teardown
