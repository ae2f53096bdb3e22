"""megatron-core's ChainedOptimizer.count_zeros, before and after the `replica-optimizer` moment.

One gloo rank, real megatron-core optimizers (FP32Optimizer over torch Adam, chained) on a
param whose grad holds 3 zeros. Prints, as JSON, the count with `log_num_zeros_in_grad`
off and on, unpatched and patched. Usage: count_zeros.py PORT.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from mindspeed_tft import patches
from mindspeed_tft.platform import apply_platform_adaptor

apply_platform_adaptor()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer  # noqa: E402
from megatron.core.optimizer.optimizer_config import OptimizerConfig  # noqa: E402

parallel_state.initialize_model_parallel()
param = torch.nn.Parameter(torch.ones(6))
param.grad = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 0.0])


def count(log_num_zeros_in_grad: bool) -> float:
    optimizer = FP32Optimizer(torch.optim.Adam([param]),
                              OptimizerConfig(log_num_zeros_in_grad=log_num_zeros_in_grad), None)
    optimizer.grad_stats_parallel_group = dist.group.WORLD
    return float(ChainedOptimizer([optimizer]).count_zeros())


result = {"unpatched": [count(False), count(True)]}
patches.install("replica-optimizer")
result["patched"] = [count(False), count(True)]
print(json.dumps(result), flush=True)
dist.destroy_process_group()
