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

#: the module replaced, and the module it cannot import
REPLACED = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
MISSING = "triton"
#: its public functions (its ``__all__``) that change the mode: each refuses
SWITCHES = ("set_batch_invariant_mode", "disable_batch_invariant_mode",
            "enable_batch_invariant_mode")


def _refuse(*args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError(
        f"{REPLACED} needs {MISSING}, which is not installed here (mindspeed-tft stands in for "
        f"the module so that Megatron-LM imports without it); fix: pip install {MISSING}, or "
        "leave --batch-invariant-mode off")


def _stand_in() -> types.ModuleType:
    module = types.ModuleType(REPLACED, f"mindspeed-tft's stand-in for {REPLACED} ({MISSING} "
                                        "is not installed): see mindspeed_tft.stand_ins")
    for function in SWITCHES:
        setattr(module, function, _refuse)
    module.is_batch_invariant_mode_enabled = lambda: False  # type: ignore[attr-defined]
    module.__all__ = [*SWITCHES, "is_batch_invariant_mode_enabled"]  # type: ignore[attr-defined]
    return module


def needed() -> bool:
    """Whether this megatron-core has the module and it cannot import here."""
    if importlib.util.find_spec(MISSING) is not None:
        return False
    try:
        return importlib.util.find_spec(REPLACED) is not None
    except ModuleNotFoundError:  # a package on the way does not exist in this version
        return False


def install() -> None:
    """Put the stand-in in place (the ``stand-ins`` moment of `mindspeed_tft.patches`)."""
    if REPLACED in sys.modules or not needed():
        return
    package, _, attr = REPLACED.rpartition(".")
    module = _stand_in()
    sys.modules[REPLACED] = module
    setattr(importlib.import_module(package), attr, module)
