"""Abandon pending collectives within a bounded time, so a stopped rank's training thread
raises instead of waiting for a peer that will never answer.

When one rank fails, the others block in the next collective that needs it. A dead peer
closes its sockets and gloo raises at once, but a peer that is alive and stuck (it raised
and sits in the fault handler, or it hangs) keeps them blocked until the process-group
timeout, minutes. NCCL (and HCCL) can abort their communicators. gloo cannot: its
`abort()` leaves the connections open, and the wait of some of its operations (every
reduce-scatter) ignores timeouts. What does wake every gloo operation at once is what a
dead peer does: closed connections. `abandon()` therefore shuts down (without closing: the
file descriptors stay valid for gloo) the TCP connections of the job's process groups, and
only those: `install_connection_tracking()` (the `connection-tracking` moment of
`mindspeed_tft.patches`, installed by the plugin before any group exists)
wraps torch's `_new_process_group_helper`, through which every process group is made
(`init_process_group`, `new_group`, the rebuilds), and records the sockets each creation
opened (the socket inodes of /proc/self/fd after it, less those before). A user's own
connections (loggers, data streams) are left alone; so are those of the rendezvous store
and the control plane (`keep_ports`), even when made while a group was built. A connection
another thread of the process opens while a group is being built is taken for the
group's: the window is the group's creation, or the whole of a `tracking_window()` block
(megatron-core's `initialize_model_parallel`, the rebuild: one listing of the sockets
before and after, not two per group). A lazily connected gloo group (the CPU platform's
default, `platform.gloo_device`) makes its connections at their first use instead, on the
process's gloo listener (recorded when it was made, inside a group's creation) or towards
a peer's: `abandon` shuts down every connection accepted on a recorded listener too, and
the peer's own stop shuts down the ones this rank made towards it. Every operation of this
rank, and every operation of a peer waiting on this rank, then fails with "Connection
closed by peer"; the
training threads land in the fault handler, where the error counts as a consequence of the
stop. The process lives on: recovery rebuilds the process groups on new connections.

Closed connections are not always enough: a gloo operation already queued when its
connections break can wait forever (seen with a sequence-parallel all-reduce in the
backward pass). So on gloo the waits themselves are made abandonable as well: `Work.wait()`
without a timeout (what every synchronous collective and every `handle.wait()` calls) waits
in slices of `POLL_SECONDS` and, once `abandon()` was called, raises `CollectivesAbandoned`
("FORCE STOP ...", a consequence of the stop, SPEC 6) until `reset()`. A slice costs nothing
when the operation completes within it: the wait returns as soon as the operation does.

A peer of a faulty rank may also be computing, not waiting: it would only fail at its next
collective, after the rest of its forward or backward pass. `install_stop_points()` (the
plugin, at every train start) hooks each transformer layer, forward and backward, to raise
`CollectivesAbandoned` once `abandon()` was called, so the training thread leaves its
compute within one layer's work.

Linux: the connections are found through /proc/self/fd and /proc/self/net/tcp{,6}.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import stat
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mindspeed_tft.events import work_counts

log = logging.getLogger("mindspeed_tft.recovery")

_LISTEN = "0A"
POLL_SECONDS = 0.1

_abandoned = threading.Event()
_abandon_reason = ""
_waits_installed = False


class CollectivesAbandoned(RuntimeError):
    """A collective was abandoned because the control plane stopped this rank."""


#: ids of the works of point-to-point operations in flight: a gloo send or receive whose
#: wait times out closes its connection, so these wait without slices (a receive fails at
#: once when `abandon` shuts the connections down)
_p2p_works: set[int] = set()


def _abandonable_wait(original: Any) -> Any:
    poll = timedelta(seconds=POLL_SECONDS)

    @functools.wraps(original)
    def wait(self: Any, timeout: timedelta | None = None) -> bool:
        if timeout is not None and timeout != timedelta(0):
            return original(self, timeout)
        if id(self) in _p2p_works:
            try:
                if _abandoned.is_set():  # posted after the connections were shut down
                    raise CollectivesAbandoned(
                        f"FORCE STOP: point-to-point operation abandoned ({_abandon_reason})")
                return original(self)
            finally:
                _p2p_works.discard(id(self))
        while True:
            if _abandoned.is_set():
                raise CollectivesAbandoned(f"FORCE STOP: collective abandoned ({_abandon_reason})")
            try:
                return original(self, poll)
            except RuntimeError as error:
                if "timed out" not in str(error).lower():
                    raise

    return wait


def _marked_p2p(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        for work in result if isinstance(result, list) else [result]:
            if work is not None:
                _p2p_works.add(id(work))
        return result

    return wrapper


def _blocking_p2p(nonblocking: Any, blocking: Any) -> Any:
    """`send`/`recv` as `isend`/`irecv` + wait (so their waits are marked point-to-point)."""

    @functools.wraps(blocking)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        work = nonblocking(*args, **kwargs)
        if work is not None:
            work.wait()
        peer = args[1] if len(args) > 1 else kwargs.get("src", kwargs.get("dst"))
        return peer

    return wrapper


def install_abandonable_waits() -> None:
    """Make `Work.wait()` abandonable (idempotent; gloo)."""
    global _waits_installed
    if not _waits_installed:
        from torch.distributed import distributed_c10d as c10d

        # a declared run-time patch (patches.py): the type checker refuses any method assignment
        dist.Work.wait = _abandonable_wait(dist.Work.wait)  # type: ignore[method-assign]
        # torch checks P2POp's function against distributed_c10d's own isend/irecv: both
        # names must be the marked ones
        for name in ("isend", "irecv", "batch_isend_irecv"):
            marked = _marked_p2p(getattr(c10d, name))
            setattr(c10d, name, marked)
            setattr(dist, name, marked)
        dist.send = _blocking_p2p(dist.isend, dist.send)
        dist.recv = _blocking_p2p(dist.irecv, dist.recv)
        _waits_installed = True


def reset() -> None:
    """Collectives may run again (the process groups were rebuilt)."""
    _abandoned.clear()


def _tcp_connections() -> dict[int, tuple[int, int, str]]:
    """socket inode -> (local port, remote port, state) of this process's TCP sockets."""
    table: dict[int, tuple[int, int, str]] = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16),
                            state)
    return table


