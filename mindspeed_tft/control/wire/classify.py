"""Fault kinds and the classification of errors seen in a training process (SPEC 6).

| error | kind |
| --- | --- |
| RuntimeError with "UCE ERROR" or "HBM MULTI BIT ECC" | `uce` |
| RuntimeError with "HCCL OP RETRY FAILED", "SUSPECT REMOTE ERROR", "UB LINK ERROR", "HCCS LINK ERROR", or a gloo/NCCL peer-connection error | `comm` |
| "FORCE STOP" (`ForceStop`, raised by the plugin itself to stop a rank) | `normal` |
| anything else | `unknown` |

The controller adds two kinds no process reports about itself: `lost` (a process that
exits, is killed, or whose node stops heartbeating) and `hang` (reported by a rank's
progress watchdog; treated like `lost`).
"""

from __future__ import annotations

from enum import Enum


class FaultKind(str, Enum):
    UCE = "uce"
    COMM = "comm"
    NORMAL = "normal"
    UNKNOWN = "unknown"
    HANG = "hang"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value


FORCE_STOP = "FORCE STOP"

UCE_MARKERS = ("UCE ERROR", "HBM MULTI BIT ECC")
COMM_MARKERS = (
    "HCCL OP RETRY FAILED",
    "SUSPECT REMOTE ERROR",
    "UB LINK ERROR",
    "HCCS LINK ERROR",
    # gloo / NCCL: a peer went away or the communicator was torn down
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
)


class ForceStop(RuntimeError):
    """Raised in a training thread the controller has stopped ("FORCE STOP", kind normal)."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(f"{FORCE_STOP}: {detail}" if detail else FORCE_STOP)


def classify_message(message: str) -> FaultKind:
    """Kind of a RuntimeError from its message."""
    if FORCE_STOP in message:
        return FaultKind.NORMAL
    if any(m in message for m in UCE_MARKERS):
        return FaultKind.UCE
    if any(m in message for m in COMM_MARKERS):
        return FaultKind.COMM
    return FaultKind.UNKNOWN


def classify_error(exc: BaseException) -> FaultKind:
    """Kind of an exception raised by the training function (SPEC 6)."""
    if isinstance(exc, ForceStop):
        return FaultKind.NORMAL
    if isinstance(exc, RuntimeError):
        return classify_message(str(exc))
    if type(exc).__name__ == "DistNetworkError":  # torch.distributed, not a RuntimeError subclass everywhere
        return FaultKind.COMM
    return FaultKind.UNKNOWN
