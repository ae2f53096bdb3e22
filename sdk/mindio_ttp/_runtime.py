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
`TTP_ADDR` and port 8000 in MindSpeed-LLM 2.3.0), or a process of its own does
(`tft_init_controller(-1, world_size, False)`, as a cluster manager or the SDK's
example_proc.py runs it), with the features the calls give: worker reboot (`enable_arf`),
UCE repair (`enable_uce` of the processor in the same process), repairs from the
checkpoint when a replica layout has `replica_cnt` 1. Without `TTP_JOB_TOKEN` and CURVE
keys, the controller makes the job's token and hands it to the ranks of this host
(`_token`): a REGISTER without it is refused. A processor refused with a token it read from
the file, which now holds another (it read an earlier job's, before this job's controller
replaced it), says so in one line and registers again with the new one, within
`TTP_REGISTER_TIMEOUT`.

Refusals follow the SDK's (run side by side in tests/test_sdk_compat.py): its words first,
then what is allowed; where the SDK ends the process with code 2 (`tft_init_processor`
out of range, `tft_start_controller` on a wildcard address or a port below 1024), so does
this one (SystemExit(2)), without the SDK's 10 s wait.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from mindspeed_tft.arguments import launched_by_tft
from mindspeed_tft.control import ControlConfig, Controller, Features, Processor, ProcessorError
from mindspeed_tft.control.processor.termination import Termination
from mindspeed_tft.control.wire.config import ControlConfigError, parse_ip, parse_port
from mindspeed_tft.process_exit import at_exit

from . import _token
from ._enums import FRAMEWORKS
from ._faults import FaultTable
from ._translate import replica_layout

log = logging.getLogger("mindio_ttp")

MAX_WORLD_SIZE = 100000
#: the lowest port the SDK's controller binds (its PortInfo)
MIN_PORT = 1024


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
        self.device = 0
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
        #: the job token file the controller of this process published (`_token`)
        self.token_file: Path | None = None

    # -- controller -------------------------------------------------------------------------
    def init_controller(self, rank: int, world_size: int, enable_local_copy: bool,
                        enable_arf: bool, enable_zit: bool) -> None:
        """The SDK's checks: rank -1 is a controller in a process of its own (a cluster
        manager's, or example_proc.py's `controller` role), 0 <= rank a rank's."""
        _check_ints("init_controller", rank, world_size)
        if not -1 <= rank < world_size <= MAX_WORLD_SIZE or world_size <= 0:
            raise ValueError(f"init controller failed, error num:1 (rank={rank}, world_size="
                             f"{world_size}: need -1 <= rank < world_size <= {MAX_WORLD_SIZE};"
                             " -1 is a controller outside every rank)")
        if enable_local_copy:
            raise ValueError("init controller failed, error num:1 (enable_local_copy=True, a "
                             "local copy of the optimizer state, is not supported; pass False)")
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
        ip = _controller_ip(bind_ip)
        if not MIN_PORT <= _int_or_none(port, MIN_PORT - 1) <= 65535:
            _exit_refused("start controller failed, error:1",
                          f"port={port!r}: need an int in [{MIN_PORT}, 65535]")
        try:
            config = ControlConfig.from_env(controller_addr=ip, port=int(port))
        except ControlConfigError as e:
            _exit_refused("start controller failed, error:1", str(e))
        token_file = None
        if config.job_token is None and not config.curve:
            # no token and no keys: one is made for this job (see _token), and its file
            # goes at the latest when this process ends, however it ends (`at_exit`)
            token, token_file = _token.publish(ip, config.port)
            at_exit(functools.partial(_token.withdraw, token_file, token))
            config = dataclasses.replace(config, job_token=token)
        # enable_zit: a lost rank without a replacement shrinks the job and returning ranks
        # grow it, through the ZIT handlers (`_zit`); it needs worker reboot, as the SDK's
        features = Features(high_availability=True, hbm_repair=self.enable_uce,
                            worker_reboot=arf, elastic=arf and zit, source="mindio_ttp")
        controller = Controller(world_size, config, features=features)
        try:
            controller.start()
        except BaseException:
            _token.withdraw(token_file)
            raise
        self.controller, self.token_file = controller, token_file

    def update_features(self, **changes: Any) -> None:
        """Features learnt from later calls, for the controller this process hosts."""
        controller = self.controller
        if controller is None:
            return
        controller.update_features(dataclasses.replace(controller.features, **changes))

    def destroy_controller(self) -> None:
        controller, self.controller = self.controller, None
        if controller is not None:
            controller.stop()
        token_file, self.token_file = self.token_file, None
        _token.withdraw(token_file, controller.config.job_token if controller else None)

    # -- processor --------------------------------------------------------------------------
    def init_processor(self, rank: int, world_size: int, enable_local_copy: bool,
                       enable_tls: bool, enable_uce: bool, enable_arf: bool) -> None:
        _check_ints("init_processor", rank, world_size)
        if not 0 <= rank < world_size <= MAX_WORLD_SIZE:
            _exit_refused(f"init processor {rank} failed, world_size {world_size}, Out of range",
                          f"need 0 <= rank < world_size <= {MAX_WORLD_SIZE}")
        if enable_local_copy:
            _exit_refused(f"init processor {rank} failed, error:1",
                          "enable_local_copy=True, a local copy of the optimizer state, is not "
                          "supported; pass False")
        if enable_tls:
            log.warning("enable_tls: the SDK's TLS is not used here; the control plane "
                        "authenticates with CURVE keys (TTP_CURVE_*) and the job's token "
                        "(TTP_JOB_TOKEN, made by the controller when none is given)")
        self.rank, self.world_size = rank, world_size
        self.enable_uce, self.enable_arf = bool(enable_uce), bool(enable_arf)
        self.device = _current_device()
        self.update_features(hbm_repair=self.enable_uce)
        if "torch" in sys.modules:  # before the framework makes its first process group
            from mindspeed_tft import patches

            patches.install("connection-tracking")
            patches.install("gloo-collectives")
            patches.install("group-names")  # as the SDK replaces _process_group_name here
            if "megatron.training.checkpointing" in sys.modules:  # MindSpeed-LLM
                patches.install("sdk-load-verify")  # its loads check the manifests

    def start_processor(self, master_ip: str, port: int, actions: Any) -> None:
        if self.rank is None or self.world_size is None:
            raise RuntimeError("tft_start_processor before tft_init_processor")
        if self.processor is not None:
            raise RuntimeError(f"the processor of rank {self.rank} is already started")
        try:
            config, token_file = _processor_config(master_ip, port)
            processor = _register(self.rank, self.world_size, config, token_file, actions)
        except (ProcessorError, ControlConfigError) as e:
            if not mindcluster_task() or launched_by_tft(os.environ):
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


