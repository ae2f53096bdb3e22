"""The replica consistency check: do all holders of a shard hold the same bits?

With `--tft-check-replicas-interval K`, every K iterations each rank hashes its optimizer
shard (fp32 main params, exp_avg, exp_avg_sq, step: `transfer.shard_digest`), gathers
the digests of its replica group (the holders of the same shard) and compares them. Every rank
records a `replica_check` event (iteration, shard, holders, digest); a mismatch raises, so
replicas that drift apart are caught at the step where they did, not at repair time.
In the manner of Megatron-LM's `--check-weight-hash-across-dp-replicas-interval`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.events import emit
from mindspeed_tft.replica.groups import ReplicaGroups
from mindspeed_tft.replica.transfer import shard_digest


class ReplicaMismatchError(RuntimeError):
    """Holders of one shard hold different optimizer state."""


class ReplicaConsistencyCheck:
    """Compares shard digests across each replica group every `interval` iterations (the
    plugin calls `start` when training starts and `after_step` after every step).
    `groups()` gives the current replica groups (a repair or a shrink builds new ones)."""

    def __init__(self, groups: Callable[[], ReplicaGroups], interval: int) -> None:
        self._groups = groups
        self.interval = interval
        self._replica_group: dist.ProcessGroup | None = None

    @property
    def groups(self) -> ReplicaGroups:
        return self._groups()

    def start(self) -> None:
        """Build the replica groups the check gathers over (collective, all ranks)."""
        self._replica_group = self._build_replica_group()

    def _build_replica_group(self) -> dist.ProcessGroup | None:
        """One group per shard of the dense optimizer (all ranks create every group)."""
        dense = self.groups.dense
        mine = None
        me = dist.get_rank()
        for shard in dense.shards():
            holders = dense.holders(shard)
            if len(holders) < 2:
                continue
            group = dist.new_group(holders)
            if me in holders:
                mine = group
        return mine

    def after_step(self, iteration: int, optimizer: Any, model: list[torch.nn.Module]) -> None:
        """Check the replicas after `iteration` (collective in each replica group)."""
        if iteration % self.interval != 0:
            return
        me = dist.get_rank()
        dense = self.groups.dense
        shard = dense.shard_of(me)
        holders = dense.holders(shard)
        digest = shard_digest(optimizer, model)
        digests = [digest]
        if self._replica_group is not None:
            digests = [""] * len(holders)
            dist.all_gather_object(digests, digest, group=self._replica_group)
        emit("replica_check", me, iteration=iteration, shard=str(shard),
             holders=holders, digest=digest, match=len(set(digests)) == 1)
        if len(set(digests)) != 1:
            raise ReplicaMismatchError(
                f"iteration {iteration}: holders {holders} of {shard} hold different "
                f"optimizer state (digests {digests})"
            )
