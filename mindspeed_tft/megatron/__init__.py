"""The Megatron-LM host: mindspeed-tft in Megatron-LM's own training loop (core_v0.12.1 to
core_v0.16.1).

Three ways to switch it on, all with the user's unchanged training script and flags:

- one line at the top of the script, MindSpeed's convention:
  ``import mindspeed_tft.megatron_adaptor``;
- no edit: ``python -m mindspeed_tft.megatron pretrain_gpt.py ARGS`` (what the launcher's
  workers run), or ``tft-run ... pretrain_gpt.py ARGS``, which starts its workers that way
  when the script imports `megatron.training`.

`install()` is the named moment: the stand-ins of modules that cannot import here
(`mindspeed_tft.stand_ins`), the platform adaptor, the update bracket, the
``megatron-lm`` patches (`adaptor`) and, on CPU, the ``megatron-lm-cpu`` ones (`cpu`).
Megatron-LM itself comes from wherever the script finds it (a user's clone first on the
path); the megatron-core wheel's `megatron.core` is the same code.

Modules:

- `adaptor`: the ``megatron-lm`` patches: mindspeed-tft inside `megatron.training`'s loop
- `cpu`: the ``megatron-lm-cpu`` patches: Megatron-LM's loop on CPU (gloo)
- `helpers`: whether Megatron-LM can build its dataset helpers here, asked before it tries
- `__main__`: ``python -m mindspeed_tft.megatron SCRIPT ARGS``: a script run unchanged
"""

from __future__ import annotations


def install() -> None:
    """Make Megatron-LM's `pretrain()` run with mindspeed-tft (idempotent). Call before the
    training script imports `megatron.training`'s `pretrain`."""
    from mindspeed_tft import patches
    from mindspeed_tft.platform import CPU, apply_platform_adaptor, import_megatron_core

    import_megatron_core()
    patches.install("stand-ins")  # before Megatron-LM imports what they stand in for
    platform = apply_platform_adaptor()
    patches.install("update-bracket")
    patches.install("megatron-lm")
    if platform == CPU:
        patches.install("megatron-lm-cpu")
