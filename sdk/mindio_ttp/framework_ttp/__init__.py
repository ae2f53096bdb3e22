"""The processor side of the SDK's API (`mindio_ttp.framework_ttp`), as MindSpeed-LLM imports
it; the controller functions are here too, as in the SDK.

Imported by the installed `torchrun` script (the usage guide's step), it also routes
torchrun's launches with high availability through mindspeed-tft's launcher (`_torchrun`).

Modules:

- `ttp_decorator`: the processor side of the SDK's API and its exception decorator
"""

from .. import _torchrun
from ..controller_ttp import tft_destroy_controller, tft_init_controller, tft_start_controller
from ..utils import tft_can_do_uce_repair
from .ttp_decorator import (
    Action,
    OptimizerType,
    RepairType,
    ReportState,
    set_mindio_export_version,
    tft_destroy_processor,
    tft_end_updating_os,
    tft_exception_handler,
    tft_get_reboot_type,
    tft_get_repair_step,
    tft_get_repair_type,
    tft_init_processor,
    tft_is_reboot_node,
    tft_pause_train,
    tft_register_clean_handler,
    tft_register_decrypt_handler,
    tft_register_exception_handler,
    tft_register_exit_handler,
    tft_register_rebuild_group_handler,
    tft_register_rename_handler,
    tft_register_repair_handler,
    tft_register_rollback_handler,
    tft_register_save_ckpt_handler,
    tft_register_stop_handler,
    tft_register_stream_sync_handler,
    tft_register_zit_downgrade_rebuild_handler,
    tft_register_zit_upgrade_rebuild_handler,
    tft_register_zit_upgrade_repair_handler,
    tft_register_zit_upgrade_rollback_handler,
    tft_report_error,
    tft_report_load_ckpt_step,
    tft_reset_limit_step,
    tft_set_dp_group_info,
    tft_set_optimizer_replica,
    tft_set_step_args,
    tft_start_copy_os,
    tft_start_processor,
    tft_start_updating_os,
    tft_wait_next_action,
)

_torchrun.install_if_torchrun()

__all__ = [
    "tft_init_controller",
    "tft_start_controller",
    "tft_destroy_controller",
    "tft_init_processor",
    "tft_start_processor",
    "tft_destroy_processor",
    "tft_start_updating_os",
    "tft_start_copy_os",
    "tft_end_updating_os",
    "tft_set_optimizer_replica",
    "tft_exception_handler",
    "tft_set_step_args",
    "tft_register_rename_handler",
    "tft_register_save_ckpt_handler",
    "tft_register_exit_handler",
    "tft_register_stop_handler",
    "tft_register_clean_handler",
    "tft_register_rebuild_group_handler",
    "tft_register_repair_handler",
    "tft_register_rollback_handler",
    "tft_register_stream_sync_handler",
    "tft_register_zit_upgrade_rollback_handler",
    "tft_register_zit_upgrade_repair_handler",
    "tft_register_zit_upgrade_rebuild_handler",
    "tft_register_zit_downgrade_rebuild_handler",
    "tft_register_exception_handler",
    "tft_report_error",
    "tft_wait_next_action",
    "tft_get_repair_step",
    "tft_get_repair_type",
    "tft_is_reboot_node",
    "tft_get_reboot_type",
    "tft_can_do_uce_repair",
    "tft_reset_limit_step",
    "tft_pause_train",
    "tft_set_dp_group_info",
    "tft_report_load_ckpt_step",
    "tft_register_decrypt_handler",
    "set_mindio_export_version",
    "OptimizerType",
    "Action",
    "ReportState",
    "RepairType",
]
