"""Every "SPEC n" the code cites names a numbered section of docs/design.md that exists.

The code cites the design contract as ``SPEC n`` (``SPEC 3, 7``, ``SPEC 1, 2 and 10``) and the
docs as ``docs/design.md, section n``, sometimes with a part of it in quotes (``section 11,
"Exit codes"``): that part must be a heading or a bold lead-in of that section. The opening of
docs/design.md says how its sections are numbered ("1 to N, with 9a"): that must be its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
#: where citations live: the code, its tests, benchmarks and scripts, and the docs
SOURCES = ("mindspeed_tft", "sdk", "tests", "bench", "scripts", "docs", "README.md")

_NUMBERS = r"(\d+[a-z]?(?:(?:,? and |, )\d+[a-z]?)*)"
_SPEC = re.compile(r"\bSPEC\s+" + _NUMBERS)
_SECTION = re.compile(r"design\.md`?,?\s+sections?\s+" + _NUMBERS + r'(?:,\s+"([^"]+)")?')
_HEADING = re.compile(r"^## (\d+[a-z]?)\. ", re.M)


def sections(design: str) -> dict[str, str]:
    """Section number -> its text, from the ``## n. Title`` headings."""
    marks = list(_HEADING.finditer(design))
    return {m[1]: design[m.start(): marks[i + 1].start() if i + 1 < len(marks) else len(design)]
            for i, m in enumerate(marks)}


def _order(number: str) -> tuple[int, str]:
    return int(number.rstrip("abcdefghijklmnopqrstuvwxyz")), number.lstrip("0123456789")


def count_problems(design: str) -> list[str]:
    """What `design`'s opening says of its numbering ("The sections are numbered 1 to N, with
    9a ... between 9 and 10") against its ``## n.`` headings, in their order."""
    flat = re.sub(r"\s+", " ", design)
    said = re.search(r"The sections are numbered 1 to (\d+)([^;.]*)", flat)
    if said is None:
        return ['docs/design.md does not say "The sections are numbered 1 to N"']
    stated = sorted([str(n) for n in range(1, int(said[1]) + 1)]
                    + re.findall(r"\b(\d+[a-z])\b", said[2]), key=_order)
    headings = list(sections(design))
    if headings == stated:
        return []
    return [f"docs/design.md says its sections are {', '.join(stated)}; its headings are "
            f"{', '.join(headings)}"]


def citations(text: str) -> list[tuple[str, str | None]]:
    """(section number, quoted part or None) for every citation in `text`."""
    # a citation may wrap: "(SPEC\n    #  2)" or a docstring's next line
    flat = re.sub(r"\s*\n\s*(?:#+\s*|\*\s*)?", " ", text)
    found: list[tuple[str, str | None]] = []
    for match in _SPEC.finditer(flat):
        found += [(n, None) for n in re.split(r",? and |, ", match[1])]
    for match in _SECTION.finditer(flat):
        numbers = re.split(r",? and |, ", match[1])
        found += [(n, None) for n in numbers[:-1]] + [(numbers[-1], match[2])]
    return found


def problems(files: dict[str, str], design: str) -> list[str]:
    """Every citation in `files` (name -> text) that names no section (or part) of `design`."""
    known = sections(design)
    bad = []
    for name, text in sorted(files.items()):
        for number, part in citations(text):
            if number not in known:
                bad.append(f"{name}: cites section {number} of docs/design.md, which has "
                           f"sections {', '.join(known)}")
            elif part and not re.search(
                    r"^(?:#{3,4} |(?:- )?\*\*)" + re.escape(part), known[number], re.M):
                bad.append(f'{name}: cites "{part}" in section {number} of docs/design.md, '
                           "which has no heading or bold lead-in of that name")
    return bad


def cited_files() -> dict[str, str]:
    files = {}
    for source in SOURCES:
        path = REPO / source
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            if (file.suffix in {".py", ".sh", ".md", ".cfg", ".toml"} and file.is_file()
                    and file != Path(__file__).resolve()):
                files[str(file.relative_to(REPO))] = file.read_text(errors="replace")
    return files