def _register(rank: int, world_size: int, config: ControlConfig, token_file: Path | None,
              actions: Any) -> Processor:
    """Start rank `rank`'s processor. Refused with the token read from `token_file`, which
    now holds another (module docstring), it starts again with that one; all of it within
    `register_timeout`."""
    deadline = time.monotonic() + config.register_timeout
    while True:
        processor = Processor(rank, world_size, config)
        actions.register(processor)
        try:
            processor.start(max(0.0, deadline - time.monotonic()))
            return processor
        except ProcessorError:
            now = None if token_file is None else _token.read(config.processor_addr, config.port)
            if now in (None, config.job_token) or time.monotonic() >= deadline:
                raise
        print(f"[mindio_ttp] rank {rank}: the controller at {config.processor_addr}:"
              f"{config.port} refused the job token read from {token_file}, an earlier job's; "
              "registering again with the one its controller wrote there now",
              file=sys.stderr, flush=True)
        config = dataclasses.replace(config, job_token=now)


def _processor_config(master_ip: str, port: int) -> tuple[ControlConfig, Path | None]:
    """Where a processor connects, and the job's token it shows (with the file it was read
    from, when a controller of this host made it)."""
    if launched_by_tft(os.environ):
        config = ControlConfig.from_env()  # the launcher's address, port and token
        if int(port) != config.port:
            log.info("the launcher's controller listens on port %d (TTP_PORT), not %s",
                     config.port, port)
        return config, None
    config = ControlConfig.from_env(
        processor_addr=_address(master_ip, "tft_start_processor master_ip", wildcard=False),
        port=parse_port(port, "tft_start_processor port"))
    if config.job_token is None and not config.curve:
        # the token a controller of this host made for the job (see _token)
        token = _token.wait_for(config.processor_addr, config.port, config.register_timeout)
        return (dataclasses.replace(config, job_token=token),
                _token.token_path(config.processor_addr, config.port))
    return config, None


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


def _check_ints(method: str, *values: Any) -> None:
    """The SDK's (SWIG's) refusal of an argument that is not an int (a bool is one)."""
    for number, value in enumerate(values, 1):
        if not isinstance(value, int):
            raise TypeError(f"in method '{method}', argument {number} of type 'int' (got "
                            f"{value!r})")


def _int_or_none(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


def _exit_refused(sdk_words: str, why: str) -> NoReturn:
    """Refuse as the SDK does where it ends the process with 2 (its words, then why)."""
    log.error("%s: %s", sdk_words, why)
    print(f"[mindio_ttp] {sdk_words}: {why}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _controller_ip(bind_ip: Any) -> str:
    """`tft_start_controller`'s address: an IP or a host name that resolves, never a
    wildcard (the SDK's refusals, its words)."""
    text = str(bind_ip)
    try:
        if ipaddress.ip_address(text.strip("[]")).is_unspecified:
            _exit_refused("start controller failed, all-zero ip is not supported",
                          f"bind_ip={bind_ip!r}: give the address the ranks connect to")
    except ValueError:
        pass
    try:
        return _address(text, "tft_start_controller bind_ip", wildcard=False)
    except ControlConfigError as e:
        _exit_refused("start controller failed, error:1", str(e))


def _current_device() -> int:
    """What `get_device()` answers: the index of the device this process trains on, as the
    SDK's `torch.npu.current_device()` (MindSpore: `device_id`); 0 on CPU, as the SDK
    answers where no device was chosen."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return int(npu.current_device())
    if torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return 0


RUNTIME = Runtime()
