"""Rebuild every process group of a job in place (SPEC 9): the world, megatron-core's
TP/PP/DP/CP/embedding groups and the replica groups, with the same ranks, on new connections.

After a fault the groups are unusable: a peer died, or `collectives.abandon` shut their
connections. Every rank of the job (survivors and restarted workers alike) calls
`join_generation(args, generation)` with the same generation number (the controller's
incident id): it initializes the default group on a fresh key space of the job's
rendezvous store (`tft/generation/<n>/` under MASTER_ADDR:MASTER_PORT, the store the
launcher hosts, so it outlives any worker) and builds megatron-core's parallel state and the
replica groups again, in the same order on every rank. A survivor first calls
`leave_generation()`, which remembers which groups existed (by ranks and backend) and
destroys them, and afterwards `repoint_process_groups(...)`, which replaces every reference
to an old group held by its DDP model chunks and optimizers with the new group of the same
ranks and backend, so the model, its buffers and the optimizer state stay in memory
untouched.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_tft.envvars import launcher_value
from mindspeed_tft.events import work_counts
from mindspeed_tft.process_exit import exit_without_teardown

log = logging.getLogger("mindspeed_tft.recovery")

#: (global ranks, backend, occurrence): megatron-core makes twins with the same ranks and
#: backend (its gloo copies of the DP groups, gloo everywhere on CPU); every rank creates the
#: groups in the same order, so the n-th twin of one generation is the n-th of the next.
GroupKey = tuple[tuple[int, ...], str, int]

_MAX_DEPTH = 8

#: Groups of past generations, never let go in the training thread: the last reference to a
#: gloo group runs its destructor, which joins the group's worker threads once their queued
#: work is done, and after a fault that work may wait on a dead peer until the group's
#: timeout (minutes). `release_retired_groups` drops them in a daemon thread instead.
_retired: list[dist.ProcessGroup] = []

#: the store clients the groups of the current and the past generations were built on: a
#: Python store must stay referenced from Python while C++ uses it (torch calls its methods
#: through a trampoline that looks them up on the Python object; once that object is
#: collected every call fails with "Not implemented"); past ones go with the retired groups
_stores: list[CountingStore] = []

#: the rendezvous-store client of the groups `leave_generation` left, for the next
#: generation to reuse (a survivor opens no new store connection)
_left_client: list[dist.Store] = []

#: the daemon threads releasing retired groups (see `_leave_while_releasing`)
_release_threads: list[threading.Thread] = []

#: how long, at interpreter exit, a release still in progress is waited for
RELEASE_EXIT_GRACE_SECONDS = 1.0


def process_group_keys() -> dict[dist.ProcessGroup, GroupKey]:
    """Every live process group of this process (in creation order) -> its key."""
    from torch.distributed.distributed_c10d import _world

    keys: dict[dist.ProcessGroup, GroupKey] = {}
    seen: dict[tuple[tuple[int, ...], str], int] = {}
    for group, ranks in list(_world.pg_group_ranks.items()):
        try:
            backend = str(dist.get_backend(group))
        except (RuntimeError, ValueError):
            continue
        twin = (tuple(sorted(ranks)), backend)
        seen[twin] = seen.get(twin, -1) + 1
        keys[group] = (*twin, seen[twin])
    return keys


def leave_generation() -> dict[dist.ProcessGroup, GroupKey]:
    """Destroy every process group of this process; returns what existed, for re-pointing."""
    from megatron.core import parallel_state

    old = process_group_keys() if dist.is_initialized() else {}
    _retired.extend(old)
    _left_client[:] = [_base_store()] if dist.is_initialized() else []
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    return old


def _base_store() -> dist.Store:
    """The store client under the default group's PrefixStores (and `CountingStore`)."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.inner if isinstance(store, CountingStore) else store


def release_retired_groups() -> int:
    """Drop the groups of past generations from a daemon thread (call once nothing else
    refers to them: after `repoint_process_groups`, with the caller's own mapping deleted),
    so a destructor that waits for stuck work blocks only that thread. Returns how many."""
    groups = list(_retired)
    _retired.clear()
    del _stores[:-1]  # the current generation's stays
    count = len(groups)
    if not count:
        return 0

    def release() -> None:
        groups.clear()

    if not _release_threads:
        atexit.register(_leave_while_releasing)
    thread = threading.Thread(target=release, name="tft-release-groups", daemon=True)
    _release_threads.append(thread)
    thread.start()
    return count


def _leave_while_releasing() -> None:
    """atexit: if an old group's destructor is still waiting for its stuck work (it ends only
    when the peers' processes exit and close their connections), end the process now
    instead of tearing the interpreter down. Python 3.11 stops a daemon thread that wants
    the GIL back during finalization with pthread_exit, and that unwinding through the
    group's C++ destructor aborts the process ("terminate called without an active
    exception", SIGABRT) after training finished. Runs before finalization begins; the exit
    code is 1 after an uncaught exception and 0 otherwise (decided exit codes never get
    here: they leave through exit_without_teardown)."""
    deadline = time.monotonic() + RELEASE_EXIT_GRACE_SECONDS
    for thread in _release_threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if not any(thread.is_alive() for thread in _release_threads):
        return
    code = 1 if getattr(sys, "last_value", None) is not None else 0
    print("[mindspeed-tft] process groups retired by a repair are still waiting for "
          "peers that left; exiting without interpreter teardown", file=sys.stderr,
          flush=True)
    exit_without_teardown(code)


