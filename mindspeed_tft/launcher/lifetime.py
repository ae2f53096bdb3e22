"""Bounded lifetimes: a worker (or warm spare) never outlives the launcher that started it.

A launcher killed by SIGKILL (`tft-run`, torchrun) cannot stop its workers: torch starts each
worker in a session of its own, so a signal to the launcher's process group does not reach
them, and nothing else tells them. Left alone they would train on with no launcher to
restart them (and, under high availability, often with no controller either). Two
mechanisms end them within seconds:

- the Linux parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`): the kernel kills the
  process as soon as its parent ends. `tft-run` (and torchrun with the hook) sets it in the
  child between fork and exec (`preexec`), so it covers the whole life of a worker or spare,
  imports included; the plugin sets it again in the worker (`tie_to_launcher`), which also
  covers workers of a plain torchrun;
- a watch thread (`tie_to_launcher`) that compares `os.getppid()` with the launcher's pid
  every `WATCH_SECONDS`: the parent-death signal fires when the *thread* that forked the
  child ends, and a parent that died before the signal was set is not noticed by it at all.

The launcher's pid is `TFT_LAUNCHER_PID` (set by `tft-run` in every worker and spare); under
a plain torchrun it is the worker's parent when `tie_to_launcher` runs. Linux only: elsewhere
only the watch thread runs.

A training process's own helpers, its data-loader worker processes, live and end with it (the
``data-loader-workers`` moment of `mindspeed_tft.patches`, installed with high availability).
A launcher stops a worker by signalling its whole process group (torch's `SubprocessHandler`
`os.killpg`s: SIGTERM, then SIGKILL after its grace period); a scheduler may signal every
process of the job. Under high availability that SIGTERM starts the grace period in which
the training process finishes the fault's handling (`plugin._Termination`), but torch's
data-loader worker dies of it (its C handler keeps only its parent's SIGTERM as a clean exit),
and the training process's SIGCHLD handler then raises ``RuntimeError: DataLoader worker (pid
N) is killed by signal: Terminated`` in its main thread at whatever it is doing: a healthy
rank would report a fault, or drop out of the dump it is writing. So a data-loader worker
(forked: torch's default start method on Linux) blocks SIGTERM before torch installs its
worker signal handlers, and a thread of its own takes each SIGTERM with its sender
(`sigwaitinfo`): from its training process (torch's shutdown of its workers, multiprocessing's
at exit) it exits 0 as torch's handler would; from anyone else it is left to the training
process, which ends its workers when it ends. The worker also gets the parent-death signal
(SIGKILL), so that it ends the moment its training process does, however that ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from subprocess import Popen
from typing import Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from mindspeed_tft.envvars import launcher_value

#: pid of the launcher that started this worker or spare (set by `tft-run`)
LAUNCHER_PID_ENV = "TFT_LAUNCHER_PID"
#: seconds between two looks at the parent pid
WATCH_SECONDS = 1.0
#: exit code of a worker that ends because its launcher is gone (nobody reads it: the
#: launcher that would is the one that is gone)
LAUNCHER_GONE_EXIT_CODE = 1

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None
_watching = False


def _prctl() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
    return _libc


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent ends; False where the
    platform has no such thing (not Linux) or the call failed."""
    libc = _prctl()
    if libc is None:
        return False
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def preexec() -> None:
    """For `subprocess.Popen(preexec_fn=...)` in the launcher: runs in the child between fork
    and exec (async-signal-safe enough: one system call through a function resolved before
    the fork)."""
    libc = _libc
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def launcher_pid() -> int | None:
    """`TFT_LAUNCHER_PID` as a number (None when unset or not a number)."""
    try:
        return int(os.environ.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return None


def _leave(reason: str) -> None:
    print(f"[mindspeed-tft pid {os.getpid()}] {reason}; exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(LAUNCHER_GONE_EXIT_CODE)


def _watch(parent: int) -> None:
    while True:
        time.sleep(WATCH_SECONDS)
        if os.getppid() != parent:
            _leave(f"the launcher (pid {parent}) is gone")


def _ancestors() -> list[int]:
    """The pids above this process, parent first (empty where /proc cannot be read)."""
    found: list[int] = []
    pid = os.getppid()
    while pid > 1 and len(found) < 64:
        found.append(pid)
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def tie_to_launcher() -> int | None:
    """End this worker when its launcher ends (see the module docstring); returns the pid
    of the parent it is tied to, None when this process was not started by a launcher
    (no `TFT_LAUNCHER_PID`, not a torchelastic worker). Idempotent.

    A worker started through a wrapper (`--no-python` with a shell script that runs
    python) is tied to the wrapper, which `tft-run` gave the parent-death signal; when the
    launcher is not among its ancestors any more, it is gone, and the worker leaves now."""
    global _watching
    parent = launcher_pid()
    if parent is None:
        if launcher_value("TORCHELASTIC_RUN_ID") is None or launcher_value("LOCAL_RANK") is None:
            return None
        parent = os.getppid()  # plain torchrun: the worker's parent is the agent
    elif os.getppid() != parent:
        if parent not in _ancestors():
            _leave(f"the launcher (pid {parent}) is gone")
        parent = os.getppid()
    if _watching:
        return parent
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # gone before the signal was set: it will never come
        _leave(f"the launcher (pid {parent}) is gone")
    _watching = True
    threading.Thread(target=_watch, args=(parent,), name="tft-launcher-watch",
                     daemon=True).start()
    return parent


def install_data_worker_signals() -> None:
    """The ``data-loader-workers`` moment of `mindspeed_tft.patches`: torch's worker signal
    set-up, wrapped (see the module docstring). In the training process, from its main
    thread."""
    from torch.utils.data._utils import signal_handling

    global _forking_thread
    _forking_thread = threading.main_thread().ident
    signal_handling._set_worker_signal_handlers = _worker_signal_handlers(
        signal_handling._set_worker_signal_handlers)


#: the training process's main thread, which starts its data-loader workers: the
#: parent-death signal follows the thread that forked, so only its children get one
_forking_thread: int | None = None


def _worker_signal_handlers(original: Callable[..., None]) -> Callable[..., None]:
    def set_worker_signal_handlers(*args: Any) -> None:
        taking = hasattr(signal, "sigwaitinfo")
        if taking:  # first: from here on a SIGTERM waits for the thread below
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        original(*args)  # torch's messages for SIGBUS, SIGSEGV, SIGFPE
        if taking:
            threading.Thread(target=_take_sigterms, name="tft-data-worker-sigterm",
                             daemon=True).start()
        if threading.get_ident() == _forking_thread:  # forked by the training thread
            set_parent_death_signal(signal.SIGKILL)

    return set_worker_signal_handlers


def _take_sigterms() -> None:
    """A data-loader worker's SIGTERMs, with their senders (blocked in every thread)."""
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == os.getppid():  # its training process ends it: torch's clean exit
            os._exit(0)


class TiedSubprocessHandler(SubprocessHandler):
    """torch's `SubprocessHandler` whose process gets the parent-death signal (and its
    launcher's pid in `TFT_LAUNCHER_PID`) from its start."""

    def _popen(self, args: tuple, env: dict[str, str]) -> Popen:
        env = {**env, LAUNCHER_PID_ENV: str(os.getpid())}
        return Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr,
                     start_new_session=True, preexec_fn=preexec)


# resolve prctl now, in the launcher, so that `preexec` does no lookup after a fork
_prctl()
