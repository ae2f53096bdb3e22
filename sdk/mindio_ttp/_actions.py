"""The controller's orders, as calls of the handlers a framework registered with the SDK.

mindspeed-tft's controller orders (docs/design.md, section 5) `hold`, `stop`, `clean`,
`repair`, `rollback`, `resume` for a repair and `dump`, `rename`, `exit` for a dying-gasp
checkpoint. `SdkActions` registers a processor callback for each that calls the SDK-shaped
handler, with the SDK's arguments and return-code conventions:

| order | handler call (the SDK's signature) |
| --- | --- |
| pause | once the training thread waits in `tft_pause_train` (bounded): `stream_sync()` |
| stop | `stop(train_args, ctx)` |
| clean | `clean(is_uce_error, train_args, ctx)` -> 0 ok, 2 (UCE, nothing to rebuild: no repair for this rank), else the clean failed (the job falls back to a dump) |
| repair | worker reboot: `rebuild_group(fault_ranks, train_args, ctx)` on every rank (a restarted one once its training function waits in the decorator); then, on each rank that sends or receives, `repair(step, need_rebuild, error_ranks, repair_info, train_args, ctx)` (`_translate.repair_calls`) |
| rollback | `rollback(step, train_args, ctx)`; the rank's data is then Updated at `step` |
| dump | on the ranks that write: `clean(...)` first when `TTP_STOP_CLEAN_BEFORE_DUMP=1` (MindSpeed-LLM sets it) and this incident had no clean, then `save_ckpt(step, save_info, train_args, ctx)` |
| rename | the manifest of the dump in `<save>/iter_X_tmp` (`_dump_manifest`), then `rename(step, train_args)` (the PyTorch path's arguments) |
| exit | `exit(ctx)`, then the process exits with the decided code |
| scale_in (elastic training) | `clean(...)` where this incident had none; on the ranks that stay `zit_downgrade_rebuild(new_dp_ranks, new_world_ranks, train_args, zit_param)` (`_zit`) |
| scale_out (elastic training) | on every rank `zit_upgrade_rebuild(rank_list, train_args, zit_param)`, `zit_upgrade_repair(...)` on senders and returning ranks, `zit_upgrade_rollback(step, train_args, zit_param)`; the data is then Updated at the lock step |

A handler that raises fails the order (the controller then falls back to a dump, or exits).
The handlers run on the processor's order threads while the training thread waits in the
exception decorator, as the SDK runs them on its processor's threads.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mindspeed_tft.control import Processor
from mindspeed_tft.control.wire.callbacks import RecoveryCallbacks
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
from mindspeed_tft.recovery import group_names

from ._enums import RET_NO_REBUILD, RET_OK
from ._runtime import Runtime
from ._translate import repair_calls, repair_type_name, save_info
from ._zit import DOWNGRADE_PARAM, UPGRADE_PARAM, DpLayout, Shards, downgrade, upgrade_repairs

log = logging.getLogger("mindio_ttp")


class HandlerError(RuntimeError):
    """A handler returned what the SDK counts as a failure."""


class SdkActions(RecoveryCallbacks):
    """The processor callbacks of one process (`callbacks.RecoveryCallbacks`, every method
    its own; see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.processor: Processor | None = None
        #: elastic training: the launch DP layout and optimizer shards
        self.launch: DpLayout | None = None
        self.shards: Shards | None = None

    def register(self, processor: Processor) -> None:
        """Be `processor`'s recovery callbacks."""
        self.processor = processor
        processor.set_callbacks(self)

    def _call(self, name: str, *args: Any) -> Any:
        """Call handler `name` with `args` (its ctx appended unless the SDK passes none)."""
        entry = self.rt.handlers.get(name)
        if entry is None:
            return None
        func, ctx = entry
        return func(*args) if name == "rename" else func(*args, ctx)

    def _call_bare(self, name: str) -> Any:
        """Call handler `name` with no arguments (the SDK passes the stream sync none)."""
        entry = self.rt.handlers.get(name)
        return None if entry is None else entry[0]()

    def _has(self, name: str) -> bool:
        return self.rt.handlers.get(name) is not None

    # -- orders -------------------------------------------------------------------------
    def pause(self, order: PauseOrder) -> None:
        """The SDK's pause callback: once the training thread is held at its next hold point
        (`tft_pause_train`; bounded wait), the stream-sync handler runs on this thread, as
        the SDK calls it at the end of its pause callback (also when that wait timed out)."""
        assert self.processor is not None
        held = self.processor.wait_held()
        if not held:
            log.warning("rank %s: the training thread did not reach a hold point of the pause; "
                        "syncing the stream anyway, as the SDK does", self.rt.rank)
        self._call_bare("stream_sync")

    def stop(self, order: StopOrder) -> StopResult:
        rt = self.rt
        rt.cleaned = False
        rt.repair_step = order.lock_step
        group_names.set_repair_id(order.incident)  # the groups made from now on carry it
        if not self._has("stop"):
            raise HandlerError("no stop handler registered (tft_register_stop_handler)")
        self._call("stop", rt.args)
        return StopResult()

    def clean(self, order: CleanOrder) -> CleanResult:
        rt = self.rt
        rt.repair_type = repair_type_name(order.strategy)
        rt.repair_step = order.lock_step or rt.repair_step
        return self._clean()

    def _clean(self) -> CleanResult:
        rt = self.rt
        uce = rt.uce_reported
        if not self._has("clean"):
            raise HandlerError("no clean handler registered (tft_register_clean_handler)")
        ret = self._call("clean", uce, rt.args)
        rt.uce_reported = False
        rt.cleaned = True
        if ret == RET_NO_REBUILD and uce:
            # the UCE spared what a repair would copy: no repair for this rank
            return CleanResult(spared=True)
        if ret not in (RET_OK, RET_NO_REBUILD, None):
            raise HandlerError(f"the clean handler returned {ret!r} (0: ok, 2: a UCE with "
                               "nothing to rebuild)")
        return CleanResult()

    def repair(self, order: RepairOrder) -> RepairResult:
        rt, processor = self.rt, self.processor
        assert processor is not None and rt.rank is not None and rt.world_size is not None
        rt.repair_type = repair_type_name(order.strategy)
        rt.repair_step = order.lock_step
        rt.loaded_step = None
        group_names.set_repair_id(order.incident)  # also in a restarted worker (no stop)
        if order.strategy == "recover":
            if processor.rejoining:
                # the SDK rebuilds a restarted worker's groups once it is ready (its training
                # function raised "ARF FINISH" and waits in the decorator)
                processor.run_in_training_thread(lambda: None)
            self._call("rebuild_group", list(order.new_ranks), rt.args)
        for call in repair_calls(order, rt.rank, rt.world_size, rt.uce_damaged,
                                 list(rt.groups)):
            self._call("repair", call.step, call.need_rebuild, call.error_ranks,
                       call.repair_info, rt.args)
        rt.uce_damaged = False
        return RepairResult(step=rt.loaded_step)

    def rollback(self, order: RollbackOrder) -> RollbackResult:
        step = order.step
        self.rt.repair_step = step
        self._call("rollback", step, self.rt.args)
        assert self.processor is not None
        # the data is Updated at `step` now (the SDK's notify-normal sets the same), also in
        # a restarted worker that has made no update of its own yet
        self.processor.report_update_end(step)
        return RollbackResult(step)

    def dump(self, order: DumpOrder) -> DumpResult:
        rt = self.rt
        rt.repair_type = "dump"
        step = order.lock_step
        rt.repair_step = step
        if not order.shards:
            return DumpResult()
        if not self._has("save_ckpt"):
            raise HandlerError("no save handler registered (tft_register_save_ckpt_handler)")
        if os.environ.get("TTP_STOP_CLEAN_BEFORE_DUMP") == "1" and not rt.cleaned:
            self._clean()
        assert rt.rank is not None
        info = save_info(order, rt.rank, rt.groups)
        self._call("save_ckpt", step, info, rt.args)
        return DumpResult(tuple(tuple(entry["ranks"]) for entry in info))

    def rename(self, order: RenameOrder) -> RenameResult:
        step = order.lock_step
        # every writer's save handler returned: the manifest goes with the files it covers
        # (imported here: its checksums import torch, which a process without a dump, such as
        # the SDK's own example, never needs)
        from ._dump_manifest import write_before_rename

        write_before_rename(step, self.rt.rank)
        self._call("rename", step, self.rt.args)
        # where the dump is, for the controller (a shrink or grow follows a renamed dump): the
        # SDK's handlers know the folder, the SDK does not
        return RenameResult(step, f"the rename handler's checkpoint of step {step}")

    def resume(self, order: ResumeOrder) -> None:
        """Nothing to call: the SDK has no resume handler (its rollback handler already put
        the state at the step; the processor lets the training thread train on)."""
        return None

    def exit(self, order: ExitOrder) -> None:
        try:
            self._call("exit")
        except Exception:  # the exit goes on
            log.exception("rank %s: the exit handler failed", self.rt.rank)

    # -- elastic training: the ZIT handlers (see `_zit`) ---------------------------------
    def _zit(self, name: str, *args: Any, param: str) -> None:
        """Call ZIT handler `name` with `args`, the train args and the strategy parameters
        (the SDK passes its `zit_param` where other handlers get their ctx)."""
        entry = self.rt.handlers.get(name)
        if entry is None:
            raise HandlerError(f"no {name} handler registered (tft_register_{name}_handler): "
                               "elastic training needs it")
        entry[0](*args, self.rt.args, param)

    def _layout(self) -> DpLayout:
        """The launch DP layout (this rank's first DP group) and shards (`self.shards`)."""
        if self.launch is None:
            assert self.processor is not None
            self.launch = DpLayout(self.rt.groups.get("dense") or self.rt.dp_ranks or [])
            self.shards = Shards(self.rt.groups, self.processor.replica or {})
        return self.launch

    def _enter_world(self, world: list[int]) -> dict[str, Any]:
        """This rank's replica layout in `world` (the launch shards and their holders in
        it), registered and returned for the controller."""
        rt, processor, shards = self.rt, self.processor, self.shards
        assert rt.rank is not None and processor is not None and shards is not None
        layout, rt.groups = shards.layout_in(rt.rank, world)
        processor.update_replica(layout)
        return dict(layout)

    def scale_in(self, order: ScaleInOrder) -> ScaleResult:
        """The job shrinks without the lost ranks' DP replicas: the SDK's downgrade. Every
        rank is cleaned first (the SDK's stop and clean before it); every rank the order
        names stays, calls `zit_downgrade_rebuild` and trains on from memory at the lock
        step. A world without a holder of some shard is refused before the handler runs."""
        rt = self.rt
        assert rt.rank is not None and rt.rank in order.ranks
        group_names.set_repair_id(order.incident)
        layout = self._layout()
        if not rt.cleaned:
            self._clean()
        world, dp_size = downgrade(list(order.ranks), layout)
        replica = self._enter_world(world)
        self._zit("zit_downgrade_rebuild", layout.dp_group(rt.rank, world), list(world),
                  param=DOWNGRADE_PARAM)
        return ScaleResult(True, dp_size, order.lock_step, replica, layout.size)

    def scale_out(self, order: ScaleOutOrder) -> ScaleResult:
        """The job grows by returning ranks: the SDK's upgrade (rebuild on every rank, the
        training state copied to each returning rank, rollback to the lock step)."""
        rt, processor = self.rt, self.processor
        assert rt.rank is not None and processor is not None
        step = order.lock_step
        world = list(order.ranks)
        joining = list(order.joining)
        group_names.set_repair_id(order.incident)
        rt.repair_step = step
        if processor.rejoining and rt.rank in joining:
            # as in a worker reboot: once its training function raised "ARF FINISH" and
            # waits in the decorator (its train args are known then)
            processor.run_in_training_thread(lambda: None)
        layout = self._layout()
        self._zit("zit_upgrade_rebuild", list(joining), param=UPGRADE_PARAM)
        assert self.shards is not None
        for call in upgrade_repairs(rt.rank, world, joining, step, layout, self.shards):
            self._zit("zit_upgrade_repair", call.step, call.need_rebuild, call.error_ranks,
                      call.repair_info, param=UPGRADE_PARAM)
        self._zit("zit_upgrade_rollback", step, param=UPGRADE_PARAM)
        processor.report_update_end(step)  # Updated at `step`, as after a rollback
        replica = self._enter_world(world)
        return ScaleResult(True, order.dp_size, step, replica)
