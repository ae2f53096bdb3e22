"""The reference training loop on megatron-core, shaped like Megatron-LM's `training.py`.

pretrain -> setup_model_and_optimizer -> train -> train_step, with Megatron-LM's names and
semantics: DDP-wrapped model chunks, `get_megatron_optimizer` (Adam, optionally the
distributed optimizer), `OptimizerParamScheduler`, megatron-core's pipeline schedules, a log
line per `--log-interval`, evaluation every `--eval-interval`, checkpoints every
`--save-interval`. The plugin reaches the loop only through `TrainerHooks` and the
`TrainingState` (see `hooks.py`, `state.py`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.events import iteration_log
from mindspeed_tft.plugin.hooks import (
    HookList,
    TrainerHooks,
    phase_reporting_forward_step,
    set_update_listener,
)
from mindspeed_tft.plugin.state import TrainingState
from mindspeed_tft.training.checkpointing import (
    checkpoint_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from mindspeed_tft.training.initialize import (
    initialize_distributed_state,
    initialize_megatron,
    initialize_model_parallel,
    seed_and_microbatches,
)

ModelProvider = Callable[[bool, bool], torch.nn.Module]
ForwardStep = Callable[[Iterator, torch.nn.Module], tuple[torch.Tensor, Callable]]
DatasetsProvider = Callable[[list[int]], tuple[Any, Any, Any]]


def _print_line(message: str) -> None:
    """One line in one write: `print` writes the text and its newline apart, and in an
    unbuffered process sharing its launcher's pipe another process' line can land between."""
    sys.stdout.write(f"{message}\n")
    sys.stdout.flush()


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        _print_line(message)


def print_rank_last(message: str) -> None:
    """Print on the last global rank only (it holds the loss with pipeline parallelism)."""
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        _print_line(message)


def is_last_rank() -> bool:
    """The rank that logs losses and writes `iteration` events."""
    return dist.get_rank() == dist.get_world_size() - 1


def get_model(
    model_provider: ModelProvider, args: argparse.Namespace, broadcast_params: bool = True
) -> list[torch.nn.Module]:
    """Build this rank's model chunk and wrap it in megatron-core's DDP (its params are
    broadcast from data-parallel rank 0 unless `broadcast_params` is False)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = model_provider(ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    if args.fp16:
        model.half()
    elif args.bf16:
        model.bfloat16()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
        check_for_nan_in_grad=False,
    )
    wrapped = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    if broadcast_params:
        wrapped.broadcast_params()
    return [wrapped]


def get_optimizer_param_scheduler(optimizer: Any, args: argparse.Namespace) -> Any:
    """Megatron-LM's scheduler setup: steps are counted in samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr_decay_steps = args.lr_decay_iters * args.global_batch_size
    wd_incr_steps = args.train_iters * args.global_batch_size
    if args.lr_warmup_fraction is not None:
        lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
    else:
        lr_warmup_steps = args.lr_warmup_iters * args.global_batch_size
    wsd_decay_steps = (
        args.lr_wsd_decay_iters * args.global_batch_size if args.lr_wsd_decay_iters else None
    )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def optimizer_config_from_args(args: argparse.Namespace) -> Any:
    """megatron-core's OptimizerConfig for Megatron-LM's flags."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather_with_optimizer_step=False,
        clip_grad=args.clip_grad,
        log_num_zeros_in_grad=False,
    )


def setup_model_and_optimizer(
    model_provider: ModelProvider, args: argparse.Namespace, broadcast_params: bool = True
) -> tuple[list[torch.nn.Module], Any, Any]:
    """Model chunks, optimizer and LR scheduler, as Megatron-LM sets them up."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    model = get_model(model_provider, args, broadcast_params)
    chunks: list[Any] = list(model)  # megatron-core's DDP (it ships no type information)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [m.no_sync for m in chunks]
    if args.overlap_grad_reduce:
        config.grad_sync_func = chunks[0].start_grad_sync
    optimizer = get_megatron_optimizer(
        optimizer_config_from_args(args),
        model,
        use_gloo_process_groups=args.enable_gloo_process_groups,
    )
    scheduler = get_optimizer_param_scheduler(optimizer, args)
    return model, optimizer, scheduler


def _reduce_losses(losses_reduced: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Average each reported loss over micro-batches (token-weighted for (sum, count))."""
    reduced: dict[str, torch.Tensor] = {}
    for key in losses_reduced[0]:
        numerator: Any = 0
        denominator: Any = 0
        for item in losses_reduced:
            value = item[key]
            if isinstance(value, tuple | list):
                numerator += value[0]
                denominator += value[1]
            else:
                numerator += value
                denominator += 1
        reduced[key] = numerator / denominator
    return reduced


