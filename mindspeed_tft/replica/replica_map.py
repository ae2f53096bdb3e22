"""Who holds which optimizer shard: the replica map (SPEC 2).

Each data-parallel group (DP x CP with context parallelism) of size d is split into N
contiguous chunks of d/N ranks; the optimizer is sharded within a chunk, so DP index i holds
shard ``i % (d/N)`` and the holders of a shard are DP indices ``s, s + d/N, s + 2d/N, ...``
(in that order: the order in which a dump picks the first healthy one, SPEC 7).

A shard is named by `ShardId(optimizer, group, index)`: the optimizer ("dense" or
"expert"), the DP group it belongs to (its position in the model-parallel layout: the index
of the DP group in `ReplicaMap.dp_groups`), and the shard index within a chunk. With the
non-distributed fp16/bf16 optimizer every DP rank holds the whole state: N = d, one shard
(index 0) per group, held by every rank of the group.

The map is plain data, built from the rank lists of the DP groups; it answers for any global
rank, so the controller and the dump planner can use it without torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, order=True)
class ShardId:
    """One optimizer shard: optimizer name, DP group index, shard index within a chunk."""

    optimizer: str
    group: int
    index: int

    def __str__(self) -> str:
        return f"{self.optimizer} shard {self.index} of DP group {self.group}"


@dataclass(frozen=True)
class ReplicaMap:
    """The replica layout of one optimizer over all DP groups of the job."""

    optimizer: str
    dp_groups: tuple[tuple[int, ...], ...]
    replica_num: int
    _position: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        position: dict[int, tuple[int, int]] = {}
        sizes = {len(group) for group in self.dp_groups}
        if len(sizes) != 1:
            raise ValueError(f"DP groups of different sizes: {sorted(sizes)}")
        d = sizes.pop()
        if self.replica_num < 1 or d % self.replica_num != 0:
            raise ValueError(
                f"replica number {self.replica_num} does not divide the DP group size {d}"
            )
        for group_index, ranks in enumerate(self.dp_groups):
            for dp_index, rank in enumerate(ranks):
                if rank in position:
                    raise ValueError(f"rank {rank} appears in two DP groups")
                position[rank] = (group_index, dp_index)
        object.__setattr__(self, "_position", position)

    @classmethod
    def build(
        cls, optimizer: str, dp_groups: Sequence[Sequence[int]], replica_num: int
    ) -> ReplicaMap:
        """A map over `dp_groups` (each a list of global ranks in DP-index order)."""
        return cls(optimizer, tuple(tuple(g) for g in dp_groups), replica_num)

    @property
    def dp_size(self) -> int:
        """d: the size of every DP group."""
        return len(self.dp_groups[0])

    @property
    def chunk_size(self) -> int:
        """d/N: ranks per chunk, i.e. shards per DP group."""
        return self.dp_size // self.replica_num

    @property
    def ranks(self) -> list[int]:
        """Every global rank the map covers, ascending."""
        return sorted(self._position)

    def dp_index(self, rank: int) -> int:
        """The rank's index in its DP group."""
        return self._locate(rank)[1]

    def group_of(self, rank: int) -> int:
        """The index of the rank's DP group."""
        return self._locate(rank)[0]

    def shard_of(self, rank: int) -> ShardId:
        """The shard a global rank holds."""
        group_index, dp_index = self._locate(rank)
        return ShardId(self.optimizer, group_index, dp_index % self.chunk_size)

    def holders(self, shard: ShardId) -> list[int]:
        """The global ranks holding `shard`, in DP-index order (i, i + d/N, ...)."""
        if shard.optimizer != self.optimizer:
            raise KeyError(f"{shard} does not belong to the {self.optimizer} optimizer")
        if not (0 <= shard.group < len(self.dp_groups) and 0 <= shard.index < self.chunk_size):
            raise KeyError(f"no {shard} in a layout of {len(self.dp_groups)} DP groups of "
                           f"{self.chunk_size} shards")
        ranks = self.dp_groups[shard.group]
        return [ranks[i] for i in range(shard.index, self.dp_size, self.chunk_size)]

    def holders_of_rank(self, rank: int) -> list[int]:
        """The global ranks holding the same shard as `rank` (itself included)."""
        return self.holders(self.shard_of(rank))

    def replica_peers(self, rank: int) -> list[int]:
        """The other ranks holding `rank`'s shard."""
        return [r for r in self.holders_of_rank(rank) if r != rank]

    def chunk_of(self, rank: int) -> int:
        """Which of the N chunks of its DP group the rank is in (the replica instance)."""
        return self.dp_index(rank) // self.chunk_size

    def chunk_ranks(self, group: int, chunk: int) -> list[int]:
        """The ranks of chunk `chunk` of DP group `group` (one full copy of the state)."""
        start = chunk * self.chunk_size
        return list(self.dp_groups[group][start : start + self.chunk_size])

    def shards(self) -> Iterator[ShardId]:
        """Every shard of the job."""
        for group_index in range(len(self.dp_groups)):
            for index in range(self.chunk_size):
                yield ShardId(self.optimizer, group_index, index)

    def describe_rank(self, rank: int) -> dict[str, Any]:
        """What the rank registers with the controller (schema of the control plane)."""
        shard = self.shard_of(rank)
        return {
            "dp_index": self.dp_index(rank),
            "dp_size": self.dp_size,
            "replica_num": self.replica_num,
            "group": shard.group,
            "shard": shard.index,
            "holders": self.holders(shard),
        }

    def _locate(self, rank: int) -> tuple[int, int]:
        try:
            return self._position[rank]
        except KeyError:
            raise KeyError(f"rank {rank} is not in the {self.optimizer} replica map") from None
