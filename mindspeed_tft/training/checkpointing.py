"""The reference trainer's checkpoints, in Megatron-LM's layout (torch format; the layout
itself is `mindspeed_tft.recovery.layout`), written so a half-written one never looks
complete.

`model_optim_rng.pt` holds what Megatron-LM's holds: `args` (with `consumed_train_samples`),
`checkpoint_version`, `iteration`, `model`, `optimizer` (non-parameter state),
`opt_param_scheduler`, `rng_state`. Every rank writes into `iter_XXXXXXX_tmp` (and fsyncs
what it wrote); after all ranks wrote, rank 0 publishes it (`layout.publish_checkpoint`:
fsync, rename or atomic exchange with an existing `iter_XXXXXXX`, then the tracker), so a
crash at any point leaves the tracker on a complete checkpoint. Loading restores the exact
trajectory: model, optimizer, scheduler, data position (`consumed_train_samples`) and every
RNG. Files are loaded weights-only (`layout.load_file`, with `CHECKPOINT_SAFE_GLOBALS` for
`model_optim_rng.pt`); a truncated, corrupt or refused file is a `CheckpointError` naming it.

`--load` of a directory without a checkpoint (no tracker file) follows Megatron-LM
core_v0.12.1's `_load_base_checkpoint`: a loud warning on rank 0 and training from iteration
0; with `--exit-on-missing-checkpoint`, every rank exits instead, with code
`MISSING_CHECKPOINT_EXIT_CODE` (1; Megatron-LM's `sys.exit()` exits 0, which reads as
success to a scheduler).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.events import emit
from mindspeed_tft.recovery import manifest
from mindspeed_tft.recovery.layout import (
    CHECKPOINT_SAFE_GLOBALS,
    CHECKPOINT_VERSION,
    DISTRIB_OPTIM_FILENAME,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    CheckpointError,
    CheckpointWriteError,
    checkpoint_writes,
    discard_unpublished,
    get_rng_state,
    iteration_dir_name,
    load_file,
    make_save_dirs,
    publish_checkpoint,
    save_file,
    set_rng_state,
    this_rank_dir_name,
)

#: exit code of every rank when `--load` has no checkpoint and `--exit-on-missing-checkpoint`
MISSING_CHECKPOINT_EXIT_CODE = 1


def _model_state(model: list[torch.nn.Module]) -> dict[str, Any]:
    chunks: list[Any] = list(model)  # megatron-core's modules (it ships no type information)
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict_for_save_checkpoint()}
    return {f"model{i}": chunk.state_dict_for_save_checkpoint() for i, chunk in enumerate(chunks)}


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

    A write that fails on any rank (a full file system, any OSError: `checkpoint_writes`)
    fails the save on every rank at the next agreement (`_settle`, where a barrier stood):
    the partial `iter_X_tmp` is removed, nothing is published, the tracker keeps the last
    checkpoint, one line says it, and every rank raises the `CheckpointWriteError` (with high
    availability a fault like any exception: the dump of the lock step is tried).
    """
    args = state.args
    root = root or args.save
    iteration = state.iteration
    started = time.monotonic()
    tmp_dir = os.path.join(root, iteration_dir_name(iteration) + "_tmp")
    rank_dir = os.path.join(tmp_dir, this_rank_dir_name())
    settle = functools.partial(_settle, state, root, iteration)
    failure = None
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        failure = _attempt(iteration, root, lambda: make_save_dirs(tmp_dir, root))
    settle(failure)
    # every file is written (with optimizer replicas, each replica's data-parallel rank 0
    # writes the same distrib_optim.pt: the manifest waits for all of them)
    settle(_attempt(iteration, root, lambda: _write_rank_files(state, rank_dir, root)))
    failure = None
    if _is_data_parallel_writer():
        failure = _attempt(iteration, root, lambda: manifest.write_manifest(rank_dir, iteration))
    if hooks is not None:
        hooks.on_phase(state, "save", iteration - 1)
    settle(failure)
    final = os.path.join(root, iteration_dir_name(iteration))
    failure = None
    if dist.get_rank() == 0:
        failure = _attempt(iteration, root, lambda: publish_checkpoint(root, iteration))
        if failure is None:
            emit("checkpoint_saved", 0, iteration=iteration, path=final,
                 seconds=time.monotonic() - started)
    settle(failure)
    return final


