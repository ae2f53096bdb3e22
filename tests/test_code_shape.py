"""The code's shape limits, so that they cannot rot: no function over 80 lines and no class over
500 in the package (`mindspeed_tft/`) or the SDK shim (`sdk/`). A definition's lines run from
its `def` / `class` line to its last line (decorators not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 500


def oversized(folder: Path) -> list[str]:
    """`path:line name (N lines, limit L)` (path relative to `folder`'s parent) for every
    function over 80 lines and class over 500 under `folder`."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if size > limit:
                found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} "
                             f"({size} lines, limit {limit})")
    return found


@pytest.mark.parametrize("folder", ["mindspeed_tft", "sdk"])
def test_no_function_over_80_lines_and_no_class_over_500(folder: str) -> None:
    assert oversized(ROOT / folder) == []


def test_the_check_sees_an_oversized_function_and_class(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text(f"class Big:\n    def big(self):\n{body}\n",
                                             encoding="utf-8")
    assert oversized(tmp_path / "pkg") == [
        f"pkg/big.py:1 Big ({MAX_CLASS_LINES + 2} lines, limit {MAX_CLASS_LINES})",
        f"pkg/big.py:2 big ({MAX_CLASS_LINES + 1} lines, limit {MAX_FUNCTION_LINES})"]
