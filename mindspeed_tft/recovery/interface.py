"""What recovery needs from the trainer it repairs: a narrow, typed view of the host's
training state (`mindspeed_tft.plugin.state.TrainingState` is the implementation every host
builds). Recovery code depends on this protocol only, never on a host or on the plugin.
"""

from __future__ import annotations

import argparse
from typing import Any, Protocol

import torch


class RecoverableState(Protocol):
    """The training state as recovery sees it (see the module docstring)."""

    args: argparse.Namespace
    model: list[torch.nn.Module]
    optimizer: Any
    opt_param_scheduler: Any

    @property
    def iteration(self) -> int: ...

    @iteration.setter
    def iteration(self, value: int) -> None: ...

    def reset_train_data_iterator(self) -> None: ...

    def checkpoint_state_dict(self, rng_state: dict[str, Any]) -> dict[str, Any]: ...

    def load_checkpoint(self, root: str) -> int: ...

    def rebuild(self, root: str) -> int: ...

    after_rollback: Any
