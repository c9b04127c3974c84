"""The glossary (`docs/glossary.md`) is the one place a concept's word is chosen: the spellings it retires are gone.

Each table row of the glossary may name, in its last column, the spellings the rename pass retired (backquoted).
This test reads them from the glossary itself and finds none of them in the repository's code, command line, docs,
notebooks and tests -- except on a line that says the spelling was removed or retired (a changelog-like sentence,
or a test that the old spelling is refused).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GLOSSARY = ROOT / "docs" / "glossary.md"
SCANNED_SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".yml", ".c"}
TOP_FOLDERS = ("simdist", "tests", "docs", "bench", "experiments", "notebooks", "policies", ".ci")
TOP_FILES = ("README.md", "pyproject.toml", "mkdocs.yml")
EXCUSED = re.compile(r"\b(removed|retired|refused|unknown|no longer)\b", re.I)


def retired_spellings() -> list[str]:
    """The backquoted spellings in the glossary's "retired" column (the last cell of each word's row)."""
    found: list[str] = []
    header_has_retired = False
    for line in GLOSSARY.read_text().splitlines():
        if not line.startswith("|"):
            header_has_retired = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[-1].lower().startswith("retired"):
            header_has_retired = True
            continue
        if header_has_retired and not set(line) <= set("|-: "):
            found += re.findall(r"`([^`]+)`", cells[-1])
    return found


@functools.cache
def tracked_lines() -> tuple[tuple[str, int, str], ...]:
    """Every scanned line of the repository (but the glossary and this file) as ``(path, number, text)``."""
    here = Path(__file__).resolve()
    return tuple(
        (str(path.relative_to(ROOT)), n, line)
        for path in tracked_files()
        if path != here
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
    )


def tracked_files() -> list[Path]:
    """The project's own text: its top-level folders and files (no subprocess: `tests/unit` runs in one process)."""
    paths = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for folder in TOP_FOLDERS:
        paths += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and not _ignored(p))
    return [p for p in paths if p.suffix in SCANNED_SUFFIXES and p != GLOSSARY]


def _ignored(path: Path) -> bool:
    parts = path.relative_to(ROOT).parts
    return any(
        (part.startswith(".") and part != ".ci") or part in {"__pycache__", "build", "results"} for part in parts
    )


def test_the_glossary_names_retired_spellings():
    """The column is read (a parse that finds nothing would make the next test pass vacuously)."""
    spellings = retired_spellings()
    assert len(spellings) >= 10, spellings
    assert "ReductionModel" in spellings


@pytest.mark.parametrize("spelling", retired_spellings())
def test_a_retired_spelling_is_gone(spelling):
    pattern = re.compile(r"(?<![\w-])" + re.escape(spelling) + r"(?![\w-])")
    hits = [
        f"{path}:{n}: {line.strip()}"
        for path, n, line in tracked_lines()
        if spelling in line and pattern.search(line) and not EXCUSED.search(line)
    ]
    assert not hits, f"{spelling!r} is retired (docs/glossary.md), still written in:\n" + "\n".join(hits[:20])