def _write_rank_files(state: Any, rank_dir: str, root: str) -> None:
    """This rank's files of the checkpoint (the distributed optimizer's parameter state is
    collective over the data-parallel group: data-parallel rank 0 writes it)."""
    args = state.args
    optimizer = state.optimizer
    if args.use_distributed_optimizer and not args.no_save_optim:
        distrib_file = os.path.join(rank_dir, DISTRIB_OPTIM_FILENAME)
        try:
            make_save_dirs(rank_dir, root)
        finally:  # a rank whose folder could not be made still takes part in the collective
            optimizer.save_parameter_state(distrib_file)
        if os.path.isfile(distrib_file):  # megatron-core's writer: data-parallel rank 0
            _fsync_file(distrib_file)
    if _is_data_parallel_writer():
        make_save_dirs(rank_dir, root)
        save_file(checkpoint_state_dict(state), os.path.join(rank_dir, MODEL_FILENAME))


def _attempt(iteration: int, root: str, write: Callable[[], Any]) -> CheckpointWriteError | None:
    """Run `write`; the `CheckpointWriteError` a failed write became, or None."""
    try:
        with checkpoint_writes("checkpoint", iteration, root):
            write()
    except CheckpointWriteError as failure:
        return failure
    return None


def _settle(state: Any, root: str, iteration: int, failure: CheckpointWriteError | None) -> None:
    """Collective over all ranks (it stands where a barrier stood): whether any rank's
    writes failed. If one did, rank 0 removes the unpublished checkpoint, the lowest failing
    rank says it in one line (the space left once that is gone), and every rank raises: a
    failing rank its own `CheckpointWriteError`, the others one with the lowest's reason."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = next(state.model[0].parameters()).device
    first = torch.tensor([rank if failure is not None else world], dtype=torch.int64,
                         device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    failed = int(first.item())
    if failed == world:
        return
    if rank == 0:
        discard_unpublished(root, iteration)
    dist.barrier()  # the partial files are gone
    if rank == failed and failure is not None:
        # its line first: the others raise as soon as they have the reason, and the
        # controller's stop may abort this rank's collectives before it could say it
        failure.report(rank)
    reason = [failure.reason if failure is not None else None]
    dist.broadcast_object_list(reason, src=failed)
    if failure is None:
        raise CheckpointWriteError("checkpoint", iteration, root, str(reason[0]))
    raise failure


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoint_args_value(checkpoint_args: argparse.Namespace | None, name: str,
                           default: Any) -> Any:
    """`name` of the checkpoint's args (`default` when it has none, or no args at all)."""
    return getattr(checkpoint_args, name, default)


def missing_checkpoint(root: str | None, exit_on_missing: bool, rank: int) -> None:
    """`--load root` found no checkpoint: Megatron-LM core_v0.12.1's rule. Rank 0 warns
    (Megatron-LM's lines, then which folder and what to do); with `exit_on_missing`
    every rank exits with `MISSING_CHECKPOINT_EXIT_CODE`, otherwise training starts from
    iteration 0."""
    tracker = os.path.join(root, TRACKER_FILENAME) if root else "because load directory is " \
        "not defined"
    why = "the folder does not exist" if root and not os.path.isdir(root) else \
        f"it has no {TRACKER_FILENAME}"
    if rank == 0:
        print(f"WARNING: could not find the metadata file {tracker}", flush=True)
        if exit_on_missing:
            print(">> '--exit-on-missing-checkpoint' set ... exiting. <<", flush=True)
            print(f"[mindspeed-tft] ERROR: --load {root}: no checkpoint ({why}); exiting with "
                  f"code {MISSING_CHECKPOINT_EXIT_CODE} (--exit-on-missing-checkpoint)",
                  file=sys.stderr, flush=True)
        else:
            print("    will not load any checkpoints and will start from random", flush=True)
            print(f"[mindspeed-tft] WARNING: --load {root}: no checkpoint ({why}); training "
                  "starts from iteration 0 (--exit-on-missing-checkpoint makes this an error)",
                  file=sys.stderr, flush=True)
    if exit_on_missing:
        sys.exit(MISSING_CHECKPOINT_EXIT_CODE)


