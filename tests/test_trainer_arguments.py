"""The trainer's command line: Megatron-LM's flags with Megatron-LM's meaning."""

from __future__ import annotations

import shlex

import pytest
import torch

from mindspeed_tft.arguments import add_tft_args
from mindspeed_tft.training.arguments import (
    ArgumentError,
    fused_kernel_notices,
    parse_args,
    validate_args,
)

# The GPT_ARGS, DATA_ARGS and OUTPUT_ARGS of MindIO TFT's reference Llama2-7B script, plus
# its trailing flags (tokenizer path, data path and checkpoint directories filled in).
REFERENCE_FLAGS = """
--use-mcore-models --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
--sequence-parallel --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008
--num-attention-heads 32 --tokenizer-type Llama2Tokenizer --tokenizer-model /tok.model
--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1
--global-batch-size 256 --make-vocab-size-divisible-by 1 --lr 1.25e-6 --train-iters 5000
--lr-decay-style cosine --untie-embeddings-and-output-weights --disable-bias-linear
--attention-dropout 0.0 --init-method-std 0.01 --hidden-dropout 0.0
--position-embedding-type rope --normalization RMSNorm --use-fused-rmsnorm --swiglu
--use-flash-attn --no-masked-softmax-fusion --attention-softmax-in-fp32 --min-lr 1.25e-7
--weight-decay 1e-1 --lr-warmup-fraction 0.01 --clip-grad 1.0 --adam-beta1 0.9
--initial-loss-scale 65536 --adam-beta2 0.95 --no-gradient-accumulation-fusion
--no-load-optim --no-load-rng --use-distributed-optimizer --use-fused-swiglu
--use-fused-rotary-pos-emb --overlap-grad-reduce --bf16 --enable-high-availability
--enable-hbmfault-repair --enable-worker-reboot --distributed-optimizer-no-replica
--data-path /data/llama_text_document --split 949,50,1 --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 10 --distributed-backend nccl
--load /ckpt --save /ckpt
"""


def test_reference_script_flags_parse_with_megatron_meaning():
    args = parse_args(add_tft_args, shlex.split(REFERENCE_FLAGS))
    validate_args(args, world_size=8)
    assert args.data_parallel_size == 4
    assert args.num_microbatches == 64  # 256 / (1 x 4)
    assert args.params_dtype is torch.bfloat16
    assert args.accumulate_allreduce_grads_in_fp32 is True  # Megatron-LM: bf16 -> fp32 grads
    assert args.add_bias_linear is False
    assert args.masked_softmax_fusion is False
    assert args.gradient_accumulation_fusion is False
    assert args.untie_embeddings_and_output_weights is True
    assert args.kv_channels == 128
    assert args.num_query_groups == 32
    assert args.lr_decay_iters == 5000
    assert args.start_weight_decay == args.end_weight_decay == 0.1
    assert args.sequence_parallel is False  # TP = 1: Megatron-LM turns it off
    assert args.data_path == ["/data/llama_text_document"]
    assert args.enable_high_availability and args.distributed_optimizer_no_replica


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(add_tft_args, ["--num-layers", "2", "--enable-magic"])
    assert "unrecognized arguments: --enable-magic" in capsys.readouterr().err


def test_fused_kernel_flags_get_one_notice_each():
    args = parse_args(add_tft_args, shlex.split(REFERENCE_FLAGS))
    assert fused_kernel_notices(args, "cpu") == [
        f"notice: {flag} has no kernel in this trainer on cpu; using the unfused implementation"
        for flag in ("--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb",
                     "--use-flash-attn")
    ]


def _tiny(*extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
            "--mock-data", *extra]


def test_swiglu_default_ffn_size_is_megatrons():
    args = validate_args(parse_args(None, _tiny("--swiglu")), world_size=1)
    assert args.ffn_hidden_size == 128  # int(4 * 64 * 2 / 3 / 64) * 64


@pytest.mark.parametrize(
    ("extra", "world_size", "message"),
    [
        ((), 3, "world size 3 is not divisible by tensor (2) x pipeline (1) x context (1) "
                "parallel sizes = 2"),
        (("--global-batch-size", "6"), 4,
         "--global-batch-size 6 is not divisible by micro batch size (2) x data-parallel size "
         "(2) = 4"),
        (("--fp16", "--bf16"), 2, "--fp16 and --bf16 cannot both be set"),
    ],
)
def test_invalid_layouts_name_the_value(extra, world_size, message):
    args = parse_args(None, _tiny("--tensor-model-parallel-size", "2", *extra))
    with pytest.raises(ArgumentError) as error:
        validate_args(args, world_size=world_size)
    assert str(error.value) == message


def test_no_data_is_an_error():
    argv = [a for a in _tiny() if a != "--mock-data"]
    with pytest.raises(ArgumentError, match=r"no training data: give --data-path PREFIX"):
        validate_args(parse_args(None, argv), world_size=1)


def test_nccl_on_cpu_falls_back_to_gloo_with_a_notice(capsys, monkeypatch):
    from mindspeed_tft.platform import distributed_backend

    monkeypatch.setenv("RANK", "0")
    assert distributed_backend("nccl") == "gloo"
    assert capsys.readouterr().out == (
        "[mindspeed-tft] notice: --distributed-backend nccl is not available on cpu; using gloo\n"
    )
