"""Worker of `bench/recovery.py`: what this machine's own limits are for the bytes a repair
moves, measured with torch.distributed on the same backend and the same number of ranks as
the jobs (run by torchrun right after them).

Arguments (JSON, argv[1]): {"sends": {case: {"bytes": B, "src": s, "dst": d}, ...},
"copy_bytes": C, "copy_rank": c, "gather_bytes": G, "gather_groups": [[ranks], ...],
"repeats": R}; without "copy_bytes" only the sends (the limit measured right after one
job, paired with its shard copy). It measures, each the median of R runs after one warm-up
run, into buffers that already exist (touched):

- `p2p_s` (per case): `dist.send` of one contiguous B-byte tensor from rank s to rank d
  (what that case's shard copy has to move at least, between the same two ranks);
- `copy_s`: `Tensor.copy_` of C bytes into an existing tensor on rank c (memory bandwidth);
- `all_gather_s`: `dist.all_gather_into_tensor` of a G-byte buffer (each rank gives G / k)
  in each group of `gather_groups` at once; `exchange_s`: the same result from
  point-to-point sends (each rank sends its part to every other rank of its group and
  receives theirs); `gather_s`: the faster of the two, the limit of the rollback's param
  gather (on gloo the exchange: `recovery.rollback.gather_chunk_params`).

Rank 0 prints one JSON line {"p2p_s": {case: s}, "copy_s", "all_gather_s", "exchange_s",
"gather_s"} (only "p2p_s" without "copy_bytes").
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.recovery.rollback import post_exchange


def _timed(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        if i:  # the first run warms connections and pages
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    me = dist.get_rank()
    repeats = int(spec.get("repeats", 3))

    def sender(case: dict[str, int]) -> Callable[[], None]:
        src, dst = int(case["src"]), int(case["dst"])
        p2p = torch.ones(int(case["bytes"]), dtype=torch.uint8)

        def send() -> None:
            if me == src:
                dist.send(p2p, dst=dst)
            elif me == dst:
                dist.recv(p2p, src=src)
        return send

    result = _copy_and_gather(spec, me, repeats) if "copy_bytes" in spec else {}
    sends = {name: round(_timed(sender(case), repeats), 5)
             for name, case in spec["sends"].items()}
    if me == 0:
        print(json.dumps({"p2p_s": sends, **{k: round(v, 5) for k, v in result.items()}}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _copy_and_gather(spec: dict[str, Any], me: int, repeats: int) -> dict[str, float]:
    """The plain copy's and the param gather's limits (see the module docstring)."""
    source = torch.ones(int(spec["copy_bytes"]), dtype=torch.uint8)
    target = torch.zeros_like(source)

    def copy() -> None:
        if me == int(spec["copy_rank"]):
            target.copy_(source)

    groups = [dist.new_group(ranks) for ranks in spec["gather_groups"]]
    mine = next(i for i, ranks in enumerate(spec["gather_groups"]) if me in ranks)
    size = len(spec["gather_groups"][mine])
    gathered = torch.zeros(int(spec["gather_bytes"]) // size * size, dtype=torch.uint8)
    part = torch.ones(gathered.numel() // size, dtype=torch.uint8)

    def gather() -> None:
        dist.all_gather_into_tensor(gathered, part, group=groups[mine])

    ranks = spec["gather_groups"][mine]
    parts = list(gathered.chunk(size))

    def exchange() -> None:
        for work in post_exchange(parts, ranks.index(me), ranks, groups[mine]):
            work.wait()

    result = {"copy_s": _timed(copy, repeats),
              "all_gather_s": _timed(gather, repeats), "exchange_s": _timed(exchange, repeats)}
    result["gather_s"] = min(result["all_gather_s"], result["exchange_s"])
    return result


if __name__ == "__main__":
    main()
