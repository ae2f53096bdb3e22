"""How a training process ends with a decided code once torch.distributed is up.

Interpreter teardown frees process groups and their C++ threads at whatever moment it gets to
them, and was seen to abort such a process with SIGABRT ("terminate called without an active
exception"), which turns a decided exit code (2 for a refused checkpoint, 75 after a dump)
into a crash. `exit_without_teardown` flushes the output and ends the process at once. It
sits in the base layer so that every layer may end a process this way.

What must not be left behind when a process ends (the job token file of a controller on the
SDK route) is given to `at_exit`: it runs on a normal exit (atexit), in
`exit_without_teardown` (which skips atexit) and on SIGTERM or SIGHUP where nothing else
handles them (the process then still dies of the signal).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

#: what `at_exit` was given, not run yet
_last: list[Callable[[], None]] = []


def print_error(message: str) -> None:
    """`[mindspeed-tft] error: <message>` on stderr in one write: the ranks of a job share
    their launcher's pipe, and `print` writes the text and its newline apart (with
    PYTHONUNBUFFERED), so another rank's output could end up inside the line."""
    sys.stderr.write(f"[mindspeed-tft] error: {message}\n")
    sys.stderr.flush()


def exit_without_teardown(code: int) -> NoReturn:
    """End this process now with `code`, after flushing its output, without interpreter
    teardown (atexit handlers could block on broken process groups).

    Args:
        code: the process's exit code.
    """
    _run_last()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def at_exit(fn: Callable[[], None]) -> None:
    """Run `fn` once when this process ends, whichever way Python still sees (module
    docstring); the latest first, as atexit. Called from the main thread, it also takes
    SIGTERM and SIGHUP where they still have their default action.

    Args:
        fn: a quick call that needs no other thread; an exception it raises is printed.
    """
    if not _last:
        atexit.register(_run_last)
    _last.append(fn)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _die_of)


def _run_last() -> None:
    while _last:
        fn = _last.pop()
        try:
            fn()
        except Exception as e:  # the process ends anyway; the others still run
            print_error(f"at exit: {fn!r} failed: {type(e).__name__}: {e}")


def _die_of(signum: int, frame: Any) -> None:
    """A signal whose default action ends the process: run `at_exit`'s, then die of it."""
    _run_last()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
