"""From this control plane's orders to the arguments the SDK's handlers get (pure functions).

The controller's orders carry mindspeed-tft's plans (docs/design.md, sections 5 to 9):
`repair` says which shard each rank receives from whom and which it sends, or that every rank
reloads the last checkpoint; `dump` names the shards a rank writes and every writer. The
SDK's handlers want its own shapes: a repair handler gets `(step, need_rebuild, error_ranks,
repair_info)` with `repair_info = {"type", "repair_type", "src", "dst", "rank_list"}`, a save
handler `(step, save_info)` with `save_info = [{"type", "ranks"}]` per optimizer. The rules
are the SDK's (its controller's `RepairSelectReplica` / `GetAllRepairInfo` and its
processor's `HandleRepair`): a receiver whose device reported a UCE gets RT_UCE_HIGHLEVEL and
must rebuild, any other receiver RT_RECV_REPAIR, its source RT_SEND; a repair from the
checkpoint gives every rank RT_LOAD_CKPT (RT_LOAD_REBUILD where the device reported a UCE);
`error_ranks` are the ranks repaired, `rank_list` every rank sending or receiving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mindspeed_tft.control.wire.order_types import DumpOrder, RepairOrder

from ._enums import OptimizerType, RepairType

#: the layout names of the optimizers `tft_set_optimizer_replica` describes, in its order
OPTIMIZER_NAMES = ("dense", "moe")
#: what `tft_get_repair_type` says for each strategy
_REPAIR_TYPES = {"retry": "retry", "load_checkpoint": "retry", "recover": "recover",
                 "dump": "dump", "exit": "dump"}


def repair_type_name(strategy: str | None) -> str:
    """`tft_get_repair_type()`: retry, recover, dump, or the SDK's `unknow`."""
    return _REPAIR_TYPES.get(strategy or "", "unknow")


def optimizer_index(name: str) -> int:
    """OptimizerType value of a layout name (`dense` -> ATTENTION, `moe` -> MOE)."""
    return OptimizerType.MOE.value if name == "moe" else OptimizerType.ATTENTION.value


def shard_holders(ranks: list[int], count: int, shard: int) -> list[int]:
    """The holders of `shard` in a DP group `ranks` cut into `count` consecutive chunks,
    each a full copy (MindSpeed-LLM's replica groups): the shard-th rank of each chunk."""
    chunk = len(ranks) // count
    return [ranks[shard + k * chunk] for k in range(count)]


def replica_layout(rank: int, replica_info: list[dict[str, Any]]) -> tuple[dict[str, Any],
                                                                          dict[str, list[int]]]:
    """`tft_set_optimizer_replica(rank, replica_info)` as the layout a processor registers
    (`{name: {dp_index, dp_size, replica_num, shard, holders}}`), and each optimizer's
    data-parallel ranks. The DP group is cut into `replica_cnt` consecutive chunks, each a
    full copy (MindSpeed-LLM's replica groups, this project's layout); ValueError names what
    does not fit."""
    if not isinstance(replica_info, list) or not 1 <= len(replica_info) <= len(OPTIMIZER_NAMES):
        raise ValueError(f"replica_info={replica_info!r}: a list of 1 or 2 dicts (dense, moe)")
    layout: dict[str, Any] = {}
    groups: dict[str, list[int]] = {}
    for name, entry in zip(OPTIMIZER_NAMES, replica_info, strict=False):
        ranks, count = entry.get("rank_list"), entry.get("replica_cnt")
        shift = entry.get("replica_shift", 0)
        if not (isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks)
                and type(count) is int and type(shift) is int):
            raise ValueError(f"set_optimizer_replica failed, rank:{rank}, replica_info is "
                             f"invalid: {entry!r} (rank_list: ints, replica_cnt: int, "
                             "replica_shift: int)")
        size = len(ranks)
        if rank not in ranks or not 1 <= count <= size or size % count or shift:
            raise ValueError(
                f"set_optimizer_replica failed, rank:{rank}: {entry!r} (the rank must be in "
                f"rank_list, 1 <= replica_cnt <= {size} dividing it, replica_shift 0: the "
                "shifted X1 layout is not supported)")
        index = ranks.index(rank)
        shard = index % (size // count)
        layout[name] = {"dp_index": index, "dp_size": size, "replica_num": count,
                        "shard": shard, "holders": shard_holders(ranks, count, shard)}
        groups[name] = list(ranks)
    return layout, groups


@dataclass(frozen=True)
class RepairCall:
    """The arguments of one repair handler call (after them come the train args and ctx)."""

    step: int
    need_rebuild: bool
    error_ranks: list[int]
    repair_info: dict[str, Any]


def _call(step: int, repair_type: RepairType, src: list[int], dst: list[int],
          types: list[int], rank_list: list[int]) -> RepairCall:
    rebuild = repair_type in (RepairType.RT_UCE_HIGHLEVEL, RepairType.RT_LOAD_REBUILD)
    return RepairCall(step, rebuild, list(dst), {
        "type": types, "repair_type": repair_type.value, "src": src, "dst": dst,
        "rank_list": rank_list})


def repair_calls(order: RepairOrder, rank: int, world_size: int, uce_reported: bool,
                 optimizers: list[str]) -> list[RepairCall]:
    """The repair handler calls of `rank` for one `repair` order (none: nothing to repair
    here, as the SDK sends no repair message to such a rank)."""
    step = order.lock_step
    if order.source == "checkpoint":
        kind = RepairType.RT_LOAD_REBUILD if uce_reported else RepairType.RT_LOAD_CKPT
        names = optimizers or [OPTIMIZER_NAMES[0]]
        return [_call(step, kind, [rank] * len(names), [rank] * len(names),
                      [optimizer_index(n) for n in names], list(range(world_size)))]
    calls = []
    receive, send = order.receive, order.send
    involved = list(order.involved or sorted(
        {rank, *(e.source for e in receive), *(e.target for e in send)}))
    if receive:
        kind = RepairType.RT_UCE_HIGHLEVEL if uce_reported else RepairType.RT_RECV_REPAIR
        calls.append(_call(step, kind, [e.source for e in receive], [rank] * len(receive),
                           [optimizer_index(e.optimizer) for e in receive], involved))
    if send:
        calls.append(_call(step, RepairType.RT_SEND, [rank] * len(send),
                           [e.target for e in send],
                           [optimizer_index(e.optimizer) for e in send], involved))
    return calls


def save_info(order: DumpOrder, rank: int,
              groups: dict[str, list[int]]) -> list[dict[str, Any]]:
    """`save_info` of a save handler call: per optimizer this rank writes, the ranks of its
    data-parallel group that write it (one per shard; DP order)."""
    writers = set(order.writers or [rank])
    info = []
    for entry in order.shards:
        name = entry.optimizer
        group = groups.get(name, [rank])
        info.append({"type": optimizer_index(name),
                     "ranks": [r for r in group if r in writers] or [rank]})
    return info
