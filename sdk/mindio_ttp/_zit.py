"""Elastic training through the SDK's four ZIT handlers: which ranks a shrink keeps and which
handler calls a grow makes on each rank (pure functions; `_actions` makes the calls).

mindspeed-tft's controller shrinks a job when a lost rank gets no replacement and grows it
back when the lost data-parallel (DP) replicas return (docs/design.md, "Elastic training").
Its `scale_in` and `scale_out` orders become the SDK's calls, with its arguments
(Ascend/mind-cluster `component/mindio/tft`, `ttp_decorator.py`):

- scale-in ("downgrade"): on every rank that stays,
  `zit_downgrade_rebuild(new_dp_ranks, new_world_ranks, train_args, zit_param)`, with
  `zit_param = '{"scale-in-strategy": "DP"}'`; the ranks train on from their memory at the
  lock step (no rollback).
- scale-out ("upgrade"): on every rank of the larger world,
  `zit_upgrade_rebuild(rank_list, train_args, zit_param)` (`rank_list`: the returning
  ranks), then `zit_upgrade_repair(step, need_rebuild, error_ranks, repair_info, train_args,
  zit_param)` on each sender (RT_SEND) and each returning rank (RT_RECV_REPAIR), then
  `zit_upgrade_rollback(step, train_args, zit_param)` on every rank, with
  `zit_param = '{"scale-out-strategy": "DP"}'`.

Ranks are global (control-plane) ranks, as the SDK passes them. A shrink keeps every rank
the controller kept: all but the lost ranks' whole DP replicas (the SDK's controller isolates
the same ranks and passes the same lists). No divisor of the launch DP size is chosen:
MindSpeed-LLM's downgrade handler spreads the global batch's micro-batches over the ranks
that stay, one more on the first ones where they do not divide evenly, and it expects
`new_dp_ranks` to be its DP group without exactly the lost DP indices (with any other rank
missing it waits in `new_group` for it). The optimizer shards are those the host described
at launch (`tft_set_optimizer_replica`: a DP group cut into `replica_cnt` consecutive
chunks, shard s held by the s-th rank of each): after a shrink a shard is held by its launch
holders that stay, and a shrink without a holder of some shard is refused, naming it (the
dump that precedes every shrink is refused for the same reason first). A grow sends each
returning rank its shard from a holder of the same shard that stayed. The DP index of a rank
follows megatron-core's rank order (tensor, context, expert, data, pipeline; data below
pipeline), taken from this rank's DP group at launch. The launch DP size is reported as the
global batch's unit, so a grow goes back to sizes that divide it (the launch size itself
among them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ._enums import OptimizerType, RepairType
from ._translate import RepairCall, shard_holders

#: the strategy parameters the SDK's cluster manager gives with its DP strategies
#: (MindSpeed-LLM's handlers accept no other)
DOWNGRADE_PARAM = json.dumps({"scale-in-strategy": "DP"})
UPGRADE_PARAM = json.dumps({"scale-out-strategy": "DP"})


class DpLayout:
    """Megatron's DP layout of the launch world, from one rank's launch DP group."""

    def __init__(self, dp_group: Sequence[int]) -> None:
        ranks = sorted(dp_group)
        if not ranks:
            raise ValueError("no data-parallel group (tft_set_optimizer_replica)")
        self.stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
        if ranks != list(range(ranks[0], ranks[0] + self.stride * len(ranks), self.stride)):
            raise ValueError(f"data-parallel group {list(dp_group)} is not in megatron-core's "
                             "rank order (evenly spaced ranks): elastic training cannot place "
                             "the other ranks")
        self.size = len(ranks)
        self.block = self.stride * self.size  # the ranks of one pipeline stage

    def dp_index(self, rank: int) -> int:
        return (rank % self.block) // self.stride

    def position(self, rank: int) -> tuple[int, int]:
        """The model-parallel position of `rank` (pipeline stage, offset within the DP
        stride): the ranks of one DP group share it."""
        return rank // self.block, rank % self.stride

    def dp_group(self, rank: int, world: Sequence[int]) -> list[int]:
        """The DP group of `rank` in `world` (ascending)."""
        where = self.position(rank)
        return sorted(r for r in world if self.position(r) == where)


class MissingShard(ValueError):
    """No rank of the new world holds some optimizer shard (the message names it)."""


class Shards:
    """The optimizer shards of one rank's DP groups at launch (`tft_set_optimizer_replica`):
    per layout name (dense, moe) the group's ranks and replica count."""

    def __init__(self, groups: dict[str, list[int]], layout: dict[str, Any]) -> None:
        self.groups = {name: list(ranks) for name, ranks in groups.items()}
        self.counts = {name: int(layout[name]["replica_num"]) for name in self.groups}

    def holders(self, name: str, shard: int) -> list[int]:
        """The launch holders of `shard` of layout `name` (one per replica chunk)."""
        return shard_holders(self.groups[name], self.counts[name], shard)

    def shard_of(self, name: str, rank: int) -> int:
        ranks = self.groups[name]
        return ranks.index(rank) % (len(ranks) // self.counts[name])

    def missing(self, world: Sequence[int]) -> list[str]:
        """The shards no rank of `world` holds, named with their launch holders."""
        kept = set(world)
        return [f"{name} shard {shard} (held by ranks {holders} at launch)"
                for name, ranks in self.groups.items()
                for shard in range(len(ranks) // self.counts[name])
                if not kept & set(holders := self.holders(name, shard))]

    def layout_in(self, rank: int, world: Sequence[int]) -> tuple[dict[str, Any],
                                                                 dict[str, list[int]]]:
        """`rank`'s replica layout in `world` (the launch shards, each held by its holders
        in `world`) and its DP groups there; MissingShard names a shard nobody holds."""
        lost = self.missing(world)
        if lost:
            raise MissingShard(f"no rank of the new world {sorted(world)} holds "
                               + "; ".join(lost))
        kept = set(world)
        layout: dict[str, Any] = {}
        groups: dict[str, list[int]] = {}
        for name, ranks in self.groups.items():
            group = [r for r in ranks if r in kept]
            shard = self.shard_of(name, rank)
            holders = [h for h in self.holders(name, shard) if h in kept]
            layout[name] = {"dp_index": group.index(rank), "dp_size": len(group),
                            "replica_num": len(holders), "shard": shard, "holders": holders}
            groups[name] = group
        return layout, groups


def downgrade(staying: Sequence[int], layout: DpLayout) -> tuple[list[int], int]:
    """(the ranks of the smaller world, ascending; its DP size): every rank that stays."""
    world = sorted(staying)
    return world, max(len(layout.dp_group(r, world)) for r in world)


def upgrade_repairs(rank: int, world: Sequence[int], joining: Sequence[int], step: int,
                    layout: DpLayout, shards: Shards) -> list[RepairCall]:
    """The `zit_upgrade_repair` calls of `rank` in a grow to `world` by `joining`: each
    returning rank receives its dense shard from a rank that stayed holding the same shard
    (the k-th returning holder of a shard from the (k mod n)-th staying one), which sends
    (RT_SEND)."""
    coming = set(joining)
    source: dict[int, int] = {}
    for joiner in sorted(coming):
        holders = [h for h in shards.holders("dense", shards.shard_of("dense", joiner))
                   if h in world]
        stayed = [h for h in holders if h not in coming]
        if not stayed:
            raise MissingShard(f"rank {joiner} returns but no rank that kept the training "
                               f"state holds its shard (holders: {holders})")
        k = [h for h in holders if h in coming].index(joiner)
        source[joiner] = stayed[k % len(stayed)]
    rank_list = layout.dp_group(rank, world)
    attention = OptimizerType.ATTENTION.value
    calls = []
    if rank in source:
        calls.append(_repair(step, RepairType.RT_RECV_REPAIR, [source[rank]], [rank],
                             [attention], rank_list))
    targets = sorted(j for j, s in source.items() if s == rank)
    if targets:
        calls.append(_repair(step, RepairType.RT_SEND, [rank] * len(targets), targets,
                             [attention] * len(targets), rank_list))
    return calls


def _repair(step: int, kind: RepairType, src: list[int], dst: list[int], types: list[int],
            rank_list: list[int]) -> RepairCall:
    """As the SDK's `set_repair_rollback_config` builds them (error_ranks: the receivers)."""
    return RepairCall(step, False, list(dst), {"type": types, "repair_type": kind.value,
                                               "src": src, "dst": dst, "rank_list": rank_list})
