"""Every ``python`` and ``bash`` block of README.md and docs/ runs, or says on the line above why it does not.

The marker is an HTML comment on the line just above the fence (invisible on the rendered page)::

    <!-- docs-test: skip: REASON -->   never run here; REASON says why and what runs it instead
    <!-- docs-test: slow -->           run only with --run-slow (each block in its own interpreter)
    <!-- tests/integration/test_x.py runs this block -->   run by that test

Unmarked ``python`` blocks run under --run-slow (CI runs it), all in one fresh interpreter (one torch import), each as
its own ``__main__`` module; unmarked ``bash`` blocks are not allowed (every shell line starts an interpreter:
mark them ``slow`` or ``skip``). Plain fences (no language) are output and are not run. README's first block is
the install the CI runs and is checked verbatim instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

SETTLED = "\n".join(
    [
        "```bash",
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 10"
        " || pip install torch==2.13.0",
        'pip install -e ".[dev]"',
        "simdist repro 8913     # reproduce DeepSpeed #8913 in the simulator and print the verdict",
        "python -m pytest -q    # run the tests",
        "```",
    ]
)
"""README's first lines after the title: the install and the two commands (issue #29), run by the CI itself."""

FENCE = re.compile(r"(?:^<!--\s*(?P<mark>[^\n]*?)\s*-->\n)?^```(?P<lang>[A-Za-z]*)\n(?P<code>.*?)^```$", re.S | re.M)
ELSEWHERE = re.compile(r"(tests/\S+\.py) runs this block")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    mark: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            mark = (match.group("mark") or "").strip()
            line = text.count("\n", 0, match.start("lang")) + 1
            found.append(Block(page, line, match.group("lang"), match.group("code"), mark))
    return found


def _is_settled(block: Block) -> bool:
    return block.page.name == "README.md" and block.page.parent == ROOT and block.line == 3


RUNNABLE = ("python", "bash")
ALL = blocks()
DEFAULT = [b for b in ALL if b.lang == "python" and not b.mark]
SLOW = [b for b in ALL if b.lang in RUNNABLE and b.mark == "docs-test: slow"]


def test_readme_is_one_screen_and_starts_with_the_settled_commands():
    text = (ROOT / "README.md").read_text()
    assert text.startswith("# simdist\n\n" + SETTLED + "\n"), "README must open with the settled install commands"
    assert len(text.splitlines()) <= 150


def test_every_runnable_block_runs_or_says_why():
    assert len(ALL) >= 20 and any(_is_settled(b) for b in ALL)  # the parser sees the blocks
    unmarked_shell = [b.where for b in ALL if b.lang == "bash" and not b.mark and not _is_settled(b)]
    assert not unmarked_shell, f"bash blocks need a docs-test mark (slow or skip: why): {unmarked_shell}"
    for block in ALL:
        if block.lang not in RUNNABLE or not block.mark:
            continue
        if block.mark == "docs-test: slow":
            continue
        skip = re.fullmatch(r"docs-test: skip: (.{10,})", block.mark)
        other = ELSEWHERE.fullmatch(block.mark)
        assert skip or other, f"{block.where}: unknown mark {block.mark!r} (skip needs a reason)"
        if other:
            assert (ROOT / other.group(1)).is_file(), f"{block.where}: {other.group(1)} does not exist"


HISTORY = re.compile(
    r"\bissues? #?(?!8913\b)\d+|\bround \d+|\b(?:first|second|third|fourth) round\b"
    r"|\bquiet (?:2-vCPU |2-core )?machine",
    re.IGNORECASE,
)
"""Project history a reader cannot follow: issue numbers, review rounds, "the quiet machine" (#8913, the case's
name, is not history)."""
HISTORY_PENDING = {"verdicts.md", "idioms.md", "production.md"}
"""Pages whose owners are rewriting them now; each must leave this set once it is clean (checked below)."""


def test_no_page_tells_project_history():
    """The changelog keeps dated entries; every other page says what is, not how it came to be."""
    offenders = {}
    for page in PAGES:
        if page.name == "changelog.md":
            continue
        found = HISTORY.findall(page.read_text())
        if page.name in HISTORY_PENDING and page.parent == ROOT / "docs":
            assert found, f"{page.name} is clean now: remove it from HISTORY_PENDING"
        elif found:
            offenders[str(page.relative_to(ROOT))] = found
    assert not offenders, offenders


RUNNER = """
import runpy, sys, tempfile, traceback, pathlib
failed = []
for where, code in BLOCKS:
    path = pathlib.Path(tempfile.mkdtemp()) / "block.py"
    path.write_text(code)
    try:
        runpy.run_path(str(path), run_name="__main__")
    except BaseException:
        failed.append(where)
        print(f"--- {where}", file=sys.stderr)
        traceback.print_exc()
print("FAILED", failed)
"""


@pytest.mark.slow  # about 11 s on the loaded 2-core machine: more than the default suite's budget for one check
def test_the_python_blocks_run(tmp_path):
    """One interpreter for all the default blocks (one torch import); each block in its own ``__main__``."""
    assert len(DEFAULT) >= 4
    script = f"BLOCKS = {[(b.where, b.code) for b in DEFAULT]!r}\n" + RUNNER
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "FAILED []" in done.stdout, done.stderr[-5000:]


@pytest.mark.slow
@pytest.mark.parametrize("block", SLOW, ids=[b.where for b in SLOW])
def test_the_slow_blocks_run(block, tmp_path):
    if block.lang == "python":
        (tmp_path / "block.py").write_text(block.code)
        argv = [sys.executable, "block.py"]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", textwrap.dedent(block.code)]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # this venv's simdist, python
    env = {**os.environ, "PATH": path}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{block.where}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict`` (the ``docs`` extra): broken links, a missing nav page, a docstring mkdocstrings
    cannot render all fail it."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "simdist repro" in cli and "--tolerance-ulp" in cli  # generated from the parser
