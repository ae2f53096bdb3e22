"""Megatron-LM's command line, with Megatron-LM's names, defaults and meaning.

megatron-core ships no argument parser (that lives in Megatron-LM's `megatron.training`), so
the reference trainer carries its own: every flag of the MindIO TFT reference Llama2-7B script
parses here, plus the few a CPU demo needs (`--mock-data`, `--vocab-size`, `--seed`).
`parse_args(extra_args_provider)` mirrors Megatron-LM's: the plugin adds its flags through the
provider (`mindspeed_tft.arguments.add_tft_args`). `validate_args(args, world_size)` derives
what Megatron-LM derives (data-parallel size, micro-batch count, params dtype, ffn size...)
and rejects what cannot run, naming the value and what is allowed.

MindSpeed's fused-kernel flags (`--use-fused-rmsnorm`, `--use-fused-swiglu`,
`--use-fused-rotary-pos-emb`, `--use-flash-attn`) are accepted everywhere; where the platform
has no such kernel, `fused_kernel_notices` lists one notice line per flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

_FUSED_KERNEL_FLAGS = {
    "use_fused_rmsnorm": "--use-fused-rmsnorm",
    "use_fused_swiglu": "--use-fused-swiglu",
    "use_fused_rotary_pos_emb": "--use-fused-rotary-pos-emb",
    "use_flash_attn": "--use-flash-attn",
}


class ArgumentError(ValueError):
    """A command-line value that cannot run; the message names it and what is allowed."""


def _add_network_size_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default: 4 x hidden size (2/3 of that, rounded to 64, with --swiglu)")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="accepted for compatibility: models are always megatron-core models")
    g.add_argument("--use-legacy-models", action="store_true")


def _add_regularization_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-08)
    g.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion")
    g.add_argument("--no-masked-softmax-fusion", action="store_false",
                   dest="masked_softmax_fusion")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--use-fused-rmsnorm", action="store_true",
                   help="MindSpeed: fused RMSNorm kernel where the platform has one")
    g.add_argument("--use-fused-swiglu", action="store_true",
                   help="MindSpeed: fused SwiGLU kernel where the platform has one")
    g.add_argument("--use-fused-rotary-pos-emb", action="store_true",
                   help="MindSpeed: fused rotary embedding kernel where the platform has one")
    g.add_argument("--use-cpu-initialization", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None)


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine"])
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--override-opt-param-scheduler", action="store_true")
    g.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true")


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce (and keep) gradients in bf16 instead of fp32 with --bf16")


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo", "hccl"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--disable-gloo-process-groups", action="store_false",
                   dest="enable_gloo_process_groups")
    g.add_argument("--local-rank", type=int, default=None)


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--split", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--num-workers", type=int, default=2)  # Megatron-LM's: loader processes
    g.add_argument("--tokenizer-type", default=None,
                   choices=["Llama2Tokenizer", "GPTSentencePieceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="If '--load' is set, but checkpoint is not found (e.g., path typo), "
                   "then exit (code 1) instead of random initialization.")
    g.add_argument("--ckpt-format", default="torch", choices=["torch"])


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-throughput", action="store_true")


def build_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> argparse.ArgumentParser:
    """Megatron-LM's parser (the subset the reference trainer runs), plus the provider's."""
    parser = argparse.ArgumentParser(
        description="Megatron-compatible GPT pretraining on megatron-core",
        allow_abbrev=False,
    )
    for add in (
        _add_network_size_args,
        _add_regularization_args,
        _add_training_args,
        _add_learning_rate_args,
        _add_mixed_precision_args,
        _add_distributed_args,
        _add_data_args,
        _add_checkpointing_args,
        _add_logging_args,
    ):
        add(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    argv: Sequence[str] | None = None,
) -> argparse.Namespace:
    """Parse the command line (unknown flags are errors, as in Megatron-LM)."""
    return build_parser(extra_args_provider).parse_args(argv)


def _require(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            raise ArgumentError(f"--{name.replace('_', '-')} is required")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive Megatron-LM's computed arguments and reject combinations that cannot run."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "train_iters", "lr")
    args.world_size = world_size
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        raise ArgumentError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x "
            f"context ({cp}) parallel sizes = {model_parallel}"
        )
    args.data_parallel_size = world_size // model_parallel
    if args.use_legacy_models:
        raise ArgumentError("--use-legacy-models is not supported: models are megatron-core models")
    if args.context_parallel_size != 1:
        raise ArgumentError(
            f"--context-parallel-size {cp} is not supported by the reference trainer; allowed: 1"
        )
    if args.expert_model_parallel_size != 1:
        raise ArgumentError(
            f"--expert-model-parallel-size {args.expert_model_parallel_size} is not supported by "
            "the reference trainer (dense GPT only); allowed: 1"
        )
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    step_batch = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % step_batch != 0:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro batch size "
            f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size}) = "
            f"{step_batch}"
        )
    args.num_microbatches = args.global_batch_size // step_batch
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 cannot both be set")
    args.params_dtype = torch.float32
    if args.fp16:
        args.params_dtype = torch.half
    if args.bf16:
        args.params_dtype = torch.bfloat16
        # Megatron-LM: bf16 accumulates and all-reduces gradients in fp32 unless asked not to.
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16
    if tp == 1 and args.sequence_parallel:
        args.sequence_parallel = False  # Megatron-LM: sequence parallelism needs TP > 1
    _derive_model_shape(args, tp, pp)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters != 0:
        raise ArgumentError("--lr-warmup-fraction and --lr-warmup-iters cannot both be set")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    _check_data(args)
    if args.save_interval is not None and args.save_interval <= 0:
        raise ArgumentError(f"--save-interval {args.save_interval} must be a positive integer")
    if args.log_interval <= 0:
        raise ArgumentError(f"--log-interval {args.log_interval} must be a positive integer")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise ArgumentError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
        )
    # Consumed-sample counters live in args, as in Megatron-LM (saved with the checkpoint).
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0
    args.iteration = 0
    return args


def _derive_model_shape(args: argparse.Namespace, tp: int, pp: int) -> None:
    """Megatron-LM's derived model sizes; layouts the model cannot be split into."""
    if args.hidden_size % args.num_attention_heads != 0:
        raise ArgumentError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    if args.num_attention_heads % tp != 0:
        raise ArgumentError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.num_layers % pp != 0:
        raise ArgumentError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}"
        )
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type != "rope":
        raise ArgumentError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}"
        )


def _check_data(args: argparse.Namespace) -> None:
    """The data flags: a source, its tokenizer, the loader's worker processes."""
    if not args.mock_data and not args.data_path:
        raise ArgumentError("no training data: give --data-path PREFIX [PREFIX ...] or --mock-data")
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else None
        if args.tokenizer_type is None:
            raise ArgumentError("--tokenizer-type is required with --data-path")
    if args.num_workers < 0:
        raise ArgumentError(f"--num-workers {args.num_workers} is invalid; allowed: 0 (load in "
                            "the training process) or a positive number of loader processes")


def fused_kernel_notices(args: argparse.Namespace, platform: str) -> list[str]:
    """One notice per fused-kernel flag that has no kernel on `platform` (accepted, unused).

    The reference trainer builds megatron-core's local (non-Transformer-Engine) layers, so no
    fused kernel is wired on any platform; MindSpeed-LLM brings its own on NPU.
    """
    return [
        f"notice: {flag} has no kernel in this trainer on {platform}; "
        "using the unfused implementation"
        for attr, flag in _FUSED_KERNEL_FLAGS.items()
        if getattr(args, attr, False)
    ]
