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

It also reads the CPU time of each of the rank's threads (Linux: /proc, in ns) at every
step boundary and charges it per iteration to four groups, [cpu ms, cpu ms] like the rest:
threads_main (the main thread: the trainer, compute included), threads_control (the
plugin's control plane: its Python threads, named `tft-*`, and the ZeroMQ I/O threads),
threads_gloo (gloo's transport loop and work threads, one set per process group) and
threads_other. Unlike process CPU time, this says which threads used it.

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
_thread_cpu: dict[int, float] = {}  # native thread id -> CPU ms at the last step boundary
_thread_comm: dict[int, str] = {}  # native thread id -> its kernel name
THREAD_GROUPS = ("threads_main", "threads_control", "threads_gloo", "threads_other")
_GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


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


def _thread_group(tid: int, comm: str, names: dict[int, str]) -> str:
    if tid == os.getpid():
        return "threads_main"
    if names.get(tid, "").startswith("tft-") or comm.startswith("ZMQbg"):
        return "threads_control"
    return "threads_gloo" if comm in _GLOO_THREADS else "threads_other"


def _charge_threads(record: dict[str, list[float]]) -> None:
    """Add to `record` the CPU ms each thread group used since the last call (Linux: the
    kernel's per-thread run time in ns, /proc/self/task/<tid>/schedstat; a thread seen for
    the first time is charged all its CPU time so far)."""
    import threading

    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    for task in tasks.iterdir():
        tid = int(task.name)
        try:
            cpu = int((task / "schedstat").read_text().split()[0]) / 1e6
            if tid not in _thread_comm:
                _thread_comm[tid] = (task / "comm").read_text().strip()
        except (OSError, IndexError, ValueError):  # ended meanwhile, or no schedstat
            continue
        slot = record.setdefault(_thread_group(tid, _thread_comm[tid], names), [0.0, 0.0])
        used = cpu - _thread_cpu.get(tid, 0.0)
        slot[0] += used
        slot[1] += used
        _thread_cpu[tid] = cpu


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
            _charge_threads(_current)
            _records.append(_current)
        else:
            _charge_threads({})  # start the count here: the set-up before is not a step
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
