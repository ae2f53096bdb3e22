"""Optimizer replicas: N copies of every distributed-optimizer shard (SPEC 2, 3).

- `replica_map`: who holds which shard, for any global rank (plain data).
- `groups`: the replica maps of the job and the process groups megatron-core lacks;
  destroyable and rebuildable.
- `optimizer`: megatron-core's partial distributed optimizer as the replica engine, with
  the grad-statistics group and the parameter-state writer fixed for N > 1.
- `transfer`: export, import and copy (digest-checked) of a rank's shard.
- `check`: the replica consistency check (`--tft-check-replicas-interval`).
"""
