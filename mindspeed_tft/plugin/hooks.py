"""Step hooks: the points in a training step where the plugin may act (half of the
interface a host implements; the other half is `state.TrainingState`).

The host's training loop calls a `TrainerHooks` object at fixed points of every step; the
plugin (fault injection, step snapshots, the processor of the control plane, the replica
check) implements the methods it needs. Phases, in step order, with `step` = completed updates when the step began
(Megatron's `iteration` before the step; step s produces iteration s + 1):

- ``forward``: before the first micro-batch's forward pass of the step.
- ``backward``: when the first micro-batch's backward pass reaches this stage's output.
- ``optimizer``: inside the optimizer update (between `on_update_start` and `on_update_end`).
- ``save``: during a periodic checkpoint save at the end of the step, after the files are
  written and before they are published.
- ``after``: after the step finished (the update applied, `iteration` advanced).

The optimizer update bracket is reported through `on_update_start` / `on_update_end`
around megatron-core's local update (`step_with_ready_grads` of the mixed-precision and fp32
optimizers: the inner Adam step and the copy of main params into model params). Nothing in
that bracket communicates, so a rank that enters it always finishes it; the param all-gather
of the distributed optimizer comes after it. `install_update_bracket()` installs it once per
process (the ``update-bracket`` moment of `mindspeed_tft.patches`).

`phase_reporting_forward_step` wraps a host's forward-step function so that the first
micro-batch of a step reports the ``forward`` and ``backward`` phases.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mindspeed_tft.plugin.state import TrainingState

PHASES = ("forward", "backward", "optimizer", "save", "after")


class TrainerHooks:
    """The points of a training step where the plugin acts; each does nothing here.

    A host calls them from its loop (`TFTPlugin.hooks` returns the plugin's); the plugin's
    parts subclass it and override what they need. Every method gets the host's
    `TrainingState`; `step` is the number of completed updates when the step began.
    """

    def on_train_start(self, state: TrainingState) -> None:
        """Training is set up (model, optimizer, data) and about to run its first step.

        Args:
            state: the host's training state.
        """

    def on_phase(self, state: TrainingState, phase: str, step: int) -> None:
        """The step reached a phase.

        Args:
            state: the host's training state.
            phase: one of `PHASES`: ``forward``, ``backward``, ``optimizer``, ``save``,
                ``after``.
            step: completed updates when the step began.
        """

    def on_update_start(self, state: TrainingState, step: int) -> None:
        """An optimizer is about to modify its state in place.

        Args:
            state: the host's training state.
            step: the step whose update starts.
        """

    def on_update_end(self, state: TrainingState, step: int) -> None:
        """The optimizer finished modifying its state.

        Args:
            state: the host's training state.
            step: the step whose update ended.
        """

    def on_step_end(self, state: TrainingState) -> None:
        """A step completed; `state.iteration` counts it.

        Args:
            state: the host's training state.
        """

    def on_train_end(self, state: TrainingState) -> None:
        """Training finished (all iterations, or the exit interval).

        Args:
            state: the host's training state.
        """


class HookList(TrainerHooks):
    """Calls several hooks objects in order."""

    def __init__(self, hooks: list[TrainerHooks] | None = None) -> None:
        self.hooks: list[TrainerHooks] = list(hooks or [])

    def append(self, hooks: TrainerHooks) -> None:
        self.hooks.append(hooks)

    def on_train_start(self, state: TrainingState) -> None:
        for h in self.hooks:
            h.on_train_start(state)

    def on_phase(self, state: TrainingState, phase: str, step: int) -> None:
        for h in self.hooks:
            h.on_phase(state, phase, step)

    def on_update_start(self, state: TrainingState, step: int) -> None:
        for h in self.hooks:
            h.on_update_start(state, step)

    def on_update_end(self, state: TrainingState, step: int) -> None:
        for h in self.hooks:
            h.on_update_end(state, step)

    def on_step_end(self, state: TrainingState) -> None:
        for h in self.hooks:
            h.on_step_end(state)

    def on_train_end(self, state: TrainingState) -> None:
        for h in self.hooks:
            h.on_train_end(state)


class _UpdateBracket:
    """Where the patched optimizers report their local update; set by the trainer."""

    hooks: TrainerHooks | None = None
    state: TrainingState | None = None


_bracket = _UpdateBracket()
_installed = False


def set_update_listener(hooks: TrainerHooks | None, state: TrainingState | None) -> None:
    """Route update-bracket reports of this process to `hooks` (None: nobody)."""
    _bracket.hooks = hooks
    _bracket.state = state


def _bracketed(step_with_ready_grads: Any) -> Any:
    @functools.wraps(step_with_ready_grads)
    def wrapper(self: Any) -> bool:
        hooks, state = _bracket.hooks, _bracket.state
        if hooks is None or state is None:
            return step_with_ready_grads(self)
        step = state.iteration
        hooks.on_update_start(state, step)
        hooks.on_phase(state, "optimizer", step)
        result = step_with_ready_grads(self)
        hooks.on_update_end(state, step)
        return result

    wrapper.__tft_update_bracket__ = True  # type: ignore[attr-defined]
    return wrapper


def install_update_bracket() -> None:
    """Wrap megatron-core's local optimizer updates with the bracket (once per process; the
    ``update-bracket`` moment of `mindspeed_tft.patches`)."""
    global _installed
    if _installed:
        return
    from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer

    for cls in (MixedPrecisionOptimizer, FP32Optimizer):
        cls.step_with_ready_grads = _bracketed(cls.step_with_ready_grads)
    _installed = True


ForwardStep = Callable[[Iterator, Any], "tuple[torch.Tensor, Callable]"]


def phase_reporting_forward_step(
    forward_step_func: ForwardStep, state: TrainingState, hooks: TrainerHooks
) -> ForwardStep:
    """The host's forward step, reporting the ``forward`` phase of the step before its first
    micro-batch and the ``backward`` phase when that micro-batch's backward pass reaches this
    stage's output."""
    step = state.iteration
    seen = {"forward": False}

    def forward_step(data_iterator: Iterator, model: Any, *args: Any, **kwargs: Any):
        first = not seen["forward"]
        if first:
            seen["forward"] = True
            hooks.on_phase(state, "forward", step)
        output_tensor, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
        if first and output_tensor.requires_grad:
            fired = {"backward": False}

            def on_backward(grad: torch.Tensor) -> torch.Tensor:
                if not fired["backward"]:
                    fired["backward"] = True
                    hooks.on_phase(state, "backward", step)
                return grad

            output_tensor.register_hook(on_backward)
        return output_tensor, loss_func

    return forward_step
