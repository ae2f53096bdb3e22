"""The per-process state behind the SDK's functions: the controller this process hosts, its
rank's processor, the registered handlers and what the current incident told this rank.

One `Runtime` per process (`RUNTIME`), as the SDK keeps module-level state. The public
functions of `framework_ttp` and `controller_ttp` are thin wrappers around it; the orders of
the controller reach the handlers through `_actions.SdkActions`.

Where the controller runs: under `tft-run` (or torchrun with the usage guide's import) the
launcher of node 0 hosts it and every worker has `TFT_CONTROLLER_IN_LAUNCHER=1`: then
`tft_init_controller` / `tft_start_controller` of rank 0 only note that, and the processors
connect to the launcher's address and port (`TTP_ADDR` / `PROCESSOR_ADDR`, `TTP_PORT`).
Otherwise rank 0's process hosts it, bound where MindSpeed-LLM asks (`CONTROLLER_ADDR` /
`TTP_ADDR` and port 8000 in MindSpeed-LLM 2.3.0), with the features the calls give:
worker reboot (`enable_arf`), UCE repair (`enable_uce` of the processor in the same
process), repairs from the checkpoint when a replica layout has `replica_cnt` 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from mindspeed_tft.arguments import launched_by_tft
from mindspeed_tft.control import ControlConfig, Controller, Features, Processor, ProcessorError
from mindspeed_tft.control.processor.termination import Termination
from mindspeed_tft.control.wire.config import ControlConfigError, parse_ip, parse_port

from ._enums import FRAMEWORKS
from ._faults import FaultTable
from ._translate import replica_layout

log = logging.getLogger("mindio_ttp")

MAX_WORLD_SIZE = 100000


def mindcluster_task() -> bool:
    """``MINDX_TASK_ID`` is set: MindSpeed-LLM leaves the controller to MindCluster."""
    return os.environ.get("MINDX_TASK_ID") is not None


class Handlers:
    """The registered handlers: name -> (function, ctx)."""

    NAMES = ("save_ckpt", "rename", "exit", "stop", "clean", "repair", "rollback",
             "rebuild_group", "stream_sync", "zit_upgrade_rollback", "zit_upgrade_repair",
             "zit_upgrade_rebuild", "zit_downgrade_rebuild")

    def __init__(self) -> None:
        self._fns: dict[str, tuple[Callable[..., Any], Any]] = {}

    def register(self, name: str, func: Callable[..., Any], ctx: Any = None) -> None:
        if name not in self.NAMES:
            raise ValueError(f"unknown handler {name!r} (allowed: {', '.join(self.NAMES)})")
        if not callable(func):
            raise TypeError(f"tft_register_{name}_handler: func must be a callable, not "
                            f"{type(func).__name__}")
        self._fns[name] = (func, ctx)

    def get(self, name: str) -> tuple[Callable[..., Any], Any] | None:
        return self._fns.get(name)


class Runtime:
    """See the module docstring."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.handlers = Handlers()
        self.enable_uce = True
        self.enable_arf = False
        self.faults = FaultTable(lambda: self.enable_uce)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.device: Any = None
        self.controller_init: tuple[int, int, bool, bool] | None = None
        self.controller: Controller | None = None
        self.processor: Processor | None = None
        self.termination: Termination | None = None
        self.export_version: str | None = None
        #: what the handlers get as `train_args` (the decorator's arguments, a list)
        self.args: Any = None
        #: optimizer layout name -> its data-parallel ranks (`tft_set_optimizer_replica`)
        self.groups: dict[str, list[int]] = {}
        self.dp_ranks: list[int] | None = None
        self.reboot_answered = False
        # what the current incident told this rank (the order threads write it)
        self.repair_type = "unknow"
        self.repair_step = 0
        #: this rank's device reported a UCE since its last clean (`is_uce_error`)
        self.uce_reported = False
        #: ... since its last repair (a receiver's repair type, RT_UCE_HIGHLEVEL)
        self.uce_damaged = False
        self.cleaned = False
        self.loaded_step: int | None = None
        self.decryptor: Callable[..., Any] | None = None

    # -- controller -------------------------------------------------------------------------
    def init_controller(self, rank: int, world_size: int, enable_local_copy: bool,
                        enable_arf: bool, enable_zit: bool) -> None:
        _check_world(rank, world_size, "init controller")
        if enable_local_copy:
            raise ValueError("init controller failed: enable_local_copy=True (a local copy of "
                             "the optimizer state) is not supported; pass False")
        self.controller_init = (rank, world_size, bool(enable_arf), bool(enable_zit))

    def start_controller(self, bind_ip: str, port: int) -> None:
        if launched_by_tft(os.environ):
            log.info("the launcher hosts the controller: tft_start_controller has nothing to "
                     "start")
            return
        if self.controller_init is None:
            raise RuntimeError("tft_start_controller before tft_init_controller")
        if self.controller is not None:
            raise RuntimeError("the controller of this process is already started")
        _, world_size, arf, zit = self.controller_init
        if zit:
            log.warning("enable_zit: elastic training by MindCluster's strategies is not "
                        "available here; a lost rank without a replacement ends the job with "
                        "a dump (mindspeed-tft's own elastic training: --enable-elastic-training "
                        "in its hosts)")
        config = ControlConfig.from_env(
            controller_addr=_address(bind_ip, "tft_start_controller bind_ip", wildcard=True),
            port=parse_port(port, "tft_start_controller port"))
        features = Features(high_availability=True, hbm_repair=self.enable_uce,
                            worker_reboot=arf, source="mindio_ttp")
        controller = Controller(world_size, config, features=features)
        controller.start()
        self.controller = controller

    def update_features(self, **changes: Any) -> None:
        """Features learnt from later calls, for the controller this process hosts."""
        controller = self.controller
        if controller is None:
            return
        features = dataclasses.replace(controller.features, **changes)
        controller.features = features
        controller.planner.features = features

    def destroy_controller(self) -> None:
        controller, self.controller = self.controller, None
        if controller is not None:
            controller.stop()

    # -- processor --------------------------------------------------------------------------
    def init_processor(self, rank: int, world_size: int, enable_local_copy: bool,
                       enable_tls: bool, enable_uce: bool, enable_arf: bool) -> None:
        _check_world(rank, world_size, "init processor")
        if enable_local_copy:
            raise ValueError("init processor failed: enable_local_copy=True (a local copy of "
                             "the optimizer state) is not supported; pass False")
        if enable_tls:
            log.warning("enable_tls: the SDK's TLS is not used here; the control plane "
                        "authenticates with CURVE keys (TTP_CURVE_*) and the job's token "
                        "(TTP_JOB_TOKEN)")
        self.rank, self.world_size = rank, world_size
        self.enable_uce, self.enable_arf = bool(enable_uce), bool(enable_arf)
        self.device = _current_device()
        self.update_features(hbm_repair=self.enable_uce)
        if "torch" in sys.modules:  # before the framework makes its first process group
            from mindspeed_tft import patches

            patches.install("connection-tracking")
            patches.install("gloo-collectives")

    def start_processor(self, master_ip: str, port: int, actions: Any) -> None:
        if self.rank is None or self.world_size is None:
            raise RuntimeError("tft_start_processor before tft_init_processor")
        if self.processor is not None:
            raise RuntimeError(f"the processor of rank {self.rank} is already started")
        if launched_by_tft(os.environ):
            config = ControlConfig.from_env()  # the launcher's address and port
            if int(port) != config.port:
                log.info("the launcher's controller listens on port %d (TTP_PORT), not %s",
                         config.port, port)
        else:
            config = ControlConfig.from_env(
                processor_addr=_address(master_ip, "tft_start_processor master_ip",
                                        wildcard=False),
                port=parse_port(port, "tft_start_processor port"))
        processor = Processor(self.rank, self.world_size, config)
        actions.register(processor)
        try:
            processor.start()
        except ProcessorError as e:
            if not mindcluster_task() or \
                    launched_by_tft(os.environ):
                raise
            raise ProcessorError(
                f"{e}: MINDX_TASK_ID is set, so MindSpeed-LLM started no controller (it leaves "
                "it to MindCluster); run under tft-run, or torchrun with `import "
                "mindio_ttp.framework_ttp`, whose launcher hosts it") from None
        self.processor = processor
        if threading.current_thread() is threading.main_thread():  # where signals go
            self.termination = Termination(config.lost_after + config.heartbeat_interval + 1.0)
            self.termination.install()

    def is_reboot_node(self) -> bool:
        """True once, in a process restarted into a running job (worker reboot)."""
        processor = self._processor("tft_is_reboot_node")
        if self.reboot_answered:
            return False
        self.reboot_answered = True
        return processor.rejoining

    def set_replica(self, rank: int, replica_info: list[dict[str, Any]]) -> None:
        _check_rank(rank, "set_optimizer_replica")
        layout, groups = replica_layout(rank, replica_info)
        self.groups = groups
        self._processor("tft_set_optimizer_replica").update_replica(layout)
        if any(entry["replica_num"] == 1 for entry in layout.values()):
            self.update_features(no_replica=True)

    def set_dp_group(self, rank: int, dp_ranks: list[int]) -> None:
        _check_rank(rank, "set_dp_group_info")
        if not isinstance(dp_ranks, list) or not all(type(r) is int for r in dp_ranks):
            raise ValueError(f"set_dp_group_info input params invalid, rank:{rank}, "
                             f"dp_rank_list:{dp_ranks!r} (a list of ints)")
        self.dp_ranks = list(dp_ranks)

    def destroy_processor(self) -> None:
        processor, self.processor = self.processor, None
        if processor is not None:
            processor.stop(0)

    def _processor(self, caller: str) -> Processor:
        if self.processor is None:
            raise RuntimeError(f"{caller}: the processor is not started (tft_init_processor, "
                               "tft_start_processor)")
        return self.processor

    # -- the training thread ----------------------------------------------------------------
    def set_export_version(self, framework_type: str) -> None:
        if framework_type not in FRAMEWORKS:
            raise ValueError(f"This framework: {framework_type} is not supported by mindio tft "
                             f"now (allowed: {', '.join(FRAMEWORKS)})")
        self.export_version = framework_type
        os.environ["TTP_STOP_CLEAN_BEFORE_DUMP"] = "1"

    def start_updating(self) -> None:
        processor = self._processor("tft_start_updating_os")
        processor.before_update(processor.step + 1)

    def end_updating(self, step: int) -> None:
        if type(step) is not int or step <= 0:
            raise ValueError(f"tft_end_updating_os: step={step!r} must be a positive int")
        processor = self._processor("tft_end_updating_os")
        processor.report_update_end(step)
        processor.report_progress(step)

    def pause_point(self, step: int) -> None:
        processor = self._processor("tft_pause_train")
        if self.termination is not None:
            self.termination.check(processor)
        processor.hold_point(step + 1)


