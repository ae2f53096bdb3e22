"""Which accelerator this process trains on, and how to make megatron-core run there.

`detect_platform()` answers once per process: Ascend NPU when `torch_npu` imports, CUDA when
`torch.cuda.is_available()`, else CPU. `distributed_backend()` maps the platform to the
torch.distributed backend (hccl, nccl, gloo). `apply_platform_adaptor()` installs the adaptor
the platform needs before megatron-core is used: on CPU the redirections of `cpu_adaptor`,
on NPU `torch_npu`'s own transfer of `torch.cuda` calls, on CUDA nothing; and, wherever
megatron-core falls back to torch's own Adam, the checkpoint fix of `native_adam`.
`import_megatron_core()` is the first import of megatron-core in a process (entry points call
it before anything else imports it): it refuses a megatron-core outside the supported range
(`megatron_version`: exit 2, one line), and on CPU keeps its fused helpers eager (see there).

Modules:

- `cpu_adaptor`: megatron-core on CPU with gloo: `torch.cuda` means the CPU in this process
- `gloo_device`: one gloo transport device per process; lazy connection for larger groups
- `megatron_version`: which megatron-core this process runs on, and the range supported
- `native_adam`: megatron-core with torch's own Adam (no Apex, no Transformer Engine)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any

import torch

from mindspeed_tft.envvars import launcher_value

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


def _eager(model: Any = None, **_options: Any) -> Any:
    """`torch.compile` that compiles nothing: the function itself (or, called with options
    only, a decorator that returns it)."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_core() -> ModuleType:
    """Import megatron-core; on CPU with its `jit_fuser` eager instead of `torch.compile`.

    megatron-core (0.12.1 and 0.16.1) decorates its fused helpers (bias-GeLU, SwiGLU, ...) with
    `torch.compile` when it is imported, which pulls in TorchDynamo and Inductor: about 2.4 s
    of the 4 s a CPU rank spends importing, for kernels that CPU runs do not call (their
    fused-kernel flags are turned off with a notice) and that Inductor could only build with a
    C++ toolchain. On CPU the import therefore runs with `torch.compile` standing in as the
    identity, so `megatron.core.jit.jit_fuser` keeps functions eager; `torch.compile` itself
    is restored right after. On NPU and CUDA this is a plain import. Call it before anything
    else imports megatron-core; later calls just return the module.
    """
    from mindspeed_tft import patches
    from mindspeed_tft.platform import megatron_version

    megatron_version.check()  # exit 2, one line, outside the supported range
    if "megatron.core" in sys.modules or detect_platform() != CPU:
        return importlib.import_module("megatron.core")
    with patches.swapped("torch:compile", _eager):
        module = importlib.import_module("megatron.core")
        importlib.import_module("megatron.core.jit")
    return module


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
    if launcher_value("RANK") in (None, "0"):
        print(
            f"[mindspeed-tft] notice: --distributed-backend {requested} is not available on "
            f"{detect_platform()}; using {native}",
            flush=True,
        )
    return native


def apply_platform_adaptor() -> str:
    """Make megatron-core usable on this platform; idempotent. Returns the platform name."""
    from mindspeed_tft import patches

    platform = detect_platform()
    if platform == CPU:
        patches.install("cpu")
    elif platform == NPU:
        # torch_npu's own adaptor redirects torch.cuda.* to torch.npu.* (what MindSpeed uses).
        from torch_npu.contrib import transfer_to_npu  # noqa: F401
    patches.install("torch-adam")
    return platform
