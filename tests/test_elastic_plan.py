"""The smaller world of elastic training: the largest DP size that splits the global batch
evenly, the ranks that stay, the replica number that still fits."""

import pytest

from mindspeed_tft.control.controller.elasticity import Elasticity
from mindspeed_tft.elastic import even_dp_size, replica_num_for, shrunk_world


@pytest.mark.parametrize(("gbs", "mbs", "replicas", "size"), [
    (16, 2, 3, 2), (24, 2, 3, 3), (48, 4, 3, 3), (16, 2, 1, 1), (32, 1, 7, 4), (14, 2, 6, 1),
])
def test_even_dp_size_is_the_largest_that_splits_the_global_batch(gbs, mbs, replicas, size):
    assert even_dp_size(gbs, mbs, replicas) == size
    assert gbs % (mbs * size) == 0


def test_no_replica_left_is_refused():
    with pytest.raises(ValueError, match=r"no data-parallel replica left \(0\)"):
        even_dp_size(16, 2, 0)


def test_shrunk_world_keeps_whole_replicas_in_rank_order():
    # TP2 x DP2 x PP2 (tensor fastest, pipeline slowest): replica of rank r is (r // 2) % 2
    ranks = [0, 1, 4, 5]  # DP index 1 (ranks 2, 3, 6, 7) lost
    assert shrunk_world(ranks, lambda r: (r // 2) % 2, 16, 2) == ([0, 1, 4, 5], 1)
    # DP4 that lost rank 1: 8 micro-batches per step go to DP2, 12 to DP3
    assert shrunk_world([0, 2, 3], lambda r: r, 16, 2) == ([0, 2], 2)
    assert shrunk_world([0, 2, 3], lambda r: r, 24, 2) == ([0, 2, 3], 3)


@pytest.mark.parametrize(("dp", "wanted", "n"), [(3, 2, 1), (2, 2, 2), (6, 3, 3), (1, 2, 1),
                                                 (4, 1, 1), (3, 4, 3), (6, 4, 3), (4, 8, 4)])
def test_replicas_are_reformed_with_the_largest_divisor_of_the_dp_size_up_to_n(dp, wanted, n):
    assert replica_num_for(dp, wanted) == n


def _elasticity(world: int, tp: int, micro_batches: int | None) -> Elasticity:
    known = Elasticity()
    for rank in range(world):  # megatron-core's layout, PP = 1: DP index = rank // TP
        known.note_registration(rank, {"dense": {"dp_index": rank // tp}})
        known.note_registration(rank, {"dense": {"dp_index": 99}})  # the first one counts
    known.micro_batches = micro_batches
    return known


def test_the_job_grows_by_whole_replicas_to_an_even_dp_size():
    known = _elasticity(4, 1, 12)
    assert known.grown_world([0, 1], [2, 3]) == ([0, 1, 2, 3], 4)
    assert known.grown_world([0, 1], [3]) == ([0, 1, 3], 3)  # 12 splits over 3 as well
    assert known.grown_world([0, 1, 3], [2]) == ([0, 1, 2, 3], 4)
    known.micro_batches = 8  # 8 micro-batches split over 2 or 4 ranks, not 3
    assert known.grown_world([0, 1], [3]) is None
    assert known.grown_world([0], [2, 3]) == ([0, 2], 2)  # the first replicas that come back
    assert known.grown_world([0, 1], []) is None
    assert Elasticity().grown_world([0], [1]) is None  # no shrink yet: nothing to go on


def test_a_tensor_parallel_replica_grows_back_only_when_complete():
    known = _elasticity(4, 2, 8)  # TP2 x DP2: replica 1 is ranks 2 and 3
    assert known.grown_world([0, 1], [2]) is None
    assert known.grown_world([0, 1], [2, 3]) == ([0, 1, 2, 3], 2)
