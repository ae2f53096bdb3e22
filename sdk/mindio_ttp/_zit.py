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

Ranks are global (control-plane) ranks, as the SDK passes them. The DP index of a rank
follows megatron-core's rank order (tensor, context, expert, data, pipeline; data below
pipeline), taken from this rank's DP group at launch. The SDK does not know the global
batch: a shrink keeps the largest number of DP replicas that divides the launch DP size
(every such size splits any global batch the launch size split), and reports the launch DP
size as the global batch's unit, so a grow goes back only to such sizes too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from mindspeed_tft.elastic import shrunk_world

from ._enums import OptimizerType, RepairType
from ._translate import RepairCall

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


def downgrade(staying: Sequence[int], layout: DpLayout) -> tuple[list[int], int]:
    """(the ranks of the smaller world, ascending; its DP size): the first DP replicas among
    `staying`, as many as the largest divisor of the launch DP size allows."""
    return shrunk_world(list(staying), layout.dp_index, layout.size, 1)


def upgrade_repairs(rank: int, world: Sequence[int], joining: Sequence[int], step: int,
                    layout: DpLayout) -> list[RepairCall]:
    """The `zit_upgrade_repair` calls of `rank` in a grow to `world` by `joining`: each
    returning rank receives from a rank that stayed in its DP group (the k-th returning rank
    of a group from its (k mod n)-th staying one), which sends (RT_SEND)."""
    coming = set(joining)
    source: dict[int, int] = {}
    for joiner in sorted(coming):
        group = layout.dp_group(joiner, world)
        stayed = [r for r in group if r not in coming]
        if not stayed:
            raise ValueError(f"rank {joiner} returns into a DP group with no rank that kept "
                             f"the training state ({group})")
        k = sorted(r for r in group if r in coming).index(joiner)
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
