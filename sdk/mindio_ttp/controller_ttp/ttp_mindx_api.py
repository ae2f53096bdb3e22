"""The SDK's interface to MindCluster's ClusterD (fault notices, strategies, results).

This control plane decides by itself (its launcher restarts workers, its controller chooses
the strategy), so there is no cluster manager to talk to. Two calls are served, in the
process that hosts the controller, as the SDK serves them: a pause
(`tft_notify_controller_stop_train(..., stop_type="pause")`: every rank is held at its next
`tft_pause_train`, and its stream-sync handler runs) and its end
(`tft_notify_controller_change_strategy("continue")`). Every other call says in the log that
no cluster manager is connected and returns RET_ERROR, as the SDK does for a call it cannot
serve.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .._runtime import RUNTIME

log = logging.getLogger("mindio_ttp")

RET_OK = 0
RET_ERROR = 1


def _unsupported(name: str) -> int:
    log.warning("%s: no cluster manager (ClusterD) is connected to mindspeed-tft's control "
                "plane; nothing done", name)
    return RET_ERROR


def _order(name: str, what: str) -> int:
    """Pause or resume the controller this process hosts (RET_ERROR: it hosts none)."""
    controller = RUNTIME.controller
    if controller is None:
        log.warning("%s: no controller in this process", name)
        return RET_ERROR
    if what == "pause":
        controller.pause()
    else:
        controller.resume()
    return RET_OK


def tft_register_mindx_callback(action: str, func: Callable[..., Any]) -> int:
    return _unsupported("tft_register_mindx_callback")


def tft_notify_controller_stop_train(fault_ranks: dict, stop_type: str = "stop",
                                     timeout: int | None = None) -> int:
    """stop_type "pause": hold every rank at its next `tft_pause_train` until
    `tft_notify_controller_change_strategy("continue")` (the controller of this process)."""
    if stop_type != "pause":
        return _unsupported(f"tft_notify_controller_stop_train(stop_type={stop_type!r})")
    return _order("tft_notify_controller_stop_train", "pause")


def tft_notify_controller_on_global_rank(fault_ranks: dict, time: int = 1) -> int:
    return _unsupported("tft_notify_controller_on_global_rank")


def tft_notify_controller_prepare_action(action: str, fault_ranks: dict | None = None) -> int:
    return _unsupported("tft_notify_controller_prepare_action")


def tft_notify_controller_change_strategy(strategy: str, params: str = "") -> int:
    """strategy "continue": end a pause (the controller of this process)."""
    if strategy != "continue":
        return _unsupported(f"tft_notify_controller_change_strategy({strategy!r})")
    return _order("tft_notify_controller_change_strategy", "resume")


def tft_notify_controller_dump() -> int:
    return _unsupported("tft_notify_controller_dump")
