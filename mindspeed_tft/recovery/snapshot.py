"""What a rank must remember to restore, or dump, the state of a recent step.

A fault can hit a rank anywhere in a step: before its update (the state is still that of
the previous step, but the RNG has moved on through the forward pass), or after its local
update but before the step's bookkeeping (the optimizer is at the new step, the LR scheduler
and the consumed-sample count are not). `StepSnapshots` records, cheaply, what the
optimizer state does not hold: every RNG state, the LR scheduler's state and the consumed
samples, for the last steps this rank reached. `at(step)` returns them for the lock step.

Recorded points:
- train start (after a load or a rollback): the state at `iteration`;
- end of each local update of step s: the RNG state, which is the one step s + 1 starts
  with (nothing draws random numbers between an update and the next forward pass);
- end of each completed step: scheduler and consumed samples at the new iteration.

It also knows whether the model params in memory are still the complete params of a step
(`params_iteration`): true from the end of a step (or a train start) until the next update
starts. A rollback to that step then has nothing to all-gather (`recovery.rollback`). With
megatron-core's `overlap_param_gather` the all-gather of a step's params runs during the next
forward pass, so the params are never known complete after a step there.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from mindspeed_tft.recovery.interface import RecoverableState
from mindspeed_tft.recovery.layout import get_rng_state

_KEEP = 3


@dataclass
class StepSnapshot:
    """The non-optimizer state of iteration `iteration` on this rank."""

    iteration: int
    rng_state: dict[str, Any]
    scheduler_state: dict[str, Any]
    consumed_train_samples: int


def restore_scheduler(scheduler: Any, scheduler_state: dict[str, Any]) -> None:
    """Put a live megatron-core OptimizerParamScheduler back to `scheduler_state`.

    Its `load_state_dict` advances the scheduler by the saved step count (it expects a fresh
    scheduler at step 0), so the count is reset first."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(copy.deepcopy(scheduler_state))


class SnapshotUnavailableError(RuntimeError):
    """This rank cannot reconstruct the state of the requested step."""


class StepSnapshots:
    """Remembers the last few steps' RNG, scheduler state and consumed samples (fed by the
    plugin's step hooks: `on_train_start`, `on_update_start`, `on_update_end`,
    `on_step_end`)."""

    def __init__(self) -> None:
        self._snapshots: dict[int, StepSnapshot] = {}
        self._rng_after_update: dict[int, dict[str, Any]] = {}
        self._samples_per_step = 0
        #: the iteration whose complete params the model holds (None: unknown, or an update
        #: may have changed them since)
        self.params_iteration: int | None = None

    def on_train_start(self, state: RecoverableState) -> None:
        self._samples_per_step = state.args.global_batch_size
        self._record(state, get_rng_state())
        self.params_iteration = state.iteration

    def on_update_start(self, state: RecoverableState, step: int) -> None:
        self.params_iteration = None

    def on_update_end(self, state: RecoverableState, step: int) -> None:
        self._rng_after_update[step + 1] = get_rng_state()
        for old in [s for s in self._rng_after_update if s < step + 1 - _KEEP]:
            del self._rng_after_update[old]

    def on_step_end(self, state: RecoverableState) -> None:
        rng = self._rng_after_update.get(state.iteration) or get_rng_state()
        self._record(state, rng)
        self.params_iteration = None if _overlaps_param_gather(state) else state.iteration

    def _record(self, state: RecoverableState, rng: dict[str, Any]) -> None:
        self._snapshots[state.iteration] = StepSnapshot(
            iteration=state.iteration,
            rng_state=rng,
            scheduler_state=copy.deepcopy(state.opt_param_scheduler.state_dict()),
            consumed_train_samples=state.args.consumed_train_samples,
        )
        for old in [s for s in self._snapshots if s < state.iteration - _KEEP]:
            del self._snapshots[old]

    def at(self, step: int, scheduler: Any) -> StepSnapshot:
        """The snapshot of iteration `step`; when this rank finished the update of step
        `step` but not its bookkeeping, it is derived from the previous one (the scheduler
        advanced by one step with `scheduler`, a live scheduler restored for the purpose)."""
        if step in self._snapshots:
            return self._snapshots[step]
        previous = self._snapshots.get(step - 1)
        rng = self._rng_after_update.get(step)
        if previous is None or rng is None:
            known = sorted(self._snapshots)
            raise SnapshotUnavailableError(
                f"no record of iteration {step} on this rank (it knows iterations {known})"
            )
        restore_scheduler(scheduler, previous.scheduler_state)
        scheduler.step(increment=self._samples_per_step)
        return StepSnapshot(
            iteration=step,
            rng_state=rng,
            scheduler_state=copy.deepcopy(scheduler.state_dict()),
            consumed_train_samples=previous.consumed_train_samples + self._samples_per_step,
        )


def _overlaps_param_gather(state: RecoverableState) -> bool:
    return any(getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False)
               for chunk in state.model)


def encode_snapshot(snapshot: StepSnapshot) -> bytes:
    """The snapshot as msgpack bytes (for a restarted rank that has none of its own)."""
    import msgpack
    import numpy as np
    import torch

    rng = snapshot.rng_state
    version, internal, gauss = rng["random_rng_state"]
    np_state = rng["np_rng_state"]
    record = {
        "iteration": snapshot.iteration,
        "consumed_train_samples": snapshot.consumed_train_samples,
        "scheduler": snapshot.scheduler_state,
        "random": [version, list(internal), gauss],
        "numpy": [np_state[0], np.asarray(np_state[1], dtype=np.uint32).tobytes(),
                  int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": bytes(rng["torch_rng_state"].numpy().tobytes()),
        "tracker": {name: bytes(state.numpy().tobytes())
                    for name, state in rng["rng_tracker_states"].items()},
    }
    if "cuda_rng_state" in rng:
        record["cuda"] = bytes(torch.as_tensor(rng["cuda_rng_state"]).cpu().numpy().tobytes())
    return msgpack.packb(record, use_bin_type=True)


def decode_snapshot(data: bytes) -> StepSnapshot:
    """Inverse of `encode_snapshot`."""
    import msgpack
    import numpy as np
    import torch

    record = msgpack.unpackb(data, raw=False, strict_map_key=False)

    def byte_tensor(raw: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

    version, internal, gauss = record["random"]
    name, keys, pos, has_gauss, cached = record["numpy"]
    rng: dict[str, Any] = {
        "random_rng_state": (version, tuple(internal), gauss),
        "np_rng_state": (name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss,
                         cached),
        "torch_rng_state": byte_tensor(record["torch"]),
        "rng_tracker_states": {k: byte_tensor(v) for k, v in record["tracker"].items()},
    }
    if "cuda" in record:
        rng["cuda_rng_state"] = byte_tensor(record["cuda"])
    return StepSnapshot(
        iteration=record["iteration"],
        rng_state=rng,
        scheduler_state=record["scheduler"],
        consumed_train_samples=record["consumed_train_samples"],
    )
