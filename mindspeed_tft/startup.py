"""A worker's start-up without the cyclic garbage collector's passes over the import-time heap.

Importing torch and megatron-core builds ~600 k Python objects, and CPython's collector walks
all of them again at each full collection while they are being built (figures: docs/design.md,
section 9, "Imports without the cyclic garbage collector"). So a worker's entry point calls
`defer_gc` before its first import of torch, and its host's `pretrain()` calls `imports_done`
once the imports are done (after a warm spare's wait, before anything is built): it freezes
what exists (`gc.freeze`: later collections never walk it; the few thousand cyclic leftovers
of the imports stay) and switches the collector back on. Model, optimizer and data are built
with the collector on, so no tensor of theirs can be kept alive by the freeze. A process
whose collector was already off (the user's choice) is left as it is.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from importlib import import_module

#: modules a worker's set-up imports on first use, which `imports_done` (and a warm spare,
#: before it is ready) imports ahead: torch imports `torch._dynamo` on the first
#: construction of a `torch.optim.Optimizer` (its `_disable_dynamo` wrapper), 0.8 s of a
#: repair with a spare on this project's CPU machine
LAZY_TORCH_IMPORTS = ("torch._dynamo",)

_deferred = False


def defer_gc() -> None:
    """At a process's entry, before its heavy imports: no cyclic collection until
    `imports_done`."""
    global _deferred
    if gc.isenabled():
        gc.disable()
        _deferred = True


def imports_done(also: Iterable[str] = LAZY_TORCH_IMPORTS) -> None:
    """Import the modules `also` (what the set-up would import on first use anyway), freeze
    every object there is and switch the collector back on (if `defer_gc` switched it off)."""
    global _deferred
    if not _deferred:
        return
    for name in also:
        import_module(name)
    gc.freeze()
    gc.enable()
    _deferred = False