def _address(value: Any, what: str, *, wildcard: bool) -> str:
    """An IP literal, or a host name resolved to one (as the SDK does); a ControlConfigError
    names the value otherwise."""
    text = str(value)
    try:
        return parse_ip(text, what, allow_wildcard=wildcard)
    except ControlConfigError:
        try:
            resolved = socket.gethostbyname(text)
        except OSError:
            raise ControlConfigError(f"{what}={value!r} is neither an IPv4/IPv6 address nor "
                                     "a host name that resolves") from None
        return parse_ip(resolved, what, allow_wildcard=wildcard)


def _check_rank(rank: Any, what: str) -> None:
    if type(rank) is not int or not 0 <= rank < MAX_WORLD_SIZE:
        raise ValueError(f"{what} failed, rank:{rank!r}: a rank is an int in [0, {MAX_WORLD_SIZE})")


def _check_world(rank: Any, world_size: Any, what: str) -> None:
    if (type(rank) is not int or type(world_size) is not int
            or not 0 <= rank < world_size <= MAX_WORLD_SIZE):
        raise ValueError(f"{what} failed: rank={rank!r}, world_size={world_size!r} (need "
                         f"0 <= rank < world_size <= {MAX_WORLD_SIZE})")


def _current_device() -> Any:
    """What `get_device()` answers: the accelerator this process uses (None on CPU)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return npu.current_device()
    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return None


RUNTIME = Runtime()