def train_step(
    forward_step_func: ForwardStep, state: TrainingState, hooks: TrainerHooks
) -> tuple[dict[str, torch.Tensor], int, float | None]:
    """One optimizer step over `num_microbatches` micro-batches: (losses, skipped, grad norm)."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = state.args
    chunk: Any  # megatron-core's DDP (it ships no type information)
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    forward_backward_func = get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=phase_reporting_forward_step(forward_step_func, state, hooks),
        data_iterator=state.train_data_iterator,
        model=state.model,
        num_microbatches=get_num_microbatches(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    loss_dict: dict[str, torch.Tensor] = {}
    if ps.is_pipeline_last_stage(ignore_virtual=True) and losses_reduced:
        loss_dict = _reduce_losses(losses_reduced)
        # kept before the update: a stop may land between the update and the log line
        batch = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        iteration_log.prepare(state.iteration + 1, loss=float(loss_dict["lm loss"]),
                              consumed_samples=args.consumed_train_samples + batch)
    update_successful, grad_norm, _ = state.optimizer.step()
    if update_successful:
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        state.opt_param_scheduler.step(increment=increment)
    return loss_dict, 0 if update_successful else 1, grad_norm


def training_log(
    state: TrainingState,
    loss_dict: dict[str, torch.Tensor],
    grad_norm: float | None,
    skipped: int,
    elapsed_ms: float,
    interval_stats: dict[str, float],
) -> None:
    """Megatron-LM's log line, every `--log-interval` iterations, on the last rank."""
    args = state.args
    for key, value in loss_dict.items():
        interval_stats[key] = interval_stats.get(key, 0.0) + float(value)
    interval_stats["_iters"] = interval_stats.get("_iters", 0) + 1
    interval_stats["_ms"] = interval_stats.get("_ms", 0.0) + elapsed_ms
    interval_stats["_skipped"] = interval_stats.get("_skipped", 0) + skipped
    if state.iteration % args.log_interval != 0:
        return
    iters = interval_stats.pop("_iters")
    ms_per_iter = interval_stats.pop("_ms") / iters
    skipped_total = int(interval_stats.pop("_skipped"))
    tokens_per_second = args.global_batch_size * args.seq_length / (ms_per_iter / 1000.0)
    lr = state.optimizer.param_groups[0]["lr"]
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    line = (
        f" [{stamp}] iteration {state.iteration:8d}/{args.train_iters:8d} |"
        f" consumed samples: {args.consumed_train_samples:12d} |"
        f" elapsed time per iteration (ms): {ms_per_iter:.1f} |"
        f" tokens per second: {tokens_per_second:.1f} |"
        f" learning rate: {lr:.6E} |"
        f" global batch size: {args.global_batch_size:5d} |"
    )
    for key in sorted(k for k in interval_stats if not k.startswith("_")):
        line += f" {key}: {interval_stats[key] / iters:.6E} |"
    if args.fp16:
        line += f" loss scale: {state.optimizer.get_loss_scale().item():.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped_total:3d} |"
    interval_stats.clear()
    print_rank_last(line)


