"""gloo process groups with and without the shared transport device (`platform.gloo_device`,
installed by the ``cpu`` patch moment) on 2 real ranks.

Each rank starts the default group (timeout 77 s), then makes GROUPS more groups of both
ranks (timeout 55 s) and all-reduces its rank + 1 over each. It prints, as JSON: the
threads each extra group added to the process, the devices behind the default group, the
groups' timeouts, whether every sum was exact and whether torch's `isinstance` checks
still recognise the groups. Usage: gloo_shared_device.py RANK PORT shared|own.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from mindspeed_tft import patches
from mindspeed_tft.platform import gloo_device

GROUPS = 6
rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if mode == "shared":
    patches.install("cpu")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def backend(group: object) -> object:
    return group._get_backend(torch.device("cpu"))  # type: ignore[attr-defined]


dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=timedelta(seconds=77))
before = threads()
groups = [dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=55))
          for _ in range(GROUPS)]
added = threads() - before
sums = []
for group in groups:
    value = torch.full((1024,), float(rank + 1))
    dist.all_reduce(value, group=group)
    sums.append(bool(torch.equal(value, torch.full((1024,), 3.0))))
world = backend(dist.group.WORLD)
print(json.dumps({
    "threads_per_group": added / GROUPS,
    "devices": len(world.options._devices),
    "shared": c10d.ProcessGroupGloo is gloo_device.SharedDeviceGloo,
    "timeouts_s": [world.options._timeout.total_seconds(),
                   backend(groups[0]).options._timeout.total_seconds()],
    "sums_exact": all(sums),
    "isinstance": all(isinstance(backend(g), c10d.ProcessGroupGloo)
                      and isinstance(backend(g), dist.ProcessGroupGloo)
                      for g in [dist.group.WORLD, *groups]),
}), flush=True)
dist.barrier()
os._exit(0)  # no interpreter teardown: gloo's can abort at exit, with or without sharing
