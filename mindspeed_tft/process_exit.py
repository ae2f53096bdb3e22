"""How a training process ends with a decided code once torch.distributed is up.

Interpreter teardown frees process groups and their C++ threads at whatever moment it gets to
them, and was seen to abort such a process with SIGABRT ("terminate called without an active
exception"), which turns a decided exit code (2 for a refused checkpoint, 75 after a dump)
into a crash. `exit_without_teardown` flushes the output and ends the process at once. It
sits in the base layer so that every layer may end a process this way.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
