"""Shard transfer: a rank's optimizer shard copied between two holders over torch.distributed,
straight from the sender's live tensors into the receiver's.

A shard is, per main param of the (chained) megatron-core optimizer in param-group order:
the fp32 main param, Adam's `exp_avg` and `exp_avg_sq`; then the step count; then the model
params the optimizer does not update (frozen ones, usually none). The order is the same on
every holder of a shard (they build the same model and the same shard ranges), so the
sender's tensor i lands in the receiver's tensor i. Model params the optimizer updates are
not sent, as a rule: the rollback derives them from the main params (`recovery.rollback`), as
the update itself does. The exception (`with_params`): a restarted worker has no params at
all, and a holder whose params are complete at the lock step sends its whole param buffers
after the shard. One send of the params to the one rank that lacks them replaces the
all-gather that every rank of the chunk would otherwise run in the rollback (0.41 s for
228 MiB at 60 M parameters here, against 0.06 s for the send).

How the bytes move (`copy_shard`):
- a header first: the sender's byte, tensor and message counts, its step and the moment it
  began; the receiver refuses a shard whose layout is not its own (not a replica). Neither
  side waits for the other to prepare: the sender posts the header and packs while it
  travels, the receiver posts its receive of the header first and lays out its buffers
  while it comes;
- then the receiver posts every receive and sends a one-word "go"; the sender posts every
  message when it comes, and they leave back to back. Posted the other way round (the
  sender's messages first), each of the receiver's receives would wait for the previous
  message's last byte: gloo posts a receive under the connection's lock, which its loop
  thread holds while a message comes in, so the sender would see one receive, hence one
  message, per round trip (the tiny preset's 4 messages: 3 round trips of 0.1-0.5 ms on
  this machine's loaded cores);
- a tensor of at least `DIRECT_BYTES` travels as itself: the sender posts its bytes, the
  receiver receives into the destination tensor's bytes. No staging copy, no serialisation;
- the smaller tensors are packed, one dtype per message, into as few messages as
  `PACK_BYTES` allows: a message costs about 60 us of fixed gloo overhead here, as much as
  240 KiB of bytes, so a shard of many small tensors (norm weights, moments of the pieces of
  params cut at shard boundaries) must not travel as many messages. Packing is one
  `torch.cat` per message, unpacking one `torch.split` and a copy per tensor;
- direct and packed messages alternate (`isend`/`irecv`, one tag each): the receiver
  unpacks a packed message while the next direct one is on the wire.

Every message carries its checksum: after its messages are posted, the sender computes the
XXH3-64 digest (the `xxhash` library) of each message's bytes while they travel, and sends
the digests as one last message; the receiver digests each message as it lands (while the
next is on the wire) and compares. A mismatch names the message's tensors and the sender:
the shard is damaged (a link, a memory or a `TFT_INJECT` ``corrupt`` item that flips a byte
of what is sent, never of the sender's state), `CopyResult.check` raises
`ShardTransferError`, the repair fails and the job ends in the dump, whose holders are never
the receiver (it is the rank that lost its state). The digests cost about what a copy of the
bytes in memory costs (bench/README.md, "`bench/checksums.py`"), beside a transfer
that also moves them between processes.

`shard_digest`: CRC-32 of a rank's shard, read in place (replica checks).
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft import faults
from mindspeed_tft.events import work_counts

#: tensors of at least this many bytes travel as themselves; the smaller ones are packed.
#: A message's fixed cost (about 60 us with gloo here) is the time of ~240 KiB of bytes, and
#: packing plus unpacking a tensor costs about as much as its bytes on the wire
DIRECT_BYTES = 256 << 10
#: packed messages hold at most about this many bytes (so the receiver unpacks one while the
#: next is on the wire); the tiny preset's 36 small tensors (1.15 MiB) travel as one
PACK_BYTES = 4 << 20
_MAGIC = 0x54465453  # "TFTS"
#: int64s of a header: magic, bytes, tensors, messages, step, param buffers, sent (ns)
_HEADER_LEN = 7
#: the tag of the receiver's "every receive is posted" message
_GO_TAG = 1 << 20
#: the tag of the sender's digests (one int64 per message)
_DIGEST_TAG = (1 << 20) + 1


class ShardTransferError(RuntimeError):
    """A shard could not be copied intact."""


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


def _frozen_params(model: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p for chunk in model for p in chunk.parameters() if not p.requires_grad]


@dataclass
class Shard:
    """The live tensors of one rank's shard, in transfer order, and its optimizer step."""

    tensors: list[torch.Tensor]
    step: int
    states: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def local_shard(optimizer: Any, model: list[torch.nn.Module], *, create: bool = False) -> Shard:
    """This rank's shard as views of its live tensors (nothing copied). `create`: give a
    param without optimizer state (a restarted worker before its first step) zeroed moments,
    as Adam's first step would, so that they can be received into."""
    tensors: list[torch.Tensor] = []
    states, steps = [], set()
    for param, state in _main_params(optimizer):
        if "exp_avg" not in state:
            if not create:
                raise ShardTransferError(
                    "the optimizer has no state yet: no step has completed, nothing to send"
                )
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        else:
            steps.add(int(state["step"]))
        tensors += [param.detach(), state["exp_avg"].detach(), state["exp_avg_sq"].detach()]
        states.append(state)
    if len(steps) > 1:
        raise ShardTransferError(f"optimizer state holds different steps {sorted(steps)}")
    tensors += [p.detach() for p in _frozen_params(model)]
    return Shard(tensors, steps.pop() if steps else 0, states)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a flat CPU tensor of its dtype (a view when it is one already, a copy
    on the CPU if it is not)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.detach().to("cpu", memory_format=torch.contiguous_format)
    return tensor.view(-1)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat uint8 view (of a CPU copy if it is not one)."""
    return _flat(tensor).view(torch.uint8)


def _message_digest(buffer: torch.Tensor) -> int:
    """XXH3-64 of a message's bytes, as an int64 (the digests travel as one tensor)."""
    import xxhash

    # numpy's stub lacks ndarray.__buffer__ (the array has the buffer protocol)
    value = xxhash.xxh3_64_intdigest(_bytes_of(buffer).numpy())  # type: ignore[arg-type]
    return value - (1 << 64) if value >= 1 << 63 else value


