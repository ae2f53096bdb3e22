"""megatron-core 0.12.1 with torch's own Adam (no Apex, no Transformer Engine).

Without Apex or Transformer Engine, megatron-core falls back to `torch.optim.AdamW`, whose
per-parameter state carries a `step` tensor next to `exp_avg` and `exp_avg_sq`. The
distributed optimizer restores the step from the param groups (`load_state_dict`) and then
copies every per-parameter state tensor from the checkpoint's parameter state, which holds
only `param`, `exp_avg` and `exp_avg_sq`: the copy fails with `KeyError: 'step'`.
`apply()` makes that copy take the tensors the checkpoint holds and keep the step it already
restored.

`load_state_dict` also gives every parameter's state the *same* `step` tensor object, which
torch's Adam then increments once per parameter, in place: after a resume the bias
correction of each parameter uses a different, wrong step. `apply()` gives each parameter
its own copy. Applied on every platform where the fallback is in use (always on CPU).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_APPLIED = False


def apply() -> None:
    """Patch the distributed optimizer's per-parameter state restore; idempotent."""
    global _APPLIED
    from megatron.core.optimizer import distrib_optimizer

    if _APPLIED or distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        if self.ddp_config.use_custom_fsdp or self.config.use_precision_aware_optimizer:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():  # without --bf16 the main param is a view of the model param
            for key, tensor in tensors.items():
                destination[key].copy_(tensor)

    cls._set_main_param_and_optimizer_states = set_states

    original_load = cls.load_state_dict

    @functools.wraps(original_load)
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        original_load(self, state_dict)
        for param_state in self.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()

    cls.load_state_dict = load_state_dict
    _APPLIED = True
