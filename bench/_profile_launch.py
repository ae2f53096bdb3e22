"""LAUNCHER of `bench/overhead.py --profile`: torchrun with the timing worker in front.

`scripts/pretrain_tiny_cpu.sh` calls `$LAUNCHER --nproc-per-node N --master-port P
<repo>/pretrain_gpt.py <flags>`. With LAUNCHER = `python bench/_profile_launch.py`, this runs
torchrun with the same arguments but starts `bench/_profile_worker.py <repo>/pretrain_gpt.py
<flags>` on every rank, so the profiled job is the real job plus timing wrappers.
"""

from __future__ import annotations

import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "_profile_worker.py"


def main() -> None:
    from torch.distributed.run import main as torchrun_main

    argv = list(sys.argv[1:])
    target = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    argv.insert(target, str(WORKER))
    torchrun_main(argv)


if __name__ == "__main__":
    main()
