"""One gloo transport device per process, shared by every gloo process group.

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

#: the environment variable torch's gloo reads for the interfaces to use
IFNAME_ENV = "GLOO_SOCKET_IFNAME"

_TorchGloo = c10d.ProcessGroupGloo
_devices: list[Any] = []


def _interfaces() -> list[str]:
    """The interfaces ``GLOO_SOCKET_IFNAME`` names, as torch reads it (a value of one
    character or less means none)."""
    value = os.environ.get(IFNAME_ENV, "")
    if len(value) <= 1:
        return []
    return [name for name in value.split(",") if name]


def shared_devices() -> list[Any]:
    """This process's gloo devices, made on first use and then reused by every group."""
    if not _devices:
        names = _interfaces()
        if names:
            _devices.extend(_TorchGloo.create_device(interface=name) for name in names)
        else:
            _devices.append(_TorchGloo.create_default_device())
    return _devices


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
            options = _TorchGloo._Options()
            options._devices = shared_devices()
            options._threads = 2 * len(options._devices)
            if timeout is not None:
                options._timeout = timeout
        super().__init__(store, rank, size, options)  # a caller's own options: as given


def share() -> None:
    """Build every later gloo process group of this process on one shared device
    (idempotent; before the first group, so the default group shares it too)."""
    c10d.ProcessGroupGloo = SharedDeviceGloo
