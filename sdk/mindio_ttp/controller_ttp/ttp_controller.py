"""The controller side of the SDK's API: mindspeed-tft's `Controller` in this process.

MindSpeed-LLM's rank 0 calls `tft_init_controller` and `tft_start_controller` unless
`MINDX_TASK_ID` is set (MindCluster's TaskD then hosts it). Under mindspeed-tft's launcher
(`tft-run`, or torchrun with the usage guide's import) the launcher of node 0 hosts the
controller instead and these calls start nothing; there a `MINDX_TASK_ID` changes nothing.
"""

from __future__ import annotations

import logging
import os

from mindspeed_tft.arguments import launched_by_tft

from .._runtime import RUNTIME, mindcluster_task

log = logging.getLogger("mindio_ttp")

RET_OK = 0
RET_ERROR = 1


def tft_init_controller(rank: int, world_size: int, enable_local_copy: bool,
                        enable_arf: bool = False, enable_zit: bool = False) -> None:
    """Set up the controller of a job (before `tft_start_controller`).

    Args:
        rank: this process's global rank.
        world_size: the number of training ranks.
        enable_local_copy: the SDK's local copy of the optimizer state; refused when true.
        enable_arf: worker reboot.
        enable_zit: the SDK's zero-interruption training switch.
    """
    RUNTIME.init_controller(rank, world_size, enable_local_copy, enable_arf, enable_zit)


def tft_start_controller(bind_ip: str, port: int, enable_tls: bool = True,
                         tls_info: str = "") -> None:
    """Start the controller; returns once it is bound.

    Args:
        bind_ip: the address to bind.
        port: the port to bind.
        enable_tls: the SDK's TLS switch (CURVE keys and a per-job token are used instead).
        tls_info: ignored (see `enable_tls`).
    """
    if mindcluster_task() and not launched_by_tft(os.environ):
        log.warning("MINDX_TASK_ID is set: MindSpeed-LLM leaves the controller to MindCluster; "
                    "this one starts anyway (no cluster manager talks to this control plane)")
    if enable_tls:
        log.warning("enable_tls: the SDK's TLS is not used here; the controller authenticates "
                    "with CURVE keys (TTP_CURVE_*) and the job's token (TTP_JOB_TOKEN)")
    RUNTIME.start_controller(bind_ip, port)


def tft_destroy_controller() -> None:
    """Stop the controller this process hosts (none: nothing to do)."""
    RUNTIME.destroy_controller()


def tft_query_high_availability_switch() -> bool:
    """Whether MindCluster switched high availability on: there is no cluster manager."""
    return False
