"""The gloo reduce-scatter stand-in (`recovery.collectives`) on 2 real ranks.

Each rank reduce-scatters two buffers of integer-valued floats (sums exact in any order):
one into a view of its own slice of the buffer (how megatron-core's grad buffers do it), one
into a separate tensor. It prints, as JSON, whether each output equals the exact sum and
whether the buffer itself was reduced (in place) or left as it was (copied first).
Usage: gloo_reduce_scatter.py RANK PORT.
"""

import json
import sys

import torch
import torch.distributed as dist

from mindspeed_tft import patches

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
patches.install("gloo-collectives")
from megatron.core.distributed import param_and_grad_buffer as buffers  # noqa: E402

reduce_scatter = buffers.dist_reduce_scatter_func
n = 1 << 16


def values(r: int) -> torch.Tensor:
    return torch.arange(2 * n, dtype=torch.float32) * (r + 1)


total = values(0) + values(1)
own = values(rank)
view = own[rank * n:(rank + 1) * n]
with buffers._coalescing_manager(None, async_ops=False):  # megatron-core's sync: started, then waited
    reduce_scatter(view, own, group=None, async_op=True)
separate_input, separate = values(rank), torch.empty(n)
reduce_scatter(separate, separate_input, group=None)
print(json.dumps({
    "view_exact": bool(torch.equal(view, total[rank * n:(rank + 1) * n])),
    "buffer_reduced_in_place": bool(torch.equal(own, total)),
    "separate_exact": bool(torch.equal(separate, total[rank * n:(rank + 1) * n])),
    "separate_input_kept": bool(torch.equal(separate_input, values(rank))),
}), flush=True)
dist.destroy_process_group()
