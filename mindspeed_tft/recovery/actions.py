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
- `rename`: stage 3, publish the dump and record `dump_saved`;
- `clean`: nothing left to drop on CPU (the stop already abandoned the collectives);
- `repair`: in the training thread, rebuild every process group with the restarted
  workers (`rebuild.py`), re-point the model and optimizer at the new groups, then copy
  shards from replica holders (`rollback.transfer_shards`) or, without replicas, reload the
  last periodic checkpoint in place;
- `rollback`: in the training thread, every rank back to the lock step (`rollback.py`);
  then let the old process groups go (`groups_released`).
- `scale_in` (elastic training, after a dump): in the training thread, continue in a
  smaller world from the dump (the plugin's `scale_in`). Afterwards this rank's global rank
  in the process groups may differ from its control-plane rank (`members` maps them).
- `scale_out` (elastic training, after a dump): in the training thread, continue in a
  larger world from the dump (the plugin's `scale_out`). A returning rank (no model yet)
  first joins the larger world's process groups, then waits until the trainer has built its
  model (`attach`), then loads the dump like the others (`RecoverableState.rebuild`).

A restarted worker registers before it has a model: its `repair` first joins the new
process groups (the training thread, waiting in `TFTPlugin.join_job`, runs that), then waits
until the trainer has built its model and optimizer (`attach`), then receives its shard.
Dump callbacks run in the processor's action threads (the training thread is parked and
leaves the state alone); repair and rollback run in the training thread itself. Every wait
has a deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mindspeed_tft.control.wire.callbacks import CallbackHost, RecoveryCallbacks
from mindspeed_tft.control.wire.order_types import (
    CleanOrder,
    DumpOrder,
    ExitOrder,
    PauseOrder,
    RenameOrder,
    RepairOrder,
    ResumeOrder,
    RollbackOrder,
    ScaleInOrder,
    ScaleOutOrder,
    StopOrder,
)
from mindspeed_tft.control.wire.results import (
    CleanResult,
    DumpResult,
    RenameResult,
    RepairResult,
    RollbackResult,
    ScaleResult,
    StopResult,
)
from mindspeed_tft.events import emit, emit_work, iteration_log
from mindspeed_tft.recovery import collectives
from mindspeed_tft.recovery.dump import (
    FAILED_SUFFIX,
    SHARDS_DIRNAME,
    DumpError,
    assemble,
    claim,
    discard_position,
    publish,
    shard_path,
    shard_record,
    tmp_dir,
    uses_distributed_optimizer,
    write_shard,
)
from mindspeed_tft.recovery.interface import RecoverableState
from mindspeed_tft.recovery.layout import (
    CheckpointWriteError,
    checkpoint_writes,
    get_rng_state,
    iteration_dir_name,
    model_parallel_dir_name,
    this_rank_dir_name,
)
from mindspeed_tft.recovery.rebuild import release_retired_groups
from mindspeed_tft.recovery.rollback import gather_needed, rollback, transfer_shards
from mindspeed_tft.recovery.snapshot import SnapshotUnavailableError, StepSnapshot, StepSnapshots
from mindspeed_tft.replica.replica_map import ReplicaMap

log = logging.getLogger("mindspeed_tft.recovery")

ASSEMBLE_WAIT_SECONDS = 60.0


class RecoveryActions(RecoveryCallbacks):
    """The processor callbacks of one rank (`callbacks.RecoveryCallbacks`: every method is
    its own, none inherited)."""

    def __init__(
        self,
        rebuild_process_groups: Callable[[int, bool], None],
        snapshots: StepSnapshots,
        replica_map: ReplicaMap,
        rank: int,
        keep_ports: list[int],
        scale_in: Callable[[int, list[int], str], dict[str, Any]] | None = None,
        scale_out: Callable[[int, list[int], int, str, int], dict[str, Any]] | None = None,
    ) -> None:
        self.rebuild_process_groups = rebuild_process_groups
        self.resize = scale_in
        self.grow = scale_out
        #: control-plane ranks of the process-group world in global-rank order (None: the
        #: same numbers)
        self.members: list[int] | None = None
        self.state: RecoverableState | None = None
        self.snapshots = snapshots
        self.map = replica_map
        self.rank = rank
        self.keep_ports = keep_ports
        self.attached = threading.Event()
        self.received_snapshot: StepSnapshot | None = None
        self.loaded_step: int | None = None
        #: the repair copied the complete params of the lock step into this rank
        self.params_restored = False
        #: the incident whose repair ended (rollback done) and whose first step has not
        #: ended yet (`after_step` then closes the repair's work count)
        self._resume_incident: int | None = None
        self._rebuild_seconds: float | None = None
        #: lock step -> the claim this rank made on its dump folder (`dump.claim`)
        self._claims: dict[int, str] = {}
        #: lock step -> the claimant whose dump of it was published before this side's
        self._published_by: dict[int, str] = {}

    def register(self, processor: CallbackHost) -> None:
        """Be `processor`'s recovery callbacks."""
        self.processor = processor
        processor.set_callbacks(self)

    def attach(self, state: RecoverableState) -> None:
        """The trainer's state exists (model, optimizer, data)."""
        self.state = state
        self.attached.set()

    def scale_to(self, members: list[int], replica_map: ReplicaMap) -> None:
        """The job continues in the world of `members` with `replica_map` (global ranks)."""
        self.members = list(members)
        self.map = replica_map

    def global_rank_of(self, rank: int) -> int:
        """The process-group rank of control-plane `rank`."""
        return rank if self.members is None else self.members.index(rank)

    @property
    def global_rank(self) -> int:
        return self.global_rank_of(self.rank)

    def _training_state(self) -> RecoverableState:
        if self.state is None:
            raise RuntimeError(f"rank {self.rank} has no training state yet")
        return self.state

    # -- stop -----------------------------------------------------------------------------
    def stop(self, order: StopOrder) -> StopResult:
        closed = collectives.abandon(
            f"incident {order.incident}: stopped by the controller", self.keep_ports
        )
        self._mark_work("stop", order.incident)
        # the iterations this rank completed; the stop may have cut the logging rank's line off
        return StopResult(connections_closed=closed,
                          iterations=tuple(iteration_log.records()))

    # -- orders the processor carries out itself -------------------------------------------
    def pause(self, order: PauseOrder) -> None:
        """Nothing to do: the processor holds the training thread before its next update."""
        return None

    def resume(self, order: ResumeOrder) -> None:
        """Nothing to do: the rollback already put the state at the step the rank resumes
        from, and the first step after it closes the repair's work count (`after_step`)."""
        return None

    def exit(self, order: ExitOrder) -> None:
        """Nothing to save: the dump, when one is owed, was written by its own orders; the
        processor lets the training thread go and the process ends."""
        return None

    # -- repair ---------------------------------------------------------------------------
    def clean(self, order: CleanOrder) -> CleanResult:
        """Nothing left to drop on CPU: the stop already abandoned the collectives."""
        return CleanResult()

    def repair(self, order: RepairOrder) -> RepairResult:
        generation = order.incident
        rejoining = self.state is None
        run = self.processor.run_in_training_thread
        started = time.perf_counter()
        run(lambda: self.rebuild_process_groups(generation, not rejoining))
        self._rebuild_seconds = time.perf_counter() - started
        if rejoining:
            self._wait_attached()
        try:
            return run(lambda: self._restore(order))
        except BaseException:
            self._release_old_groups(generation)
            raise

    def _release_old_groups(self, incident: int) -> None:
        """Let the past generation's process groups go (`release_retired_groups`) once the
        repair has moved its bytes: at the end of the rollback, or at once when the restore
        failed. Not right after the rebuild: that teardown (every rank closes the
        connections of its ~24 old gloo groups and joins their threads, at once) ran beside
        the shard copy and slowed it (docs/design.md, "The old groups go after the
        transfers")."""
        released = release_retired_groups()
        if released:
            emit("groups_released", self.rank, groups=released, incident=incident)

    def _restore(self, order: RepairOrder) -> RepairResult:
        state = self._training_state()
        lock_step = order.lock_step
        self.received_snapshot = None
        self.loaded_step = None
        self.params_restored = False
        if order.source == "checkpoint":
            root = state.args.save or state.args.load
            if not root:
                raise RuntimeError("no --save or --load directory: no checkpoint to repair from")
            self.loaded_step = state.load_checkpoint(root)
            if self.loaded_step == 0:
                raise RuntimeError(f"no periodic checkpoint under {root} to repair from")
            return RepairResult(step=self.loaded_step)
        self.received_snapshot, got_params = transfer_shards(
            state, self.snapshots, order, self.rank, self.global_rank_of)
        if got_params:  # the complete params of the lock step: nothing to gather for them
            self.snapshots.params_iteration = lock_step
            self.params_restored = True
        return RepairResult(received=len(order.receive), sent=len(order.send))

    def rollback(self, order: RollbackOrder) -> RollbackResult:
        damaged = self.rank in order.params_damaged
        return self.processor.run_in_training_thread(
            lambda: self._rollback(order.step, damaged, order.incident))

    def _rollback(self, step: int, params_damaged: bool = True,
                  incident: int = 0) -> RollbackResult:
        state = self._training_state()
        if self.loaded_step is not None:
            # the checkpoint load restored scheduler, samples and RNG of that iteration
            snapshot = StepSnapshot(step, get_rng_state(), state.opt_param_scheduler.state_dict(),
                                    state.args.consumed_train_samples)
        else:
            try:
                snapshot = self.snapshots.at(step, state.opt_param_scheduler)
            except SnapshotUnavailableError:
                if self.received_snapshot is None or self.received_snapshot.iteration != step:
                    raise
                snapshot = self.received_snapshot
        needed_here = ((params_damaged and not self.params_restored)
                       or self.loaded_step is not None
                       or self.snapshots.params_iteration != step)
        gather = gather_needed(state, needed_here)
        seconds = rollback(state, snapshot, gather, copy=needed_here)
        self.snapshots.params_iteration = step
        emit("rolled_back", self.rank, iteration=step,
             shard=str(self.map.shard_of(self.global_rank)),
             seconds=seconds, params_gathered=gather,
             param_bytes=sum(p.numel() * p.element_size()
                             for chunk in state.model for p in chunk.parameters()),
             lr=state.optimizer.param_groups[0]["lr"],
             consumed_samples=state.args.consumed_train_samples)
        self._release_old_groups(incident)
        self._mark_work("repaired", incident, rebuild_s=_rounded(self._rebuild_seconds))
        self._resume_incident = incident
        # parked now: a record the stop result missed (the update ran on after it) is final
        return RollbackResult(step, tuple(iteration_log.records()))

    # -- work counts ------------------------------------------------------------------------
    def _mark_work(self, mark: str, incident: int, **fields: Any) -> None:
        """A `work` event (`events.emit_work`) with this process's counts now, the group
        connections it opened since the last mark counted first."""
        collectives.count_connections(self.keep_ports)
        emit_work(self.rank, mark, incident=incident, **fields)

    def after_step(self) -> None:
        """The trainer ended a step (the plugin's step hook: one attribute check): the
        first step after a repair closes the repair's work count (`resumed`), with the
        connections that lazily connected groups made in that step."""
        if self._resume_incident is None:
            return
        incident, self._resume_incident = self._resume_incident, None
        self._mark_work("resumed", incident)

    # -- elastic training -----------------------------------------------------------------
    def scale_in(self, order: ScaleInOrder) -> ScaleResult:
        if self.resize is None:
            raise RuntimeError(f"rank {self.rank}: this process cannot scale in")
        resize = self.resize
        root = os.path.dirname(order.path)
        ranks = list(order.ranks)
        result = self.processor.run_in_training_thread(
            lambda: resize(order.incident, ranks, root))
        if result.get("stays"):
            self._check_loaded(result, order.lock_step, root)
        return _scale_result(result)

    def scale_out(self, order: ScaleOutOrder) -> ScaleResult:
        if self.grow is None:
            raise RuntimeError(f"rank {self.rank}: this process cannot scale out")
        grow = self.grow
        root = os.path.dirname(order.path)
        world = list(order.ranks)
        returning = self.state is None
        run = self.processor.run_in_training_thread
        result = run(lambda: grow(order.incident, world, order.dp_size, root, order.lock_step))
        if returning:
            self._wait_attached()
            result["iteration"] = run(lambda: self._training_state().rebuild(root))
        self._check_loaded(result, order.lock_step, root)
        return _scale_result(result)

    def _check_loaded(self, result: dict[str, Any], lock_step: int, root: str) -> None:
        """A scale change loaded the dump of the lock step, not another checkpoint."""
        if result.get("iteration") != lock_step:
            raise RuntimeError(f"rank {self.rank} loaded iteration {result.get('iteration')} "
                               f"from {root}, not the dump's {lock_step}")

    def _wait_attached(self) -> None:
        """A restarted or returning rank: wait (bounded) until its trainer built its model."""
        if not self.attached.wait(self.processor.config.action_time_limit):
            raise RuntimeError(f"rank {self.rank}: the trainer did not set up its model in time")

    # -- dump -----------------------------------------------------------------------------
    def _checkpoint_root(self) -> str:
        root = self._training_state().args.save
        if not root:
            raise DumpError("no --save directory: there is nowhere to write the dump")
        return root

    def dump(self, order: DumpOrder) -> DumpResult:
        try:
            return self._dump(order)
        except CheckpointWriteError as error:  # this rank's write failed: one line says so
            error.report(self.rank)
            raise DumpError(str(error)) from error

    def _dump(self, order: DumpOrder) -> DumpResult:
        lock_step = order.lock_step
        shards = [entry for entry in order.shards if entry.optimizer == "dense"]
        if not shards:
            return DumpResult()
        root = self._checkpoint_root()
        if order.claim:
            other = claim(root, lock_step, order.claim, self.processor.config.action_time_limit)
            self._claims[lock_step] = order.claim
            if other is not None:  # the other side of a partition published this step
                self._published_by[lock_step] = other
                log.warning("rank %d: the dump of iteration %d was published already by %s: "
                            "this side writes nothing", self.rank, lock_step, other)
                return DumpResult()
        state = self._training_state()
        my_shard = self.map.shard_of(self.global_rank)
        written = []
        distributed = uses_distributed_optimizer(state)
        assembler = my_shard.index == 0
        own = None
        for entry in shards:
            if entry.shard != my_shard.index:
                raise DumpError(
                    f"rank {self.rank} holds {my_shard}, not dense shard {entry.shard}"
                )
            if distributed and assembler:  # kept in memory for the assembly below
                own = shard_record(state, lock_step, self.map.chunk_size, my_shard.index)
            elif distributed:
                written.append(
                    write_shard(state, root, lock_step, self.map.chunk_size, my_shard.index)
                )
        result = DumpResult(tuple(written))
        if assembler:
            if distributed:
                self._wait_for_shards(root, lock_step)
            snapshot = self.snapshots.at(lock_step, state.opt_param_scheduler)
            result = DumpResult(tuple(written),
                                assemble(state, root, snapshot, self.map.chunk_size, own))
        emit("dump_written", self.rank, iteration=lock_step, shard=str(my_shard),
             assembled=result.assembled is not None)
        log.info("rank %d: dump of iteration %d written (%s)", self.rank, lock_step, result)
        return result

    def _wait_for_shards(self, root: str, lock_step: int) -> None:
        """Until every other shard of this position is written, or its holder gave up
        (`<file>.failed`: then, once every holder is done, the position's folder goes)."""
        directory = os.path.join(tmp_dir(root, lock_step), this_rank_dir_name(), SHARDS_DIRNAME)
        wanted = [shard_path(directory, i)
                  for i in range(1, self.map.chunk_size)]  # shard 0 is the assembler's own
        deadline = time.monotonic() + ASSEMBLE_WAIT_SECONDS
        while not all(os.path.isfile(p) or os.path.isfile(p + FAILED_SUFFIX) for p in wanted):
            if time.monotonic() > deadline:
                missing = [p for p in wanted if not os.path.isfile(p)]
                raise DumpError(f"shards never written within {ASSEMBLE_WAIT_SECONDS:g}s: {missing}")
            time.sleep(0.05)
        failed = [p for p in wanted if os.path.isfile(p + FAILED_SUFFIX)]
        if failed:
            discard_position(root, lock_step)
            raise DumpError(f"{', '.join(failed)} not written: the holder could not write it "
                            "(its own error says why); nothing was published")

    # -- rename ---------------------------------------------------------------------------
    def rename(self, order: RenameOrder) -> RenameResult:
        lock_step = order.lock_step
        sizes = self._training_state().args.tft_features.parallel
        expected = [model_parallel_dir_name(tp, pp, sizes.pipeline)
                    for tp in range(sizes.tensor) for pp in range(sizes.pipeline)]
        other = self._published_by.get(lock_step)
        if other is not None:
            path = os.path.join(self._checkpoint_root(), iteration_dir_name(lock_step))
            emit("dump_not_published", self.rank, iteration=lock_step, path=path,
                 published_by=other)
            log.warning("rank %d: iteration %d's checkpoint %s was published by %s; not "
                        "publishing it again", self.rank, lock_step, path, other)
            return RenameResult(lock_step, path)
        root = self._checkpoint_root()
        try:  # a failed publish leaves the dump's complete files where they are
            with checkpoint_writes("dump", lock_step, root):
                path = publish(root, lock_step, expected, self._claims.get(lock_step))
        except CheckpointWriteError as error:
            error.report(self.rank)
            raise DumpError(str(error)) from error
        emit("dump_saved", self.rank, iteration=lock_step, path=path)
        log.warning("rank %d: dying-gasp checkpoint of iteration %d published at %s",
                    self.rank, lock_step, path)
        return RenameResult(lock_step, path)


def _scale_result(result: dict[str, Any]) -> ScaleResult:
    """The plugin's answer to a scale change (`TFTPlugin.scale_in`, `scale_out`), typed."""
    return ScaleResult(bool(result["stays"]), int(result["dp_size"]), result.get("iteration"),
                       result.get("replica"), result.get("micro_batches"))


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
