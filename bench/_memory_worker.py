"""Worker of `bench/memory.py`: one rank of a real training job that measures its memory.

Run by torchrun with pretrain_gpt.py's flags (Megatron-LM's plus mindspeed-tft's). It sets the
job up with the trainer's own code, as `mindspeed_tft.training.pretrain` does
(`initialize_megatron`, `install_update_bracket`, `TFTPlugin.setup`,
`setup_model_and_optimizer` with pretrain_gpt's model provider, mock-data iterators,
`TFTPlugin.attach` / `hooks` / `run` / `finish`), runs `--train-iters` real `train_step`s with
train()'s hooks and, after each, counts the bytes that exist on this rank:

- params: the storage of every DDP buffer's `param_data` (bf16 model params live there);
- grads: the storage of every DDP buffer's `grad_data`;
- optimizer: every tensor of the inner torch optimizers: the fp32 main params, their `.grad`
  (the fp32 main grads the distributed optimizer attaches in `prepare_grads`; they are still
  attached after `step()` and dropped by the next step's `zero_grad`), and the per-param state
  (`exp_avg`, `exp_avg_sq`, `step`).

Each distinct storage is counted once (keyed by `untyped_storage().data_ptr()`), in the order
params, grads, optimizer: a main grad that is a view of the fp32 grad buffer costs nothing
extra. As cross-checks it also sums every tensor the Python garbage collector can see
(`other`: tensors outside the three categories, e.g. rotary caches, the last batch, losses)
and records the process's resident set size (current and peak).

The result (one JSON object) goes to `$BENCH_MEMORY_OUT/rank<R>.json`.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


class StorageCounter:
    """Sums the bytes of distinct storages, attributing each to the first category seen."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}
        self.count: dict[str, int] = {}

    def add(self, category: str, tensor: torch.Tensor | None) -> None:
        self.bytes.setdefault(category, 0)
        self.count.setdefault(category, 0)
        if tensor is None:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[category] += storage.nbytes()
        self.count[category] += 1


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers behind a (possibly chained) megatron optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def measure(model: list[torch.nn.Module], optimizer: Any) -> dict[str, Any]:
    """Bytes of params, grads and optimizer state on this rank (see the module docstring)."""
    counter = StorageCounter()
    buffers = [
        buffer
        for chunk in model
        for buffer in list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []))
    ]
    for buffer in buffers:
        counter.add("params", buffer.param_data)
    for buffer in buffers:
        counter.add("grads", buffer.grad_data)
    main_params = 0
    main_grads = 0
    for megatron_opt in inner_optimizers(optimizer):
        torch_opt = megatron_opt.optimizer
        for group in torch_opt.param_groups:
            for param in group["params"]:
                main_params += 1
                counter.add("optimizer", param)
                counter.add("main_grads", param.grad)
                main_grads += param.grad is not None
                for value in torch_opt.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor):
                        counter.add("optimizer", value)
    # Everything else Python can see (diagnostic only).
    gc.collect()
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                counter.add("other", obj)
        except Exception:  # noqa: BLE001 - some tracked objects refuse inspection
            continue
    # Model params outside the buffers (should not exist with the distributed optimizer).
    outside = 0
    for chunk in model:
        for param in chunk.parameters():
            if param.untyped_storage().data_ptr() not in counter.seen:
                outside += param.numel()
    numel = sum(p.numel() for chunk in model for p in chunk.parameters())
    return {
        "num_params": numel,
        "buffer_numel": sum(b.numel for b in buffers),
        "buffer_numel_unpadded": sum(b.numel_unpadded for b in buffers),
        "param_dtype": str(buffers[0].param_data.dtype) if buffers else None,
        "grad_dtype": str(buffers[0].grad_data.dtype) if buffers else None,
        "bytes": dict(counter.bytes),
        "storages": dict(counter.count),
        "main_params": main_params,
        "main_params_with_grad": main_grads,
        "params_outside_buffers": outside,
    }


def resident_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process, in bytes (Linux)."""
    import resource

    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm", encoding="ascii") as f:
        current = int(f.read().split()[1]) * page
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    from megatron.core import parallel_state as ps

    import pretrain_gpt
    from mindspeed_tft import patches
    from mindspeed_tft.arguments import add_tft_args, validate_tft_args
    from mindspeed_tft.plugin import TFTPlugin
    from mindspeed_tft.plugin.hooks import HookList, set_update_listener
    from mindspeed_tft.plugin.state import TrainingState
    from mindspeed_tft.training.data import build_data_iterator, get_train_valid_test_num_samples
    from mindspeed_tft.training.global_vars import get_args
    from mindspeed_tft.training.initialize import initialize_megatron, initialize_model_parallel
    from mindspeed_tft.training.training import setup_model_and_optimizer, train_step

    out_dir = Path(os.environ["BENCH_MEMORY_OUT"])
    initialize_megatron(add_tft_args, validate_tft_args, sys.argv[1:])
    args = get_args()
    patches.install("update-bracket")
    plugin = TFTPlugin(args, initialize_model_parallel)
    plugin.setup()
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, args)
    train_ds, _valid_ds, _test_ds = pretrain_gpt.train_valid_test_datasets_provider(
        list(get_train_valid_test_num_samples(args))
    )
    dp_rank = ps.get_data_parallel_rank()
    dp_size = ps.get_data_parallel_world_size()

    def build_train_iterator(consumed_samples: int) -> Any:
        return build_data_iterator(
            train_ds, consumed_samples, args.micro_batch_size, dp_rank, dp_size
        )

    state = TrainingState(
        args=args,
        model=model,
        optimizer=optimizer,
        opt_param_scheduler=scheduler,
        build_train_data_iterator=build_train_iterator,
        checkpoint_state_dict=lambda rng_state: {},
        load_checkpoint=lambda root: 0,
    )
    state.reset_train_data_iterator()
    # As pretrain() does: register with the control plane (HA), then train under the
    # plugin's fault handler; the loop is train()'s, with a measurement after every step.
    if hasattr(plugin, "attach"):
        plugin.attach(state)
    hooks = HookList([plugin.hooks()])
    per_step: list[dict[str, Any]] = []

    def train_and_measure() -> int:
        for chunk in model:
            chunk.train()
        set_update_listener(hooks, state)
        hooks.on_train_start(state)
        while state.iteration < args.train_iters:
            _losses, skipped, _grad_norm = train_step(pretrain_gpt.forward_step, state, hooks)
            state.iteration += 1
            args.consumed_train_samples += args.global_batch_size
            hooks.on_phase(state, "after", state.iteration - 1)
            hooks.on_step_end(state)
            # main grads stay attached until the next step's zero_grad: measure here
            result = measure(model, optimizer)
            result["skipped"] = skipped
            result["rss_bytes"], result["peak_rss_bytes"] = resident_bytes()
            per_step.append(result)
        hooks.on_train_end(state)
        set_update_listener(None, None)
        return state.iteration

    if hasattr(plugin, "run"):
        plugin.run(train_and_measure)
    else:
        train_and_measure()
    rank = torch.distributed.get_rank()
    record = {
        "rank": rank,
        "world_size": torch.distributed.get_world_size(),
        "data_parallel_size": dp_size,
        "replica_num": args.tft_features.replica_num,
        "instances": getattr(args, "num_distributed_optimizer_instances", 1),
        "high_availability": bool(args.enable_high_availability),
        "steps": per_step,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    torch.distributed.barrier()
    if hasattr(plugin, "finish"):
        plugin.finish()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
