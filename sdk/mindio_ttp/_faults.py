"""Which report an exception of the training function becomes: the SDK's patterns.

The exception decorator looks for the first registered pattern that the message of a
`RuntimeError` contains, asks that pattern's handle for a key and reports the state the key
names (`ReportState`), as the SDK does:

| message contains | key | reported |
| --- | --- | --- |
| `UCE ERROR` | `UCE ERROR` (`OTHER` without UCE repair) | RS_UCE |
| `HBM MULTI BIT ECC` | `... can repair` / `... can't repair` (the error's `time us=N` against the last update, `utils`) | RS_UCE / RS_UCE_CORRUPTED |
| `FORCE STOP` | `FORCE STOP` | RS_NORMAL |
| `ARF FINISH` | `ARF FINISH` | RS_PREREPAIR_FINISH |
| `STEP FINISH` | `STEP FINISH` | RS_STEP_FINISH |
| `HCCL OP RETRY FAILED`, `SUSPECT REMOTE ERROR`, `UB LINK ERROR`, `HCCS LINK ERROR` | the pattern (`OTHER` without UCE repair) | RS_HCCL_FAILED |
| none | `OTHER` | RS_UNKNOWN |

`tft_register_exception_handler(pattern, type, handle)` adds a pattern (after the built-in
ones, or replacing one) whose handle returns a key; `type` is the state that key reports
(MindSpeed-LLM registers `PRECISION ERROR` -> RS_RETRY). A registration is checked at once:
the pattern a non-empty string, the type a `ReportState` name, the handle callable.
"""

from __future__ import annotations

from collections.abc import Callable

from ._enums import ReportState
from .utils.uce_utils import hbm_error_time, tft_can_do_uce_repair

OTHER = "OTHER"
HBM = "HBM MULTI BIT ECC"
_RETRY_PATTERNS = ("HCCL OP RETRY FAILED", "SUSPECT REMOTE ERROR", "UB LINK ERROR",
                   "HCCS LINK ERROR")


class FaultTable:
    """The patterns of one process (`retry()`: whether UCE repair is on for it)."""

    def __init__(self, retry: Callable[[], bool]) -> None:
        self.retry = retry
        self.handles: dict[str, Callable[[str], str]] = {}
        self.types: dict[str, str] = {OTHER: "RS_UNKNOWN"}

        def if_retry(key: str) -> Callable[[str], str]:
            return lambda message: key if self.retry() else OTHER

        def fixed(key: str) -> Callable[[str], str]:
            return lambda message: key

        self._add("UCE ERROR", "RS_UCE", if_retry("UCE ERROR"))
        self.handles[HBM] = self._hbm
        self.types[f"{HBM} can repair"] = "RS_UCE"
        self.types[f"{HBM} can't repair"] = "RS_UCE_CORRUPTED"
        self._add("FORCE STOP", "RS_NORMAL", fixed("FORCE STOP"))
        self._add("ARF FINISH", "RS_PREREPAIR_FINISH", fixed("ARF FINISH"))
        self._add("STEP FINISH", "RS_STEP_FINISH", fixed("STEP FINISH"))
        for pattern in _RETRY_PATTERNS:
            self._add(pattern, "RS_HCCL_FAILED", if_retry(pattern))

    def _add(self, pattern: str, fault_type: str, handle: Callable[[str], str]) -> None:
        self.handles[pattern] = handle
        self.types[pattern] = fault_type

    def _hbm(self, message: str) -> str:
        if not self.retry():
            return OTHER
        repairable = tft_can_do_uce_repair(hbm_error_time(message))
        return f"{HBM} can repair" if repairable else f"{HBM} can't repair"

    def register(self, pattern: str, fault_type: str, handle: Callable[[str], str]) -> None:
        """`tft_register_exception_handler` (see the module docstring)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"fault_pattern={pattern!r} must be a non-empty string")
        if fault_type not in ReportState.__members__:
            raise ValueError(f"fault_type={fault_type!r} is not a ReportState name (allowed: "
                             f"{', '.join(ReportState.__members__)})")
        if not callable(fault_handle := handle):
            raise TypeError(f"fault_handle={fault_handle!r} must be a callable")
        self._add(pattern, fault_type, handle)

    def classify(self, message: str) -> tuple[str, ReportState]:
        """(key, state) for the message of a RuntimeError; a handle's key that no type names
        reports RS_UNKNOWN."""
        key = OTHER
        for pattern, handle in list(self.handles.items()):
            if pattern in message:
                key = str(handle(message))
                break
        name = self.types.get(key, "RS_UNKNOWN")
        return key, ReportState[name]
