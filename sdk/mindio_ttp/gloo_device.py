"""What torch_npu's `stop_device` / `restart_device` do for HCCL, for torch.distributed's gloo
backend on CPU (this project's addition to the SDK's API).

A framework's stop handler must make a training thread blocked in a collective give up (on an
NPU: `torch_npu.npu.stop_device`, after which device operations raise "FORCE STOP"); its
clean handler lets collectives run again (`restart_device`) once it rebuilt what the stop
broke. On gloo, `stop_device()` shuts down the TCP connections of this process's process
groups and makes every pending and later wait raise "FORCE STOP ..."
(`mindspeed_tft.recovery.collectives.abandon`); the rendezvous store's and the control
plane's connections stay. The process groups cannot be used again: the clean (a retry) or
rebuild (a worker reboot) handler makes new ones, then calls `restart_device()`.
`tft_init_processor` records the connections of every process group made after it (it
installs the `connection-tracking` and `gloo-collectives` moments of `mindspeed_tft.patches`
when torch is loaded), so call it before the first process group, as MindSpeed-LLM does.
"""

from __future__ import annotations

from typing import Any

from mindspeed_tft.envvars import launcher_value
from mindspeed_tft.recovery import collectives

from ._runtime import RUNTIME


def _keep_ports() -> list[int]:
    """Ports whose connections survive: the controller's, the backups', the rendezvous'."""
    ports = []
    processor = RUNTIME.processor
    if processor is not None:
        ports.append(processor.config.port)
        ports.extend(port for _, port in processor.config.backups)
    master_port = launcher_value("MASTER_PORT")
    if master_port:
        ports.append(int(master_port))
    return ports


def stop_device(device: Any = None) -> int:
    """Make every collective of this process fail now ("FORCE STOP"); returns 0 (torch_npu's
    success code)."""
    collectives.abandon("the controller stopped this rank (stop_device)", _keep_ports())
    return 0


def restart_device(device: Any = None) -> None:
    """Collectives may run again (on process groups made after the stop)."""
    collectives.reset()
