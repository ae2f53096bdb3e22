"""Sphinx configuration of the API reference (scripts/docs.sh builds it, warnings as errors).

Two pages are generated here at build time instead of being written twice: the command-line
tools' ``--help`` (each tool run as users run it) and the events schema and exit codes (the
tables of docs/design.md, section 11, which is the contract).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GENERATED = HERE / "_generated"

project = "mindspeed-tft"
author = "mindspeed-tft contributors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
nitpicky = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

#: the command-line tools of the Stable API: (title, how users run it)
CLIS = (
    ("tft-run", ["tft-run", "--help"]),
    ("tft-report", ["tft-report", "--help"]),
    ("tft-drill", ["tft-drill", "--help"]),
    ("tft-plan", ["tft-plan", "--help"]),
    ("python -m mindspeed_tft.control.keys", [sys.executable, "-m", "mindspeed_tft.control.keys",
                                              "--help"]),
)


def _helps(commands: list[list[str]]) -> list[str]:
    """Each tool's --help output, as a user's terminal of 100 columns shows it (the tools run
    side by side: each imports torch)."""
    scripts = Path(sys.executable).parent
    env = {**os.environ, "COLUMNS": "100"}
    runs = []
    for command in commands:
        if (scripts / command[0]).exists():
            command = [str(scripts / command[0]), *command[1:]]
        runs.append((command, subprocess.Popen(command, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True, env=env)))
    outputs = []
    for command, run in runs:
        out, err = run.communicate(timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {run.returncode}: {err}")
        outputs.append(out)
    return outputs


def _flags_help() -> str:
    """The flags `add_tft_args` adds to a Megatron pretrain script's parser."""
    from mindspeed_tft.arguments import add_tft_args

    os.environ["COLUMNS"] = "100"
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", add_help=False)
    return add_tft_args(parser).format_help()


def _literal(text: str) -> str:
    return "::\n\n" + "".join(f"    {line}\n" if line.strip() else "\n"
                              for line in text.splitlines()) + "\n"


def _cli_page() -> str:
    out = ["Command-line tools", "==================", "",
           "Each tool's ``--help``, generated from the tool itself at build time.", ""]
    out += ["Flags of the training script", "----------------------------", "",
            "Registered by :func:`mindspeed_tft.arguments.add_tft_args` (a Megatron "
            "``extra_args_provider``)", _literal(_flags_help())]
    for (title, _), text in zip(CLIS, _helps([command for _, command in CLIS]), strict=True):
        out += [title, "-" * len(title), "", _literal(text)]
    return "\n".join(out)


def _rst_inline(text: str) -> str:
    """Markdown's inline code and bold as reStructuredText."""
    # escaped spaces around a literal: reStructuredText needs none beside brackets
    text = re.sub(r"`([^`]+)`", r"\\ ``\1``\\ ", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"**\1**", text)


def _table(design: str, lead: str) -> tuple[list[str], list[list[str]]]:
    """The Markdown table that follows the bold lead-in `lead` in docs/design.md."""
    start = design.index(lead)
    lines = design[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not all(set(c) <= set("-: ") for c in cells):
            rows.append(cells)
    return rows[0], rows[1:]


def _list_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    out = [f".. list-table:: {title}", "   :header-rows: 1", ""]
    for row in [header, *rows]:
        out.append(f"   * - {_rst_inline(row[0])}")
        out += [f"     - {_rst_inline(cell)}" for cell in row[1:]]
    return "\n".join(out) + "\n"


def _contract_page() -> str:
    design = (REPO / "docs" / "design.md").read_text()
    events = _table(design, "**Events file.**")
    codes = _table(design, "**Exit codes:**")
    return "\n".join([
        "Events file and exit codes", "==========================", "",
        "The tables of ``docs/design.md``, section 11 (the contract), as they are there.", "",
        "Events file", "-----------", "",
        "JSON Lines, one object per event, each with ``time`` (unix seconds), ``event`` and "
        "``rank`` (-1: the controller), set by ``--tft-events-file PATH`` or "
        "``TFT_EVENTS_FILE``. New events and fields may be added; existing ones keep their "
        "names and meaning. :func:`mindspeed_tft.events.validate_record` checks an iteration "
        "record.", "",
        _list_table("Events", *events), "",
        "Exit codes", "----------", "",
        _list_table("Process exit codes", *codes)])


def _generate(app: object) -> None:
    GENERATED.mkdir(exist_ok=True)
    for name, text in (("cli.rst", _cli_page()), ("contract.rst", _contract_page())):
        path = GENERATED / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def setup(app):  # noqa: ANN001, ANN201 (Sphinx's hook)
    app.connect("builder-inited", _generate)
