"""Which accelerator this process trains on, and how to make megatron-core run there.

`detect_platform()` answers once per process: Ascend NPU when `torch_npu` imports, CUDA when
`torch.cuda.is_available()`, else CPU. `distributed_backend()` maps the platform to the
torch.distributed backend (hccl, nccl, gloo). `apply_platform_adaptor()` installs the adaptor
the platform needs before megatron-core is used: on CPU the redirections of `cpu_adaptor`,
on NPU `torch_npu`'s own transfer of `torch.cuda` calls, on CUDA nothing; and, wherever
megatron-core falls back to torch's own Adam, the checkpoint fix of `native_adam`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

NPU = "npu"
CUDA = "cuda"
CPU = "cpu"

_BACKEND_BY_PLATFORM = {NPU: "hccl", CUDA: "nccl", CPU: "gloo"}


@functools.cache
def detect_platform() -> str:
    """Return "npu", "cuda" or "cpu" for this process (cached)."""
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():  # type: ignore[attr-defined]
                return NPU
        except Exception as exc:  # a broken torch_npu install must not stop CPU runs
            logger.warning("torch_npu is installed but unusable (%s); not using NPU", exc)
    if torch.cuda.is_available():
        return CUDA
    return CPU


def distributed_backend(requested: str | None = None) -> str:
    """The torch.distributed backend for this platform.

    `requested` is the user's `--distributed-backend`. A backend this platform cannot run
    (nccl or hccl on CPU, say) falls back to the platform's own with a one-line notice.
    """
    native = _BACKEND_BY_PLATFORM[detect_platform()]
    allowed = {native, "gloo"}
    if requested is None or requested in allowed:
        return requested or native
    if requested not in ("nccl", "hccl", "gloo"):
        raise ValueError(
            f"--distributed-backend {requested!r} is not a backend; allowed: nccl, hccl, gloo"
        )
    if os.environ.get("RANK", "0") == "0":
        print(
            f"[mindspeed-tft] notice: --distributed-backend {requested} is not available on "
            f"{detect_platform()}; using {native}",
            flush=True,
        )
    return native


def device_for_rank(local_rank: int) -> torch.device:
    """The device a rank trains on: its local accelerator, or the CPU."""
    platform = detect_platform()
    if platform == CPU:
        return torch.device("cpu")
    return torch.device(platform, local_rank)


def apply_platform_adaptor() -> str:
    """Make megatron-core usable on this platform; idempotent. Returns the platform name."""
    from mindspeed_tft.platform import native_adam

    platform = detect_platform()
    if platform == CPU:
        from mindspeed_tft.platform import cpu_adaptor

        cpu_adaptor.apply()
    elif platform == NPU:
        # torch_npu's own adaptor redirects torch.cuda.* to torch.npu.* (what MindSpeed uses).
        from torch_npu.contrib import transfer_to_npu  # noqa: F401
    native_adam.apply()
    return platform
