"""Megatron-LM's `megatron.training` on CPU (gloo): the ``megatron-lm-cpu`` moment.

megatron-core's own CUDA calls are redirected by the platform adaptor (the ``cpu`` moment of
`mindspeed_tft.patches`). Megatron-LM's start-up adds a few of its own: it asserts CUDA,
builds megatron-core's parallel state only when `torch.cuda.device_count() > 0`, selects a
device, loads fused CUDA kernels (needs nvcc) and warms up JIT kernels. On CPU these become:
allowed, one 'device' (the CPU), nothing to select, nothing to load, nothing to warm up.

The training script then runs unchanged with a short list of CPU flags (docs/usage.md):
``--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
--no-rope-fusion --no-bias-swiglu-fusion --no-persist-layer-norm`` (and ``--num-workers 0``
keeps data-loader processes out of small runs); `--distributed-backend nccl` falls back to
gloo with a notice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_installed = False


def _allow_no_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def install_patches() -> None:
    """Install the ``megatron-lm-cpu`` patches (once per process)."""
    global _installed
    if _installed:
        return
    import megatron.legacy.fused_kernels as fused_kernels
    import torch
    from megatron.training import initialize, training

    training.initialize_megatron = _allow_no_cuda(training.initialize_megatron)
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    fused_kernels.load = lambda args: None
    initialize._warmup_jit_function = lambda: None
    _installed = True
