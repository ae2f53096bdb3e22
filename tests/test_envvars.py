"""The table of environment variables (`mindspeed_tft/envvars.py`) against the source.

Pure and fast (no processes): the package and `sdk/` are parsed with `ast`, and every
environment variable they read or set for another process is found by the shapes the code
uses for it:

- ``os.environ.get(K)``, ``os.getenv(K)``, ``environ[K]``, ``K in environ`` (the mapping
  being ``os.environ`` or a parameter named ``environ`` / ``env``);
- a call that passes such a mapping followed by the name (``_number(env, "TTP_PORT", ...)``);
- a call of a module's own helper whose parameter is the name (``_int_env(SPARE_ENV)``);
- ``environ[K] = v`` and ``env = {K: v, ...}`` set it for this process or a child.

K is a string literal or a module-level constant holding one (``INJECT_ENV = "TFT_INJECT"``,
imported or not). The test fails when a variable read is missing from the table, when a row
names a variable nobody reads (or sets), when a row's reader is not the one module that reads
it, and when docs/usage.md does not list every public row.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from mindspeed_tft import envvars

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"mindspeed_tft": ROOT / "mindspeed_tft", "mindio_ttp": ROOT / "sdk" / "mindio_ttp"}
NAME = re.compile(r"^[A-Z][A-Z0-9_]*[A-Z0-9]$")
ENV_NAMES = {"environ", "env"}


def _modules() -> dict[str, ast.Module]:
    trees = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            trees[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return trees


def _constants(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Module-level ``NAME_ENV = "VALUE"`` of every module (a name defined twice with two
    values would make the scan ambiguous: the test refuses it)."""
    found: dict[str, set[str]] = defaultdict(set)
    for tree in trees.values():
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id.endswith("_ENV")
                    and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                found[node.targets[0].id].add(node.value.value)
    ambiguous = {name: values for name, values in found.items() if len(values) > 1}
    assert not ambiguous, f"constants with two values: {ambiguous}"
    return {name: values.pop() for name, values in found.items()}