class CountingStore(dist.Store):
    """A rendezvous-store client that counts what goes through it (`events.work_counts`:
    ``store_ops.<operation>`` per call, ``store_bytes`` for the values set and got) and
    forwards every call to the store it wraps. The process groups of a generation are built
    on it (`join_generation`), so it sees every store operation their creation and their
    lazily made connections do (torch and gloo call a Python store through torch's store
    trampoline), and those of the iteration log and the fault-injection ledger (which find
    the default group's store)."""

    # the `type: ignore`s below: torch's stub of `Store` lacks `timeout`, `multi_set`,
    # `append`, `has_extended_api` and `clone`, which the class has at run time
    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.set_timeout(inner.timeout)  # type: ignore[attr-defined]

    @staticmethod
    def _count(op: str, nbytes: int = 0) -> None:
        work_counts.add(f"store_ops.{op}")
        if nbytes:
            work_counts.add("store_bytes", nbytes)

    def set(self, key: str, value: Any) -> None:
        self._count("set", len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count("get", len(value))
        return value

    def add(self, key: str, value: int) -> int:
        self._count("add")
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set", len(desired))
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait")
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys")
        return self.inner.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        self._count("multi_get", sum(len(v) for v in values))
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._count("multi_set", sum(len(v) for v in values))
        self.inner.multi_set(keys, values)  # type: ignore[attr-defined]

    def append(self, key: str, value: Any) -> None:
        self._count("append", len(value))
        self.inner.append(key, value)  # type: ignore[attr-defined]

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()  # type: ignore[attr-defined]

    def clone(self) -> CountingStore:
        return CountingStore(self.inner.clone())  # type: ignore[attr-defined]


def _store_client(timeout: timedelta) -> CountingStore:
    """A counting client of the job's rendezvous store at MASTER_ADDR:MASTER_PORT: the one
    the groups just left were built on when it is that store's (a survivor), else a new
    connection (a restarted worker). A new connection per survivor would cost each rank one
    more connection per repair, and under torchrun many clients connecting to its store at
    once wait: 19 of 32 simultaneous connects there took 5.0 s (13 under 10 ms; 32 connects
    to a store in a process of its own, 24-96 ms), which made every rank's rebuild of a
    32-rank UCE repair take 5.5-5.7 s instead of 0.5-0.7 s."""
    addr = launcher_value("MASTER_ADDR")
    port = launcher_value("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError(
            "MASTER_ADDR and MASTER_PORT must name the job's rendezvous store to rebuild the "
            f"process groups (got MASTER_ADDR={addr!r}, MASTER_PORT={port!r})"
        )
    left = _left_client.pop() if _left_client else None
    if isinstance(left, dist.TCPStore) and left.host == addr and left.port == int(port):
        return CountingStore(left)
    client = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout,
                           wait_for_workers=False)
    work_counts.add("connections.store")
    return CountingStore(client)


def join_generation(
    args: argparse.Namespace,
    generation: int,
    initialize_model_parallel: Callable[[argparse.Namespace], None],
) -> None:
    """Initialize the default group for `generation`, then megatron-core's parallel state
    with the host's own `initialize_model_parallel(args)` (the call its start-up makes);
    collective: every rank of the job calls it with the same number."""
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    client = _store_client(timeout)
    _stores.append(client)
    store = dist.PrefixStore(f"tft/generation/{generation}/", client)
    dist.init_process_group(
        backend=args.distributed_backend,
        store=store,
        rank=args.rank,
        world_size=args.world_size,
        timeout=timeout,
    )
    initialize_model_parallel(args)
    log.info("rank %d joined process-group generation %d", args.rank, generation)


def repoint_process_groups(
    roots: Iterable[Any], old_keys: dict[dist.ProcessGroup, GroupKey]
) -> int:
    """Replace references to old groups under `roots` (model chunks, optimizers) by the new
    groups with the same ranks and backend; returns how many references were replaced."""
    new_by_key = {key: group for group, key in process_group_keys().items()}
    # An old group without a new twin (a group nobody rebuilt) stays referenced: using it
    # fails loudly.
    mapping = {id(old): new_by_key[key] for old, key in old_keys.items() if key in new_by_key}
    replaced = 0
    seen: set[int] = set()

    def swapped(value: Any) -> dist.ProcessGroup | None:
        if isinstance(value, dist.ProcessGroup):
            return mapping.get(id(value))
        return None

    def visit(obj: Any, depth: int) -> None:
        nonlocal replaced
        if depth > _MAX_DEPTH or id(obj) in seen or isinstance(obj, torch.Tensor | str | bytes):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            items: Iterable[tuple[Any, Any]] = list(obj.items())
        elif isinstance(obj, list):
            items = list(enumerate(obj))
        elif isinstance(obj, tuple):
            items = []
            for value in obj:  # immutable: only what it holds can be re-pointed
                visit(value, depth + 1)
        elif (type(obj).__module__ or "").startswith(("megatron.", "mindspeed_tft.")) and hasattr(
            obj, "__dict__"
        ):
            for name, value in list(vars(obj).items()):
                new = swapped(value)
                if new is not None:
                    setattr(obj, name, new)
                    replaced += 1
                else:
                    visit(value, depth + 1)
            return
        else:
            return
        for key, value in items:
            new = swapped(value)
            if new is not None:
                obj[key] = new
                replaced += 1
            else:
                visit(value, depth + 1)

    for root in roots:
        visit(root, 0)
    return replaced
