"""The dying-gasp checkpoint (TTP, SPEC 7): a Megatron-layout checkpoint of the lock step,
written from surviving replicas after the process groups are gone.

A dump needs no collective communication: a fault has broken the process groups. It goes
through the checkpoint directory instead, in three stages driven by the controller:

1. `write_shard` — the chosen holder of each optimizer shard writes its shard of every
   bucket (fp32 main params, exp_avg, exp_avg_sq, and its slice of the bf16 param buffer,
   which its own update refreshed) to `iter_L_tmp/mp_rank_XX/tft_shards/shard_NNN.pt`.
2. `assemble` — one healthy rank per model-parallel position reads the shards of its
   position, concatenates them into megatron-core's DP-zero parameter state
   (`distrib_optim.pt`), writes the assembled params into its own param buffer (the model
   params of the lock step), and writes `model_optim_rng.pt` with the scheduler, consumed
   samples and RNG of the lock step. With the non-distributed fp16/bf16 optimizer every rank
   holds the whole state, and the assembler writes the checkpoint from its own memory.
3. `publish` — one rank renames `iter_L_tmp` to `iter_L` and updates
   `latest_checkpointed_iteration.txt` (`layout.publish_checkpoint`: everything fsynced
   first, an existing `iter_L` exchanged atomically, never moved away first), so a
   half-written dump is never taken for a checkpoint, and a crash while publishing leaves the
   tracker on a complete one.

Before any of it, every writing rank claims the folder for the controller that ordered the
dump (`claim`: `iter_L_tmp/tft_claim.json`, created exclusively): the two sides of a network
partition may each order a dump of the same step into one shared save folder, and the side
that claims second writes nothing (a `DumpError` naming the other side), so one checkpoint of
a step has one writer. A claim older than the action time limit is a dead dump's, and is
taken over. The renaming rank checks the claim is still its side's before it publishes; a
side that finds the step already published by the other side's claim writes nothing and
publishes nothing (`claim` names that side).

A write that fails (a full file system: `layout.checkpoint_writes`) removes what it wrote;
a shard's holder leaves `shard_NNN.pt.failed` so that the assembler stops waiting for it and
removes its position's folder; nothing is published and the tracker keeps the last
checkpoint. The failing rank says it in one line (`CheckpointWriteError.report`).

Every file is fsynced by its writer. Shard files are read back weights-only
(`layout.load_file`): a shard file planted in the save directory cannot run code in the
assembling rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from typing import Any

import torch

from mindspeed_tft.recovery.interface import RecoverableState
from mindspeed_tft.recovery.layout import (
    DISTRIB_OPTIM_FILENAME,
    MODEL_FILENAME,
    CheckpointError,
    CheckpointWriteError,
    checkpoint_writes,
    iteration_dir_name,
    load_file,
    make_save_dirs,
    publish_checkpoint,
    remove_quietly,
    save_file,
    this_rank_dir_name,
)
from mindspeed_tft.recovery.manifest import write_manifest
from mindspeed_tft.recovery.snapshot import StepSnapshot, restore_scheduler

SHARDS_DIRNAME = "tft_shards"
#: who writes a dump folder (`claim`)
CLAIM_FILENAME = "tft_claim.json"
#: beside a shard file its holder could not write (`write_shard`): the assembler stops waiting
FAILED_SUFFIX = ".failed"
_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


class DumpError(RuntimeError):
    """The dump cannot be completed; nothing is published."""


def tmp_dir(root: str, iteration: int) -> str:
    """Where the dump of `iteration` is written before it is published."""
    return os.path.join(root, iteration_dir_name(iteration) + "_tmp")


def claim(root: str, lock_step: int, claimant: str, stale_after: float) -> str | None:
    """Claim the dump folder of `lock_step` for `claimant` (the ordering controller; every
    rank of its side claims with the same value). Returns None when this side writes the
    dump, or the other claimant that published it already (nothing to write: the step has
    its checkpoint). Raises `DumpError` when another claimant holds the folder and its
    claim is younger than `stale_after` seconds."""
    published = claimant_of(os.path.join(root, iteration_dir_name(lock_step)))
    if published is not None and published != claimant:
        return published
    directory = tmp_dir(root, lock_step)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CLAIM_FILENAME)
    staged = f"{path}.{os.getpid()}.{os.urandom(4).hex()}"
    with open(staged, "wb") as f:  # complete before anyone can read it under its name
        f.write(json.dumps({"claimant": claimant, "lock_step": lock_step}).encode())
        f.flush()
        os.fsync(f.fileno())
    try:
        try:
            os.link(staged, path)  # exclusive: fails when the folder is claimed already
            return None
        except FileExistsError:
            pass
        holder = claimant_of(directory)
        if holder == claimant:
            return None
        try:
            age = time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            age = stale_after
        if age < stale_after:
            raise DumpError(f"{directory} is being written by {holder or 'another writer'} "
                            f"(claimed {age:.1f}s ago; the other side of a partition?): this "
                            "side writes nothing, so that the step has one checkpoint")
        os.replace(staged, path)  # a dead dump's claim: taken over atomically
        if claimant_of(directory) != claimant:
            raise DumpError(f"{directory}: another writer took the stale claim over")
        return None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(staged)


def claimant_of(directory: str) -> str | None:
    """Who claimed the dump folder `directory` (None: nobody, or an unreadable claim)."""
    try:
        with open(os.path.join(directory, CLAIM_FILENAME), "rb") as f:
            value = json.loads(f.read(4096).decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    holder = value.get("claimant") if isinstance(value, dict) else None
    return holder if isinstance(holder, str) else None


def _distributed_optimizers(optimizer: Any) -> list[Any]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in chained if isinstance(opt, DistributedOptimizer)]


def uses_distributed_optimizer(state: RecoverableState) -> bool:
    """Whether the state is sharded (megatron-core's DistributedOptimizer)."""
    return bool(_distributed_optimizers(state.optimizer))


def local_shard_payload(
    state: RecoverableState, chunk: int, index: int
) -> list[dict[tuple[int, str, int], dict]]:
    """This rank's shard (`index` of `chunk` per bucket) of every distributed optimizer,
    as CPU copies. `chunk` and `index` come from the replica map: no process group is
    needed, so this works after a fault broke them."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    payload = []
    for opt in _distributed_optimizers(state.optimizer):
        buckets: dict[tuple[int, str, int], dict] = {}
        for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
            for dtype, range_maps in gbuf_range_maps.items():
                for bucket_idx, range_map in enumerate(range_maps):
                    bucket = opt.buffers[gbuf_idx].buckets[bucket_idx]
                    local_numel = bucket.grad_data.numel() // chunk
                    local = {k: torch.zeros(local_numel, dtype=torch.float32) for k in _STATE_KEYS}
                    for model_param, param_range in range_map["param_map"].items():
                        tensors = opt._get_main_param_and_optimizer_states(model_param)
                        start, end = param_range["gbuf_local"].start, param_range["gbuf_local"].end
                        for key in _STATE_KEYS:
                            local[key][start:end].copy_(tensors[key].detach().view(-1).cpu())
                    local["param_data"] = shard_buffer(bucket.param_data, chunk)[index].cpu().clone()
                    buckets[(gbuf_idx, str(dtype), bucket_idx)] = local
        payload.append(buckets)
    return payload


def write_shard(state: RecoverableState, root: str, lock_step: int, chunk: int, index: int) -> str:
    """Stage 1: write this rank's optimizer shard (`index` of `chunk`) of the lock step;
    returns the file. A write that fails removes the partial file, leaves `<file>.failed`
    for the assembler (when the file system lets it) and raises a `CheckpointWriteError`."""
    if not _distributed_optimizers(state.optimizer):
        raise DumpError("write_shard needs the distributed optimizer")
    directory = os.path.join(tmp_dir(root, lock_step), this_rank_dir_name(), SHARDS_DIRNAME)
    path = shard_path(directory, index)
    partial = path + ".partial"
    remove_quietly(path + FAILED_SUFFIX)  # left by an earlier dump of this step
    record = shard_record(state, lock_step, chunk, index)
    try:
        with checkpoint_writes("dump", lock_step, root, lambda: remove_quietly(partial)):
            make_save_dirs(directory, root)
            save_file(record, partial)
            os.replace(partial, path)
    except CheckpointWriteError:
        with contextlib.suppress(OSError):  # an empty file: no data block needed
            open(path + FAILED_SUFFIX, "x").close()
        raise
    return path


def shard_path(directory: str, index: int) -> str:
    """The file of shard `index` in a position's shards folder."""
    return os.path.join(directory, f"shard_{index:03d}.pt")


def _read_shards(
    directory: str, chunk: int, lock_step: int, in_memory: dict[int, dict] | None = None
) -> list[dict]:
    shards = []
    for index in range(chunk):
        if in_memory and index in in_memory:
            shards.append(in_memory[index])
            continue
        path = shard_path(directory, index)
        if not os.path.isfile(path):
            raise DumpError(f"shard {index} of {directory} was not written: cannot assemble")
        try:
            shard = load_file(path)
        except CheckpointError as error:
            raise DumpError(f"shard {index} cannot be assembled: {error}") from error
        if not isinstance(shard, dict) or not {"iteration", "shard", "optimizers"} <= set(shard):
            raise DumpError(f"{path} is not a shard file (expected a dict with iteration, "
                            f"shard, optimizers; got {type(shard).__name__})")
        if shard["iteration"] != lock_step or shard["shard"] != index:
            raise DumpError(
                f"{path} holds shard {shard['shard']} of iteration {shard['iteration']}, "
                f"expected shard {index} of iteration {lock_step}"
            )
        shards.append(shard)
    return shards


def _assemble_parameter_state(
    opt: Any, opt_index: int, shards: list[dict]
) -> dict[Any, Any]:
    """megatron-core's DP-zero parameter state of `opt` from the shards of every chunk rank;
    also writes the assembled bf16 params into `opt`'s param buffers (the model params)."""
    state: dict[Any, Any] = {"buckets_coalesced": True}
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        dtype_state = {}
        for dtype, range_maps in gbuf_range_maps.items():
            buffer = opt.buffers[gbuf_idx]
            world = {k: torch.zeros(buffer.numel_unpadded, dtype=torch.float32)
                     for k in _STATE_KEYS}
            offset = 0
            for bucket_idx in range(len(range_maps)):
                bucket = buffer.buckets[bucket_idx]
                key = (gbuf_idx, str(dtype), bucket_idx)
                pieces = [shard["optimizers"][opt_index][key] for shard in shards]
                numel = bucket.numel_unpadded
                for name in _STATE_KEYS:
                    whole = torch.cat([piece[name] for piece in pieces])
                    world[name][offset : offset + numel].copy_(whole[:numel])
                params = torch.cat([piece["param_data"] for piece in pieces])
                bucket.param_data.copy_(params.to(bucket.param_data.device))
                offset += numel
            dtype_state[dtype] = {**world, "numel_unpadded": buffer.numel_unpadded}
        state[gbuf_idx] = dtype_state
    return state


def _set_lock_step_bookkeeping(state: RecoverableState, snapshot: StepSnapshot) -> None:
    state.iteration = snapshot.iteration
    state.args.consumed_train_samples = snapshot.consumed_train_samples
    restore_scheduler(state.opt_param_scheduler, snapshot.scheduler_state)


def shard_record(state: RecoverableState, lock_step: int, chunk: int, index: int) -> dict:
    """What `write_shard` writes, in memory (the assembler keeps its own shard)."""
    return {"iteration": lock_step, "shard": index, "chunk_size": chunk,
            "optimizers": local_shard_payload(state, chunk, index)}


def assemble(
    state: RecoverableState, root: str, snapshot: StepSnapshot, chunk: int,
    own_shard: dict | None = None,
) -> str:
    """Stage 2: write this model-parallel position's checkpoint files of the lock step
    (`chunk` shards per bucket with the distributed optimizer; `own_shard`, the assembler's
    own `shard_record`, is used from memory instead of its file). A write that fails removes
    the position's folder (every shard of it is in: nobody else writes there now) and raises
    a `CheckpointWriteError`."""
    lock_step = snapshot.iteration
    rank_dir = os.path.join(tmp_dir(root, lock_step), this_rank_dir_name())
    opts = _distributed_optimizers(state.optimizer)
    states = None
    if opts:
        shards_dir = os.path.join(rank_dir, SHARDS_DIRNAME)
        in_memory = {own_shard["shard"]: own_shard} if own_shard is not None else None
        shards = _read_shards(shards_dir, chunk, lock_step, in_memory)
        states = [_assemble_parameter_state(opt, i, shards) for i, opt in enumerate(opts)]
    _set_lock_step_bookkeeping(state, snapshot)
    model_state = state.checkpoint_state_dict(snapshot.rng_state)
    with checkpoint_writes("dump", lock_step, root, lambda: discard_position(root, lock_step)):
        make_save_dirs(rank_dir, root)
        if states is not None:
            save_file(states[0] if len(states) == 1 else states,
                      os.path.join(rank_dir, DISTRIB_OPTIM_FILENAME))
        save_file(model_state, os.path.join(rank_dir, MODEL_FILENAME))
        if opts:
            shutil.rmtree(os.path.join(rank_dir, SHARDS_DIRNAME), ignore_errors=True)
        write_manifest(rank_dir, lock_step)
    return rank_dir


def discard_position(root: str, lock_step: int) -> None:
    """Remove this rank's model-parallel folder of the unpublished dump of `lock_step`, and
    the dump's `iter_X_tmp` once no position's folder is left in it."""
    directory = tmp_dir(root, lock_step)
    remove_quietly(os.path.join(directory, this_rank_dir_name()))
    with contextlib.suppress(OSError):
        if os.listdir(directory) == [CLAIM_FILENAME]:  # only this side's claim is left
            os.remove(os.path.join(directory, CLAIM_FILENAME))
        os.rmdir(directory)


def publish(root: str, lock_step: int, expected_dirs: list[str],
            claimant: str | None = None) -> str:
    """Stage 3: check every model-parallel folder is complete (and, given `claimant`, that
    the folder is still that side's), then publish atomically."""
    directory = tmp_dir(root, lock_step)
    if claimant is not None and (holder := claimant_of(directory)) != claimant:
        raise DumpError(f"{directory} is claimed by {holder or 'nobody'}, not by "
                        f"{claimant}: not published")
    for name in expected_dirs:
        rank_dir = os.path.join(directory, name)
        if not os.path.isfile(os.path.join(rank_dir, MODEL_FILENAME)):
            raise DumpError(f"{rank_dir} has no {MODEL_FILENAME}: the dump is incomplete")
        if os.path.isdir(os.path.join(rank_dir, SHARDS_DIRNAME)):
            raise DumpError(f"{rank_dir} was not assembled: the dump is incomplete")
    return publish_checkpoint(root, lock_step)
