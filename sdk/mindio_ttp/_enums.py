"""The SDK's enumerations, with its values (mindio_ttp 7.3.0, `framework_ttp.ttp_decorator`)."""

from __future__ import annotations

from enum import Enum


class OptimizerType(Enum):
    """Which optimizer a replica layout or a repair entry is about (`repair_info["type"]`)."""

    ATTENTION = 0
    MOE = 1


class Action(Enum):
    """What `tft_wait_next_action` returns."""

    RETRY = 0
    EXIT = 1


class ReportState(Enum):
    """What a processor reports (`tft_report_error`)."""

    RS_NORMAL = 0
    RS_RETRY = 1
    RS_UCE = 2
    RS_UCE_CORRUPTED = 3
    RS_HCCL_FAILED = 4
    RS_UNKNOWN = 8
    RS_INIT_FINISH = 5
    RS_PREREPAIR_FINISH = 6
    RS_STEP_FINISH = 7


class RepairType(Enum):
    """The kind of one rank's repair (`repair_info["repair_type"]`)."""

    RT_SEND = 0
    RT_UCE_HIGHLEVEL = 1
    RT_UCE_LOWLEVEL = 2
    RT_ROLLBACK = 4
    RT_RECV_REPAIR = 3
    RT_LOAD_CKPT = 5
    RT_LOAD_REBUILD = 6


#: the frameworks `set_mindio_export_version` accepts
FRAMEWORKS = ("MindSpeed", "MindSpeed-LLM")
#: return codes of the SDK's callbacks (a clean handler returns one of the first three)
RET_OK = 0
RET_ERROR = 1
RET_NO_REBUILD = 2
