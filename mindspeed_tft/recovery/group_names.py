"""Process-group names that carry the repair's id, as Huawei's MindIO SDK names them.

torch 2.13 names a group by a counter (`_world.group_count`: "0" for the default group, then
"1", "2", ...) or, with local synchronization, by a hash of its ranks, and keeps every
group's rendezvous keys in the default store under `<name>/`. `destroy_process_group()`
restarts the counter at 0: a framework that rebuilds its groups on the same store after a
repair (MindSpeed-LLM's handlers do, through the `mindio_ttp` API) would give a new group an
old group's name, and with it the old group's keys, which a stale rank may still read or
write. Huawei's SDK replaces torch's `_process_group_name` in `tft_init_processor` with one
that appends the repair's id; so does the `group-names` moment of `mindspeed_tft.patches`
(installed by this project's `mindio_ttp` at the same call), with the same names:

- the default group (`ranks == []`): `"<repair id>__"`, the counter unchanged;
- a counted group: `"<count>_<repair id>"`, the counter advanced;
- a hashed group: `sha1("_".join(ranks)) + "_<repair id>"`, hashed again while the name is
  taken.

`set_repair_id` is called by the SDK's actions when an incident's first order reaches the
rank, so every group made during a repair has that repair's id. This project's own plugin
route needs none of it: it rebuilds every group under a new store prefix per generation
(`rebuild.join_generation`).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

_lock = threading.Lock()
_repair_id = 0


def set_repair_id(repair_id: int) -> None:
    """The id of the repair under way (names of the groups made from now on carry it)."""
    global _repair_id
    if type(repair_id) is not int or repair_id < 0:
        raise ValueError(f"repair id {repair_id!r} must be an int >= 0")
    with _lock:
        _repair_id = repair_id


def repair_id() -> int:
    return _repair_id


def process_group_name(ranks: list[int], use_hashed_name: bool) -> Any:
    """torch's `_process_group_name(ranks, use_hashed_name)`, with the repair's id."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    if use_hashed_name:
        # sha1 only spreads names apart (as in the SDK and torch), no secret is involved
        name = hashlib.sha1("_".join(map(str, ranks)).encode()).hexdigest()  # noqa: S324
        name = f"{name}_{_repair_id}"
        while name in world.pg_names.values():
            name = hashlib.sha1(f"{name}_".encode()).hexdigest()  # noqa: S324
    elif ranks == []:
        name = f"{_repair_id}__"
    else:
        name = f"{world.group_count}_{_repair_id}"
        world.group_count += 1
    return c10d.GroupName(name)


def install() -> None:
    """The `group-names` moment of `mindspeed_tft.patches`."""
    from torch.distributed import distributed_c10d as c10d

    c10d._process_group_name = process_group_name