def _socket_fds() -> Iterable[tuple[int, int]]:
    """(fd, inode) of this process's open sockets (fstat: a socket's st_ino is the inode
    /proc/self/net/tcp names; a third of the cost of reading the /proc/self/fd links)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.fstat(int(name))
        except OSError:  # the listing's own descriptor, or closed since
            continue
        if stat.S_ISSOCK(info.st_mode):
            yield int(name), info.st_ino


#: socket inodes opened while process groups were created (`install_connection_tracking`)
_group_sockets: set[int] = set()
_tracking_installed = False


def _socket_inodes() -> set[int]:
    return {inode for _, inode in _socket_fds()}


_window = threading.local()


@contextlib.contextmanager
def tracking_window() -> Any:
    """Every process group created inside the block (by this thread) is tracked at once:
    one listing of the sockets before the block and one after, instead of two per group
    (megatron-core makes dozens of groups, and a rebuild's listings cost more than the
    groups themselves). Nests; the tracking's window is the whole block."""
    depth = getattr(_window, "depth", 0)
    before = _socket_inodes() if depth == 0 else set()
    _window.depth = depth + 1
    try:
        yield
    finally:
        _window.depth = depth
        if depth == 0:
            _record_new_sockets(before)


def _record_new_sockets(before: set[int]) -> None:
    after = _socket_inodes()
    _group_sockets.intersection_update(after)  # forget the closed ones
    _group_sockets.update(after - before)


def _counted(result: Any) -> Any:
    """Count a group creation (`events.work_counts`): ``group_calls`` for every call (torch's API
    wants every rank of the world to call it for every group, member or not; a non-member's
    call returns at once, with no store operation or connection) and ``groups_created``
    for the groups this rank is a member of."""
    work_counts.add("group_calls")
    group = result[0] if isinstance(result, tuple) else result
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        work_counts.add("groups_created")
    return result