def _posted(work: dist.Work | None) -> dist.Work:
    """The request of a point-to-point op (torch returns None to a rank outside the group:
    never so here, where both ends are members)."""
    if work is None:
        raise RuntimeError("a shard transfer was posted on a group this rank is not in")
    return work


def shard_digest(optimizer: Any, model: list[torch.nn.Module]) -> str:
    """CRC-32 of this rank's optimizer shard (main params, moments, step), read in place."""
    shard = local_shard(optimizer, model)
    value = zlib.crc32(shard.step.to_bytes(8, "little"))
    for tensor in shard.tensors:
        # numpy's stub lacks ndarray.__buffer__ (the array has the buffer protocol)
        value = zlib.crc32(_bytes_of(tensor).numpy(), value)  # type: ignore[arg-type]
    return f"{value:08x}"


def param_buffers(model: list[torch.nn.Module]) -> list[torch.Tensor]:
    """The model's complete params as megatron-core's DDP holds them with the distributed
    optimizer (each buffer's `param_data`); empty without it (then every rank derives all its
    params from its own main params)."""
    out = []
    for chunk in model:
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            if getattr(buffer, "param_data", None) is not None:
                out.append(buffer.param_data.detach())
    return out


@dataclass
class CopyResult:
    """What `copy_shard` did: the bytes moved (shard and params), of them the model params'
    (`param_bytes`, 0 when none travelled) and (on the receiver) the seconds from the moment
    both holders were in `copy_shard` to the last byte in place (0 on the sender)."""

    nbytes: int
    seconds: float = 0.0
    param_bytes: int = 0
    #: what arrived damaged (its checksum differs from the sender's), None when all is intact
    damaged: str | None = None
    #: (receiver) seconds the checksums added after the last byte (the last message's digest,
    #: the wait for the sender's), and the seconds of all its digests
    check_seconds: float = 0.0
    hash_seconds: float = 0.0

    def check(self) -> None:
        """Raise `ShardTransferError` when the shard arrived damaged (the receiver's state
        then holds the damaged bytes: it must not train on them)."""
        if self.damaged is not None:
            raise ShardTransferError(self.damaged)


