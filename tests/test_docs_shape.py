"""The docs that map the code stay true to it.

- Every package of `mindspeed_tft/` and `sdk/mindio_ttp/` has an ``__init__.py`` whose
  docstring ends its description with a ``Modules:`` list: one line per module and per
  subpackage (``- `name`: what it is for``, a subpackage as ``name/``), naming every one
  of them and nothing else. A module added, removed or renamed without its line fails here.
- docs/architecture.md's "Reading order" starts at the cores (the controller's
  `ControllerCore`, the processor's `ProcessorCore` and `LinkCore`), and every file or folder
  it names exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the roots whose packages list their modules
ROOTS = ("mindspeed_tft", "sdk/mindio_ttp")
_ENTRY = re.compile(r"- `(\w+/?)`: \S")
CORES = ("control/controller/core.py", "control/processor/core.py", "control/processor/link.py")


def packages(root: Path) -> list[Path]:
    """`root` and every folder under it that holds Python files."""
    return sorted({p.parent for p in root.rglob("*.py") if "__pycache__" not in p.parts})


def members(package: Path) -> set[str]:
    """The modules of `package` (``__init__`` aside) and its subpackages (``name/``)."""
    found = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    return found | {f"{d.name}/" for d in package.iterdir()
                    if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))}


def listed(docstring: str) -> tuple[list[str], list[str]]:
    """(the names of the ``Modules:`` list, the lines of that list that are not entries)."""
    lines = docstring.splitlines()
    if "Modules:" not in [line.strip() for line in lines]:
        return [], []
    start = [line.strip() for line in lines].index("Modules:") + 1
    names: list[str] = []
    stray: list[str] = []
    for line in lines[start:]:
        if not line.strip():
            if names:
                break
            continue
        entry = _ENTRY.match(line)
        if entry:
            names.append(entry[1])
        else:
            stray.append(line.strip())
    return names, stray


def problems(root: Path, base: Path | None = None) -> list[str]:
    """What every package under `root` (paths shown relative to `base`, by default `root`'s
    parent) gets wrong in its ``Modules:`` list."""
    base = base or root.parent
    bad = []
    for package in packages(root):
        init = package / "__init__.py"
        where = init.relative_to(base)
        if not init.is_file():
            bad.append(f"{package.relative_to(base)}: a package without __init__.py "
                       "(whose docstring lists its modules)")
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        names, stray = listed(doc)
        if not names:
            bad.append(f'{where}: its docstring has no "Modules:" list')
            continue
        bad += [f"{where}: {line!r} in its Modules: list is not one line "
                "'- `name`: what it is for'" for line in stray]
        bad += [f"{where}: lists `{name}` twice" for name in sorted(set(names))
                if names.count(name) > 1]
        have = members(package)
        bad += [f"{where}: its docstring does not list `{name}`"
                for name in sorted(have - set(names))]
        bad += [f"{where}: its docstring lists `{name}`, which is not a module of it"
                for name in sorted(set(names) - have)]
    return bad


def test_every_package_lists_its_modules() -> None:
    bad = [line for root in ROOTS for line in problems(REPO / root, REPO)]
    assert not bad, "\n".join(bad)


def test_a_wrong_module_list_fails(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "loose").mkdir()
    for name in ("a.py", "b.py", "sub/c.py", "loose/d.py"):
        (pkg / name).write_text('"""x."""\n', encoding="utf-8")
    (pkg / "__init__.py").write_text(
        '"""The package.\n\nModules:\n\n- `a`: the first\n- `gone`: renamed since\n'
        "  a second line\n- `a`: again\n- `sub/`: a subpackage\n\"\"\"\n", encoding="utf-8")
    (pkg / "sub" / "__init__.py").write_text('"""Nothing listed."""\n', encoding="utf-8")
    assert problems(pkg) == [
        "pkg/__init__.py: 'a second line' in its Modules: list is not one line "
        "'- `name`: what it is for'",
        "pkg/__init__.py: lists `a` twice",
        "pkg/__init__.py: its docstring does not list `b`",
        "pkg/__init__.py: its docstring does not list `loose/`",
        "pkg/__init__.py: its docstring lists `gone`, which is not a module of it",
        "pkg/loose: a package without __init__.py (whose docstring lists its modules)",
        'pkg/sub/__init__.py: its docstring has no "Modules:" list',
    ]


def reading_order(architecture: str) -> list[str]:
    """The numbered items of the "Reading order" section, each as one line."""
    section = architecture.split("\n## Reading order\n", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"\n(?=\d+\. )", "\n" + section)
    return [" ".join(item.split()) for item in items if re.match(r"\d+\. ", item)]


def named_paths(text: str) -> list[str]:
    """The files (``x.py``, ``x.md``; a ``:name`` after one dropped) and folders (``x/``)
    that `text` names in backquotes."""
    return re.findall(r"`((?:[\w.]+/)*[\w.]+\.(?:py|md)|(?:[\w.]+/)+)(?::\w+)?`", text)


def test_the_reading_order_starts_at_the_cores_and_names_what_exists() -> None:
    items = reading_order((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    code = [item for item in items if any(p.endswith(".py") for p in named_paths(item))]
    assert code, items
    first = [p for p in named_paths(code[0]) if p.endswith(".py")]
    assert first[0] == CORES[0] and set(CORES) <= set(first), code[0]
    files = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
             if ".git" not in p.parts and "__pycache__" not in p.parts]
    missing = [path for item in items for path in named_paths(item)
               if not any(f == path.rstrip("/") or f.endswith("/" + path.rstrip("/"))
                          for f in files)]
    assert not missing, f"docs/architecture.md's reading order names {missing}, which do not exist"


def test_the_reading_order_check_reads_items_and_paths() -> None:
    page = ("# A\n## Reading order\n\nIntro.\n\n1. `docs/design.md` first.\n2. The cores:\n"
            "   `control/controller/core.py` and `processor/link.py`.\n3. `training.py:pretrain`,"
            " `tests/control/`.\n\n## Next\n4. `not/this.py`\n")
    items = reading_order(page)
    assert items == ["1. `docs/design.md` first.",
                     "2. The cores: `control/controller/core.py` and `processor/link.py`.",
                     "3. `training.py:pretrain`, `tests/control/`."]
    assert [named_paths(item) for item in items] == [
        ["docs/design.md"], ["control/controller/core.py", "processor/link.py"],
        ["training.py", "tests/control/"]]