def _rank_dir_or_error(root: str, iteration: int, directory: str) -> str:
    rank_dir = os.path.join(directory, this_rank_dir_name())
    if not os.path.isdir(rank_dir):
        found = sorted(n for n in os.listdir(directory) if n.startswith("mp_rank_"))
        raise CheckpointError(
            f"checkpoint iteration {iteration} of {root} has no {rank_dir} for this rank; it "
            f"holds {found or 'no mp_rank_* folder'}: the tensor/pipeline layout must match "
            "the one that saved it"
        )
    return rank_dir


def _load_parameter_state(optimizer: Any, path: str) -> None:
    """megatron-core's `load_parameter_state(path)` (the DP-zero format: data-parallel rank 0
    reads the file and scatters it), with the file read by `load_file`: weights-only, and an
    error that names it."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    states = None
    for idx, opt in enumerate(chained):
        if not hasattr(opt, "load_parameter_state_from_dp_zero") or getattr(
                opt, "is_stub_optimizer", False):
            continue
        if states is None and dist.get_rank(opt.data_parallel_group) == 0:
            states = load_file(path)
        state = None
        if states is not None:
            state = states if len(chained) == 1 else states[idx]
        opt.load_parameter_state_from_dp_zero(state)


def _resolve(root: str, startup: bool) -> tuple[int, str] | None:
    """The checkpoint the tracker under `root` names; a bad tracker is refused
    (`manifest.resolve_for_load`), and so is `release` (a Megatron-LM release checkpoint,
    which this trainer does not load)."""
    try:
        return manifest.resolve_for_load(root, startup=startup)
    except ValueError as error:
        if not startup:
            raise CheckpointError(str(error)) from None
        manifest.refuse_at_startup(f"--load {root}: {error} (this trainer loads no release "
                                   "checkpoint)")


def load_checkpoint(state: Any, root: str | None = None) -> int:
    """Load the latest checkpoint under `root` (default `args.load`) into `state`.

    Returns the loaded iteration, 0 when `root` has no checkpoint (an explicit `root`, a
    repair; for `args.load`, `missing_checkpoint`'s rule applies first). Raises
    `CheckpointError` naming the file or folder that cannot be loaded.
    """
    args = state.args
    startup = root is None
    root = root or args.load
    found = _resolve(root, startup) if root else None
    if found is None:
        if startup:
            missing_checkpoint(root, getattr(args, "exit_on_missing_checkpoint", False),
                               dist.get_rank())
        elif dist.get_rank() == 0:
            print(f"[mindspeed-tft] no checkpoint found at {root}", flush=True)
        return 0
    iteration, directory = found
    rank_dir = _rank_dir_or_error(root, iteration, directory)
    # before any tensor is read: a mismatch exits 2 at start-up, fails a repair
    manifest.verify_for_load(root, os.path.basename(rank_dir), _is_data_parallel_writer(),
                             dist.get_rank(), startup=startup)
    model_file = os.path.join(rank_dir, MODEL_FILENAME)
    # Megatron-LM's format: args is an argparse.Namespace, the RNG state has numpy arrays
    state_dict = load_file(model_file, CHECKPOINT_SAFE_GLOBALS)
    if not isinstance(state_dict, dict) or "iteration" not in state_dict:
        raise CheckpointError(f"{model_file} is not a model_optim_rng.pt (no iteration in it)")
    try:
        _load_model_state(state.model, state_dict)
    except (KeyError, RuntimeError) as error:
        raise CheckpointError(f"{model_file}: the model state does not fit this model: "
                              f"{error}") from error

    optimizer = state.optimizer
    if not args.no_load_optim and not args.finetune:
        if "optimizer" not in state_dict:
            raise ValueError(f"{model_file} holds no optimizer state; load with --no-load-optim")
        optimizer.load_state_dict(state_dict["optimizer"])
        if args.use_distributed_optimizer:
            _load_parameter_state(optimizer, os.path.join(rank_dir, DISTRIB_OPTIM_FILENAME))
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
