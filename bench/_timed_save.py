"""LAUNCHER of `bench/dump.py`: torchrun whose workers time checkpoint saves and dump stages.

`scripts/pretrain_tiny_cpu.sh` calls `$LAUNCHER --nproc-per-node N --master-port P
<repo>/pretrain_gpt.py <flags>`. With LAUNCHER = `python bench/_timed_save.py`, this runs
torchrun with the same arguments, but every rank starts `bench/_timed_save.py --timed-worker
<repo>/pretrain_gpt.py <flags>`: the unchanged trainer (runpy, as `__main__`) with a few
functions wrapped. Each wrapped call that returns appends one JSON line
`{"what", "iteration", "start", "end"}` (unix seconds) to `$BENCH_SAVE_OUT/rank<R>.jsonl`
(written at once: the job is killed later on). What is timed:

- `save`: the trainer's `save_checkpoint` (periodic and final saves; collective, with
  barriers at its start and end), `iteration` = the saved one; inside it
  `save_optimizer_state` (the optimizer's `save_parameter_state`, called on megatron-core's
  `ChainedOptimizer`: gather of the optimizer shards to DP rank 0 and its `distrib_optim.pt`);
- the dying-gasp dump's stages (`mindspeed_tft.recovery`): `dump_write_shard` (a holder writes
  its optimizer shard file) with `dump_shard_to_cpu` inside it, `dump_wait_shards` (the
  assembler waits for the other holders' files), `dump_assemble_and_write` (read the shard
  files, assemble megatron-core's parameter state, write `distrib_optim.pt` and
  `model_optim_rng.pt`) with `dump_read_shards` and `dump_assemble` inside it, and
  `dump_publish` (checks and atomic rename).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER_FLAG = "--timed-worker"


def _record(what: str, iteration: int | None, start: float, end: float) -> None:
    out = os.environ.get("BENCH_SAVE_OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    line = json.dumps({"what": what, "iteration": iteration, "start": start, "end": end})
    rank = int(os.environ.get("RANK", "0"))
    with open(Path(out) / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(line + "\n")


def _timed(
    what: str, fn: Callable[..., Any],
    iteration: Callable[[tuple[Any, ...]], int | None] = lambda args: None,
) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        result = fn(*args, **kwargs)  # a call that raises is not recorded
        _record(what, iteration(args), start, time.time())
        return result

    return wrapper


def install() -> None:
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    import mindspeed_tft.recovery.actions as actions
    import mindspeed_tft.recovery.dump as dump
    import mindspeed_tft.training.training as training

    training.save_checkpoint = _timed(
        "save", training.save_checkpoint, lambda args: int(args[0].iteration))
    # the outer (chained) optimizer's: the plugin replaces the distributed optimizer's own
    ChainedOptimizer.save_parameter_state = _timed(
        "save_optimizer_state", ChainedOptimizer.save_parameter_state)
    actions.write_shard = _timed("dump_write_shard", actions.write_shard,
                                 lambda args: int(args[2]))
    dump.local_shard_payload = _timed("dump_shard_to_cpu", dump.local_shard_payload)
    actions.RecoveryActions._wait_for_shards = _timed(
        "dump_wait_shards", actions.RecoveryActions._wait_for_shards)
    actions.assemble = _timed("dump_assemble_and_write", actions.assemble,
                              lambda args: int(args[2].iteration))
    dump._read_shards = _timed("dump_read_shards", dump._read_shards)
    dump._assemble_parameter_state = _timed("dump_assemble", dump._assemble_parameter_state)
    actions.publish = _timed("dump_publish", actions.publish)


def worker(argv: list[str]) -> None:
    sys.argv = argv
    install()
    runpy.run_path(argv[0], run_name="__main__")


def launch(argv: list[str]) -> None:
    from torch.distributed.run import main as torchrun_main

    target = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    argv[target:target] = [str(Path(__file__).resolve()), WORKER_FLAG]
    torchrun_main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER_FLAG]:
        worker(sys.argv[2:])
    else:
        launch(sys.argv[1:])
