"""Shard transfer: a rank's optimizer shard and model params as flat tensors, copied between
ranks over torch.distributed and verified by checksum.

`export_shard` flattens what a rank holds: the fp32 main params of its optimizer shard,
Adam's `exp_avg` and `exp_avg_sq`, the step count, and its model params. The order is the
inner optimizer's param-group order and the model's parameter order, which is the same on
every holder of a shard (they build the same model and the same shard ranges), so a flat
tensor from one holder fits every other holder. `import_shard` writes one back in place.
`copy_shard` sends a shard from a holder to a receiver on a process group, with a SHA-256
digest of the bytes; the receiver checks it before importing. Dump and repair use this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

OPTIMIZER_KEYS = ("main_params", "exp_avg", "exp_avg_sq")


class ShardTransferError(RuntimeError):
    """A shard could not be exported, copied or imported intact."""


@dataclass
class ShardState:
    """One rank's optimizer shard and model params, flat."""

    main_params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    model_params: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """All tensors in transfer order (the step travels as a one-element int64 tensor)."""
        return {
            "main_params": self.main_params,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "step": torch.tensor([self.step], dtype=torch.int64),
            "model_params": self.model_params,
        }

    def optimizer_digest(self) -> str:
        """SHA-256 of the optimizer shard (main params, moments, step)."""
        return _digest([self.main_params, self.exp_avg, self.exp_avg_sq,
                        torch.tensor([self.step], dtype=torch.int64)])

    def digest(self) -> str:
        """SHA-256 of everything the shard holds."""
        return _digest(list(self.tensors().values()))


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().contiguous().view(-1)
        h.update(str(flat.dtype).encode())
        h.update(flat.numel().to_bytes(8, "little"))
        h.update(flat.cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a megatron-core (chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    megatron_optimizers = chained if chained is not None else [optimizer]
    return [m.optimizer for m in megatron_optimizers if not getattr(m, "is_stub_optimizer", False)]


def _main_params(optimizer: Any) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    """(main param, its optimizer state dict) in param-group order; the state dict is the
    optimizer's own (created empty for a param that has none yet, as torch does)."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                yield param, inner.state[param]


def _model_params(model: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [param for chunk in model for param in chunk.parameters()]


def export_shard(optimizer: Any, model: list[torch.nn.Module]) -> ShardState:
    """Flatten this rank's optimizer shard and model params (copies, on the CPU)."""
    params, avg, avg_sq, steps = [], [], [], set()
    for param, state in _main_params(optimizer):
        if "exp_avg" not in state:
            raise ShardTransferError(
                "the optimizer has no state yet: no step has completed, nothing to export"
            )
        params.append(param.detach().view(-1).float())
        avg.append(state["exp_avg"].detach().view(-1))
        avg_sq.append(state["exp_avg_sq"].detach().view(-1))
        steps.add(int(state["step"]))
    if len(steps) > 1:
        raise ShardTransferError(f"optimizer state holds different steps {sorted(steps)}")
    model_flat = torch.cat([p.detach().view(-1) for p in _model_params(model)])
    return ShardState(
        main_params=torch.cat(params).cpu().clone(),
        exp_avg=torch.cat(avg).cpu().clone(),
        exp_avg_sq=torch.cat(avg_sq).cpu().clone(),
        step=steps.pop() if steps else 0,
        model_params=model_flat.cpu().clone(),
    )


def import_shard(optimizer: Any, model: list[torch.nn.Module], shard: ShardState) -> None:
    """Write `shard` into this rank's optimizer state and model params, in place."""
    offset = 0
    pairs = list(_main_params(optimizer))
    total = sum(p.numel() for p, _ in pairs)
    if total != shard.main_params.numel():
        raise ShardTransferError(
            f"shard holds {shard.main_params.numel()} optimizer elements, this rank "
            f"{total}: not a replica of this rank's shard"
        )
    with torch.no_grad():
        for param, state in pairs:
            n = param.numel()
            param.view(-1).copy_(shard.main_params[offset : offset + n])
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            state["exp_avg"].view(-1).copy_(shard.exp_avg[offset : offset + n])
            state["exp_avg_sq"].view(-1).copy_(shard.exp_avg_sq[offset : offset + n])
            state["step"] = torch.tensor(float(shard.step))
            offset += n
        offset = 0
        model_params = _model_params(model)
        model_total = sum(p.numel() for p in model_params)
        if model_total != shard.model_params.numel():
            raise ShardTransferError(
                f"shard holds {shard.model_params.numel()} model parameters, this rank "
                f"{model_total}"
            )
        for param in model_params:
            n = param.numel()
            param.view(-1).copy_(shard.model_params[offset : offset + n])
            offset += n


def _empty_like_local(optimizer: Any, model: list[torch.nn.Module]) -> ShardState:
    pairs = list(_main_params(optimizer))
    numel = sum(p.numel() for p, _ in pairs)
    model_params = _model_params(model)
    dtype = model_params[0].dtype if model_params else torch.float32
    return ShardState(
        main_params=torch.empty(numel, dtype=torch.float32),
        exp_avg=torch.empty(numel, dtype=torch.float32),
        exp_avg_sq=torch.empty(numel, dtype=torch.float32),
        step=0,
        model_params=torch.empty(sum(p.numel() for p in model_params), dtype=dtype),
    )


def copy_shard(
    optimizer: Any,
    model: list[torch.nn.Module],
    src: int,
    dst: int,
    group: dist.ProcessGroup | None = None,
) -> str:
    """Copy the shard of global rank `src` into global rank `dst` (both must call it).

    Point-to-point on `group` (default: the world). The receiver verifies the SHA-256
    digest and imports the shard; returns the digest on both sides.
    """
    me = dist.get_rank()
    if me == src:
        shard = export_shard(optimizer, model)
        digest = shard.digest()
        for tensor in shard.tensors().values():
            dist.send(tensor.contiguous(), dst=dst, group=group)
        dist.send(torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8),
                  dst=dst, group=group)
        return digest
    if me != dst:
        raise ValueError(f"rank {me} is neither the source {src} nor the destination {dst}")
    received = _empty_like_local(optimizer, model)
    buffers = received.tensors()
    for tensor in buffers.values():
        dist.recv(tensor, src=src, group=group)
    received.step = int(buffers["step"][0])
    expected = torch.empty(32, dtype=torch.uint8)
    dist.recv(expected, src=src, group=group)
    digest = received.digest()
    if digest != bytes(expected.tolist()).hex():
        raise ShardTransferError(
            f"shard from rank {src} arrived corrupted at rank {dst}: digest {digest} != sent "
            f"{bytes(expected.tolist()).hex()}"
        )
    import_shard(optimizer, model, received)
    return digest