def _is_env(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ENV_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "environ"


class _Scan(ast.NodeVisitor):
    """The names one module reads and sets. `helpers`: function -> (parameter, module) of
    the functions that read the variable their parameter names (``_int_env(name)``), in
    this module or imported into it; a call of one is a read by that module."""

    def __init__(self, module: str, constants: dict[str, str],
                 helpers: dict[str, tuple[int, str]]) -> None:
        self.module, self.constants, self.helpers = module, constants, helpers
        self.reads: dict[str, set[str]] = defaultdict(set)  # name -> reading modules
        self.sets: set[str] = set()
        self.found: dict[str, tuple[int, str]] = {}  # helpers defined here
        self._params: list[tuple[str, list[str]]] = []

    def _key(self, node: ast.AST | None, owner: str) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and NAME.match(node.value):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in self.constants:
                return self.constants[node.id]
            for function, params in reversed(self._params):
                if node.id in params:
                    self.found[function] = (params.index(node.id), owner)
                    return None
        return None

    def _read(self, node: ast.AST | None, owner: str | None = None) -> None:
        key = self._key(node, owner or self.module)
        if key:
            self.reads[key].add(owner or self.module)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._params.append((node.name, [a.arg for a in node.args.args]))
        self.generic_visit(node)
        self._params.pop()

    def visit_Call(self, node: ast.Call) -> None:
        func, args = node.func, node.args
        called = func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and _is_env(func.value):
            self._read(args[0] if args else None)
        elif isinstance(func, ast.Attribute) and func.attr == "getenv":
            self._read(args[0] if args else None)
        elif called in self.helpers and len(args) > self.helpers[called][0]:
            index, owner = self.helpers[called]
            self._read(args[index], owner)
        for i, arg in enumerate(args[:-1]):
            if _is_env(arg):
                self._read(args[i + 1])
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if _is_env(node.value):
            if isinstance(node.ctx, ast.Store):
                key = self._key(node.slice, self.module)
                if key:
                    self.sets.add(key)
            else:
                self._read(node.slice)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _is_env(node.comparators[0]):
            self._read(node.left)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(_is_env(t) for t in node.targets) and isinstance(node.value, ast.Dict):
            for key in node.value.keys:
                name = self._key(key, self.module)
                if name:
                    self.sets.add(name)
        self.generic_visit(node)


def _visible(module: str, tree: ast.Module, helpers: dict[tuple[str, str], tuple[int, str]]
             ) -> dict[str, tuple[int, str]]:
    """The helpers a module can call by name: its own and those it imports."""
    visible = {name: found for (where, name), found in helpers.items() if where == module}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    for (where, name), found in helpers.items():
        if where != module and name in imported:
            visible.setdefault(name, found)
    return visible


def scan() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """variable -> the modules that read it; variable -> the modules that set it."""
    trees = _modules()
    constants = _constants(trees)
    helpers: dict[tuple[str, str], tuple[int, str]] = {}
    while True:  # until every helper (and a helper's helper) is known
        scans = {}
        for module, tree in trees.items():
            scans[module] = _Scan(module, constants, _visible(module, tree, helpers))
            scans[module].visit(tree)
        found = {(module, name): where for module, s in scans.items()
                 for name, where in s.found.items()}
        if found == helpers:
            break
        helpers = found
    readers: dict[str, set[str]] = defaultdict(set)
    setters: dict[str, set[str]] = defaultdict(set)
    for module, s in scans.items():
        for name, owners in s.reads.items():
            readers[name] |= owners
        for name in s.sets:
            setters[name].add(module)
    return readers, setters


READERS, SETTERS = scan()


def test_every_variable_read_or_set_has_a_row() -> None:
    missing = sorted((set(READERS) | set(SETTERS)) - set(envvars.BY_NAME))
    assert not missing, f"read or set but not in mindspeed_tft/envvars.py: {missing}"


def test_rows_are_unique_and_each_is_read_or_set() -> None:
    names = [row.name for row in envvars.TABLE]
    assert len(names) == len(set(names)), "a variable has two rows"
    unused = [row.name for row in envvars.TABLE if row.name not in READERS | SETTERS]
    assert not unused, f"rows of variables nothing reads or sets: {unused}"


def test_each_variable_has_one_reader_the_one_its_row_names() -> None:
    wrong = {}
    for row in envvars.TABLE:
        actual = READERS.get(row.name, set())
        expected = {row.reader} if row.reader else set()
        if actual != expected:
            wrong[row.name] = f"row says {row.reader}, read by {sorted(actual)}"
    assert not wrong, f"readers (one module per variable; update the row): {wrong}"


def test_each_row_names_the_modules_that_set_it() -> None:
    wrong = {row.name: f"row says {sorted(row.set_by)}, set by {sorted(SETTERS.get(row.name, ()))}"
             for row in envvars.TABLE if set(row.set_by) != SETTERS.get(row.name, set())}
    assert not wrong, f"setters (update the row): {wrong}"


def test_rows_are_complete() -> None:
    origins = {envvars.TFT, envvars.MINDIO, envvars.TORCH, envvars.MINDCLUSTER, envvars.SYSTEM}
    for row in envvars.TABLE:
        assert row.default and row.allowed and row.doc and row.origin in origins, row
        assert row.reader or row.set_by, row


def test_usage_doc_carries_the_public_table() -> None:
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert envvars.markdown_table() in usage, \
        "docs/usage.md: paste the output of `python -m mindspeed_tft.envvars`"


def test_launcher_value_refuses_other_names() -> None:
    assert "RANK" in envvars.LAUNCHER_VARIABLES and "MASTER_PORT" in envvars.LAUNCHER_VARIABLES
    try:
        envvars.launcher_value("TTP_PORT")
    except ValueError as error:
        assert "TTP_PORT" in str(error) and "MASTER_PORT" in str(error)
    else:
        raise AssertionError("launcher_value read a variable that is not torch's launcher's")


if __name__ == "__main__":
    r, s = READERS, SETTERS
    for name in sorted(set(r) | set(s)):
        print(f"{name:32} read: {sorted(r.get(name, ()))}  set: {sorted(s.get(name, ()))}")
