"""Worker of `bench/overhead.py --profile`: the real pretrain_gpt.py with timing wrappers.

Started by torchrun (via `bench/_profile_launch.py`) as `_profile_worker.py <pretrain_gpt.py>
<flags>`. Before running the trainer unchanged (runpy, as `__main__`) it wraps, at class
level, the parts of a step whose cost depends on the optimizer-replica layout, and times
every call (wall and process CPU time, ms), summed per training iteration:

- iteration: one whole iteration of the training loop, from one `train_step` to the next
  (the step plus logging, events, checkpoint and the hooks after it);
- train_step: the trainer's `train_step` (what the log's "elapsed time per iteration" times);
- plugin_hooks: the trainer hooks (`HookList` calls: step bookkeeping, the processor's
  reports, step snapshots), inside and after the step;
- forward_backward: megatron-core's forward-backward schedule (includes the grad reduction
  that `--overlap-grad-reduce` starts from backward hooks and finalize_model_grads waits for);
- grad_sync: `_ParamAndGradBucketGroup.start_grad_sync` + `finish_grad_sync` (reduce-scatter
  in the optimizer chunk; with N > 1 also the all-reduce across the N chunks);
- optimizer_step: the (chained) optimizer's `step`; inside it: prepare_grads (copy grads
  to fp32 main grads), grad_norm, clip, local_update (the inner Adam step + copy of main params
  into model params) with adam inside it, and param_gather (`start_param_sync`:
  all-gather of the updated params inside the chunk).

Nested calls of the same category are counted once; hooks that run outside `train_step`
(after the step) are charged to the step before them. At exit each rank writes
`$BENCH_PROFILE_OUT/rank<R>.json`: a list of per-iteration {category: [wall_ms, cpu_ms]}
(the last iteration, which runs into the final checkpoint, is left out).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_records: list[dict[str, list[float]]] = []
_current: dict[str, list[float]] | None = None
_active: set[str] = set()
_iteration_start: tuple[float, float] | None = None


def _timed(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _current is None or category in _active:
            return fn(*args, **kwargs)
        _active.add(category)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            slot = _current.setdefault(category, [0.0, 0.0])
            slot[0] += (time.perf_counter() - wall) * 1000.0
            slot[1] += (time.process_time() - cpu) * 1000.0
            _active.discard(category)

    return wrapper


def _patch_method(cls: type, name: str, category: str) -> None:
    setattr(cls, name, _timed(category, getattr(cls, name)))


def install() -> None:
    """Wrap the timed functions (call before the trainer runs)."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.pipeline_parallel as pp
    import torch
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    import mindspeed_tft.training.training as training
    from mindspeed_tft.plugin.hooks import HookList

    for name in ("start_grad_sync", "finish_grad_sync"):
        _patch_method(_ParamAndGradBucketGroup, name, "grad_sync")
    _patch_method(_ParamAndGradBucketGroup, "start_param_sync", "param_gather")
    _patch_method(mopt.ChainedOptimizer, "step", "optimizer_step")
    _patch_method(mopt.MixedPrecisionOptimizer, "step", "optimizer_step")
    _patch_method(mopt.MixedPrecisionOptimizer, "prepare_grads", "prepare_grads")
    _patch_method(mopt.ChainedOptimizer, "get_grad_norm", "grad_norm")
    _patch_method(mopt.ChainedOptimizer, "count_zeros", "count_zeros")
    _patch_method(DistributedOptimizer, "get_grad_norm", "grad_norm")
    # the CPU adaptor later wraps clip_grads' function and puts its wrapper into both modules:
    # time the innermost one, so that the time is counted whichever wrapper calls it
    clip = _timed("clip", clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = mopt.clip_grad_by_total_norm_fp32 = clip
    _patch_method(mopt.MixedPrecisionOptimizer, "step_with_ready_grads", "local_update")
    _patch_method(torch.optim.AdamW, "step", "adam")
    _patch_method(torch.optim.Adam, "step", "adam")

    for name in ("on_phase", "on_update_start", "on_update_end", "on_step_end"):
        _patch_method(HookList, name, "plugin_hooks")

    original_get_fb = pp.get_forward_backward_func

    def get_forward_backward_func() -> Callable[..., Any]:
        return _timed("forward_backward", original_get_fb())

    pp.get_forward_backward_func = get_forward_backward_func

    original_train_step = training.train_step

    @functools.wraps(original_train_step)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        global _current, _iteration_start
        wall, cpu = time.perf_counter(), time.process_time()
        if _current is not None and _iteration_start is not None:
            # the previous loop iteration ends where this step begins
            _current["iteration"] = [
                (wall - _iteration_start[0]) * 1000.0, (cpu - _iteration_start[1]) * 1000.0,
            ]
            _records.append(_current)
        _current = {}
        _iteration_start = (wall, cpu)
        try:
            return original_train_step(*args, **kwargs)
        finally:
            _current["train_step"] = [
                (time.perf_counter() - wall) * 1000.0,
                (time.process_time() - cpu) * 1000.0,
            ]

    training.train_step = train_step


def _write() -> None:
    out = os.environ.get("BENCH_PROFILE_OUT")
    if not out:
        return
    rank = int(os.environ.get("RANK", "0"))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(_records))


def main() -> None:
    target = sys.argv[1]
    sys.argv = sys.argv[1:]
    install()
    atexit.register(_write)
    # the trainer ends a finished job with os._exit (no interpreter teardown, no atexit)
    original_exit = os._exit

    def exit_after_writing(code: int) -> None:
        _write()
        original_exit(code)

    os._exit = exit_after_writing
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
