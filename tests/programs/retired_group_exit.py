"""A rank whose retired process group is still being released when training ends.

Rank 0 starts an all-reduce on a group that rank 1 never joins, retires the group the way a
repair does (`leave`-style destroy, then `release_retired_groups`) and returns from main
while the release thread still waits for the stuck work. Its interpreter teardown is made
slow (an object finalized late), and rank 1 exits during it: that ends the stuck work and
the release thread wants the GIL back while the interpreter is finalizing, the moment that
aborted a repaired job at its very end. Usage: retired_group_exit.py RANK PORT.
"""

import builtins
import os
import sys
import time

import torch
import torch.distributed as dist

from mindspeed_tft.recovery import rebuild

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
group = dist.new_group([0, 1])
if rank == 1:
    time.sleep(2.0)  # rank 0 is finalizing by now
    os._exit(0)

work = dist.all_reduce(torch.ones(4), group=group, async_op=True)  # rank 1 never joins
rebuild._retired.append(group)
dist.destroy_process_group(group)
del group, work
rebuild.release_retired_groups()


class _SlowTeardown:
    def __del__(self) -> None:
        time.sleep(4.0)


builtins._tft_slow_teardown = _SlowTeardown()  # finalized late in interpreter teardown
print("rank 0 returns from main", flush=True)