def evaluate(
    forward_step_func: ForwardStep, state: TrainingState, data_iterator: Iterator | None
) -> dict[str, torch.Tensor]:
    """Average losses over `--eval-iters` forward-only steps on the validation data."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = state.args
    for chunk in state.model:
        chunk.eval()
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = get_forward_backward_func()(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=state.model,
                num_microbatches=get_num_microbatches(),
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.seq_length,
                forward_only=True,
            )
            args.consumed_valid_samples += args.global_batch_size
            if losses:
                for key, value in _reduce_losses(losses).items():
                    totals[key] = totals.get(key, 0) + value
    for chunk in state.model:
        chunk.train()
    return {key: value / args.eval_iters for key, value in totals.items()}


def evaluate_and_print_results(
    prefix: str, forward_step_func: ForwardStep, state: TrainingState, data_iterator: Any
) -> None:
    """Megatron-LM's validation line: loss and perplexity."""
    results = evaluate(forward_step_func, state, data_iterator)
    line = f" validation loss at {prefix} |"
    for key, value in results.items():
        loss = float(value)
        line += f" {key} value: {loss:.6E} | {key} PPL: {math.exp(min(20.0, loss)):.6E} |"
    if results:
        print_rank_last("-" * len(line) + "\n" + line + "\n" + "-" * len(line))


