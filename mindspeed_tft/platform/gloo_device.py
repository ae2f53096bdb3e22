"""One gloo transport device per process, shared by the small gloo process groups; a lazily
connected device of its own for each group of three ranks or more.

torch gives each gloo process group a transport device of its own, and each device runs a
loop thread that wakes every 10 ms (gloo's TCP loop: `epoll_wait` with a fixed 10 ms
timeout, not configurable), whether the group is busy or idle. megatron-core makes about
twenty groups per rank (gloo copies of the data-parallel groups, size-1 tensor, pipeline,
context and expert groups; with `--optimizer-replica-num` the partial-optimizer groups on
top), so on CPU a rank's idle polling alone costs ~19 ms of CPU per second: measured with
4 ranks and 21 groups (the kernel's per-thread run time), 19 ms/s per rank against 2.6 ms/s
with one shared device. On a machine where ranks share cores, that CPU comes out of the
training step.

A gloo device can serve many groups (each group's connections are pairs of its own, on the
device's one listener and one loop). `share()` makes torch's process-group creation build
every gloo group on one device per process, made the way torch makes its default one: one
device per interface named in ``GLOO_SOCKET_IFNAME`` (comma-separated), else the device of
the host name's address, two worker threads per device, the group's timeout. Nothing else
about a group changes: its connections, its store keys, its collectives.

Groups of three or more ranks connect lazily, each on a device of its own: its pair with a
peer is connected at its first use instead of every pair at its creation. gloo's eager full
mesh costs each member of an n-rank group n - 1 connections and as many store reads when
the group is made, so what a rebuild of the process groups costs a rank (the repair of a
worker reboot or a memory fault rebuilds every group, `recovery.rebuild`) would grow with
the size of its data-parallel groups, that is with the job's. Lazily, a rank connects only
to the peers its operations talk to: ring neighbours for all-reduce and all-gather, a
tree's for broadcast and barrier (bench/repair_work.py counts them; NCCL and HCCL create
their communicators at first use too, and NCCL connects its peers lazily since 2.22).
gloo's lazy pairs cannot share a device: a lazy pair names itself to the peer's listener by
its rank, the same number in every group on the device, and a lazy context shuts its device
down when it is destroyed (gloo's `tcp/context.cc`); two groups on one lazy device hang at
the second one's first operation here. So a lazy group pays a loop thread of its own again
(~1 ms of CPU per second: one third to one half of megatron-core's groups are that big), and
groups of one or two ranks (every pair used: nothing to save) stay eager on the shared
device. ``TORCH_GLOO_LAZY_INIT=0`` keeps every group eager on the shared device.

The change is one name, `torch.distributed.distributed_c10d.ProcessGroupGloo`, the class
`_new_process_group_helper` constructs (declared in `mindspeed_tft.patches`, the ``cpu``
moment). The replacement is a subclass whose `isinstance` answers as torch's class does, so
torch's checks of groups made anywhere keep working; `torch.distributed.ProcessGroupGloo`
itself is left alone.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from torch.distributed import distributed_c10d as c10d

from mindspeed_tft.events import work_counts

#: the environment variable torch's gloo reads for the interfaces to use
IFNAME_ENV = "GLOO_SOCKET_IFNAME"
#: torch's switch for gloo's lazily connected pairs (read when a group is made)
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"

_TorchGloo = c10d.ProcessGroupGloo
_devices: list[Any] = []


def _interfaces() -> list[str]:
    """The interfaces ``GLOO_SOCKET_IFNAME`` names, as torch reads it (a value of one
    character or less means none)."""
    value = os.environ.get(IFNAME_ENV, "")
    if len(value) <= 1:
        return []
    return [name for name in value.split(",") if name]


def lazy_connections() -> bool:
    """Whether groups of `LAZY_MIN_SIZE` ranks and more connect their pairs at first use:
    yes unless ``TORCH_GLOO_LAZY_INIT`` is 0 (or another false value torch accepts)."""
    return os.environ.get(LAZY_ENV, "1").strip().lower() not in ("0", "false", "n", "no")


#: the smallest group connected lazily, on a device of its own
LAZY_MIN_SIZE = 3


def _new_devices(lazy: bool) -> list[Any]:
    """Devices made the way torch makes its default ones: one per interface named in
    ``GLOO_SOCKET_IFNAME``, else the host name's."""
    names = _interfaces()
    if names:
        return [_TorchGloo.create_device(interface=name, lazy_init=lazy) for name in names]
    return [_TorchGloo.create_default_device(lazy_init=lazy)]


def shared_devices() -> list[Any]:
    """This process's eager gloo devices, made on first use and then reused by every group
    that does not connect lazily."""
    if not _devices:
        _devices.extend(_new_devices(lazy=False))
    return _devices


def devices_for(size: int) -> list[Any]:
    """The devices a new group of `size` ranks runs on: lazily connected ones of its own
    from `LAZY_MIN_SIZE` ranks up (unless ``TORCH_GLOO_LAZY_INIT`` is 0), else the shared
    eager ones."""
    if size >= LAZY_MIN_SIZE and lazy_connections():
        devices = _new_devices(lazy=True)
        work_counts.add("gloo_devices", len(devices))
        return devices
    return shared_devices()


class _AnswersAsTorchGloo(type(_TorchGloo)):  # type: ignore[misc]
    """`isinstance(group, SharedDeviceGloo)` is `isinstance(group, ProcessGroupGloo)`:
    torch checks the groups it gets back from C++ (torch's own class) against this name."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _TorchGloo)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _TorchGloo)


class SharedDeviceGloo(_TorchGloo, metaclass=_AnswersAsTorchGloo):
    """torch's gloo process group, built on the process's shared devices."""

    def __init__(self, store: Any, rank: int, size: int, options: Any = None, *,
                 timeout: timedelta | None = None) -> None:
        if options is None:  # torch's own calls: (store, rank, size, timeout=)
            # torch's stub lacks ProcessGroupGloo._Options (the class has it at run time)
            options = _TorchGloo._Options()  # type: ignore[attr-defined]
            options._devices = devices_for(size)
            options._threads = 2 * len(options._devices)
            if timeout is not None:
                options._timeout = timeout
        super().__init__(store, rank, size, options)  # a caller's own options: as given


def share() -> None:
    """Build every later gloo process group of this process on one shared device, or,
    from `LAZY_MIN_SIZE` ranks up, on a lazily connected one of its own (idempotent;
    before the first group, so the default group is made so too)."""
    # a declared run-time patch (patches.py): the type checker refuses any class assignment
    c10d.ProcessGroupGloo = SharedDeviceGloo  # type: ignore[misc,assignment]
