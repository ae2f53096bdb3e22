"""Optimizer replicas: N copies of every distributed-optimizer shard (SPEC 2, 3).

Modules:

- `replica_map`: who holds which shard, for any global rank (plain data)
- `groups`: the job's replica maps and the process groups megatron-core lacks; rebuildable
- `optimizer`: megatron-core's partial distributed optimizer as the engine, fixed for N > 1
- `transfer`: export, import and digest-checked copy of a rank's shard
- `check`: the replica consistency check (`--tft-check-replicas-interval`)
"""
