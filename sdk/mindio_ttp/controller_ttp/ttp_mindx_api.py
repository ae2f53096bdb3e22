"""The SDK's interface to MindCluster's ClusterD (fault notices, strategies, results).

This control plane decides by itself (its launcher restarts workers, its controller chooses
the strategy), so there is no cluster manager to talk to: every call says so in the log and
returns RET_ERROR, as the SDK does for a call it cannot serve.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mindio_ttp")

RET_ERROR = 1


def _unsupported(name: str) -> int:
    log.warning("%s: no cluster manager (ClusterD) is connected to mindspeed-tft's control "
                "plane; nothing done", name)
    return RET_ERROR


def tft_register_mindx_callback(action: str, func: Callable[..., Any]) -> int:
    return _unsupported("tft_register_mindx_callback")


def tft_notify_controller_stop_train(fault_ranks: dict, stop_type: str = "stop",
                                     timeout: int | None = None) -> int:
    return _unsupported("tft_notify_controller_stop_train")


def tft_notify_controller_on_global_rank(fault_ranks: dict, time: int = 1) -> int:
    return _unsupported("tft_notify_controller_on_global_rank")


def tft_notify_controller_prepare_action(action: str, fault_ranks: dict | None = None) -> int:
    return _unsupported("tft_notify_controller_prepare_action")


def tft_notify_controller_change_strategy(strategy: str, params: str = "") -> int:
    return _unsupported("tft_notify_controller_change_strategy")


def tft_notify_controller_dump() -> int:
    return _unsupported("tft_notify_controller_dump")