def _tracked(create: Any) -> Any:
    @functools.wraps(create)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_window, "depth", 0):
            return _counted(create(*args, **kwargs))
        before = _socket_inodes()
        try:
            return _counted(create(*args, **kwargs))
        finally:
            _record_new_sockets(before)

    return wrapper


def install_connection_tracking() -> None:
    """Record the sockets every process group creation opens, so that `abandon` shuts down
    those only (idempotent; call before the first process group is made)."""
    global _tracking_installed
    if _tracking_installed:
        return
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d as c10d

    c10d._new_process_group_helper = _tracked(c10d._new_process_group_helper)
    parallel_state.initialize_model_parallel = _in_window(parallel_state.initialize_model_parallel)
    _tracking_installed = True


def _in_window(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with tracking_window():
            return fn(*args, **kwargs)

    return wrapper


def group_connections() -> set[int]:
    """Socket inodes of the process groups' connections still open (tracking installed)."""
    return _group_sockets & _socket_inodes()


#: socket inodes of the connections `count_connections` has counted (and still open)
_counted_connections: set[int] = set()


def count_connections(keep_ports: Iterable[int]) -> int:
    """Count the TCP connections of this process (either end, listeners aside) that are new
    since the last call and touch no port in `keep_ports` (the rendezvous store's and the
    controllers', whose connections are counted where they are made): the connections of
    process groups, made when a group is created or, with lazily connected groups, at
    their first use. Adds them to ``connections.groups`` of `events.work_counts` and returns how
    many. Lists /proc (a few ms): called at a repair's marks, never in a training step."""
    keep = set(keep_ports)
    table = _tcp_connections()
    current = set()
    for _, inode in _socket_fds():
        row = table.get(inode)
        if row is None or row[2] == _LISTEN or row[0] in keep or row[1] in keep:
            continue
        current.add(inode)
    new = len(current - _counted_connections)
    _counted_connections.clear()
    _counted_connections.update(current)
    work_counts.add("connections.groups", new)
    return new


def shutdown_connections(keep_ports: Iterable[int], only: set[int] | None = None) -> int:
    """Shut down the established TCP connections of this process whose local or remote
    port is not in `keep_ports`: all of them, or only those whose socket inode is in
    `only` and those accepted on a listener in `only` (a lazily connected gloo group's
    connections are made after its creation, on the process's gloo listener, or by this
    process towards a peer's listener, where the peer shuts them down); returns how
    many."""
    keep = set(keep_ports)
    table = _tcp_connections()
    fds = list(_socket_fds())
    listeners = {table[inode][0] for _, inode in fds
                 if only is not None and inode in only and inode in table
                 and table[inode][2] == _LISTEN}
    count = 0
    for fd, inode in fds:
        row = table.get(inode)
        if row is None or (only is not None and inode not in only
                           and row[0] not in listeners):
            continue
        local_port, remote_port, state = row
        if state == _LISTEN or local_port in keep or remote_port in keep:
            continue
        try:
            if os.fstat(fd).st_ino != inode:  # closed and reused since it was listed
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # closed by its owner since it was listed
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


def raise_if_abandoned() -> None:
    """Raise `CollectivesAbandoned` once the control plane stopped this rank."""
    if _abandoned.is_set():
        raise CollectivesAbandoned(f"FORCE STOP: compute abandoned ({_abandon_reason})")


def _stop_point_grad_hook(grad: Any) -> None:
    raise_if_abandoned()


def _stop_point_pre_hook(module: Any, args: Any) -> None:
    raise_if_abandoned()


def _layers(module: Any) -> Iterable[Any]:
    """The members of the outermost module lists under `module` (a transformer's layers)."""
    import torch

    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            yield from child
        else:
            yield from _layers(child)


#: a module with at least this many params gets a stop point of its own (besides the layers)
SUBLAYER_STOP_POINT_PARAMS = 1 << 21


def _big_modules(chunk: Any) -> Iterable[Any]:
    """The modules under `chunk` (itself included) with at least `SUBLAYER_STOP_POINT_PARAMS`
    params, module containers (which are never called) left out."""
    import torch

    for module in chunk.modules():
        if isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict):
            continue
        if sum(p.numel() for p in module.parameters()) >= SUBLAYER_STOP_POINT_PARAMS:
            yield module


