"""Where the plugin meets a trainer.

A trainer creates one `TFTPlugin` per process after parsing its args, calls `setup()` once
torch.distributed and megatron-core's parallel state exist (this builds the replica groups
and installs the replica optimizer when high availability is on), and installs `hooks()`
into its training loop. The hooks are: fault injection (`TFT_INJECT`, honoured with or
without high availability, so faults can be injected into any job), step bookkeeping (the
data status of SPEC 3) and, with `--tft-check-replicas-interval`, the replica consistency
check. `startup_notices(args)` lists what a user should see once at startup.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from mindspeed_tft.arguments import TFTFeatures
from mindspeed_tft.events import configure_events, emit
from mindspeed_tft.faults import FaultInjector
from mindspeed_tft.replica.bookkeeping import StepBookkeeping, UpdateStatus
from mindspeed_tft.replica.check import ReplicaConsistencyCheck
from mindspeed_tft.replica.groups import ReplicaGroups, ReplicaLayout
from mindspeed_tft.replica.optimizer import install_replica_optimizer
from mindspeed_tft.training.arguments import fused_kernel_notices
from mindspeed_tft.training.hooks import HookList, TrainerHooks
from mindspeed_tft.training.state import TrainingState


class FaultInjectionHooks(TrainerHooks):
    """Fires the `TFT_INJECT` items of this rank at their step and phase."""

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector

    def on_phase(self, state: TrainingState, phase: str, step: int) -> None:
        self.injector.fire(step, phase)


class TFTPlugin:
    """The plugin's state in one training process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.features: TFTFeatures = getattr(args, "tft_features", None) or TFTFeatures.from_args(
            args
        )
        self.status = UpdateStatus()
        self.replica_groups: ReplicaGroups | None = None

    def setup(self) -> None:
        """Build what needs torch.distributed (call after the parallel state exists)."""
        configure_events(getattr(self.args, "tft_events_file", None))
        if self.features.high_availability or getattr(self.args, "tft_check_replicas_interval", 0):
            self.replica_groups = ReplicaGroups(ReplicaLayout.from_args(self.args))
            self.replica_groups.build()
            install_replica_optimizer(self.replica_groups)
            emit("replica_layout", dist.get_rank(), **self.replica_groups.layout_event())

    def hooks(self) -> TrainerHooks:
        """The trainer hooks of this process."""
        hooks = HookList([StepBookkeeping(self.status)])
        injector = FaultInjector.from_env(dist.get_rank())
        if injector:
            hooks.append(FaultInjectionHooks(injector))
        interval = getattr(self.args, "tft_check_replicas_interval", 0)
        if interval and self.replica_groups is not None:
            hooks.append(ReplicaConsistencyCheck(self.replica_groups, interval))
        return hooks


def startup_notices(args: argparse.Namespace) -> list[str]:
    """Lines to print once at startup."""
    notices = [f"[mindspeed-tft] {line}" for line in fused_kernel_notices(args, args.platform)]
    features = getattr(args, "tft_features", None)
    if features is not None:
        notices.append(f"[mindspeed-tft] {features.describe()}")
    return notices
