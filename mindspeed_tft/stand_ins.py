"""Stand-ins for megatron-core modules that cannot be imported here: the ``stand-ins`` moment.

megatron-core 0.16.1's `megatron.core.transformer.custom_layers.batch_invariant_kernels`
imports Triton at its top, and Megatron-LM core_v0.16.1's `megatron.training.initialize`
imports it unconditionally, for one function (`enable_batch_invariant_mode`, used only with
``--batch-invariant-mode``). Triton is a 180-240 MB wheel that a CPU machine has no use for:
nothing else on the CPU training path imports it (megatron-core's other Triton users import
it inside ``try``). Where Triton is not importable, the module is replaced by a stand-in,
in `sys.modules` and as its package's attribute, before anything imports it: its functions
refuse with the fix (``pip install triton``), and reading batch-invariant mode answers
"off", which it is.

Installed by the Megatron-LM host adaptor (`mindspeed_tft.megatron.install`) before
Megatron-LM's imports; nothing is replaced where Triton imports or megatron-core is 0.12.1
(which has no such module). The reference trainer does not import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any, NoReturn

#: (module replaced, the module it cannot import)
REPLACED = (("megatron.core.transformer.custom_layers.batch_invariant_kernels", "triton"),)
#: the stand-in modules carry this attribute (True)
MARK = "__mindspeed_tft_stand_in__"


def _refuse(module: str, missing: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"{module} needs {missing}, which is not installed here (mindspeed-tft stands in "
            f"for the module so that Megatron-LM imports without it); fix: pip install "
            f"{missing}, or leave the option that needs it (--batch-invariant-mode) off")

    return refuse


def _stand_in(name: str, missing: str) -> types.ModuleType:
    module = types.ModuleType(name, f"mindspeed-tft's stand-in for {name} ({missing} is "
                                    "not installed): see mindspeed_tft.stand_ins")
    setattr(module, MARK, True)
    for function in ("enable_batch_invariant_mode", "disable_batch_invariant_mode",
                     "set_batch_invariant_mode"):
        setattr(module, function, _refuse(name, missing))
    module.is_batch_invariant_mode_enabled = lambda: False  # type: ignore[attr-defined]
    module.__all__ = [  # type: ignore[attr-defined]
        "set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
        "disable_batch_invariant_mode", "enable_batch_invariant_mode"]
    return module


def needed() -> list[tuple[str, str]]:
    """The modules of `REPLACED` that this megatron-core has and that cannot import here."""
    found = []
    for name, missing in REPLACED:
        if importlib.util.find_spec(missing) is not None:
            continue
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:  # a package on the way does not exist in this version
            continue
        found.append((name, missing))
    return found


def install() -> None:
    """Put the stand-ins in place (the ``stand-ins`` moment of `mindspeed_tft.patches`)."""
    for name, missing in needed():
        if name in sys.modules:
            continue
        package, _, attr = name.rpartition(".")
        module = _stand_in(name, missing)
        sys.modules[name] = module
        setattr(importlib.import_module(package), attr, module)
