"""Shard transfers and the rollback of every rank to the lock step (SPEC 5, 8, 9).

After the process groups are rebuilt, `transfer_shards` copies optimizer shards (with the
model params) from healthy holders to the ranks the controller named (restarted workers,
ranks whose memory a fault damaged, ranks behind the lock step); each sender also sends its
step snapshot (scheduler, consumed samples, RNG), which a restarted worker has none of.
`rollback` then puts every rank at the lock step: model params from the fp32 main params
(and, with the distributed optimizer, gathered in each replica chunk: `gather_chunk_params`),
LR scheduler, consumed samples and a data iterator rebuilt at that position, every RNG.
Grads are left to the next step, whose first act (megatron-core's `zero_grad_buffer` and
the optimizer's `zero_grad`, in Megatron-LM's `train_step` and the reference trainer's
alike) clears them: zeroing them here too cost a memset of the grad buffers (9 ms of a 17 M
UCE repair).

The all-gather is skipped when no rank needs it (`gather_needed`): a fault before any rank
started the next update (forward, backward, a UCE in optimizer state, grads or activations)
leaves every rank's params those of the lock step. A rank needs it when its process is new
(and got no params from its peer), its params were hit (a UCE in params), or an update may
have changed them since the lock step; only such a rank copies its main params into its
model params first (a rank whose params are those of the lock step holds that copy
already: megatron-core's copy is a Python loop over the params, and a cast per element
with bf16 params).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.control.wire.order_types import RepairOrder
from mindspeed_tft.events import emit, work_counts
from mindspeed_tft.recovery.interface import RecoverableState
from mindspeed_tft.recovery.layout import set_rng_state
from mindspeed_tft.recovery.snapshot import (
    StepSnapshot,
    StepSnapshots,
    decode_snapshot,
    encode_snapshot,
    restore_scheduler,
)
from mindspeed_tft.replica.transfer import copy_shard

log = logging.getLogger("mindspeed_tft.recovery")


def _send_bytes(data: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst)
    work_counts.add("state_bytes_sent", 8 + len(data))


def _recv_bytes(src: int) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src)
    buffer = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.recv(buffer, src=src)
    work_counts.add("state_bytes_received", 8 + buffer.numel())
    return bytes(buffer.numpy().tobytes())


def transfer_shards(
    state: RecoverableState,
    snapshots: StepSnapshots,
    order: RepairOrder,
    rank: int,
    global_rank_of: Callable[[int], int],
) -> tuple[StepSnapshot | None, bool]:
    """Run control-plane rank `rank`'s part of `order`'s shard transfers (its `receive` and
    `send` entries, as the controller planned them); returns the snapshot received (if
    any) and whether the complete model params of the lock step came with it.

    Point-to-point on the (rebuilt) world group, layout-checked by `copy_shard`; an entry's
    peer is a control-plane rank, `global_rank_of` its rank in that group (they differ
    after a shrink). A send to one of the order's `new_ranks` (a new process) carries this
    rank's param buffers too when they are complete at the lock step
    (`StepSnapshots.params_iteration`); a receive of a new process expects them."""
    me = dist.get_rank()
    lock_step = order.lock_step
    received: StepSnapshot | None = None
    got_params = False
    for entry in order.receive:
        src = global_rank_of(entry.source)
        copied = copy_shard(state.optimizer, state.model, src=src, dst=me,
                            expect_params=rank in order.new_ranks)
        received = decode_snapshot(_recv_bytes(src))
        copied.check()  # a damaged shard fails the repair (after the sender's last bytes)
        got_params |= copied.param_bytes > 0
        emit("shard_received", me, source=src, optimizer=entry.optimizer,
             shard=entry.shard, iteration=lock_step, bytes=copied.nbytes,
             param_bytes=copied.param_bytes, seconds=round(copied.seconds, 4),
             check_seconds=round(copied.check_seconds, 4),
             hash_seconds=round(copied.hash_seconds, 4))
        log.info("rank %d received %s shard %s from rank %d (%d bytes)", me,
                 entry.optimizer, entry.shard, src, copied.nbytes)
    for send in order.send:
        dst = global_rank_of(send.target)
        with_params = (send.target in order.new_ranks
                       and snapshots.params_iteration == lock_step)
        copy_shard(state.optimizer, state.model, src=me, dst=dst, with_params=with_params)
        _send_bytes(encode_snapshot(snapshots.at(lock_step, state.opt_param_scheduler)), dst)
        log.info("rank %d sent %s shard %s to rank %d", me, send.optimizer, send.shard, dst)
    return received, got_params


def _distributed(state: RecoverableState) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    return any(isinstance(opt, DistributedOptimizer) for opt in chained)


def gather_needed(state: RecoverableState, needed_here: bool) -> bool:
    """Whether any rank must all-gather its params in the rollback (collective over the
    default group with the distributed optimizer; otherwise there is nothing to gather)."""
    if not _distributed(state):
        return False
    device = next(state.model[0].parameters()).device
    flag = torch.tensor([int(needed_here)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def sync_model_params_from_main(state: RecoverableState, gather: bool = True,
                                copy: bool = True) -> None:
    """With `copy`, model params := the fp32 main params (the update's own copy); then, with
    `gather`, all-gathered in each chunk with the distributed optimizer (collective)."""
    chained = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    for opt in chained:
        if copy and hasattr(opt, "_copy_main_params_to_model_params"):
            opt._copy_main_params_to_model_params()
    if gather and _distributed(state):
        for chunk in state.model:
            gather_chunk_params(chunk)


def gather_chunk_params(chunk: Any) -> None:
    """Every param of a megatron-core DDP chunk from the shards its bucket groups' ranks
    hold (collective in each group). On gloo as point-to-point sends around a ring
    (`_ring_gather`): gloo's all-gather moves the same bytes 4-5x slower than its sends here
    (0.51 s against 0.11-0.15 s for 114 MiB between the two ranks of each of two groups at
    once; docs/decisions.md, "The rollback's param gather on gloo goes around a ring").
    Elsewhere megatron-core's own all-gather."""
    groups = [*chunk.bucket_groups, *getattr(chunk, "expert_parallel_bucket_groups", [])]
    for bucket_group in groups:  # what an all-gather moves, by whatever path it runs
        size = bucket_group.intra_distributed_optimizer_instance_size
        nbytes = sum(b.param_data.numel() * b.param_data.element_size()
                     for b in bucket_group.buckets) // size * (size - 1)
        work_counts.add("state_bytes_sent", nbytes)
        work_counts.add("state_bytes_received", nbytes)
    if not groups or dist.get_backend(groups[0].intra_distributed_optimizer_instance_group) \
            != dist.Backend.GLOO:
        chunk.start_param_sync(force_sync=True)
        return
    for bucket_group in groups:
        if bucket_group.param_gather_handle is not None:  # as megatron-core's force_sync
            bucket_group.param_gather_handle.wait()
            bucket_group.param_gather_handle = None
        _ring_gather(bucket_group)
        bucket_group.param_gather_dispatched = True


def _ring_gather(bucket_group: Any) -> None:
    """Every rank's shard of each bucket into its place (megatron-core's all-gather, byte
    for byte), around the group's ring: in step k each rank sends the shard it got in step
    k - 1 (its own first) to the next rank and receives the previous rank's into its place;
    every bucket's messages of a step travel together. Each rank sends and receives
    (size - 1) shards, as in any all-gather, and talks to two peers only: a lazily
    connected gloo group (`platform.gloo_device`) then opens two connections per rank for
    it, not one per rank of the group (bench/repair_work.py counts them)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    group = bucket_group.intra_distributed_optimizer_instance_group
    size = bucket_group.intra_distributed_optimizer_instance_size
    me = bucket_group.intra_distributed_optimizer_instance_rank
    ranks = dist.get_process_group_ranks(group)
    parts = [shard_buffer(bucket.param_data, size) for bucket in bucket_group.buckets]
    for step in range(size - 1):
        works = []
        for tag, bucket_parts in enumerate(parts):
            works += post_ring_step(bucket_parts, me, step, ranks, group, tag)
        for work in works:
            work.wait()


def post_ring_step(parts: list[torch.Tensor], index: int, step: int, ranks: list[int],
                   group: dist.ProcessGroup, tag: int = 0) -> list[Any]:
    """Start step `step` of a ring all-gather of `parts` (this rank's is `parts[index]`,
    `ranks[index]`): receive the previous rank's part `index - step - 1` into its place,
    send part `index - step` to the next rank; returns the works to wait for."""
    size = len(ranks)
    return [dist.irecv(parts[(index - step - 1) % size], src=ranks[(index - 1) % size],
                       group=group, tag=tag),
            dist.isend(parts[(index - step) % size], dst=ranks[(index + 1) % size],
                       group=group, tag=tag)]


def post_exchange(parts: list[torch.Tensor], index: int, ranks: list[int],
                  group: dist.ProcessGroup, tag: int = 0) -> list[Any]:
    """Start sending `parts[index]` (this rank's, `ranks[index]`) to every other rank of
    `group` and receiving theirs into `parts`; returns the works to wait for."""
    works = []
    for other, peer in enumerate(ranks):
        if other != index:
            works.append(dist.isend(parts[index], dst=peer, group=group, tag=tag))
            works.append(dist.irecv(parts[other], src=peer, group=group, tag=tag))
    return works


def rollback(state: RecoverableState, snapshot: StepSnapshot,
             gather: bool = True, copy: bool = True) -> dict[str, float]:
    """Put this rank at the snapshot's iteration (collective with the distributed
    optimizer and `gather`: the param all-gather; `copy` False: this rank's model params
    are those of the snapshot already). Returns the seconds each part took."""
    clock = _Clock()
    sync_model_params_from_main(state, gather, copy)
    clock.mark("params")
    restore_scheduler(state.opt_param_scheduler, snapshot.scheduler_state)
    state.args.consumed_train_samples = snapshot.consumed_train_samples
    state.iteration = snapshot.iteration
    set_rng_state(snapshot.rng_state)
    clock.mark("scheduler_rng")
    state.reset_train_data_iterator()
    clock.mark("data_iterator")
    if state.after_rollback is not None:
        state.after_rollback()
        clock.mark("host")
    return clock.parts


class _Clock:
    """Seconds between marks, by name."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = round(now - self._last, 4)
        self._last = now
