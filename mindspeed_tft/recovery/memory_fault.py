"""On-chip memory faults (UCE, SPEC 8): which memory a fault hit, and injecting one.

A device reports an uncorrectable memory error with the address it hit. What the repair
must do depends on what lives there: the optimizer state (fp32 main params and Adam
moments) or the model params must be copied back from a replica holder; gradients and
activations are recomputed by the step anyway. `classify_address` maps an address to one of
these regions by the storage ranges of the training state's tensors: optimizer state, the
model params (the DDP param buffers with the distributed optimizer), the DDP grad buffers
and the fp32 main grads; anything else is an
activation (transient memory).

`corrupt_memory(state, target)` is what fault injection (`TFT_INJECT` kind `uce`) does to a
rank: it overwrites a slice of real memory of that region with garbage bytes, in place, and
returns the address it hit, as a device would report it. A `param` fault hits params outside
this rank's own optimizer shard where it can (with the distributed optimizer, another rank's
part of the param buffer), which only the rollback's all-gather repairs. The raised UCE error carries that
address; the fault handler's report carries the region (`tft_detail`), which is how the
controller knows whether the rank's data must be replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mindspeed_tft.recovery.interface import RecoverableState

OPTIMIZER = "optimizer"
PARAM = "param"
GRAD = "grad"
ACTIVATION = "activation"
TARGETS = (OPTIMIZER, PARAM, GRAD, ACTIVATION)

_GARBAGE = 0xFF  # NaN in every float format
_HIT_BYTES = 4096


def _megatron_optimizers(state: RecoverableState) -> list[Any]:
    return list(getattr(state.optimizer, "chained_optimizers", [state.optimizer]))


def _optimizer_tensors(state: RecoverableState) -> Iterator[torch.Tensor]:
    for opt in _megatron_optimizers(state):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                yield param
                for key in ("exp_avg", "exp_avg_sq"):
                    tensor = opt.optimizer.state.get(param, {}).get(key)
                    if tensor is not None:
                        yield tensor


def _main_grads(state: RecoverableState) -> Iterator[torch.Tensor]:
    for opt in _megatron_optimizers(state):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    yield param.grad


def _buffers(state: RecoverableState, attribute: str) -> Iterator[torch.Tensor]:
    for chunk in state.model:
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            tensor = getattr(buffer, attribute)
            if tensor is not None:
                yield tensor


def _model_params(state: RecoverableState) -> Iterator[torch.Tensor]:
    """The DDP param buffers (distributed optimizer), else the params themselves."""
    buffers = list(_buffers(state, "param_data"))
    if buffers:
        yield from buffers
        return
    for chunk in state.model:
        yield from chunk.parameters()


def _regions(state: RecoverableState) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in _model_params(state):
        yield PARAM, tensor
    for tensor in _buffers(state, "grad_data"):
        yield GRAD, tensor
    for tensor in _main_grads(state):
        yield GRAD, tensor


def _holds(tensor: torch.Tensor, address: int, *, whole_storage: bool) -> bool:
    if whole_storage:
        start, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
    else:
        start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    return start <= address < start + size


def classify_address(state: RecoverableState, address: int) -> str:
    """The region of the training state that holds `address` (activation if none).

    Optimizer state is matched by the tensors' own bytes, not their storage: with fp32
    params the distributed optimizer's main params are views of this rank's shard of the
    model param buffer, so an address there is optimizer state (restored by the shard copy),
    while one elsewhere in that buffer is a model param of another rank's shard."""
    if any(_holds(t, address, whole_storage=False) for t in _optimizer_tensors(state)):
        return OPTIMIZER
    for region, tensor in _regions(state):
        if _holds(tensor, address, whole_storage=True):
            return region
    return ACTIVATION


def _param_slice(state: RecoverableState, nbytes: int) -> torch.Tensor | None:
    """A slice of model param memory outside this rank's optimizer state where there is one
    (another rank's shard of the param buffer), else the first param bytes."""
    owned = list(_optimizer_tensors(state))
    first = None
    for tensor in _model_params(state):
        raw = tensor.detach().view(-1).view(torch.uint8)
        if raw.numel() == 0:
            continue
        for start in (0, max(raw.numel() - nbytes, 0)):
            window = raw[start:start + nbytes]
            if not any(_holds(t, window.data_ptr(), whole_storage=False)
                       or _holds(t, window.data_ptr() + window.numel() - 1, whole_storage=False)
                       for t in owned):
                return window
        first = raw[:nbytes] if first is None else first
    return first


def _first(tensors: Iterator[torch.Tensor]) -> torch.Tensor | None:
    return next((t for t in tensors if t.numel() > 0), None)


def corrupt_memory(state: RecoverableState, target: str) -> int:
    """Overwrite a slice of `target` memory of this rank with garbage; returns its address.

    The activation target corrupts a freshly allocated working tensor: activations live only
    within a step."""
    if target == OPTIMIZER:
        tensor = _first(_optimizer_tensors(state))
    elif target == PARAM:
        tensor = _param_slice(state, _HIT_BYTES)
    elif target == GRAD:
        tensor = _first(_buffers(state, "grad_data"))
    elif target == ACTIVATION:
        tensor = torch.empty(4096, dtype=torch.float32)
    else:
        raise ValueError(f"unknown memory target {target!r}; allowed: {', '.join(TARGETS)}")
    if tensor is None:
        raise RuntimeError(f"this rank holds no {target} memory to corrupt")
    raw = tensor.detach().view(-1).view(torch.uint8)
    hit = raw[: min(raw.numel(), _HIT_BYTES)]
    hit.fill_(_GARBAGE)
    return hit.data_ptr()