@dataclass
class _Message:
    """Tensors (by index) that travel as one message: one big tensor in place (`direct`), or
    several small ones of one dtype packed."""

    indices: list[int]
    nbytes: int
    direct: bool


def _plan(tensors: list[torch.Tensor]) -> list[_Message]:
    """Big contiguous CPU tensors alone (sent in place), the rest packed by dtype into
    messages of up to PACK_BYTES; the two kinds alternate (both sides derive the same plan)."""
    direct: list[_Message] = []
    packed: list[_Message] = []
    run: list[int] = []
    run_bytes = 0
    for i, tensor in enumerate(tensors):
        size = tensor.numel() * tensor.element_size()
        if size >= DIRECT_BYTES and tensor.device.type == "cpu" and tensor.is_contiguous():
            direct.append(_Message([i], size, True))
            continue
        if run and (run_bytes >= PACK_BYTES or tensors[run[0]].dtype != tensor.dtype):
            packed.append(_Message(run, run_bytes, False))
            run, run_bytes = [], 0
        run.append(i)
        run_bytes += size
    if run:
        packed.append(_Message(run, run_bytes, False))
    # alternate, a direct one first: the receiver unpacks a packed message while the next
    # direct one arrives
    order: list[_Message] = []
    for pair in itertools.zip_longest(direct, packed):
        order += [m for m in pair if m is not None]
    return order


def _header(shard: Shard, tensors: list[torch.Tensor], plan: list[_Message],
            params: int, entered_ns: int) -> torch.Tensor:
    nbytes = sum(m.nbytes for m in plan)
    return torch.tensor([_MAGIC, nbytes, len(tensors), len(plan), shard.step, params,
                         entered_ns], dtype=torch.int64)


