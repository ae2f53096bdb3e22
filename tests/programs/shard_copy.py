"""Copy an optimizer shard between two holders of a real 4-rank job (run by torchrun).

Trains 2 steps of the tiny model with 2 optimizer replicas (DP=4: ranks 1 and 3 hold the
same shard), then rank 3 wipes its shard and model params, receives rank 1's over
torch.distributed (`copy_shard`), every rank rebuilds its model params from the
main params (as the rollback does) and reports the CRC-32 of its shard and model params.
One more step then runs with the replica check on. Then rank 3 zeroes its model params and
receives them with rank 1's shard (`with_params`), though it guessed they would not come,
and receives a shard without them though it guessed they would (`params_copied`,
`params_kept`). Last, rank 3 freezes a param (one tensor more in its shard) and must refuse
rank 1's shard (`refused`: the error each side raised). Writes one JSON file per rank:
{"rank", "before", "wiped", "after", "copied", "replicas_agree_after_step",
"params_copied", "params_kept", "refused"}.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import zlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain_gpt  # noqa: E402
from mindspeed_tft import patches  # noqa: E402
from mindspeed_tft.arguments import add_tft_args, validate_tft_args  # noqa: E402
from mindspeed_tft.plugin import (
    ReplicaCheckHooks,  # noqa: E402
    TFTPlugin,  # noqa: E402
)
from mindspeed_tft.plugin.hooks import HookList, set_update_listener  # noqa: E402
from mindspeed_tft.plugin.state import TrainingState  # noqa: E402
from mindspeed_tft.recovery.rollback import sync_model_params_from_main  # noqa: E402
from mindspeed_tft.replica.check import ReplicaConsistencyCheck  # noqa: E402
from mindspeed_tft.replica.transfer import copy_shard, param_buffers, shard_digest  # noqa: E402
from mindspeed_tft.training.data import (  # noqa: E402
    build_data_iterator,
    get_train_valid_test_num_samples,
)
from mindspeed_tft.training.initialize import (  # noqa: E402
    initialize_megatron,
    initialize_model_parallel,
)
from mindspeed_tft.training.training import setup_model_and_optimizer, train_step  # noqa: E402

ARGV = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 "
    "--seq-length 64 --max-position-embeddings 64 --make-vocab-size-divisible-by 1 "
    "--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --position-embedding-type rope --normalization RMSNorm --swiglu "
    "--tokenizer-type NullTokenizer --vocab-size 4096 --micro-batch-size 2 "
    "--global-batch-size 16 --lr 1e-3 --train-iters 3 --use-distributed-optimizer --bf16 "
    "--mock-data --eval-iters 0 --enable-high-availability --distributed-backend gloo"
).split() + ["--save", tempfile.gettempdir()]  # high availability needs one (nothing saved)


def digest(optimizer, model) -> str:
    """The shard's CRC-32 and one over the model params."""
    params = torch.cat([p.detach().float().view(-1) for chunk in model for p in chunk.parameters()])
    return f"{shard_digest(optimizer, model)}/{zlib.crc32(params.numpy()):08x}"


def main() -> None:
    args = initialize_megatron(add_tft_args, validate_tft_args, ARGV)
    patches.install("update-bracket")
    plugin = TFTPlugin(args, initialize_model_parallel)
    plugin.setup()
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, args)
    from megatron.core import parallel_state as ps

    train_ds, _, _ = pretrain_gpt.train_valid_test_datasets_provider(
        list(get_train_valid_test_num_samples(args))
    )
    state = TrainingState(
        args=args, model=model, optimizer=optimizer, opt_param_scheduler=scheduler,
        build_train_data_iterator=lambda consumed: build_data_iterator(
            train_ds, consumed, args.micro_batch_size, ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size()),
        checkpoint_state_dict=lambda rng: {}, load_checkpoint=lambda root: 0,
    )
    state.reset_train_data_iterator()
    check = ReplicaConsistencyCheck(lambda: plugin.replica_groups, interval=1)
    hooks = HookList([plugin.hooks(), ReplicaCheckHooks(check)])
    set_update_listener(hooks, state)
    check.start()
    for _ in range(2):
        train_step(pretrain_gpt.forward_step, state, hooks)
        state.iteration += 1
        args.consumed_train_samples += args.global_batch_size

    me = dist.get_rank()
    before = digest(optimizer, model)
    wiped = before
    if me == 3:
        with torch.no_grad():
            for chained in optimizer.chained_optimizers:
                for group in chained.optimizer.param_groups:
                    for param in group["params"]:
                        param.fill_(float("nan"))
                        chained.optimizer.state[param]["exp_avg"].zero_()
                        chained.optimizer.state[param]["exp_avg_sq"].zero_()
            for chunk in model:
                for param in chunk.parameters():
                    param.zero_()
        wiped = digest(optimizer, model)
    copied = None
    if me in (1, 3):
        pair = dist.new_group([1, 3])
        copied = copy_shard(optimizer, model, src=1, dst=3, group=pair).nbytes
    else:
        dist.new_group([1, 3])
    sync_model_params_from_main(state)
    after = digest(optimizer, model)

    train_step(pretrain_gpt.forward_step, state, hooks)
    state.iteration += 1
    check.after_step(state.iteration, optimizer, model)  # raises if the replicas disagree

    # the receiver's guess of the sender's choice is only a guess, both ways
    pair = dist.new_group([1, 3])  # every rank calls new_group
    if me == 3:
        with torch.no_grad():
            for buffer in param_buffers(model):
                buffer.zero_()
    if me in (1, 3):
        copy_shard(optimizer, model, src=1, dst=3, group=pair, with_params=True,
                   expect_params=False)
    params_copied = digest(optimizer, model)
    if me in (1, 3):
        copy_shard(optimizer, model, src=1, dst=3, group=pair, with_params=False,
                   expect_params=True)
    params_kept = digest(optimizer, model)

    # a shard of another layout is refused by the receiver; the sender's wait is bounded
    short = dist.new_group([1, 3], timeout=timedelta(seconds=3))
    refused = None
    if me in (1, 3):
        frozen = next(model[0].parameters())
        frozen.requires_grad_(me != 3)
        try:
            copy_shard(optimizer, model, src=1, dst=3, group=short)
        except Exception as error:  # noqa: BLE001 - reported, the test reads it
            refused = f"{type(error).__name__}: {error}"
        frozen.requires_grad_(True)
    # one file per rank: lines printed by four processes to one pipe can interleave
    Path(f"shard_copy_rank{me}.json").write_text(json.dumps(
        {"rank": me, "before": before, "wiped": wiped, "after": after, "copied": copied,
         "replicas_agree_after_step": True, "params_copied": params_copied,
         "params_kept": params_kept, "refused": refused}))
    dist.barrier()
    # not destroy_process_group: the timed-out group's teardown is not what is tested
    os._exit(0)


if __name__ == "__main__":
    main()
