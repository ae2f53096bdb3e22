"""Run megatron-core 0.12.1 on CPU with gloo: `torch.cuda` means "the CPU" in this process.

megatron-core assumes a CUDA device in a few dozen places. On a machine without one, this
adaptor redirects exactly those uses, in one place, the way `torch_npu`'s transfer_to_npu
redirects them to an NPU:

- device: `torch.cuda.current_device()` returns the CPU device, and the tensor factories
  megatron-core calls with `device="cuda"` (`torch.tensor`, `zeros`, `ones`, `empty`, `full`,
  `arange`) place the tensor on the CPU; `Tensor.cuda()` returns the tensor itself.
- streams: `torch.cuda.Stream`, `stream`, `current_stream`, `default_stream` and
  `synchronize` become no-ops (CPU work is ordered by program order).
- RNG: `torch.cuda.get_rng_state`/`set_rng_state`/`manual_seed` and the model-parallel RNG
  tracker's state functions use the CPU generator.
- tensor types: inside the few megatron-core functions that compare `Tensor.type()` with
  `'torch.cuda.FloatTensor'` and friends, CPU tensors report those names.
- FP8: `quantize_param_shard` is skipped when there are no FP8 params (it raises without
  Transformer Engine even for empty lists).
- gloo: every gloo process group is built on one transport device per process
  (`gloo_device`), instead of a device, and a loop thread polling every 10 ms, per group.

Nothing is changed when `torch.cuda.is_available()` is true.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from mindspeed_tft.platform import gloo_device

_APPLIED = False
_CPU = torch.device("cpu")
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # A bare integer means "CUDA device N" to the tensor factories.
    return isinstance(device, int) and not isinstance(device, bool)


def _redirect_device_kwarg(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    wrapper.__tft_cpu_redirect__ = True  # type: ignore[attr-defined]
    return wrapper


def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any):
    return self if self.device.type == "cpu" else self.to(_CPU, non_blocking=non_blocking)


class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU work needs no stream ordering."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _CpuStream()


def _current_stream(device: Any = None) -> _CpuStream:
    return _DEFAULT_STREAM


def _stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


_TENSOR_TYPE = torch.Tensor.type
_type_name_depth = 0


def _type_as_cuda(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any):
    if dtype is None and not kw and self.device.type == "cpu":
        return _TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _TENSOR_TYPE(self, dtype, non_blocking, **kw)


@contextlib.contextmanager
def _cuda_type_names():
    """Inside this context, `cpu_tensor.type()` answers 'torch.cuda.FloatTensor' etc."""
    global _type_name_depth
    _type_name_depth += 1
    torch.Tensor.type = _type_as_cuda
    try:
        yield
    finally:
        _type_name_depth -= 1
        if _type_name_depth == 0:
            torch.Tensor.type = _TENSOR_TYPE


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


class _DropSameGeneratorWarning(logging.Filter):
    """The RNG tracker warns when the CPU RNG changes inside `fork()`; on CPU the "CUDA"
    generator is the CPU generator, so it always does, by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_megatron() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _get_rng_state
    tp_random._set_cuda_rng_state = _set_rng_state
    logging.getLogger(tp_random.__name__).addFilter(_DropSameGeneratorWarning())

    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt.__init__ = _with_cuda_type_names(dist_opt.__init__)
    dist_opt._build_model_and_main_param_groups = staticmethod(
        _with_cuda_type_names(dist_opt._build_model_and_main_param_groups)
    )
    fp16_opt = optimizer.Float16OptimizerWithFloat16Params
    fp16_opt.__init__ = _with_cuda_type_names(fp16_opt.__init__)
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip

    original_quantize = distrib_optimizer.quantize_param_shard

    def quantize_param_shard(model_params, main_params, start_offsets, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original_quantize(model_params, main_params, start_offsets, *args, **kwargs)

    distrib_optimizer.quantize_param_shard = quantize_param_shard


def apply() -> None:
    """Install the redirections; idempotent, and a no-op where CUDA is available."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    for name in _FACTORIES:
        setattr(torch, name, _redirect_device_kwarg(getattr(torch, name)))
    # stand-ins with the CPU's answers, not torch.cuda's signatures: set as a table
    # (assigned one by one, the type checker would hold each to torch's own signature)
    standins: list[tuple[Any, str, Any]] = [(torch.Tensor, "cuda", _tensor_cuda)]
    standins += [(torch.cuda, name, standin) for name, standin in {
        "current_device": lambda: _CPU,
        "Stream": _CpuStream,
        "stream": _stream_context,
        "current_stream": _current_stream,
        "default_stream": _current_stream,
        "synchronize": lambda device=None: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "manual_seed": torch.manual_seed,
    }.items()]
    for owner, name, standin in standins:
        setattr(owner, name, standin)
    _patch_megatron()
    gloo_device.share()
    _APPLIED = True
