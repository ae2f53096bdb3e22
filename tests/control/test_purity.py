"""The control plane's cores are pure: they import nothing that does I/O, waits, or reads a
clock, the environment or a random source.

A core decides from its inputs alone (`ControllerCore.handle(input, now)`,
`ProcessorCore`, `LinkCore`), so the simulator can run it on a virtual clock and network
and a test can feed it by hand. That holds only while nothing in a core can reach a socket,
a thread, a file or the time. This test reads the imports of every module in `PURE`
(`ast`, no import is executed) and fails on:

- a standard-library module outside `STDLIB_ALLOWED` (`time`, `os`, `threading`,
  `socket`, `random`, `subprocess`, `queue`, `select`, `signal`, `io`, `pathlib`, ...);
- a third-party module outside `THIRD_PARTY_ALLOWED` (`zmq`, `torch`, ...);
- a module of this project that is not itself in `PURE` (the set is closed).

Imports under `if TYPE_CHECKING:` are types only and are not executed: they are allowed
(the cores name `ControlConfig`, whose module reads the environment, this way). `logging`
is allowed: its handlers are the shell's (`wire/config.setup_logging`); a core only hands
it lines. The test also plants `import time` and `import zmq` into each core module's text
and requires the check to catch both.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mindspeed_tft"

#: the cores, and every module they import (dotted names under mindspeed_tft)
CORES = [
    "control.controller.core", "control.controller.inputs", "control.controller.outbox",
    "control.controller.inbox", "control.controller.registration",
    "control.controller.backup", "control.controller.states", "control.controller.liveness",
    "control.controller.nodes", "control.controller.incidents",
    "control.controller.flow", "control.controller.scaling",
    "control.controller.strategy", "control.controller.ranktable",
    "control.controller.elasticity", "control.controller.phases",
    "control.controller.dumping", "control.controller.context",
    "control.processor.core", "control.processor.link", "control.processor.lanes",
    "control.processor.watchdog",
]
#: pure modules the cores may import (and that import only pure modules themselves)
SHARED = [
    "control.wire.protocol", "control.wire.order_types", "control.wire.results",
    "control.wire.fields", "control.wire.classify", "control.wire.peers",
    "control.wire.messages", "control.wire.names",
    "records", "features", "elastic",
]
PURE = CORES + SHARED

STDLIB_ALLOWED = frozenset({
    "__future__", "abc", "bisect", "builtins", "collections", "copy", "dataclasses", "enum",
    "functools", "heapq", "hmac", "ipaddress", "itertools", "logging", "math", "numbers",
    "operator", "re", "statistics", "string", "typing",
})
THIRD_PARTY_ALLOWED = frozenset({"msgpack"})


def _path(module: str) -> Path:
    base = PACKAGE.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of the imports under `if TYPE_CHECKING:`."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and \
                node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        lines.add(sub.lineno)
    return lines


def _imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import executed at run time."""
    tree = ast.parse(source)
    skip = _type_checking_only(tree)
    package = ("mindspeed_tft." + module).split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x: each name may be a module
                    found += [(node.lineno, f"{name}.{a.name}") for a in node.names]
                    continue
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def _project_module(name: str) -> str | None:
    """`name` relative to mindspeed_tft when it is one of this project's modules (a name
    imported from a module resolves to that module)."""
    if name != "mindspeed_tft" and not name.startswith("mindspeed_tft."):
        return None
    parts = name.split(".")[1:]
    while parts and not (_path(".".join(parts)).exists()):
        parts = parts[:-1]
    return ".".join(parts)


def impure_imports(source: str, module: str) -> list[str]:
    """What in `source` (the text of `module`) a core may not import, one line each."""
    bad = []
    for line, name in _imports(source, module):
        top = name.split(".")[0]
        own = _project_module(name)
        if own is not None:
            if own not in PURE:
                bad.append(f"{module}:{line}: imports {name}, not a pure module")
        elif top in sys.stdlib_module_names:
            if top not in STDLIB_ALLOWED:
                bad.append(f"{module}:{line}: imports {name} (I/O, threads, clocks or the "
                           "environment)")
        elif top not in THIRD_PARTY_ALLOWED:
            bad.append(f"{module}:{line}: imports {name} (third-party, not pure)")
    return bad


def test_every_core_and_what_it_imports_is_pure() -> None:
    problems = [p for m in PURE for p in impure_imports(_path(m).read_text(), m)]
    assert problems == []


def test_every_module_named_exists() -> None:
    assert [m for m in PURE if not _path(m).is_file()] == []


@pytest.mark.parametrize("module", CORES)
@pytest.mark.parametrize("planted", ["import time", "import zmq", "import os",
                                     "from threading import Lock",
                                     "from ...events import emit"])
def test_a_planted_io_import_is_caught(module: str, planted: str) -> None:
    source = _path(module).read_text()
    lines = source.splitlines()
    at = next(i for i, text in enumerate(lines) if text.startswith("from __future__"))
    planted_source = "\n".join([*lines[:at + 1], planted, *lines[at + 1:]])
    if planted.startswith("from ...") and module.count(".") != 2:
        planted_source = planted_source.replace("from ...events", "from ..events")
    assert impure_imports(source, module) == []
    caught = impure_imports(planted_source, module)
    assert len(caught) == 1 and caught[0].startswith(f"{module}:{at + 2}: imports ")


def test_a_type_only_import_is_allowed_and_a_run_time_one_is_not() -> None:
    source = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from ..wire.config import ControlConfig\n")
    assert impure_imports(source, "control.controller.core") == []
    assert impure_imports(source.replace("if TYPE_CHECKING:\n    ", ""),
                          "control.controller.core") == [
        "control.controller.core:3: imports mindspeed_tft.control.wire.config, not a pure "
        "module"]