def train(forward_step_func: ForwardStep, state: TrainingState, hooks: TrainerHooks) -> int:
    """Run steps until `--train-iters`; returns the final iteration."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    args = state.args
    for chunk in state.model:
        chunk.train()
    set_update_listener(hooks, state)
    hooks.on_train_start(state)
    interval_stats: dict[str, float] = {}
    while state.iteration < args.train_iters:
        start = time.perf_counter()
        loss_dict, skipped, grad_norm = train_step(forward_step_func, state, hooks)
        state.iteration += 1
        args.consumed_train_samples += (
            args.data_parallel_size * args.micro_batch_size * get_num_microbatches()
        )
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        if not loss_dict or iteration_log.record(
            state.iteration, logger=is_last_rank(), loss=float(loss_dict["lm loss"]),
            grad_norm=None if grad_norm is None else float(grad_norm),
            lr=state.optimizer.param_groups[0]["lr"],
            consumed_samples=args.consumed_train_samples,
        ):  # a recomputed iteration was logged before the fault: no second line
            training_log(state, loss_dict, grad_norm, skipped, elapsed_ms, interval_stats)
        hooks.on_phase(state, "after", state.iteration - 1)
        if (
            args.eval_interval
            and args.eval_iters > 0
            and state.iteration % args.eval_interval == 0
            and state.valid_data_iterator is not None
        ):
            evaluate_and_print_results(
                f"iteration {state.iteration}", forward_step_func, state,
                state.valid_data_iterator,
            )
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            save_checkpoint(state, hooks)
        hooks.on_step_end(state)
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            break
    hooks.on_train_end(state)
    set_update_listener(None, None)
    return state.iteration


#: what `pretrain` imports on first use (a warm spare imports them before it is ready; the
#: platform adaptors are imported, not installed: importing one changes nothing)
SETUP_MODULES = (
    "mindspeed_tft.platform.cpu_adaptor",
    "mindspeed_tft.platform.native_adam",
    "megatron.core.datasets.helpers",
    "mindspeed_tft.training.data",
    "mindspeed_tft.training.tokenizer",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel",
)


def pretrain(
    train_valid_test_datasets_provider: DatasetsProvider,
    model_provider: ModelProvider,
    forward_step_func: ForwardStep,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    extra_args_validator: Callable[[argparse.Namespace], argparse.Namespace] | None = None,
    argv: list[str] | None = None,
) -> int:
    """Initialize, set up, train, save; returns the final iteration (Megatron-LM's shape)."""
    from mindspeed_tft import patches, startup
    from mindspeed_tft.launcher.spare import wait_for_assignment
    from mindspeed_tft.plugin import SETUP_IMPORTS, TFTPlugin

    # A warm spare of `tft-run` (imports done) waits here until it takes over a failed rank.
    wait_for_assignment(warm_imports=(*SETUP_IMPORTS, *SETUP_MODULES))
    startup.imports_done()
    from mindspeed_tft.training.data import get_train_valid_test_num_samples

    args = initialize_megatron(extra_args_provider, extra_args_validator, argv,
                               init_distributed=False)
    if args.rank == 0:
        for notice in startup_notices(args):
            print(notice, flush=True)
    patches.install("update-bracket")
    plugin = TFTPlugin(args, initialize_model_parallel)
    plugin.register()
    num_samples = list(get_train_valid_test_num_samples(args))
    if plugin.rejoining:
        # A restarted worker: nothing collective before the repair brings it into the
        # rebuilt process groups (datasets from the index cache the job already built).
        train_ds, valid_ds, _test_ds = train_valid_test_datasets_provider(num_samples)
        plugin.join_job()
        seed_and_microbatches(args)
        # its state comes from its peers: random init would be overwritten (Megatron-LM's
        # --no-initialization; the rollback restores the RNG states the init used)
        args.perform_initialization = False
    else:
        initialize_distributed_state(args)
        plugin.setup()
    model, optimizer, scheduler = setup_model_and_optimizer(
        model_provider, args, broadcast_params=not plugin.rejoining
    )

    if not plugin.rejoining:
        train_ds, valid_ds, _test_ds = train_valid_test_datasets_provider(num_samples)
    state = training_state(args, model_provider, model, optimizer, scheduler, train_ds,
                           valid_ds, load=bool(args.load) and not plugin.rejoining)
    plugin.attach(state)
    hooks = HookList([plugin.hooks()])
    print_rank_0(f"[mindspeed-tft] training from iteration {state.iteration} to {args.train_iters}")
    start_iteration = state.iteration

    def train_and_save() -> int:
        iteration = train(forward_step_func, state, hooks)
        if args.save and iteration != start_iteration and (
            not args.save_interval or iteration % args.save_interval != 0
        ):
            save_checkpoint(state, hooks)
        return iteration

    iteration = plugin.run(train_and_save)
    plugin.finish()
    print_rank_0(f"[mindspeed-tft] training finished at iteration {iteration}")
    return iteration


def training_state(args: argparse.Namespace, model_provider: ModelProvider, model: Any,
                   optimizer: Any, scheduler: Any, train_ds: Any, valid_ds: Any, *,
                   load: bool) -> TrainingState:
    """The training state `pretrain` trains: model, optimizer, scheduler, data iterators, the
    checkpoint callbacks and (elastic training) the rebuild at another size; loaded from
    `args.load` when `load` (a restarted worker gets its state from its peers instead)."""
    from megatron.core import parallel_state as ps

    from mindspeed_tft.training.data import build_data_iterator

    def build_train_iterator(consumed_samples: int) -> Iterator | None:
        if train_ds is None:
            return None
        return build_data_iterator(train_ds, consumed_samples, args.micro_batch_size,
                                   ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                                   args.num_workers)

    def build_valid_iterator() -> Iterator | None:
        return build_data_iterator(valid_ds, args.consumed_valid_samples, args.micro_batch_size,
                                   ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                                   args.num_workers)

    def rebuild_model_and_optimizer(root: str) -> int:
        # elastic training: the same model, optimizer and data at the current (smaller) size,
        # from the checkpoint under root (random init skipped: the checkpoint overwrites it)
        args.perform_initialization = False
        state.model, state.optimizer, state.opt_param_scheduler = setup_model_and_optimizer(
            model_provider, args, broadcast_params=False)
        iteration = load_checkpoint(state, root)
        state.reset_train_data_iterator()
        if valid_ds is not None:
            state.valid_data_iterator = build_valid_iterator()
        return iteration

    state = TrainingState(
        args=args,
        model=model,
        optimizer=optimizer,
        opt_param_scheduler=scheduler,
        build_train_data_iterator=build_train_iterator,
        checkpoint_state_dict=lambda rng_state: checkpoint_state_dict(state, rng_state),
        load_checkpoint=lambda root: load_checkpoint(state, root),
        rebuild_model_and_optimizer=rebuild_model_and_optimizer,
    )
    if load:
        load_checkpoint(state)
    state.reset_train_data_iterator()
    if valid_ds is not None:
        state.valid_data_iterator = build_valid_iterator()
    return state



def startup_notices(args: argparse.Namespace) -> list[str]:
    """Lines to print once at startup."""
    from mindspeed_tft.training.arguments import fused_kernel_notices

    notices = [f"[mindspeed-tft] {line}" for line in fused_kernel_notices(args, args.platform)]
    features = getattr(args, "tft_features", None)
    if features is not None:
        notices.append(f"[mindspeed-tft] {features.describe()}")
    return notices
