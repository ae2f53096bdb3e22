"""What the controller's actions do in a training process (SPEC 5): the processor callbacks.

`RecoveryActions` holds the training state and what the plugin knows about it (replica map,
step snapshots) and implements the callbacks the processor runs when the controller orders
an action:

- `stop`: abandon pending collectives (`collectives.abandon`), so a training thread stuck
  in one raises and parks in the fault handler, and so do its peers (the processor has
  already held the rank before its next update, SPEC 3);
- `dump`: stages 1 and 2 of the dying-gasp checkpoint (see `dump.py`): write the shards
  this rank was chosen for; if it was chosen for shard 0 of its model-parallel position,
  assemble that position's checkpoint once every shard file is there;
- `rename`: stage 3, publish the dump and record `dump_saved`.

Callbacks run in the processor's action threads while the training thread is parked in the
fault handler, so they own the training state. Every wait has a deadline.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from mindspeed_tft.events import emit
from mindspeed_tft.recovery import collectives
from mindspeed_tft.recovery.dump import (
    SHARDS_DIRNAME,
    DumpError,
    assemble,
    publish,
    tmp_dir,
    uses_distributed_optimizer,
    write_shard,
)
from mindspeed_tft.recovery.snapshot import StepSnapshots
from mindspeed_tft.replica.replica_map import ReplicaMap
from mindspeed_tft.training.checkpointing import model_parallel_dir_name, this_rank_dir_name
from mindspeed_tft.training.state import TrainingState

log = logging.getLogger("mindspeed_tft.recovery")

ASSEMBLE_WAIT_SECONDS = 60.0


class RecoveryActions:
    """The processor callbacks of one rank."""

    def __init__(
        self,
        state: TrainingState,
        snapshots: StepSnapshots,
        replica_map: ReplicaMap,
        rank: int,
        keep_ports: list[int],
    ) -> None:
        self.state = state
        self.snapshots = snapshots
        self.map = replica_map
        self.rank = rank
        self.keep_ports = keep_ports

    def register(self, processor: Any) -> None:
        """Register every callback this class implements with `processor`."""
        for name in ("stop", "dump", "rename"):
            processor.register_callback(name, getattr(self, name))

    # -- stop -----------------------------------------------------------------------------
    def stop(self, payload: dict[str, Any]) -> dict[str, Any]:
        closed = collectives.abandon(
            f"incident {payload.get('incident')}: stopped by the controller", self.keep_ports
        )
        return {"connections_closed": closed}

    # -- dump -----------------------------------------------------------------------------
    def _checkpoint_root(self) -> str:
        root = self.state.args.save
        if not root:
            raise DumpError("no --save directory: there is nowhere to write the dump")
        return root

    def dump(self, payload: dict[str, Any]) -> dict[str, Any]:
        lock_step = int(payload["lock_step"])
        shards = [entry for entry in payload.get("shards", []) if entry["optimizer"] == "dense"]
        if not shards:
            return {"written": []}
        root = self._checkpoint_root()
        my_shard = self.map.shard_of(self.rank)
        written = []
        distributed = uses_distributed_optimizer(self.state)
        for entry in shards:
            if int(entry["shard"]) != my_shard.index:
                raise DumpError(
                    f"rank {self.rank} holds {my_shard}, not dense shard {entry['shard']}"
                )
            if distributed:
                written.append(
                    write_shard(self.state, root, lock_step, self.map.chunk_size, my_shard.index)
                )
        result: dict[str, Any] = {"written": written}
        if my_shard.index == 0:
            if distributed:
                self._wait_for_shards(root, lock_step)
            snapshot = self.snapshots.at(lock_step, self.state.opt_param_scheduler)
            result["assembled"] = assemble(self.state, root, snapshot, self.map.chunk_size)
        emit("dump_written", self.rank, iteration=lock_step, shard=str(my_shard),
             assembled="assembled" in result)
        log.info("rank %d: dump of iteration %d written (%s)", self.rank, lock_step, result)
        return result

    def _wait_for_shards(self, root: str, lock_step: int) -> None:
        directory = os.path.join(tmp_dir(root, lock_step), this_rank_dir_name(), SHARDS_DIRNAME)
        wanted = [os.path.join(directory, f"shard_{i:03d}.pt") for i in range(self.map.chunk_size)]
        deadline = time.monotonic() + ASSEMBLE_WAIT_SECONDS
        while not all(os.path.isfile(path) for path in wanted):
            if time.monotonic() > deadline:
                missing = [p for p in wanted if not os.path.isfile(p)]
                raise DumpError(f"shards never written within {ASSEMBLE_WAIT_SECONDS:g}s: {missing}")
            time.sleep(0.05)

    # -- rename ---------------------------------------------------------------------------
    def rename(self, payload: dict[str, Any]) -> dict[str, Any]:
        lock_step = int(payload["lock_step"])
        args = self.state.args
        expected = [
            model_parallel_dir_name(tp, pp, args.pipeline_model_parallel_size)
            for tp in range(args.tensor_model_parallel_size)
            for pp in range(args.pipeline_model_parallel_size)
        ]
        path = publish(self._checkpoint_root(), lock_step, expected)
        emit("dump_saved", self.rank, iteration=lock_step, path=path)
        log.warning("rank %d: dying-gasp checkpoint of iteration %d published at %s",
                    self.rank, lock_step, path)
        return {"path": path, "iteration": lock_step}
