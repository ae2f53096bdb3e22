"""What the controller's orders do to a rank's training state (SPEC 5, 7, 8, 9).

Recovery reaches the host's trainer only through `interface.RecoverableState` and the group
rebuild it is handed as a callable; it never imports the plugin.

Modules:

- `actions`: `RecoveryActions`, the processor's callbacks: what each order does in a rank
- `interface`: `RecoverableState`, the narrow typed view of the host's training state
- `collectives`: pending collectives abandoned in bounded time; the stop points
- `rebuild`: every process group of the job rebuilt in place, on new connections (SPEC 9)
- `rollback`: shard transfers and the rollback of every rank to the lock step
- `snapshot`: `StepSnapshots`, what a rank keeps to restore or dump a recent step
- `memory_fault`: which memory a UCE hit, and injecting one (SPEC 8)
- `dump`: the dying-gasp checkpoint, written from surviving replicas (SPEC 7)
- `layout`: Megatron-LM's checkpoint layout, atomic publishing, weights-only loading
- `manifest`: checksummed checkpoints: a manifest beside Megatron's files
- `group_names`: process-group names that carry the repair's id, as the MindIO SDK's do
"""
