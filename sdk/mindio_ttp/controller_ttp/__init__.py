"""The controller side of the SDK's API (`mindio_ttp.controller_ttp`).

Modules:

- `ttp_controller`: mindspeed-tft's `Controller` started in this process, the SDK's way
- `ttp_mindx_api`: the SDK's interface to MindCluster's ClusterD (notices, strategies)
"""

from .ttp_controller import (
    tft_destroy_controller,
    tft_init_controller,
    tft_query_high_availability_switch,
    tft_start_controller,
)
from .ttp_mindx_api import (
    tft_notify_controller_change_strategy,
    tft_notify_controller_dump,
    tft_notify_controller_on_global_rank,
    tft_notify_controller_prepare_action,
    tft_notify_controller_stop_train,
    tft_register_mindx_callback,
)

__all__ = [
    "tft_destroy_controller",
    "tft_init_controller",
    "tft_notify_controller_change_strategy",
    "tft_notify_controller_dump",
    "tft_notify_controller_on_global_rank",
    "tft_notify_controller_prepare_action",
    "tft_notify_controller_stop_train",
    "tft_query_high_availability_switch",
    "tft_register_mindx_callback",
    "tft_start_controller",
]
