"""The public API's fence: what each module a user imports exports, and what the SDK uses.

docs/architecture.md's "Stable API" section is the list. Every module it names under
"Python names" has an `__all__`, and everything in it is a name that section lists; the
`mindio_ttp` SDK (sdk/) imports from mindspeed_tft only names its "Used by mindio_ttp"
paragraph lists, and pins mindspeed-tft to this very version.
"""

from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
#: the modules a user imports (the Stable API's "Python names")
USER_MODULES = ("mindspeed_tft", "mindspeed_tft.plugin", "mindspeed_tft.arguments",
                "mindspeed_tft.events", "mindspeed_tft.megatron_adaptor",
                "mindspeed_tft.torchrun_adaptor", "mindio_ttp", "mindio_ttp.framework_ttp",
                "mindio_ttp.controller_ttp", "mindio_ttp.utils")


def _stable_api() -> str:
    text = ARCHITECTURE.read_text()
    return text[text.index("## Stable API"):]


def _paragraph(title: str) -> str:
    text = _stable_api()
    start = text.index(f"**{title}**")
    end = text.find("\n\n", start)
    return text[start: end if end >= 0 else len(text)]


def module_all(name: str) -> tuple[list[str] | None, set[str]]:
    """(the module's `__all__`, or None; the names it binds at top level), read with `ast`:
    importing the adaptors would install them."""
    root, _, rest = name.partition(".")
    base = REPO / ("sdk/mindio_ttp" if root == "mindio_ttp" else "mindspeed_tft")
    path = base.joinpath(*rest.split(".")) if rest else base
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    exported, bound = None, set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                exported = list(ast.literal_eval(node.value)) if node.value else None
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return exported, bound


def test_user_modules_export_only_the_stable_api() -> None:
    listed = set(re.findall(r"`([\w.]+)`", _stable_api()))
    for name in USER_MODULES:
        exported, bound = module_all(name)
        assert exported is not None, f"{name} has no __all__"
        missing = sorted(set(exported) - bound)
        assert not missing, f"{name}.__all__ names {missing}, which it does not define"
        if name.startswith("mindio_ttp"):
            continue  # Huawei's SDK defines these names (docs/design.md, section 12)
        extra = sorted(set(exported) - listed)
        assert not extra, (f"{name}.__all__ exports {extra}, which docs/architecture.md's "
                           "Stable API does not list")
    assert module_all("mindspeed_tft.plugin")[0] == ["TFTPlugin", "TrainerHooks", "TrainingState"]


def sdk_imports() -> dict[str, list[str]]:
    """Every mindspeed_tft name the SDK imports -> where (file:line)."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "sdk" / "mindio_ttp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mindspeed_tft"):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("mindspeed_tft")]
            for name in names:
                found.setdefault(name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def unlisted(imports: dict[str, list[str]], paragraph: str) -> list[str]:
    listed = set(re.findall(r"`(mindspeed_tft[\w.]*)`", paragraph))
    return [f"{where[0]}: imports {name}" for name, where in sorted(imports.items())
            if name not in listed and name != "mindspeed_tft"]


def test_the_sdk_imports_only_what_the_stable_api_lists() -> None:
    imports = sdk_imports()
    assert "mindspeed_tft.control.Processor" in imports  # the scan sees the SDK's imports
    bad = unlisted(imports, _paragraph("Used by `mindio_ttp`."))
    assert not bad, ("the SDK imports names docs/architecture.md's Stable API does not list "
                     "under 'Used by mindio_ttp':\n" + "\n".join(bad))


def test_an_unlisted_sdk_import_fails() -> None:
    assert unlisted({"mindspeed_tft.control.controller.flow.IncidentFlow": ["x.py:3"]},
                    "`mindspeed_tft.control.Processor`") == [
        "x.py:3: imports mindspeed_tft.control.controller.flow.IncidentFlow"]


def test_the_sdk_pins_this_version() -> None:
    import mindspeed_tft

    project, sdk = configparser.ConfigParser(), configparser.ConfigParser()
    project.read(REPO / "setup.cfg")
    sdk.read(REPO / "sdk" / "setup.cfg")
    assert project["metadata"]["version"] == mindspeed_tft.__version__
    requires = [line.strip() for line in sdk["options"]["install_requires"].splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert requires == [f"mindspeed-tft=={mindspeed_tft.__version__}"], requires
    assert sdk["metadata"]["version"].endswith(f"+mindspeedtft.{mindspeed_tft.__version__}")
