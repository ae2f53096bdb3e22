"""Bring a training process up: platform, args, torch.distributed, megatron-core's topology.

`initialize_megatron` mirrors Megatron-LM's: it installs the platform adaptor, parses and
validates the args (Megatron's, then the provider's validator), initializes the default
process group with the platform's backend (gloo on CPU, nccl on CUDA, hccl on NPU), builds
megatron-core's parallel state, seeds every RNG as Megatron-LM does, sets up the
micro-batch calculator and builds the tokenizer.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from mindspeed_tft.envvars import launcher_value
from mindspeed_tft.platform import (
    CPU,
    apply_platform_adaptor,
    detect_platform,
    distributed_backend,
)
from mindspeed_tft.process_exit import print_error
from mindspeed_tft.training.arguments import parse_args, validate_args
from mindspeed_tft.training.global_vars import set_args, set_tokenizer


def _env_int(name: str, default: int) -> int:
    value = launcher_value(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def set_random_seed(seed: int) -> None:
    """Seed python, numpy, torch and the model-parallel RNG tracker (Megatron-LM's scheme:
    each pipeline stage offsets the seed by 100 x its rank)."""
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize_distributed(args: argparse.Namespace) -> None:
    """Default process group and megatron-core parallel state for `args`."""
    platform = detect_platform()
    if platform != CPU:
        getattr(torch, platform).set_device(args.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=args.distributed_backend,
            world_size=args.world_size,
            rank=args.rank,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )
    initialize_model_parallel(args)


def initialize_model_parallel(args: argparse.Namespace) -> None:
    """megatron-core's TP/PP/DP/CP/EP groups for `args` on the default group (also used
    when the groups are rebuilt after a fault)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        create_gloo_process_groups=args.enable_gloo_process_groups,
    )


def initialize_megatron(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    extra_args_validator: Callable[[argparse.Namespace], argparse.Namespace] | None = None,
    argv: Sequence[str] | None = None,
    init_distributed: bool = True,
) -> argparse.Namespace:
    """Parse, validate and initialize everything a training process needs; returns args.

    With `init_distributed=False` it stops before torch.distributed (args, platform and
    tokenizer only): `initialize_distributed_state(args)` does the rest, or a worker reboot
    joins the rebuilt process groups of a running job instead."""
    from mindspeed_tft.training.tokenizer import build_tokenizer

    platform = apply_platform_adaptor()
    args = parse_args(extra_args_provider, argv)
    args.rank = _env_int("RANK", 0)
    args.local_rank = _env_int("LOCAL_RANK", 0) if args.local_rank is None else args.local_rank
    validate_args(args, world_size=_env_int("WORLD_SIZE", 1))
    if extra_args_validator is not None:
        args = _validated(extra_args_validator, args)
    args.platform = platform
    args.distributed_backend = distributed_backend(args.distributed_backend)
    set_args(args)
    set_tokenizer(build_tokenizer(args))
    if init_distributed:
        initialize_distributed_state(args)
    return args


def _validated(validator: Callable[[argparse.Namespace], argparse.Namespace],
               args: argparse.Namespace) -> argparse.Namespace:
    """The extra validator's result; a refused flag or environment value ends the process
    with exit code 2 and one line naming it, no traceback. Every rank prints it: the first
    rank to exit makes the launcher stop the others, and rank 0, slower to get here, was
    stopped before it printed."""
    from mindspeed_tft.arguments import TFTArgumentError

    try:
        return validator(args)
    except TFTArgumentError as error:
        print_error(str(error))
        raise SystemExit(2) from None


def initialize_distributed_state(args: argparse.Namespace) -> None:
    """torch.distributed, megatron-core's parallel state, RNG seeds, micro-batch counts."""
    initialize_distributed(args)
    seed_and_microbatches(args)


def seed_and_microbatches(args: argparse.Namespace) -> None:
    """Every RNG seeded and the micro-batch calculator set up (after the parallel state
    exists: at start-up, or once a restarted worker joined the rebuilt groups, which may
    have configured the calculator already for the world it joined)."""
    from megatron.core.num_microbatches_calculator import (
        reconfigure_num_microbatches_calculator,
    )

    set_random_seed(args.seed)
    reconfigure_num_microbatches_calculator(
        args.rank,
        None,
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
    )
