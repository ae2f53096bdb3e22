"""The replica distributed optimizer: megatron-core's DistributedOptimizer with N replicas.

The engine is megatron-core's own "partial distributed optimizer"
(`num_distributed_optimizer_instances = N`): the DDP buffers reduce-scatter gradients inside
each chunk and all-reduce each shard across the N chunks (so gradients are still averaged
over the whole DP group), every chunk steps its shards, and params are all-gathered inside
the chunk. Memory per parameter: 4 + 16N/d bytes with bf16 grads, 6 + 12N/d with fp32 grads.

Two things of megatron-core 0.12.1 are wrong with N > 1 and are patched here:

- grad statistics: the distributed optimizer reduces the grad norm (and zero counts) over
  the whole world, which counts every shard N times (the norm comes out sqrt(N) too large and
  clipping changes the trajectory). With replicas they are reduced over the ranks of one
  replica instance (`ReplicaGroups.grad_stats_group`).
- parameter-state checkpoints: DP rank 0 of *every* chunk writes `distrib_optim.pt` to the
  same path. With replicas only chunk 0 gathers and writes; every chunk still reads it.

And one thing costs N times as much with replicas: `ChainedOptimizer.count_zeros` counts the
zeros of every main grad of the rank's shard (N times larger) on every step, even when
`--log-num-zeros-in-grad` is off and the count is dropped (1 % of a 17 M step here). With
replicas it counts only when an optimizer asks for it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.replica.groups import ReplicaGroups

_groups: ReplicaGroups | None = None
_installed = False


def _grad_stats_group(self: Any) -> dist.ProcessGroup | None:
    if _groups is not None and _groups.sharded:
        return _groups.grad_stats_group
    return None  # megatron-core's choice: the whole world


def _save_parameter_state(self: Any, filename: str) -> None:
    """Gather the parameter state on DP rank 0 of chunk 0 and write it (chunk 0 only), through
    a file object, fsynced (a failed write raises its OSError, where torch's writer given a
    path raises a RuntimeError without the errno), as `recovery.layout.save_file` does."""
    if self.distributed_optimizer_instance_id != 0:
        return
    state_dict = self.get_parameter_state_dp_zero()
    if dist.get_rank(self.data_parallel_group) == 0:
        with open(filename, "wb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())


def _count_zeros_when_asked(count_zeros: Any) -> Any:
    @functools.wraps(count_zeros)
    def wrapper(self: Any) -> Any:
        if not any(o.config.log_num_zeros_in_grad for o in self.chained_optimizers):
            return 0  # what megatron-core returns when nobody asked, with unshared groups
        return count_zeros(self)

    return wrapper


def use_replica_groups(groups: ReplicaGroups) -> None:
    """Route megatron-core's DistributedOptimizer through the replica layout of `groups`.

    Call after `groups.build()` and before the optimizer is used; calling it again (after a
    group rebuild) points it at the new groups. Installs the patches (the
    ``replica-optimizer`` moment of `mindspeed_tft.patches`) on first use."""
    from mindspeed_tft import patches

    global _groups
    _groups = groups
    patches.install("replica-optimizer")


def install_patches() -> None:
    """The ``replica-optimizer`` moment: megatron-core's DistributedOptimizer asks
    `use_replica_groups`' groups for its grad statistics and writes its parameter state from
    replica instance 0 only, and counts grad zeros only when asked (once per process)."""
    global _installed
    if _installed:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    DistributedOptimizer.get_grad_stats_parallel_group = _grad_stats_group
    DistributedOptimizer.save_parameter_state = _save_parameter_state
    ChainedOptimizer.count_zeros = _count_zeros_when_asked(ChainedOptimizer.count_zeros)
    _installed = True
