"""Megatron-LM's checkpoint layout (torch format) and what every host's checkpoints share:
folder and file names, the tracker file, publishing a checkpoint atomically, and the RNG
state of a process.

Layout under the save directory (SPEC 11)::

    latest_checkpointed_iteration.txt          the last published iteration
    iter_0000100/
        mp_rank_00/model_optim_rng.pt          PP = 1: per tensor-parallel rank
        mp_rank_00_001/model_optim_rng.pt      PP > 1: per (TP, PP) rank
        mp_rank_00/distrib_optim.pt            distributed optimizer: fp32 main params,
                                               exp_avg, exp_avg_sq (megatron-core's DP-zero
                                               format)

The content of `model_optim_rng.pt` is the host's (see `RecoverableState`); the RNG state
inside it is `get_rng_state()`'s dict, the keys Megatron-LM uses.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import numpy as np
import torch

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"


def iteration_dir_name(iteration: int) -> str:
    """`iter_0000100` for iteration 100."""
    return f"iter_{iteration:07d}"


def model_parallel_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron-LM's per-model-parallel-rank folder: `mp_rank_TT` or `mp_rank_TT_PPP`."""
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def this_rank_dir_name() -> str:
    """The model-parallel folder name of the calling rank."""
    from megatron.core import parallel_state as ps

    return model_parallel_dir_name(
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
    )


def read_tracker(root: str) -> int | None:
    """The last published iteration under `root`, or None when there is none."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{path} holds {text!r}; expected an iteration number"
        ) from None


def write_tracker(root: str, iteration: int) -> None:
    """Replace the tracker atomically (write a temporary file, then rename)."""
    tmp = os.path.join(root, f".{TRACKER_FILENAME}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER_FILENAME))


def publish_checkpoint(root: str, iteration: int) -> str:
    """Rename `iter_X_tmp` to `iter_X` (replacing an older copy) and point the tracker at it."""
    final = os.path.join(root, iteration_dir_name(iteration))
    tmp = final + "_tmp"
    if os.path.exists(final):
        stale = final + "_old"
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, final)
    write_tracker(root, iteration)
    return final


def get_rng_state() -> dict[str, Any]:
    """Every RNG this process uses: python, numpy, torch, the model-parallel tracker."""
    from megatron.core import tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    else:  # Megatron-LM's loader restores it unconditionally (on CPU: the CPU generator)
        state["cuda_rng_state"] = state["torch_rng_state"]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned."""
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
