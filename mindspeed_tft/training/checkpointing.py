"""The reference trainer's checkpoints, in Megatron-LM's layout (torch format; the layout
itself is `mindspeed_tft.recovery.layout`), written so a half-written one never looks
complete.

`model_optim_rng.pt` holds what Megatron-LM's holds: `args` (with `consumed_train_samples`),
`checkpoint_version`, `iteration`, `model`, `optimizer` (non-parameter state),
`opt_param_scheduler`, `rng_state`. Every rank writes into `iter_XXXXXXX_tmp`; after all
ranks wrote, rank 0 renames it to `iter_XXXXXXX` and then replaces the tracker file
atomically. Loading restores the exact trajectory: model, optimizer, scheduler, data position
(`consumed_train_samples`) and every RNG.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.events import emit
from mindspeed_tft.recovery.layout import (
    CHECKPOINT_VERSION,
    DISTRIB_OPTIM_FILENAME,
    MODEL_FILENAME,
    get_rng_state,
    iteration_dir_name,
    publish_checkpoint,
    read_tracker,
    set_rng_state,
    this_rank_dir_name,
)


def _model_state(model: list[torch.nn.Module]) -> dict[str, Any]:
    if len(model) == 1:
        return {"model": model[0].state_dict_for_save_checkpoint()}
    return {f"model{i}": chunk.state_dict_for_save_checkpoint() for i, chunk in enumerate(model)}


def _load_model_state(model: list[torch.nn.Module], state_dict: dict[str, Any]) -> None:
    if len(model) == 1:
        model[0].load_state_dict(state_dict["model"], strict=True)
    else:
        for i, chunk in enumerate(model):
            chunk.load_state_dict(state_dict[f"model{i}"], strict=True)


def checkpoint_state_dict(
    state: Any, rng_state: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The content of `model_optim_rng.pt` for `state` (a TrainingState) at its iteration.

    `rng_state` defaults to this process's current RNG state."""
    args = state.args
    state_dict: dict[str, Any] = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": state.iteration,
        **_model_state(state.model),
    }
    if not args.no_save_optim:
        state_dict["optimizer"] = state.optimizer.state_dict()
        state_dict["opt_param_scheduler"] = state.opt_param_scheduler.state_dict()
    if not args.no_save_rng:
        state_dict["rng_state"] = [rng_state if rng_state is not None else get_rng_state()]
    return state_dict


def _is_data_parallel_writer() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() == 0


def save_checkpoint(
    state: Any, hooks: Any = None, root: str | None = None
) -> str:
    """Save `state` (a TrainingState) at its iteration under `root` (default `args.save`).

    Collective over all ranks. `hooks.on_phase(state, "save", step)` runs after the files are
    written and before they are published. Returns the published directory.
    """
    args = state.args
    root = root or args.save
    iteration = state.iteration
    started = time.monotonic()
    tmp_dir = os.path.join(root, iteration_dir_name(iteration) + "_tmp")
    rank_dir = os.path.join(tmp_dir, this_rank_dir_name())
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir, exist_ok=True)
    dist.barrier()

    optimizer = state.optimizer
    if args.use_distributed_optimizer and not args.no_save_optim:
        # Collective over the data-parallel group; data-parallel rank 0 writes.
        os.makedirs(rank_dir, exist_ok=True)
        optimizer.save_parameter_state(os.path.join(rank_dir, DISTRIB_OPTIM_FILENAME))

    if _is_data_parallel_writer():
        os.makedirs(rank_dir, exist_ok=True)
        torch.save(checkpoint_state_dict(state), os.path.join(rank_dir, MODEL_FILENAME))

    if hooks is not None:
        hooks.on_phase(state, "save", iteration - 1)
    dist.barrier()
    final = os.path.join(root, iteration_dir_name(iteration))
    if dist.get_rank() == 0:
        publish_checkpoint(root, iteration)
        emit("checkpoint_saved", 0, iteration=iteration, path=final,
             seconds=time.monotonic() - started)
    dist.barrier()
    return final


def _checkpoint_args_value(checkpoint_args: argparse.Namespace, name: str, default: Any) -> Any:
    return getattr(checkpoint_args, name, default)


def load_checkpoint(state: Any, root: str | None = None) -> int:
    """Load the latest checkpoint under `root` (default `args.load`) into `state`.

    Returns the loaded iteration (0 when there is no checkpoint: training starts fresh).
    """
    args = state.args
    root = root or args.load
    iteration = read_tracker(root) if root else None
    if iteration is None:
        if dist.get_rank() == 0:
            print(f"[mindspeed-tft] no checkpoint found at {root}; training from scratch",
                  flush=True)
        return 0
    rank_dir = os.path.join(root, iteration_dir_name(iteration), this_rank_dir_name())
    model_file = os.path.join(rank_dir, MODEL_FILENAME)
    if not os.path.isfile(model_file):
        raise FileNotFoundError(
            f"checkpoint iteration {iteration} of {root} has no {MODEL_FILENAME} for this rank "
            f"({model_file}); the tensor/pipeline layout must match the one that saved it"
        )
    # The file holds an argparse.Namespace (Megatron-LM's format), so it is not weights-only.
    state_dict = torch.load(model_file, map_location="cpu", weights_only=False)
    _load_model_state(state.model, state_dict)

    optimizer = state.optimizer
    if not args.no_load_optim and not args.finetune:
        if "optimizer" not in state_dict:
            raise ValueError(f"{model_file} holds no optimizer state; load with --no-load-optim")
        optimizer.load_state_dict(state_dict["optimizer"])
        if args.use_distributed_optimizer:
            optimizer.load_parameter_state(os.path.join(rank_dir, DISTRIB_OPTIM_FILENAME))
        # megatron-core's scheduler advances by the saved step count: start from 0 (this also
        # makes a reload into a live scheduler, a repair from the checkpoint, correct)
        state.opt_param_scheduler.num_steps = 0
        state.opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    elif args.fp16 or args.bf16:
        optimizer.reload_model_params()

    if not args.finetune:
        checkpoint_args = state_dict.get("args")
        args.consumed_train_samples = _checkpoint_args_value(
            checkpoint_args, "consumed_train_samples", 0
        )
        args.consumed_valid_samples = _checkpoint_args_value(
            checkpoint_args, "consumed_valid_samples", 0
        )
        state.iteration = iteration
    if not args.no_load_rng and not args.finetune and "rng_state" in state_dict:
        set_rng_state(state_dict["rng_state"][0])

    dist.barrier()
    if dist.get_rank() == 0:
        print(f"[mindspeed-tft] loaded checkpoint {root} at iteration {iteration}", flush=True)
        sys.stdout.flush()
    return state.iteration
