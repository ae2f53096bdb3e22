"""Warm spare workers, the worker's side: wait until the launcher hands this process a rank.

With `--tft-spares-per-node K` the launcher starts K extra processes per node with the
training command and `TFT_SPARE=1`. They run the training script like any worker, so their
heavy imports (torch, megatron, the model code) are done ahead of time, and then park in
`wait_for_assignment()` at the top of the trainer's `pretrain()`. When a worker dies, the
launcher hands its rank to a parked spare: the spare takes over the dead worker's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*,
TFT_WORKER_RESTART_COUNT, ...) and continues as that worker, seconds earlier than a cold
restart would get there. On CPU a waiting spare also keeps as much host memory resident as
a worker holds (`warm_memory`), so its set-up does not wait for page faults.

    from mindspeed_tft.launcher.spare import wait_for_assignment

    def pretrain(...):
        wait_for_assignment()   # at once None in a normal worker; a spare blocks here
        ...                     # read RANK, LOCAL_RANK, WORLD_SIZE only after this line

The channel is a Unix socket named by `TFT_SPARE_SOCKET`, carrying one JSON object per line
(never pickle): the spare says hello, the launcher sends the assignment
`{"env": {...}, "stdout": path, "stderr": path}` (log paths where the launcher redirects
worker output; empty otherwise), the spare answers `{"ok": true}`. Every wait is bounded: a
spare whose launcher disappears (the socket closes, or its parent process is gone) exits at
once with code 0; a spare still importing is killed by its parent-death signal (`lifetime`).
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
from collections.abc import Iterable
from importlib import import_module
from typing import Any, NoReturn

from mindspeed_tft.startup import LAZY_TORCH_IMPORTS

from ..procfs import has_ended
from .warm_memory import HeapReserve

#: "1" in a spare's environment
SPARE_ENV = "TFT_SPARE"
#: path of the launcher's Unix socket
SPARE_SOCKET_ENV = "TFT_SPARE_SOCKET"
#: the spare's number on its node (for logs)
SPARE_ID_ENV = "TFT_SPARE_ID"
#: pid of the launcher that started the spare
SPARE_LAUNCHER_PID_ENV = "TFT_SPARE_LAUNCHER_PID"
SPARE_ENV_NAMES = (SPARE_ENV, SPARE_SOCKET_ENV, SPARE_ID_ENV, SPARE_LAUNCHER_PID_ENV)
#: pid of the dead worker this process replaces (set by the launcher in restarted workers)
PREDECESSOR_PID_ENV = "TFT_PREDECESSOR_PID"
#: seconds a replacement that uses an accelerator waits for its predecessor to be gone
PREDECESSOR_WAIT_SECONDS = 60.0
#: longest message accepted on the channel
MAX_MESSAGE_BYTES = 1 << 20

#: (monotonic time, modules loaded) when this spare took its rank; None before, or in a worker
_assignment: tuple[float, frozenset[str]] | None = None
#: the host memory this spare holds ready (`warm_memory`); None in a worker, or off CPU
_reserve: HeapReserve | None = None


class SpareError(RuntimeError):
    """The spare channel cannot be used (the message says why)."""


def is_spare() -> bool:
    """True in a spare process that has not been assigned a rank yet."""
    return os.environ.get(SPARE_ENV) == "1"


def wait_for_assignment(*, warm_imports: Iterable[str] = (), connect_timeout: float = 30.0,
                        check_interval: float = 1.0) -> dict[str, str] | None:
    """In a normal worker: None, at once. In a warm spare: block until the launcher assigns
    this process a rank, switch `os.environ` (and, when the launcher redirects worker
    output, stdout/stderr) to the assigned worker's, and return the environment received.

    Either way, a process that replaces a dead worker on an accelerator first waits (at most
    `PREDECESSOR_WAIT_SECONDS`) until the dead process is gone: the launcher starts it as
    soon as a signal ends its predecessor, before the kernel has torn the predecessor down
    and freed its device memory (`procfs`). On CPU it does not wait: the kernel frees the
    host memory while the replacement sets up.

    Bounded: connecting gives up after `connect_timeout` seconds; while waiting, the
    launcher's liveness is checked every `check_interval` seconds and a spare whose launcher
    is gone exits (code 0) instead of waiting forever.
    """
    if not is_spare():
        _wait_for_predecessor()
        return None
    path = os.environ.get(SPARE_SOCKET_ENV, "")
    if not path:
        raise SpareError(f"{SPARE_ENV}=1 but {SPARE_SOCKET_ENV} is not set: this process was "
                         "not started as a spare by tft-run")
    launcher_pid = _int_env(SPARE_LAUNCHER_PID_ENV)
    for name in (*LAZY_TORCH_IMPORTS, *warm_imports):
        import_module(name)
    global _reserve
    _reserve = _host_memory_reserve()
    sock = _connect(path, connect_timeout, launcher_pid)
    try:
        _send(sock, {"hello": os.environ.get(SPARE_ID_ENV, "?"), "pid": os.getpid()})
        message = _receive(sock, check_interval, launcher_pid)
        env = message.get("env")
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise SpareError(f"malformed assignment from the launcher: {str(message)[:200]}")
        for name in SPARE_ENV_NAMES:
            os.environ.pop(name, None)
        os.environ.update(env)
        _redirect(1, message.get("stdout"))
        _redirect(2, message.get("stderr"))
        _send(sock, {"ok": True, "pid": os.getpid()})
        global _assignment
        _assignment = (time.monotonic(), frozenset(sys.modules))
    finally:
        sock.close()
    _wait_for_predecessor()
    return dict(env)


def setup_report() -> str | None:
    """In a spare that took a rank: one line saying how long ago that was and which modules
    it imported since (those its host's `warm_imports` missed). None in any other process."""
    if _assignment is None:
        return None
    taken, before = _assignment
    late = sorted(name for name in list(sys.modules) if name not in before)
    shown = ", ".join(late[:12]) + (f" and {len(late) - 12} more" if len(late) > 12 else "")
    held = "" if _reserve is None else f"; host memory held ready {_reserve.held >> 20} MiB"
    return (f"warm spare pid {os.getpid()} set up {time.monotonic() - taken:.3f} s after it "
            f"took its rank; modules imported since: {shown or 'none'}{held}")


# -- internals ---------------------------------------------------------------------------------
def _wait_for_predecessor(timeout: float = PREDECESSOR_WAIT_SECONDS) -> None:
    pid = _int_env(PREDECESSOR_PID_ENV)
    if pid is None:
        return
    from mindspeed_tft.platform import CPU, detect_platform

    if detect_platform() == CPU:
        return
    deadline = time.monotonic() + timeout
    while not has_ended(pid):
        if time.monotonic() > deadline:
            print(f"[tft pid {os.getpid()}] the dead worker pid {pid} this process replaces "
                  f"is still exiting after {timeout:g}s; going on", file=sys.stderr, flush=True)
            return
        time.sleep(0.01)


def _host_memory_reserve() -> HeapReserve | None:
    """A reserve where training keeps its state in host memory (CPU), else None."""
    from mindspeed_tft.platform import CPU, detect_platform

    return HeapReserve() if detect_platform() == CPU else None


def _grow_reserve(sock: socket.socket, launcher_pid: int | None) -> None:
    """Grow the host memory reserve towards the workers' (stops when a message arrives)."""
    if _reserve is None or launcher_pid is None or not _reserve.usable:
        return
    _reserve.grow_to(_reserve.target(launcher_pid),
                     interrupted=lambda: bool(select.select([sock], [], [], 0)[0]))


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return None


def _launcher_gone(launcher_pid: int | None) -> bool:
    return launcher_pid is not None and os.getppid() != launcher_pid


def _leave(reason: str) -> NoReturn:
    """A spare that will never be used: exit quietly (it holds no state)."""
    print(f"[tft-spare pid {os.getpid()}] {reason}; exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)


def _connect(path: str, timeout: float, launcher_pid: int | None) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError as e:
            sock.close()
            if _launcher_gone(launcher_pid):
                _leave("the launcher is gone")
            if time.monotonic() >= deadline:
                _leave(f"cannot reach the launcher at {path} within {timeout:g}s ({e})")
            time.sleep(0.1)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.settimeout(10.0)
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
    except OSError as e:
        _leave(f"the launcher's channel broke ({e})")


def _receive(sock: socket.socket, check_interval: float,
             launcher_pid: int | None) -> dict[str, Any]:
    buffer = b""
    sock.settimeout(check_interval)
    while b"\n" not in buffer:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if _launcher_gone(launcher_pid):
                _leave("the launcher is gone")
            _grow_reserve(sock, launcher_pid)
            continue
        except OSError as e:
            _leave(f"the launcher's channel broke ({e})")
        if not chunk:
            _leave("the launcher closed the channel")
        buffer += chunk
        if len(buffer) > MAX_MESSAGE_BYTES:
            raise SpareError(f"assignment larger than {MAX_MESSAGE_BYTES} bytes")
    line = buffer.split(b"\n", 1)[0]
    try:
        message = json.loads(line)
    except ValueError:
        raise SpareError(f"malformed assignment from the launcher: {line[:200]!r}") from None
    if not isinstance(message, dict):
        raise SpareError(f"malformed assignment from the launcher: {line[:200]!r}")
    return message


def _redirect(fd: int, path: Any) -> None:
    if not path or not isinstance(path, str):
        return
    (sys.stdout if fd == 1 else sys.stderr).flush()
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)
