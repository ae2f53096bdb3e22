"""The replica process groups of a job, built from megatron-core's parallel state.

megatron-core builds the groups the replica optimizer communicates in when its parallel
state is initialized with `num_distributed_optimizer_instances = N`: each DP (x CP) group is
split into N contiguous chunks ("intra partial" groups: the optimizer is sharded in a chunk,
params are all-gathered in it) and the ranks holding the same shard form an "inter partial"
group (gradients are all-reduced across it). `ReplicaGroups` adds what megatron-core lacks:

- the replica maps (`ReplicaMap`) of the whole job, dense and expert, computed from the job's
  `Features` (parallel sizes, replica number) with megatron-core's own `RankGenerator` and
  checked against the groups it actually built;
- the grad-statistics group of each replica instance (every model-parallel rank of one
  chunk index): grad norm and zero counts must sum each shard once, not N times (with a
  single DP group that is megatron-core's own optimizer chunk group, reused);
- `build()`, called again after a rebuild (worker reboot, UCE repair, a scale change).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mindspeed_tft.features import Features
from mindspeed_tft.platform import megatron_version
from mindspeed_tft.replica.replica_map import ReplicaMap

DENSE = "dense"
EXPERT = "expert"

_ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default rank order


@dataclass(frozen=True)
class ReplicaLayout:
    """The replica layout of a job, built from its features: their parallel sizes, replica
    number and optimizer kind (`Features`, the one home of these values)."""

    features: Features

    def dense_dp_groups(self) -> list[list[int]]:
        """Every DP x CP group's global ranks, in DP-index order."""
        from megatron.core.parallel_state import RankGenerator

        sizes = self.features.parallel
        generator = RankGenerator(tp=sizes.tensor, ep=1, dp=sizes.data, pp=sizes.pipeline,
                                  cp=sizes.context, order=_ORDER)
        return generator.get_ranks("dp-cp")

    def expert_dp_groups(self) -> list[list[int]]:
        """Every expert-DP group's global ranks (MoE), in DP-index order."""
        from megatron.core.parallel_state import RankGenerator

        sizes = self.features.parallel
        expert_dp = sizes.world_size // (sizes.expert_tensor * sizes.expert * sizes.pipeline)
        generator = RankGenerator(tp=sizes.expert_tensor, ep=sizes.expert, dp=expert_dp,
                                  pp=sizes.pipeline, cp=1, order=_ORDER)
        return generator.get_ranks("dp")

    def _replica_num(self, groups: list[list[int]]) -> int:
        """N, or d (every rank a whole copy) without the distributed optimizer."""
        return self.features.replica_num if self.features.distributed_optimizer else len(groups[0])

    def dense_map(self) -> ReplicaMap:
        """Replica map of the dense optimizer (N = d for the non-distributed optimizer)."""
        groups = self.dense_dp_groups()
        return ReplicaMap.build(DENSE, groups, self._replica_num(groups))

    def expert_map(self) -> ReplicaMap | None:
        """Replica map of the expert optimizer, or None without expert parallelism."""
        if self.features.parallel.expert == 1:
            return None
        groups = self.expert_dp_groups()
        return ReplicaMap.build(EXPERT, groups, self._replica_num(groups))


class ReplicaGroups:
    """The replica maps and the extra process groups of this job (build once per world)."""

    def __init__(self, layout: ReplicaLayout) -> None:
        self.layout = layout
        self.maps: dict[str, ReplicaMap] = {DENSE: layout.dense_map()}
        expert = layout.expert_map()
        if expert is not None:
            self.maps[EXPERT] = expert
        self.grad_stats_group: dist.ProcessGroup | None = None
        self._instance_groups: list[dist.ProcessGroup] = []

    @property
    def dense(self) -> ReplicaMap:
        return self.maps[DENSE]

    @property
    def sharded(self) -> bool:
        """True when the distributed optimizer keeps N > 1 replicas (1 < N <= d)."""
        return self.layout.features.distributed_optimizer and self.dense.replica_num > 1

    def build(self) -> None:
        """Create the grad-statistics group of every replica instance (collective, all ranks)
        and check megatron-core's DP and partial-DP groups against the map.

        With a single DP group (TP = PP = CP = 1) a replica instance is exactly one
        optimizer chunk, so megatron-core's intra-partial DP group already has its ranks and
        is used instead of a new group: every gloo group keeps a transport thread that wakes
        every 10 ms, about 1 ms of CPU per second per group and rank (bench/HISTORY.md)."""
        self.verify_megatron_groups()
        self.grad_stats_group = None
        self._instance_groups = []
        if not self.sharded:
            return
        dense = self.dense
        if len(dense.dp_groups) == 1:  # the same on every rank: all skip new_group alike
            from megatron.core import parallel_state as ps

            self.grad_stats_group = ps.get_data_parallel_group(
                with_context_parallel=True, partial_data_parallel=True)
            return
        me = dist.get_rank()
        for chunk in range(dense.replica_num):
            ranks = sorted(
                rank
                for group in range(len(dense.dp_groups))
                for rank in dense.chunk_ranks(group, chunk)
            )
            group = dist.new_group(ranks)
            self._instance_groups.append(group)
            if me in ranks:
                self.grad_stats_group = group

    def layout_event(self) -> dict[str, object]:
        """What this rank holds, from the map and from the groups megatron-core built."""
        from megatron.core import parallel_state as ps

        me = dist.get_rank()
        dense = self.dense
        record: dict[str, object] = {
            **dense.describe_rank(me),
            "dp_group": dist.get_process_group_ranks(
                ps.get_data_parallel_group(with_context_parallel=True)
            ),
        }
        if self.sharded:
            record["chunk_group"] = dist.get_process_group_ranks(
                ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            )
            record["replica_group"] = dist.get_process_group_ranks(
                megatron_version.replica_instance_group()
            )
            record["grad_stats_group"] = dist.get_process_group_ranks(self.grad_stats_group)
            record["own_groups"] = len(self._instance_groups)  # 0: megatron-core's reused
        return record

    def verify_megatron_groups(self) -> None:
        """Raise if megatron-core's groups of this rank disagree with the replica map."""
        from megatron.core import parallel_state as ps

        me = dist.get_rank()
        dense = self.dense
        dp_ranks = dist.get_process_group_ranks(
            ps.get_data_parallel_group(with_context_parallel=True)
        )
        expected = list(dense.dp_groups[dense.group_of(me)])
        if dp_ranks != expected:
            raise RuntimeError(
                f"rank {me}: megatron-core's DP group {dp_ranks} is not the replica map's "
                f"{expected}"
            )
        if not self.sharded:
            return
        chunk = dist.get_process_group_ranks(
            ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        )
        expected_chunk = dense.chunk_ranks(dense.group_of(me), dense.chunk_of(me))
        if list(chunk) != expected_chunk:
            raise RuntimeError(
                f"rank {me}: megatron-core's optimizer chunk {chunk} is not the replica map's "
                f"{expected_chunk}"
            )
        inter = dist.get_process_group_ranks(megatron_version.replica_instance_group())
        if sorted(inter) != sorted(dense.holders_of_rank(me)):
            raise RuntimeError(
                f"rank {me}: megatron-core's replica group {inter} is not the holders "
                f"{dense.holders_of_rank(me)} of {dense.shard_of(me)}"
            )
