"""Where the plugin meets a trainer: the hooks it installs and what it says at startup.

`build_plugin_hooks(args)` returns the `TrainerHooks` this process needs: fault injection
(`TFT_INJECT`, always honoured so faults can be injected with or without high availability)
and, with `--enable-high-availability`, the fault-tolerance hooks. `startup_notices(args)`
lists the lines a user should see once at startup (enabled features, fused-kernel flags
that have no kernel here).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from mindspeed_tft.events import configure_events
from mindspeed_tft.faults import FaultInjector
from mindspeed_tft.training.arguments import fused_kernel_notices
from mindspeed_tft.training.hooks import HookList, TrainerHooks
from mindspeed_tft.training.state import TrainingState


class FaultInjectionHooks(TrainerHooks):
    """Fires the `TFT_INJECT` items of this rank at their step and phase."""

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector

    def on_phase(self, state: TrainingState, phase: str, step: int) -> None:
        self.injector.fire(step, phase)


def build_plugin_hooks(args: argparse.Namespace) -> TrainerHooks:
    """The hooks of this process (fault injection; high availability when enabled)."""
    configure_events(getattr(args, "tft_events_file", None))
    hooks = HookList()
    injector = FaultInjector.from_env(dist.get_rank())
    if injector:
        hooks.append(FaultInjectionHooks(injector))
    return hooks


def startup_notices(args: argparse.Namespace) -> list[str]:
    """Lines to print once at startup."""
    notices = [f"[mindspeed-tft] {line}" for line in fused_kernel_notices(args, args.platform)]
    features = getattr(args, "tft_features", None)
    if features is not None:
        notices.append(f"[mindspeed-tft] {features.describe()}")
    return notices
