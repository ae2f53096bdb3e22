"""A tiny worker for the launcher tests: records how it was started, then waits for orders.

Started by `tft-run` or `torchrun` in place of a training script. It calls
`mindspeed_tft.launcher.spare.wait_for_assignment()` first, like the trainer's `pretrain()`,
so it can be a warm spare too. Arguments (unknown ones, e.g. the mindspeed-tft flags, are
ignored):

- `--out DIR` (required): where it writes and reads its files;
- `--heavy`: import torch and megatron.core first (for timings);
- `--trainer-imports`: import what pretrain_gpt.py and the top of `pretrain()` import (the
  full cost of a cold start up to `wait_for_assignment()`; for measurements);
- `--store`: check in through the TCPStore at MASTER_ADDR:MASTER_PORT (key
  `tftest/checkin/<rank>`, incremented), as workers rendezvous through the agent's store;
- `--processor`: register a `Processor` with the controller;
- `--tie`: `mindspeed_tft.launcher.lifetime.tie_to_launcher()` once it knows its rank, as
  the plugin does (the worker ends when its launcher does, also under a plain torchrun);
- `--max-seconds N`: give up after N seconds with exit code 3 (every wait is bounded).

Files in DIR: it writes `start.<pid>.json` once it knows its rank (`pid`, `ppid`, `t_start`
(process start, before imports), `t_ready` (after `wait_for_assignment`), `spare` (it was a
warm spare), `env` (the launcher-related variables)). It obeys `exit.<rank>` (exit with the
code in the file; the first process of that rank to see it takes it) and `stop` (exit 0).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ENV_PREFIXES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
                "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_", "TFT_", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "CUDA_VISIBLE_DEVICES")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--heavy", action="store_true")
    ap.add_argument("--trainer-imports", action="store_true")
    ap.add_argument("--store", action="store_true")
    ap.add_argument("--processor", action="store_true")
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=120.0)
    args, _ = ap.parse_known_args()
    out = Path(args.out)
    if args.heavy:
        import megatron.core  # noqa: F401
        import torch  # noqa: F401
    if args.trainer_imports:
        import megatron.core.parallel_state  # noqa: F401

        import mindspeed_tft.arguments  # noqa: F401
        import mindspeed_tft.plugin  # noqa: F401
        import mindspeed_tft.training  # noqa: F401
        import mindspeed_tft.training.data  # noqa: F401
        import mindspeed_tft.training.global_vars  # noqa: F401
        import mindspeed_tft.training.model  # noqa: F401

    from mindspeed_tft.launcher.spare import wait_for_assignment

    spare = os.environ.get("TFT_SPARE") == "1"
    wait_for_assignment()
    t_ready = time.time()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if args.tie:
        from mindspeed_tft.launcher.lifetime import tie_to_launcher

        tie_to_launcher()
    if args.store:  # before the start record: a test that saw the record sees the check-in
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=30))
        store.add(f"tftest/checkin/{rank}", 1)
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    record = {"pid": os.getpid(), "ppid": os.getppid(), "t_start": T_START, "t_ready": t_ready,
              "spare": spare, "rank": rank, "env": env}
    tmp = out / f".start.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"start.{os.getpid()}.json")

    processor = None
    if args.processor:
        from mindspeed_tft.control import ControlConfig, Processor

        processor = Processor(rank, world, ControlConfig.from_env(exit_grace=1.0))
        processor.start(timeout=30)

    deadline = time.monotonic() + args.max_seconds
    order = out / f"exit.{rank}"
    while time.monotonic() < deadline:
        if (out / "stop").exists():
            if processor is not None:
                processor.stop(0)
            return 0
        taken = out / f"exit.{rank}.taken.{os.getpid()}"
        try:
            os.rename(order, taken)
        except FileNotFoundError:
            pass
        else:
            code = int(taken.read_text().strip())
            sys.stdout.flush()
            os._exit(code)
        time.sleep(0.02)
    print(f"launcher_worker rank {rank}: no order within {args.max_seconds}s", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