def install_stop_points(model: Iterable[Any]) -> int:
    """Let a stopped rank leave its forward and backward passes at the next layer boundary
    (the members of the model's outermost module lists: megatron-core's transformer layers)
    instead of computing on to its next collective: a peer of a faulty rank otherwise spends
    the rest of its step's compute (0.3 s of a UCE repair at 17 M parameters here) before it
    parks. A forward pre-hook checks before each layer; the backward pass checks when it
    reaches the gradient of the layer's first trainable param (a hook on that param,
    registered once: the layer's last gradient in backward where the layer uses its params
    in the order it declares them, such as a transformer layer's input norm first). Per
    layer and micro-batch that is one flag check each way (within the noise of a 0.25 ms
    forward-backward of four 64x64 layers); hooking each call's input gradient instead (one
    hook registration per call) cost 60-200 us per layer call,
    and finer points (every module with params and every param) 3 ms of a 140 ms step at
    the tiny preset.

    Where modules are big, so is the work between two layer boundaries (up to ~0.5 s of
    backward per layer at 60 M parameters on the 2-core test machine): every module with at
    least `SUBLAYER_STOP_POINT_PARAMS` params, inside a layer or not, gets the same stop
    point. With the Llama shapes of `configs/models` (FFN 2.75 x hidden) that is the MLP from
    hidden size ~500 up, the attention and FC1 from ~720, QKV and FC2 from ~870, and, with
    a vocabulary of 4096, the output layer from 512: its backward is the first thing a
    backward pass does. The tiny preset has none (its whole model is smaller). Each costs
    one flag check each way per call, next to millions of params' work.
    Idempotent (a module is hooked once); returns the number of modules hooked."""
    added = 0
    for chunk in model:
        for module in (*_layers(chunk), *_big_modules(chunk)):
            if getattr(module, "_tft_stop_point", False):
                continue
            module.register_forward_pre_hook(_stop_point_pre_hook)
            first = next((p for p in module.parameters() if p.requires_grad), None)
            if first is not None and not getattr(first, "_tft_stop_point", False):
                first.register_hook(_stop_point_grad_hook)
                first._tft_stop_point = True
            module._tft_stop_point = True
            added += 1
    return added


def abandon(reason: str, keep_ports: Iterable[int]) -> int:
    """Make every pending and future collective of this process fail now.

    `keep_ports`: the ports of connections that must survive (the rendezvous store, the
    controllers). With `install_connection_tracking` (the plugin's default) only the
    connections the process groups opened are shut down; without it, every connection
    not kept. Returns the number of connections shut down (0 on NCCL, whose
    communicators are aborted instead)."""
    global _abandon_reason
    _abandon_reason = reason
    _abandoned.set()
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
        log.warning("communicators aborted: %s", reason)
        return 0
    count = shutdown_connections(keep_ports, _group_sockets if _tracking_installed else None)
    log.warning("%d process-group connections shut down: %s", count, reason)
    return count


# --- gloo reduce-scatter as an all-reduce ------------------------------------------------------
#
# gloo's reduce-scatter completes only inside `wait()`, which ignores timeouts and, when a
# peer's connection breaks while it is pending, can wait forever (seen on CPU: a training
# thread stuck in the backward's sequence-parallel reduce-scatter after every connection of
# its process was closed). An all-reduce waits properly and fails on a broken connection, and
# gloo's reduce-scatter is an all-reduce underneath (their results are bit-identical). On gloo
# the reduce-scatters megatron-core issues therefore run as an all-reduce of a copy of the
# input, of which each rank keeps its slice. Inside megatron-core's grad and param sync,
# torch's coalescing manager (which would batch them into a coalesced reduce-scatter) is
# replaced by one that runs the operations as they come and waits for all of them.


