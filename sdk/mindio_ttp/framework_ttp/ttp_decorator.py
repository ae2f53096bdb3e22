"""The processor side of the SDK's API (`mindio_ttp.framework_ttp.ttp_decorator`), and its
exception decorator.

`tft_exception_handler(train)` runs the training function and, as the SDK's decorator does,
turns a `RuntimeError` into a report by its message (`_faults`: `UCE ERROR`, `HBM MULTI BIT
ECC`, `FORCE STOP`, `HCCL OP RETRY FAILED`, ..., and the patterns registered with
`tft_register_exception_handler`), waits for the controller's decision and then either
enters the training function again with the same arguments (a list: the handlers may replace
its items, e.g. the LR scheduler after a checkpoint load) or ends the process with the
decided code (75 after a dying-gasp checkpoint, 1 when nothing could be saved). Any other
exception is reported as an unknown error. A restarted worker's "ARF FINISH" reports nothing:
it waits for the repair that brings it the training state, then trains.

Beyond the SDK's patterns (docs/design.md, "mindio_ttp"): an error raised after the
controller stopped the rank counts as the consequence of that stop (RS_NORMAL, as the SDK's
"FORCE STOP"), UCEs excepted; a message no pattern names is classified as mindspeed-tft does
(gloo's and NCCL's lost-connection errors are communication failures, not unknown ones).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from mindspeed_tft.control import ForceStop
from mindspeed_tft.control.processor.termination import exit_without_teardown
from mindspeed_tft.control.wire import local
from mindspeed_tft.control.wire.classify import FaultKind, classify_error

from .._actions import SdkActions
from .._enums import (
    FRAMEWORKS,
    RET_ERROR,
    RET_OK,
    Action,
    OptimizerType,
    RepairType,
    ReportState,
)
from .._runtime import MAX_WORLD_SIZE, RUNTIME

log = logging.getLogger("mindio_ttp")

TTP_MAX_WORLD_SIZE = MAX_WORLD_SIZE
ACTIONS = SdkActions(RUNTIME)

__all__ = [
    "Action", "OptimizerType", "RepairType", "ReportState", "RET_ERROR", "RET_OK",
    "get_device", "get_mindio_export_version", "set_mindio_export_version",
    "tft_destroy_processor", "tft_end_updating_os", "tft_exception_handler",
    "tft_get_reboot_type", "tft_get_repair_step", "tft_get_repair_type", "tft_init_processor",
    "tft_is_reboot_node", "tft_pause_train", "tft_register_clean_handler",
    "tft_register_decrypt_handler", "tft_register_exception_handler",
    "tft_register_exit_handler", "tft_register_rebuild_group_handler",
    "tft_register_rename_handler", "tft_register_repair_handler",
    "tft_register_rollback_handler", "tft_register_save_ckpt_handler",
    "tft_register_stop_handler", "tft_register_stream_sync_handler",
    "tft_register_zit_downgrade_rebuild_handler", "tft_register_zit_upgrade_rebuild_handler",
    "tft_register_zit_upgrade_repair_handler", "tft_register_zit_upgrade_rollback_handler",
    "tft_report_error", "tft_report_load_ckpt_step", "tft_reset_limit_step",
    "tft_set_dp_group_info", "tft_set_optimizer_replica", "tft_set_step_args",
    "tft_start_copy_os", "tft_start_processor", "tft_start_updating_os",
    "tft_wait_next_action",
]

#: ReportState -> (the kind this control plane knows, the detail the report carries)
_KINDS: dict[ReportState, tuple[FaultKind, dict[str, Any] | None]] = {
    ReportState.RS_NORMAL: (FaultKind.NORMAL, None),
    ReportState.RS_UCE: (FaultKind.UCE, None),
    # corrupted memory or a precision error: every rank reloads the last checkpoint
    ReportState.RS_UCE_CORRUPTED: (FaultKind.UCE, {"source": "checkpoint"}),
    ReportState.RS_RETRY: (FaultKind.UCE, {"source": "checkpoint", "target": "spared"}),
    ReportState.RS_HCCL_FAILED: (FaultKind.COMM, None),
    ReportState.RS_UNKNOWN: (FaultKind.UNKNOWN, None),
}


# -- processor lifecycle -------------------------------------------------------------------------
def tft_init_processor(rank: int, world_size: int, enable_local_copy: bool, enable_tls: bool = True,
                       tls_info: str = "", enable_uce: bool = True, enable_arf: bool = False,
                       enable_zit: bool = False) -> None:
    """Set this rank up (before `tft_start_processor`, before the first process group).

    Args:
        rank: this process's global rank.
        world_size: the number of training ranks.
        enable_local_copy: the SDK's local copy of the optimizer state; refused when true.
        enable_tls: the SDK's TLS switch; this control plane authenticates with CURVE keys
            and a per-job token whatever it says.
        tls_info: ignored (see `enable_tls`).
        enable_uce: repair device memory and communication faults in place.
        enable_arf: restart only failed workers (worker reboot).
        enable_zit: the SDK's zero-interruption training switch.
    """
    RUNTIME.init_processor(rank, world_size, enable_local_copy, enable_tls, enable_uce,
                           enable_arf)


def tft_start_processor(master_ip: str, port: int, local_ip: str = "") -> None:
    """Register with the controller; returns once registered.

    Args:
        master_ip: the controller's address.
        port: the controller's port.
        local_ip: ignored (the connection's own address is used).
    """
    RUNTIME.start_processor(master_ip, port, ACTIONS)


def tft_is_reboot_node() -> bool:
    """Whether this process is a worker restarted into a running job.

    Returns:
        True on the first call after `tft_start_processor` of a restarted worker (call it
        once), else False.
    """
    return RUNTIME.is_reboot_node()


def tft_get_reboot_type() -> str:
    return "arf"


def tft_destroy_processor() -> None:
    """Leave the control plane (training ended)."""
    RUNTIME.destroy_processor()


def tft_set_optimizer_replica(rank: int, replica_info: list[dict[str, Any]]) -> None:
    """Tell the controller this rank's optimizer replicas.

    Args:
        rank: this process's global rank.
        replica_info: one dict per optimizer (the dense one, then the MoE one) with
            ``rank_list``, ``replica_cnt`` and ``replica_shift``.
    """
    RUNTIME.set_replica(rank, replica_info)


def tft_set_dp_group_info(rank: int, dp_rank_list: list[int]) -> None:
    RUNTIME.set_dp_group(rank, dp_rank_list)


def set_mindio_export_version(framework_type: str) -> None:
    """The framework calling the SDK: "MindSpeed" or "MindSpeed-LLM"."""
    RUNTIME.set_export_version(framework_type)


def get_mindio_export_version() -> str | None:
    return RUNTIME.export_version


def get_device() -> int:
    """The index of the device this rank trains on, read at `tft_init_processor` as the SDK
    does (`torch.npu.current_device()`); 0 on CPU, as the SDK answers there."""
    return RUNTIME.device


def tft_set_step_args(args: Any) -> None:
    """The arguments the handlers get (MindSpeed and MindSpeed-LLM: the decorator's own)."""
    if args is None:
        log.warning("set step args input param is None")
        return
    if RUNTIME.export_version in FRAMEWORKS:
        log.warning("MindSpeed or MindSpeed-LLM no need set args")
        return
    RUNTIME.args = args


# -- the training step ---------------------------------------------------------------------------
def tft_start_updating_os(backup_step: int = -1) -> None:
    """The optimizer update starts (a rank held by a pause or a stop waits here first).

    Args:
        backup_step: the SDK's backup step; not used.

    Raises:
        RuntimeError: "FORCE STOP" once the controller stopped this rank.
    """
    RUNTIME.start_updating()


def tft_end_updating_os(step: int) -> None:
    """The optimizer update is done.

    Args:
        step: the iteration the update produced.
    """
    RUNTIME.end_updating(step)


def tft_start_copy_os() -> None:
    raise RuntimeError("notify start to local copy os failed: the local copy of the optimizer "
                       "state (enable_local_copy) is not supported")


def tft_pause_train(cur_step: int) -> None:
    """End of an iteration: a rank the controller paused waits here until it is let go.

    Args:
        cur_step: the iteration that ended (an invalid one is logged and ignored).

    Raises:
        RuntimeError: "FORCE STOP" when the controller stopped this rank.
    """
    if type(cur_step) is not int or cur_step < 0:
        log.error("pause train failed, cur_step: %r invalid!", cur_step)
        return
    RUNTIME.pause_point(cur_step)


def tft_reset_limit_step() -> None:
    """Nothing to reset: a stopped rank behind the lock step catches up by itself."""


def tft_report_load_ckpt_step(step: int) -> None:
    """A repair handler loaded a checkpoint: the rollback goes to its iteration.

    Args:
        step: the checkpoint's iteration.

    Raises:
        ValueError: `step` is not a positive int.
    """
    if type(step) is not int or step <= 0:
        raise ValueError(f"report step failed while load from ckpt: step={step!r} must be a "
                         "positive int")
    RUNTIME.loaded_step = step


def tft_get_repair_step() -> int:
    return RUNTIME.repair_step


def tft_get_repair_type() -> str:
    """In a stop, clean or repair handler: "retry", "recover", "dump" (or "unknow")."""
    return RUNTIME.repair_type


# -- reports and decisions -----------------------------------------------------------------------
def _state(error_type: Any) -> ReportState:
    if isinstance(error_type, ReportState):
        return error_type
    try:
        return ReportState(error_type)
    except ValueError:
        raise ValueError(f"report status: {error_type!r} is not a ReportState value (allowed: "
                         f"{', '.join(f'{s.name}={s.value}' for s in ReportState)})") from None


def _report(state: ReportState, message: str) -> None:
    """Tell the controller (nothing for the states that are no fault report)."""
    if state not in _KINDS:
        return
    kind, detail = _KINDS[state]
    processor = RUNTIME._processor("tft_report_error")
    if state in (ReportState.RS_UCE, ReportState.RS_UCE_CORRUPTED):  # the device's memory
        RUNTIME.uce_reported = RUNTIME.uce_damaged = True
    processor.report_error(kind, message[:4000], detail)


def tft_report_error(error_type: ReportState | int, error_code: str = "") -> None:
    """Report an error of this rank to the controller.

    As in the SDK, an unknown error (``RS_UNKNOWN``) waits here until the controller
    decides; the process then ends with the decided code.

    Args:
        error_type: a `ReportState` or its value.
        error_code: text sent with the report.

    Raises:
        ValueError: `error_type` is no `ReportState` value.
    """
    state = _state(error_type)
    _report(state, f"{state.name} {error_code}".strip())
    if state is ReportState.RS_UNKNOWN:
        _leave_or_resume(RUNTIME._processor("tft_report_error").wait_decision())


def tft_wait_next_action() -> int:
    """After a report: wait for the controller's decision.

    Returns:
        ``Action.RETRY`` (train again) or ``Action.EXIT`` (the process is being ended).
    """
    decision = RUNTIME._processor("tft_wait_next_action").wait_decision()
    return Action.RETRY.value if decision.action == "resume" else Action.EXIT.value


def _leave_or_resume(decision: Any) -> None:
    if decision.action == "resume":
        return
    processor = RUNTIME.processor
    print(f"[mindio_ttp] rank {RUNTIME.rank} exits with code {decision.code}: "
          f"{decision.reason}", flush=True)
    if processor is not None:
        processor.close()
    local.wait_local_controllers(10.0)  # a controller in this process sends its last orders
    exit_without_teardown(decision.code)


# -- handler registration ------------------------------------------------------------------------
def _registrar(name: str) -> Callable[..., None]:
    def register(func: Callable[..., Any], ctx: Any = None) -> None:
        RUNTIME.handlers.register(name, func, ctx)

    register.__name__ = register.__qualname__ = f"tft_register_{name}_handler"
    register.__doc__ = (f"Register the {name.replace('_', ' ')} handler.\n\n"
                        "Args:\n    func: the handler, called with the SDK's arguments.\n"
                        "    ctx: passed to the handler as its context.\n")
    return register


tft_register_save_ckpt_handler = _registrar("save_ckpt")
tft_register_rename_handler = _registrar("rename")
tft_register_exit_handler = _registrar("exit")
tft_register_stop_handler = _registrar("stop")
tft_register_clean_handler = _registrar("clean")
tft_register_repair_handler = _registrar("repair")
tft_register_rollback_handler = _registrar("rollback")
tft_register_rebuild_group_handler = _registrar("rebuild_group")
tft_register_stream_sync_handler = _registrar("stream_sync")
tft_register_zit_upgrade_rollback_handler = _registrar("zit_upgrade_rollback")
tft_register_zit_upgrade_repair_handler = _registrar("zit_upgrade_repair")
tft_register_zit_upgrade_rebuild_handler = _registrar("zit_upgrade_rebuild")
tft_register_zit_downgrade_rebuild_handler = _registrar("zit_downgrade_rebuild")


def tft_register_exception_handler(fault_pattern: str, fault_type: str,
                                   fault_handle: Callable[[str], str]) -> None:
    """Register a fault pattern of the training function's errors.

    Args:
        fault_pattern: a text the error message contains.
        fault_type: the `ReportState` name its key reports.
        fault_handle: maps a message to that key.
    """
    RUNTIME.faults.register(fault_pattern, fault_type, fault_handle)


def tft_register_decrypt_handler(decryptor: Callable[..., Any] | None) -> None:
    """Kept for the SDK's TLS private keys; this control plane uses CURVE keys instead."""
    if decryptor is not None and not callable(decryptor):
        raise TypeError("tft_register_decrypt_handler: func must be a callable")
    RUNTIME.decryptor = decryptor


# -- the exception decorator ---------------------------------------------------------------------
def _classify(error: BaseException) -> tuple[str, ReportState]:
    """(key, state) of an exception of the training function (module docstring)."""
    processor = RUNTIME.processor
    stopped = processor is not None and processor.stopped
    if not isinstance(error, RuntimeError):
        return "OTHER", ReportState.RS_NORMAL if stopped else ReportState.RS_UNKNOWN
    key, state = RUNTIME.faults.classify(str(error))
    if key == "OTHER":
        kind = classify_error(error)
        state = {FaultKind.COMM: ReportState.RS_HCCL_FAILED,
                 FaultKind.NORMAL: ReportState.RS_NORMAL}.get(kind, ReportState.RS_UNKNOWN)
        if isinstance(error, ForceStop):
            key = "FORCE STOP"
    if stopped and state not in (ReportState.RS_UCE, ReportState.RS_UCE_CORRUPTED):
        state = ReportState.RS_NORMAL
    return key, state


def _report_error(error: BaseException) -> None:
    """Report an exception of the training function (in its except clause)."""
    processor = RUNTIME._processor("tft_exception_handler")
    key, state = _classify(error)
    if key == "ARF FINISH" and processor.rejoining:
        log.info("rank %s restarted into the job: waiting for the repair", RUNTIME.rank)
        return
    if key == "ARF FINISH" or state in (ReportState.RS_STEP_FINISH,
                                        ReportState.RS_PREREPAIR_FINISH,
                                        ReportState.RS_INIT_FINISH):
        state = ReportState.RS_NORMAL
    level = logging.INFO if state is ReportState.RS_NORMAL else logging.ERROR
    log.log(level, "rank %s: training raised %s (%s, %s): %s", RUNTIME.rank,
            type(error).__name__, key, state.name, error)
    _report(state, f"{type(error).__name__}: {error}")


def _await_decision() -> None:
    """Wait for the controller's decision: a resume returns, an exit ends the process (the
    training function's frames are gone by then: nothing of its step is held)."""
    decision = RUNTIME._processor("tft_exception_handler").wait_decision()
    if decision.action == "resume":
        log.info("rank %s trains again from step %s (%s)", RUNTIME.rank, decision.step,
                 decision.strategy)
    _leave_or_resume(decision)


def _training_ended() -> None:
    """The SDK's destroy after a training function that returned: the processor leaves
    (rank 0's waits until every rank did) and the controller of this process stops."""
    RUNTIME.destroy_processor()
    RUNTIME.destroy_controller()


def tft_exception_handler(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function: its errors are reported and it runs again after a
    repair (see the module docstring).

    Args:
        func: the training function.

    Returns:
        The decorated function; an exit decided by the controller ends the process instead
        of returning.

    Raises:
        TypeError: `func` is not callable.
    """
    if not callable(func):
        raise TypeError("tft_exception_handler: func must be a callable")

    @functools.wraps(func)
    def wrapper(*given: Any, **kwargs: Any) -> Any:
        # the SDK's: without a framework version, handlers get a list they may change
        args: Sequence[Any] = given if RUNTIME.export_version in FRAMEWORKS else list(given)
        RUNTIME.args = args
        processor = RUNTIME._processor("tft_exception_handler")
        while True:
            processor.mark_training(True)
            try:
                result = func(*args, **kwargs)
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as error:
                _report_error(error)
            else:
                processor.mark_training(False)
                _training_ended()
                return result
            processor.mark_training(False)
            _await_decision()

    return wrapper