def _send(shard: Shard, params: list[torch.Tensor], dst: int,
          group: dist.ProcessGroup | None, entered_ns: int) -> None:
    go = torch.empty(1, dtype=torch.int64)
    ready = _posted(dist.irecv(go, src=dst, group=group, tag=_GO_TAG))
    tensors = shard.tensors + params
    plan = _plan(tensors)
    # the header does not wait for the receiver: the sender packs while it travels (every
    # packed message: small tensors add up to little at any model size)
    header = _header(shard, tensors, plan, len(params), entered_ns)
    works = [_posted(dist.isend(header, dst=dst, group=group))]
    buffers = [_bytes_of(tensors[m.indices[0]]) if m.direct
               else torch.cat([_flat(tensors[j]) for j in m.indices]) for m in plan]
    digests: list[int] | None = None
    if buffers and faults.transfer_corruption(shard.step):
        # TFT_INJECT corrupt: a byte flips on the way, after its digest was taken
        digests = [_message_digest(b) for b in buffers]
        buffers[0] = buffers[0].clone()
        flipped = buffers[0].view(torch.uint8)
        flipped[flipped.numel() // 2] ^= 0xFF
    ready.wait()  # every receive is posted: the messages go out back to back
    works += [_posted(dist.isend(b, dst=dst, group=group, tag=i + 1))
              for i, b in enumerate(buffers)]
    if digests is None:  # while the messages travel
        digests = [_message_digest(b) for b in buffers]
    works.append(_posted(dist.isend(torch.tensor(digests, dtype=torch.int64), dst=dst,
                                    group=group, tag=_DIGEST_TAG)))
    for work in works:
        work.wait()


@dataclass
class _Layout:
    """What a receiver posts: its tensors, their plan and a buffer per message (the
    destination's bytes for a direct message, a new tensor for a packed one)."""

    tensors: list[torch.Tensor]
    plan: list[_Message]
    buffers: list[torch.Tensor]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> _Layout:
        plan = _plan(tensors)
        return cls(tensors, plan, [
            _bytes_of(tensors[m.indices[0]]) if m.direct
            else torch.empty(m.nbytes // tensors[m.indices[0]].element_size(),
                             dtype=tensors[m.indices[0]].dtype)
            for m in plan])


@dataclass
class _Checked:
    """The receiver's checksum verdict: what arrived damaged (None: nothing), the seconds the
    checksums added after the last message arrived (its digest, the wait for the sender's) and
    the seconds of all its digests (most of them while later messages travelled)."""

    damaged: str | None
    seconds: float
    hashing: float


def _receive(shard: Shard, params: list[torch.Tensor], header: torch.Tensor, pending: Any,
             src: int, group: dist.ProcessGroup | None, *, entered: float,
             expect_params: bool) -> tuple[int, float, int, _Checked]:
    """Receive a shard, and the model params when the sender sends them, once the `header`
    that `pending` receives has come; returns the step, the seconds since both holders
    were in `copy_shard` and the number of param buffers received. The receiver lays out
    its buffers before the header comes (for the params it expects; again after it, if the
    sender decided otherwise), so that its receives are posted as soon as it is checked.
    The last value says what arrived damaged (its digest differs from the sender's), if
    anything, and the seconds the checksums added."""
    expected = params if expect_params else []
    layout = _Layout.of(shard.tensors + expected)
    pending.wait()
    arrived, arrived_ns = time.perf_counter(), time.time_ns()
    magic, nbytes, count, messages, step, sent_params, sent_ns = header.tolist()
    if sent_params not in (0, len(params)):
        raise ShardTransferError(
            f"rank {src} sends {sent_params} param buffers, this rank's model has "
            f"{len(params)}: not a replica of this rank's model")
    if sent_params != len(expected):  # the sender decided otherwise
        layout = _Layout.of(shard.tensors + (params if sent_params else []))
    tensors, plan = layout.tensors, layout.plan
    mine = sum(m.nbytes for m in plan)
    if [magic, nbytes, count, messages] != [_MAGIC, mine, len(tensors), len(plan)]:
        raise ShardTransferError(
            f"rank {src} offers a shard of {nbytes} bytes in {count} tensors and {messages} "
            f"messages, this rank holds {mine} bytes in {len(tensors)} tensors "
            f"and {len(plan)} messages: not a replica of this rank's shard"
        )
    works = [_posted(dist.irecv(b, src=src, group=group, tag=i + 1))
             for i, b in enumerate(layout.buffers)]
    sent_digests = torch.empty(len(plan), dtype=torch.int64)
    digests_work = _posted(dist.irecv(sent_digests, src=src, group=group, tag=_DIGEST_TAG))
    # only now may the sender post its messages: a receive posted while a message arrives
    # on the same connection waits for its last byte (the connection's lock), and the
    # sender would see one receive at a time
    go = _posted(dist.isend(torch.ones(1, dtype=torch.int64), dst=src, group=group, tag=_GO_TAG))
    digests = []
    hashing = last = 0.0
    for message, buffer, work in zip(plan, layout.buffers, works, strict=True):
        work.wait()
        began = time.perf_counter()
        digests.append(_message_digest(buffer))  # while the next messages arrive
        last = time.perf_counter() - began
        hashing += last
        if not message.direct:
            _unpack(buffer, [tensors[j] for j in message.indices])
    go.wait()
    began = time.perf_counter()
    digests_work.wait()
    # what the checksums add after the last byte: its message's digest, then the wait for
    # the sender's (the other digests ran while later messages were on the wire)
    exposed = last + time.perf_counter() - began
    damaged = [i for i, (mine, theirs) in enumerate(zip(digests, sent_digests.tolist(),
                                                        strict=True)) if mine != theirs]
    problem = None
    if damaged:
        first = plan[damaged[0]]
        problem = (f"the shard from rank {src} arrived damaged: {len(damaged)} of {len(plan)} "
                   f"messages differ from the sender's checksum (the first holds tensors "
                   f"{first.indices[:4]} of {len(tensors)}, {first.nbytes} bytes)")
    return (step, _since_both(entered, arrived, arrived_ns, sent_ns), sent_params,
            _Checked(problem, exposed, hashing))


def _since_both(entered: float, arrived: float, arrived_ns: int, sent_ns: int) -> float:
    """Seconds from the moment both holders were in `copy_shard` (the later of the
    receiver's `entered` and the sender's `sent_ns`, its wall clock then) to now,
    on the receiver's monotonic clock. The sender's moment is read against the wall clock
    at the header's arrival and bounded by the receiver's own: exact on one machine, within
    the clocks' skew across machines."""
    sender_ago = min(max(arrived_ns - sent_ns, 0) / 1e9, arrived - entered)
    return time.perf_counter() - arrived + sender_ago


def _unpack(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    pieces = torch.split(buffer, [t.numel() for t in tensors])
    with torch.no_grad():
        for tensor, piece in zip(tensors, pieces, strict=True):
            tensor.copy_(piece.view(tensor.shape))


def copy_shard(
    optimizer: Any,
    model: list[torch.nn.Module],
    src: int,
    dst: int,
    group: dist.ProcessGroup | None = None,
    *,
    with_params: bool = False,
    expect_params: bool = False,
) -> CopyResult:
    """Copy the shard of global rank `src` into global rank `dst` (both must call it).

    Point-to-point on `group` (default: the world). The receiver checks that the sender's
    shard has its own layout (bytes, tensors, messages) and takes the sender's step.
    `with_params` (the sender's choice; the header tells the receiver): the sender's complete
    model params travel too, into the receiver's param buffers (distributed optimizer only);
    otherwise the receiver's model params are not touched (see the module docstring).
    `expect_params` (the receiver's guess of that choice) only lets it lay out its buffers
    before the header comes; a wrong guess costs that layout again, nothing else. The
    receiver verifies every message's checksum: `CopyResult.damaged` says what differs
    (`CopyResult.check` raises then; the caller first finishes what the sender still sends)."""
    entered, entered_ns = time.perf_counter(), time.time_ns()
    me = dist.get_rank()
    if me == src:
        shard = local_shard(optimizer, model)
        params = param_buffers(model) if with_params else []
        _send(shard, params, dst, group, entered_ns)
        sent = sum(t.numel() * t.element_size() for t in params)
        work_counts.add("state_bytes_sent", shard.nbytes + sent)
        return CopyResult(shard.nbytes + sent, param_bytes=sent)
    if me != dst:
        raise ValueError(f"rank {me} is neither the source {src} nor the destination {dst}")
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    pending = dist.irecv(header, src=src, group=group)  # it travels while the shard is laid out
    shard = local_shard(optimizer, model, create=True)
    params = param_buffers(model)
    step, seconds, received, checked = _receive(shard, params, header, pending, src, group,
                                                entered=entered, expect_params=expect_params)
    for state in shard.states:
        state["step"] = torch.tensor(float(step))
    got = sum(t.numel() * t.element_size() for t in params) if received else 0
    work_counts.add("state_bytes_received", shard.nbytes + got)
    return CopyResult(shard.nbytes + got, seconds, param_bytes=got, damaged=checked.damaged,
                      check_seconds=checked.seconds, hash_seconds=checked.hashing)
