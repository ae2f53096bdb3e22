"""The rollback's param gather on gloo (`recovery.rollback._ring_gather`) on 4 real ranks.

A stand-in for a megatron-core bucket group (its two buckets' param buffers, 4 shards each,
this rank's shard filled with its own values and the rest zero) is gathered around the ring;
it prints, as JSON, whether every bucket equals torch's own all-gather of the same shards,
and how many process-group connections the gather made (`collectives.count_connections`,
with the groups lazily connected as on the CPU platform: two ring neighbours).
Usage: ring_gather.py RANK PORT.
"""

import json
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from mindspeed_tft.platform import gloo_device
from mindspeed_tft.recovery import collectives
from mindspeed_tft.recovery.rollback import _ring_gather

rank, port = int(sys.argv[1]), int(sys.argv[2])
size = 4
gloo_device.share()
store = dist.TCPStore("127.0.0.1", port, size, rank == 0)
dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
group = dist.new_group(list(range(size)))
buckets = []
for numel in (size * 1000, size * 37):
    data = torch.zeros(numel)
    shard = numel // size
    data[rank * shard:(rank + 1) * shard] = torch.arange(shard, dtype=torch.float32) + 1000 * rank
    buckets.append(SimpleNamespace(param_data=data))
expected = []
for bucket in buckets:
    shard = bucket.param_data.numel() // size
    own = bucket.param_data[rank * shard:(rank + 1) * shard].clone()
    out = torch.empty(bucket.param_data.numel())
    dist.all_gather_into_tensor(out, own, group=dist.new_group(list(range(size))))
    expected.append(out)
collectives.count_connections([port])  # what exists before the gather (port: the store's)
_ring_gather(SimpleNamespace(buckets=buckets, intra_distributed_optimizer_instance_group=group,
                             intra_distributed_optimizer_instance_size=size,
                             intra_distributed_optimizer_instance_rank=rank))
opened = collectives.count_connections([port])
exact = all(torch.equal(b.param_data, e) for b, e in zip(buckets, expected, strict=True))
print(json.dumps({"exact": exact, "connections": opened}))
# every rank counted before any goes on: a rank's barrier below connects it to others (lazily),
# and rank 0 once counted the connection a faster rank opened for it (the store's port is
# not counted)
store.set(f"counted/{rank}", "1")
store.wait([f"counted/{r}" for r in range(size)], timedelta(seconds=60))
dist.barrier()