class _SlicedReduce:
    """An all-reduce in flight whose slice becomes the reduce-scatter's output on wait
    (`reduced` None: the all-reduce ran in place on a buffer the output is a slice of)."""

    def __init__(self, work: Any, reduced: Any, output: Any, index: int) -> None:
        self.work = work
        self.reduced = reduced
        self.output = output
        self.index = index

    def wait(self, timeout: Any = None) -> bool:
        if self.work is not None:
            self.work.wait(timeout)
            self.work = None
            if self.reduced is not None:
                size = self.output.numel()
                piece = self.reduced.view(-1)[self.index * size : (self.index + 1) * size]
                self.output.view(-1).copy_(piece)
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def _is_own_slice(output: Any, input: Any, index: int) -> bool:
    """Whether `output` is the `index`-th of the equal slices of contiguous `input` (how
    megatron-core's grad buffers reduce-scatter: into a view of their own shard)."""
    return (output.is_contiguous() and input.is_contiguous() and output.dtype == input.dtype
            and output.device == input.device
            and output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
            and output.data_ptr() == input.data_ptr()
            + index * output.numel() * output.element_size())


class _Collector:
    """What megatron-core's sync code gets instead of a coalescing manager: `wait()` waits
    for every operation started inside the `with` block."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def wait(self) -> None:
        while self.pending:
            self.pending.pop(0).wait()


_collectors = threading.local()


def _active_collector() -> _Collector | None:
    stack = getattr(_collectors, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _collecting_manager(group: Any = None, device: Any = None, async_ops: bool = False):
    collector = _Collector()
    stack = _collectors.__dict__.setdefault("stack", [])
    stack.append(collector)
    try:
        yield collector
    finally:
        stack.pop()
    if not async_ops:
        collector.wait()


def _collected(fn: Any) -> Any:
    """Hand the work of an async operation started inside `_collecting_manager` to it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        work = fn(*args, **kwargs)
        collector = _active_collector()
        if collector is not None and work is not None:
            collector.pending.append(work)
        return work

    return wrapper


def _reduce_scatter_via_all_reduce(original_all_reduce: Any) -> Any:
    def reduce_scatter(output: Any, input: Any, op: Any = dist.ReduceOp.SUM,
                       group: Any = None, async_op: bool = False) -> Any:
        index = dist.get_rank(group)
        # megatron-core's grad buffers scatter into a view of their own shard and use nothing
        # else of the buffer afterwards: reduce it in place, no copy of the whole buffer (a
        # fresh buffer of that size costs more than the all-reduce's own memory traffic)
        in_place = _is_own_slice(output, input, index)
        reduced = None if in_place else input.detach().clone()
        work = original_all_reduce(input if in_place else reduced, op=op, group=group,
                                   async_op=True)
        pending = _SlicedReduce(work, reduced, output, index)
        collector = _active_collector()
        if collector is not None:
            collector.pending.append(pending)
            return pending if async_op else None
        if async_op:
            return pending
        pending.wait()
        return None

    return reduce_scatter


_gloo_installed = False


def install_gloo_collectives() -> None:
    """On gloo: reduce-scatters as all-reduces, collecting instead of coalescing managers in
    megatron-core's sync (idempotent)."""
    global _gloo_installed
    if _gloo_installed:
        return
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import layers, mappings

    all_reduce = _collected(dist.all_reduce)
    reduce_scatter = _reduce_scatter_via_all_reduce(dist.all_reduce)
    # torch 2.13 deprecates all_gather_into_tensor (a FutureWarning per process) for
    # all_gather_single, the same collective; older torch has only the former
    all_gather = _collected(getattr(dist, "all_gather_single", dist.all_gather_into_tensor))
    dist.all_reduce = all_reduce
    dist.reduce_scatter_tensor = reduce_scatter
    dist._reduce_scatter_base = reduce_scatter
    for module in (param_and_grad_buffer, mappings, layers):
        module.dist_reduce_scatter_func = reduce_scatter
    param_and_grad_buffer.dist_all_gather_func = all_gather
    param_and_grad_buffer._coalescing_manager = _collecting_manager
    install_abandonable_waits()
    _gloo_installed = True
