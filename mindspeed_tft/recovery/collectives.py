"""Abandon pending collectives within a bounded time, so a stopped rank's training thread
raises instead of waiting for a peer that will never answer.

When one rank fails, the others block in the next collective that needs it. A dead peer
closes its sockets and gloo raises at once, but a peer that is alive and stuck (it raised
and sits in the fault handler, or it hangs) keeps them blocked until the process-group
timeout, minutes. NCCL (and HCCL) can abort their communicators; gloo cannot: its
`abort()` does not wake a waiting operation. On gloo this module makes the waits
interruptible instead: `Work.wait()` without a timeout (what every synchronous collective
and every `handle.wait()` calls) waits in slices of `POLL_SECONDS`, and between slices checks
whether the control plane ordered the rank to stop. `abandon()` raises `CollectivesAbandoned`
("FORCE STOP ...", classified as a normal stop, SPEC 6) in every thread waiting on a
collective, and in every collective started until `reset()`. A slice costs nothing when the
operation completes within it: the wait returns as soon as the operation does.

After an abandon, the process groups are unusable (operations are half done on some ranks):
recovery destroys and rebuilds them before `reset()`.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

POLL_SECONDS = 0.2

_abandoned = threading.Event()
_reason = ""
_installed = False


class CollectivesAbandoned(RuntimeError):
    """A collective was abandoned because the control plane stopped this rank."""


def _raise_abandoned() -> None:
    raise CollectivesAbandoned(f"FORCE STOP: collective abandoned ({_reason})")


def _interruptible_wait(original: Any) -> Any:
    poll = timedelta(seconds=POLL_SECONDS)

    def wait(self: Any, timeout: timedelta | None = None) -> bool:
        if timeout is not None and timeout != timedelta(0):
            return original(self, timeout)
        while True:
            if _abandoned.is_set():
                _raise_abandoned()
            try:
                return original(self, poll)
            except RuntimeError as error:
                if "timed out" not in str(error).lower():
                    raise

    return wait


def install() -> None:
    """Make gloo waits interruptible (idempotent; call before training on gloo)."""
    global _installed
    if _installed:
        return
    dist.Work.wait = _interruptible_wait(dist.Work.wait)
    _installed = True


def abandon(reason: str) -> None:
    """Make every pending and future collective of this process raise (until `reset`).

    On NCCL, the communicators are aborted as well (that is what wakes a CUDA wait)."""
    global _reason
    _reason = reason
    _abandoned.set()
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()


def abandoned() -> bool:
    """Whether collectives are currently abandoned."""
    return _abandoned.is_set()


def reset() -> None:
    """Allow collectives again (after the process groups were rebuilt)."""
    _abandoned.clear()
