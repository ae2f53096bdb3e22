"""The layer diagram of docs/architecture.md is the import rule, and the code keeps it.

The diagram (the Mermaid block that starts with ``%% layers``) names each layer's modules in
its node's label and the allowed imports as arrows; a layer may import what its arrows reach,
directly or through other layers. Every import of ``mindspeed_tft/`` and ``sdk/mindio_ttp/``
is read from the code with `ast` (lazy imports inside functions too) and checked against it.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
#: the import roots: package name -> its directory
ROOTS = {"mindspeed_tft": REPO / "mindspeed_tft", "mindio_ttp": REPO / "sdk" / "mindio_ttp"}

_NODE = re.compile(r'^\s*(\w+)\["<b>\w+</b><br/>(.*)"\]\s*$')
_EDGE = re.compile(r"^\s*(\w+)\s*-->\s*(\w+)\s*$")


@dataclass
class Diagram:
    """The layers (node -> the module patterns of its label) and the arrows."""

    members: dict[str, list[str]]
    arrows: dict[str, set[str]]

    def layer_of(self, module: str) -> str | None:
        """The layer whose label names `module` (the longest matching pattern), or None."""
        best: tuple[int, str] | None = None
        for layer, patterns in self.members.items():
            for pattern in patterns:
                if _matches(pattern, module) and (best is None or len(pattern) > best[0]):
                    best = (len(pattern), layer)
        return best[1] if best else None

    def reach(self, layer: str) -> set[str]:
        """The layers `layer` may import: those its arrows reach, directly or not."""
        seen: set[str] = set()
        todo = [layer]
        while todo:
            for nxt in self.arrows.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen


def _dotted(pattern: str) -> str:
    """A label's pattern as a dotted module name (`control/wire/` -> mindspeed_tft.control.wire)."""
    path = pattern.rstrip("/")
    if path.split("/")[0] in ROOTS:
        return path.replace("/", ".")
    if path == "__init__":
        return "mindspeed_tft"
    return "mindspeed_tft." + path.replace("/", ".")


def _matches(pattern: str, module: str) -> bool:
    name = _dotted(pattern)
    if pattern.endswith("/"):
        return module == name or module.startswith(name + ".")
    return module == name


def parse_diagram(text: str) -> Diagram:
    """The ``%% layers`` Mermaid block of `text`; ValueError when there is none."""
    blocks = re.findall(r"```mermaid\n(.*?)```", text, re.S)
    block = next((b for b in blocks if b.lstrip().startswith("%% layers")), None)
    if block is None:
        raise ValueError("no ```mermaid block starting with '%% layers'")
    members: dict[str, list[str]] = {}
    arrows: dict[str, set[str]] = {}
    for line in block.splitlines():
        if node := _NODE.match(line):
            members[node[1]] = node[2].split()
        elif edge := _EDGE.match(line):
            arrows.setdefault(edge[1], set()).add(edge[2])
    for src, dsts in arrows.items():
        for name in {src, *dsts} - members.keys():
            raise ValueError(f"arrow {src} --> {dsts} names {name!r}, which is no node")
    return Diagram(members, arrows)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the import roots: dotted name -> file."""
    found = {}
    for root, directory in ROOTS.items():
        for path in sorted(directory.rglob("*.py")):
            parts = [root, *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


@functools.cache
def imports(module: str, path: Path, known: frozenset[str]) -> list[tuple[int, str]]:
    """(line, imported module) for each import of a known module in `path`: absolute and
    relative, at the top and inside functions; `from pkg import name` counts as pkg.name
    when that is a module, else as pkg."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target:
                found.append((node.lineno, target))
    return found


def violations(diagram: Diagram) -> list[str]:
    """Every import the diagram does not allow, and every module it does not place."""
    found = modules()
    # directories too: a package without __init__.py (a namespace package) is imported
    known = frozenset(found) | {
        ".".join([root, *d.relative_to(directory).parts])
        for root, directory in ROOTS.items() for d in directory.rglob("*") if d.is_dir()}
    problems = []
    for module in sorted(found):
        if diagram.layer_of(module) is None:
            problems.append(
                f"{found[module].relative_to(REPO)}: module {module} is in no layer of the "
                "diagram in docs/architecture.md: name it (or its package) in a node's label")
    for module, path in sorted(found.items()):
        layer = diagram.layer_of(module)
        if layer is None:
            continue
        allowed = diagram.reach(layer) | {layer}
        for line, target in imports(module, path, known):
            other = diagram.layer_of(target)
            if other is not None and other not in allowed:
                problems.append(
                    f"{path.relative_to(REPO)}:{line}: {module} ({layer}) imports {target} "
                    f"({other}): no arrow of docs/architecture.md's layer diagram allows "
                    f"{layer} -> {other}")
    return problems


def test_the_code_keeps_the_layer_diagram() -> None:
    diagram = parse_diagram(ARCHITECTURE.read_text())
    assert not (problems := violations(diagram)), "\n".join(problems)


def test_the_diagram_has_no_cycle() -> None:
    diagram = parse_diagram(ARCHITECTURE.read_text())
    cycles = [layer for layer in diagram.members if layer in diagram.reach(layer)]
    assert not cycles, f"layers on a cycle of arrows: {cycles}"


def test_a_crossing_import_fails() -> None:
    """The rule can fail: recovery may not import the controller (peers over wire/), and
    the diagram without its recovery --> wire arrow rejects recovery/actions.py."""
    diagram = parse_diagram(ARCHITECTURE.read_text())
    assert "controller" not in diagram.reach("recovery")
    diagram.arrows["recovery"].discard("wire")
    problems = violations(diagram)
    assert any("recovery/actions.py" in p and "recovery -> wire" in p for p in problems), problems


def test_an_unknown_module_fails() -> None:
    diagram = parse_diagram(ARCHITECTURE.read_text())
    diagram.members = {k: [p for p in v if p != "goodput"] for k, v in diagram.members.items()}
    problems = violations(diagram)
    assert any("module mindspeed_tft.goodput is in no layer" in p for p in problems), problems


@pytest.mark.parametrize("line", ['    a["<b>a</b><br/>x/"]\n    a --> b'])
def test_an_arrow_to_no_node_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="'b', which is no node"):
        parse_diagram(f"```mermaid\n%% layers\nflowchart TD\n{line}\n```\n")


def _defined_names() -> set[str]:
    """Every `function`, `Class` and `Class.method` defined in mindspeed_tft/."""
    names: set[str] = set()
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
                names.update(f"{node.name}.{item.name}" for item in node.body
                             if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return names


def test_the_lock_step_diagram_names_functions_that_exist() -> None:
    """The lock step's path (the ``%% lock step`` diagram) through functions of the code: a
    rename in the code that the page does not follow fails here."""
    text = ARCHITECTURE.read_text()
    block = next(b for b in re.findall(r"```mermaid\n(.*?)```", text, re.S)
                 if b.lstrip().startswith("%% lock step"))
    lines = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("%%"))
    cited = set(re.findall(r"\b([A-Z]\w+\.\w+|[a-z]+_\w+)\b", lines))
    cited -= {"train_fn", "processor/handler"}
    missing = sorted(cited - _defined_names())
    assert not missing, f"docs/architecture.md's lock step diagram names {missing}: not in the code"
