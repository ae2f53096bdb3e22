"""A rank whose retired process group is still being released when its main returns.

Rank 0 starts an all-reduce on a group that rank 1 never joins, retires the group the way a
repair does (destroy, then `release_retired_groups`) and returns from main while the
release thread still waits for the stuck work. Rank 1 exits once rank 0 is in interpreter
teardown (rank 0 writes `teardown` into DIR from an object finalized late in it) or has
exited (rank 0 writes its pid into DIR first). Rank 1's exit ends the stuck work, so
without a guard the release thread wants the GIL back in the middle of the teardown: the
moment that aborted a repaired job at its very end. Usage: retired_group_exit.py RANK PORT DIR.
"""

import builtins
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mindspeed_tft.recovery import rebuild

rank, port, run_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
group = dist.new_group([0, 1])
if rank == 1:
    pid_file, teardown = run_dir / "rank0.pid", run_dir / "teardown"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not teardown.exists():
        if pid_file.exists() and not Path(f"/proc/{pid_file.read_text()}").exists():
            break  # rank 0 has exited
        time.sleep(0.02)
    os._exit(0)

(run_dir / "rank0.pid").write_text(str(os.getpid()))
work = dist.all_reduce(torch.ones(4), group=group, async_op=True)  # rank 1 never joins
rebuild._retired.append(group)
dist.destroy_process_group(group)
del group, work
rebuild.release_retired_groups()


class _LateInTeardown:
    def __del__(self) -> None:
        (run_dir / "teardown").write_text("")
        time.sleep(4.0)  # teardown goes on while rank 1 exits


builtins._tft_late_in_teardown = _LateInTeardown()  # finalized late in interpreter teardown
print("rank 0 returns from main", flush=True)
