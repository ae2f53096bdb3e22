"""The training state: the one object through which the plugin reaches the trainer.

A trainer (this reference trainer, Megatron-LM's `megatron.training`, MindSpeed-LLM) builds a
`TrainingState` and hands it to the plugin. Recovery code (dump, repair, rollback, group
rebuild) works on this object alone: the model chunks, the optimizer, the LR scheduler, the
args (which hold `iteration` and `consumed_train_samples`, as in Megatron-LM), and a factory
that rebuilds the training data iterator at a given consumed-sample count.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainingState:
    """Everything a step reads or writes, owned by the trainer."""

    args: argparse.Namespace
    model: list[torch.nn.Module]
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer
    opt_param_scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    build_train_data_iterator: Callable[[int], Iterator | None]
    train_data_iterator: Iterator | None = None
    valid_data_iterator: Iterator | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def iteration(self) -> int:
        """Completed optimizer updates (Megatron's `iteration`)."""
        return self.args.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.args.iteration = value

    def reset_train_data_iterator(self) -> None:
        """Rebuild the training data iterator at `args.consumed_train_samples`."""
        self.train_data_iterator = self.build_train_data_iterator(
            self.args.consumed_train_samples
        )