def test_every_cited_section_exists() -> None:
    bad = problems(cited_files(), DESIGN.read_text())
    assert not bad, "\n".join(bad)


def test_the_code_cites_the_contract() -> None:
    """The scan finds the code's citations (a regex that finds none would pass anything)."""
    cited = {n for text in cited_files().values() for n, _ in citations(text)}
    assert {"2", "5", "6", "7", "11"} <= cited, sorted(cited)


def test_a_missing_section_fails() -> None:
    design = "## 1. One\n**Exit codes:** 0\n## 2. Two\ntext\n"
    files = {"a.py": '"""Kept (SPEC 1, 2 and 3); see docs/design.md, section 1, "Exit codes"."""',
             "b.py": "# the lock (SPEC\n#  2) and docs/design.md, section 2, \"Events file\""}
    assert problems(files, design) == [
        "a.py: cites section 3 of docs/design.md, which has sections 1, 2",
        'b.py: cites "Events file" in section 2 of docs/design.md, which has no heading or '
        "bold lead-in of that name",
    ]


def test_the_stated_section_count_is_the_headings() -> None:
    assert count_problems(DESIGN.read_text()) == []


def test_a_wrong_section_count_fails() -> None:
    headings = "## 1. One\n## 2. Two\n## 2a. Two and a half\n## 3. Three\n"
    assert count_problems("The sections are numbered 1 to 3, with 2a (half)\nbetween 2 and 3.\n"
                          + headings) == []
    assert count_problems("The sections are numbered 1 to 2, with 2a (half).\n" + headings) == [
        "docs/design.md says its sections are 1, 2, 2a; its headings are 1, 2, 2a, 3"]
    assert count_problems("The sections are numbered 1 to 3.\n" + headings) == [
        "docs/design.md says its sections are 1, 2, 3; its headings are 1, 2, 2a, 3"]
    assert count_problems("Numbered as you like.\n" + headings) == [
        'docs/design.md does not say "The sections are numbered 1 to N"']
    swapped = "## 1. One\n## 3. Three\n## 2. Two\n"
    assert count_problems("The sections are numbered 1 to 3.\n" + swapped) == [
        "docs/design.md says its sections are 1, 2, 3; its headings are 1, 3, 2"]


#: a part of another page cited by its title: docs/usage.md, "Environment variables"
_TITLED = re.compile(r"((?:bench/)?(?:README|HISTORY)\.md|docs/\w+\.md)`?,?\s+\"([^\"]+)\"")


def titled_problems(files: dict[str, str], pages: dict[str, str]) -> list[str]:
    """Every `page, "Title"` citation in `files` whose page (`pages`: path -> text) has no
    heading or bold lead-in starting with that title."""
    bad = []
    for name, text in sorted(files.items()):
        flat = re.sub(r"\s*\n\s*(?:#+\s*|\*\s*)?", " ", text)
        for match in _TITLED.finditer(flat):
            page = "bench/HISTORY.md" if match[1] == "HISTORY.md" else match[1]
            if page not in pages:
                bad.append(f"{name}: cites {page}, which does not exist")
            elif not re.search(r"^(?:#+ (?:\d+[a-z]?\. )?|(?:- )?\*\*)" + re.escape(match[2]),
                               pages[page], re.M):
                bad.append(f'{name}: cites "{match[2]}" in {page}, which has no heading or '
                           "bold lead-in of that name")
    return bad


def test_every_cited_title_exists() -> None:
    pages = {str(p.relative_to(REPO)): p.read_text()
             for p in [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("bench/*.md")]}
    bad = titled_problems(cited_files(), pages)
    assert not bad, "\n".join(bad)


def test_a_missing_title_fails() -> None:
    pages = {"docs/usage.md": "# Guide\n## Environment variables\n"}
    files = {"a.py": 'see docs/usage.md, "Environment variables" and docs/usage.md, "Security"'}
    assert titled_problems(files, pages) == [
        'a.py: cites "Security" in docs/usage.md, which has no heading or bold lead-in of '
        "that name"]
