"""The replica map answers who holds which optimizer shard (SPEC 2), for any layout."""

from __future__ import annotations

import pytest

from mindspeed_tft.features import Features, ParallelSizes
from mindspeed_tft.replica.groups import ReplicaLayout
from mindspeed_tft.replica.replica_map import ReplicaMap, ShardId


def test_d4_n2_contiguous_chunks():
    m = ReplicaMap.build("dense", [[0, 1, 2, 3]], 2)
    assert m.chunk_size == 2
    assert [m.shard_of(r).index for r in range(4)] == [0, 1, 0, 1]
    assert m.holders(ShardId("dense", 0, 0)) == [0, 2]
    assert m.holders(ShardId("dense", 0, 1)) == [1, 3]
    assert m.holders_of_rank(3) == [1, 3]
    assert m.replica_peers(3) == [1]
    assert m.chunk_ranks(0, 1) == [2, 3]
    assert [m.chunk_of(r) for r in range(4)] == [0, 0, 1, 1]


def test_d8_n4_holders_in_dp_index_order():
    m = ReplicaMap.build("dense", [list(range(8))], 4)
    assert m.holders(ShardId("dense", 0, 1)) == [1, 3, 5, 7]
    assert sorted(m.shards()) == [ShardId("dense", 0, 0), ShardId("dense", 0, 1)]


def test_tp2_dp4_layout_from_megatron_rank_order():
    layout = ReplicaLayout(Features(replica_num=2, distributed_optimizer=True,
                                    parallel=ParallelSizes(world_size=8, tensor=2,
                                                           expert_tensor=2)))
    m = layout.dense_map()
    # megatron-core's default order tp-cp-ep-dp-pp: DP groups stride over the TP ranks.
    assert m.dp_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert m.shard_of(5) == ShardId("dense", 1, 0)
    assert m.holders_of_rank(5) == [1, 5]
    assert m.holders_of_rank(6) == [2, 6]


def test_non_distributed_optimizer_is_its_own_replica():
    layout = ReplicaLayout(Features(replica_num=2, distributed_optimizer=False,
                                    parallel=ParallelSizes(world_size=4, tensor=2,
                                                           expert_tensor=2)))
    m = layout.dense_map()
    assert m.replica_num == 2 and m.chunk_size == 1
    assert m.holders_of_rank(0) == [0, 2]
    assert m.holders_of_rank(3) == [1, 3]


def test_expert_map_with_expert_parallelism():
    layout = ReplicaLayout(Features(replica_num=2, distributed_optimizer=True,
                                    parallel=ParallelSizes(world_size=8, expert=2)))
    expert = layout.expert_map()
    assert expert is not None and expert.dp_size == 4
    assert expert.dp_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert expert.holders_of_rank(4) == [0, 4]


def test_describe_rank_is_what_the_controller_gets():
    m = ReplicaMap.build("dense", [[0, 1, 2, 3]], 2)
    assert m.describe_rank(2) == {"dp_index": 2, "dp_size": 4, "replica_num": 2, "group": 0,
                                  "shard": 0, "holders": [0, 2]}


def test_invalid_maps_are_refused():
    with pytest.raises(ValueError, match="replica number 3 does not divide the DP group size 4"):
        ReplicaMap.build("dense", [[0, 1, 2, 3]], 3)
    with pytest.raises(ValueError, match="rank 1 appears in two DP groups"):
        ReplicaMap.build("dense", [[0, 1], [1, 2]], 1)
    m = ReplicaMap.build("dense", [[0, 1, 2, 3]], 2)
    with pytest.raises(KeyError, match="rank 9 is not in the dense replica map"):
        m.shard_of(9)
