"""Elastic training: the smaller world a job continues in when a lost rank gets no
replacement (`--enable-elastic-training`).

The data-parallel (DP) replicas that contain a lost rank leave: all tensor x pipeline ranks
of that DP index. The others continue with the same global batch, the same samples in the
same order and the same learning-rate schedule, at the largest DP size d' that

- is at most the number of remaining replicas, and
- splits the global batch into the same whole number of micro-batches on every rank:
  global_batch % (micro_batch x d') == 0, megatron-core's own condition.

Every rank then runs more micro-batches per step (global_batch / (micro_batch x d')), and
megatron-core's sampler, micro-batch calculator and gradient averaging work at d' exactly as
in a job launched at d'. Why not an uneven split: a rank with fewer micro-batches would skip
collectives its peers run once per micro-batch (Megatron-LM's `loss_func` all-reduces the
reported loss over the DP group in every micro-batch; so does this project's
`pretrain_gpt.py`), and they would wait forever. Replicas beyond d' leave the job too (DP4
with 8 micro-batches per step that loses one replica continues at DP2; with 12 it continues
at DP3).

Ranks keep their order: the new global rank of a remaining rank is its position among them,
which keeps megatron-core's rank layout (tensor fastest, pipeline slowest) at the new DP size.
Optimizer replicas are re-formed with the largest N' <= N that divides d' (N itself when it
still divides d'; N = d stays full replication); where that is 1 the job continues with one
copy of the optimizer state, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def even_dp_size(global_batch_size: int, micro_batch_size: int, replicas: int) -> int:
    """The largest DP size <= `replicas` that splits the global batch evenly."""
    if replicas < 1:
        raise ValueError(f"no data-parallel replica left ({replicas})")
    for size in range(replicas, 0, -1):
        if global_batch_size % (micro_batch_size * size) == 0:
            return size
    raise ValueError(f"global batch {global_batch_size} is not a multiple of the micro batch "
                     f"{micro_batch_size}")


def shrunk_world(ranks: Sequence[int], dp_index: Callable[[int], int],
                 global_batch_size: int, micro_batch_size: int) -> tuple[list[int], int]:
    """(the ranks of the smaller world, ascending; its DP size): of the DP replicas among
    `ranks` (`dp_index(rank)` names a rank's replica), the first d' (`even_dp_size`)."""
    replicas = sorted({dp_index(r) for r in ranks})
    size = even_dp_size(global_batch_size, micro_batch_size, len(replicas))
    kept = set(replicas[:size])
    return sorted(r for r in ranks if dp_index(r) in kept), size


def replica_num_for(dp_size: int, wanted: int) -> int:
    """The optimizer replica number N at DP size `dp_size`: the largest divisor of it that
    is at most `wanted` (`wanted` itself when it still divides it; full replicas, N = d,
    stay full; 1 is one copy of the optimizer state)."""
    return max(n for n in range(1, min(wanted, dp_size) + 1) if dp_size % n == 0)
