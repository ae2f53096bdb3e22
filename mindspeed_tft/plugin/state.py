"""The training state: the one object through which the plugin reaches the host's trainer
(half of the interface a host implements; the other half is `hooks.TrainerHooks`).

A host (this project's reference trainer, Megatron-LM's `megatron.training`) builds a
`TrainingState` and hands it to the plugin. Recovery code (dump, repair, rollback, group
rebuild) works on this object alone (it sees it through the narrow protocol
`mindspeed_tft.recovery.interface.RecoverableState`): the model chunks, the optimizer, the
LR scheduler, the args (which hold `iteration` and `consumed_train_samples`, as in
Megatron-LM), a factory that rebuilds the training data iterator at a given consumed-sample
count, and the host's own checkpoint code: what its `model_optim_rng.pt` holds, and how it
loads a checkpoint in place.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TrainingState:
    """Everything a step reads or writes, owned by the host's trainer.

    The host builds it once model, optimizer and data exist and hands it to
    `TFTPlugin.attach`; recovery (dump, repair, rollback, group rebuild) acts on it alone.
    """

    #: the training arguments; `iteration` and `consumed_train_samples` live here, as in
    #: Megatron-LM
    args: argparse.Namespace
    #: the model chunks (one per virtual pipeline stage), as megatron-core wraps them
    model: list[torch.nn.Module]
    #: megatron.core.optimizer.MegatronOptimizer
    optimizer: Any
    #: megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    opt_param_scheduler: Any
    #: the training data iterator again, at a consumed-sample count (after a rollback)
    build_train_data_iterator: Callable[[int], Iterator | None]
    #: the content of `model_optim_rng.pt` at `iteration`, with the given RNG state
    checkpoint_state_dict: Callable[[dict[str, Any]], dict[str, Any]]
    #: load the latest checkpoint under a directory into this state; returns its iteration
    #: (0: none there)
    load_checkpoint: Callable[[str], int]
    #: the training data iterator in use (replaced after a rollback)
    train_data_iterator: Iterator | None = None
    #: the validation data iterator, if any
    valid_data_iterator: Iterator | None = None
    #: called after a rollback (host-specific state to reset: timers, rerun state machine)
    after_rollback: Callable[[], None] | None = None
    #: elastic training: build model, optimizer and scheduler again for the current
    #: parallel state, load the latest checkpoint under a directory into them and rebuild
    #: the data iterator; returns the iteration loaded (None: the host cannot)
    rebuild_model_and_optimizer: Callable[[str], int] | None = None

    @property
    def iteration(self) -> int:
        """Completed optimizer updates (Megatron's `iteration`)."""
        return self.args.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.args.iteration = value

    def rebuild(self, root: str) -> int:
        """Elastic training: everything built again at the current size, from the
        checkpoint under `root` (see `rebuild_model_and_optimizer`)."""
        if self.rebuild_model_and_optimizer is None:
            raise RuntimeError("this trainer cannot rebuild its model for a smaller world "
                               "(elastic training needs the host to set "
                               "TrainingState.rebuild_model_and_optimizer)")
        return self.rebuild_model_and_optimizer(root)

    def reset_train_data_iterator(self) -> None:
        """Rebuild the training data iterator at `args.consumed_train_samples`."""
        self.train_data_iterator = self.build_train_data_iterator(
            self.args.consumed_train_samples
        )
