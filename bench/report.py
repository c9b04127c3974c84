"""Benchmark results as data: the JSON schema the bench scripts write and the docs' benchmarks page renders.

A result file is ``bench/results/<name>.json``::

    {"machine": str,            # what ran it: CPU, cores, OS, the load at the start
     "when": str,               # ISO 8601 date or date-time (UTC)
     "command": str,            # the command line that produced it, from the repository root
     "tables": [{"title": str, "columns": [str, ...], "rows": [[str | number, ...], ...], "notes": str}]}

Scripts write it with `write` (``--json PATH``); any tool may write the same schema (it is the only contract).
docs/hooks.py renders every file into docs/benchmarks.md at build time with `render_dir`, so the page never
holds a hand-copied figure; `load` refuses a file that does not follow the schema, naming the file and the field,
which makes ``mkdocs build`` (and tests/unit/meta/test_bench_results.py) fail rather than publish a half table.

This module imports nothing outside the standard library: the docs build and the tests load it by path.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

Cell = str | int | float

RESULTS = Path(__file__).resolve().parent / "results"
"""Where the bench scripts' result files live (``bench/results``)."""


@dataclass
class Table:
    """One table of a result: a title, column names, rows of cells (strings or numbers), and a note under it."""

    title: str
    columns: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    notes: str = ""

    def add(self, *cells: Cell) -> None:
        """Append one row; its length must match the columns."""
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.title!r}: a row of {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))


def machine() -> str:
    """The machine in words: CPU model, logical CPUs, OS and architecture, and the load average at the call."""
    model = platform.machine()  # (platform.processor() may start a subprocess: /proc/cpuinfo names the CPU)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = f", load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, "getloadavg") else ""
    return f"{model}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}{load}"


def command() -> str:
    """This process's command line as one would type it from the repository root (``python bench/x.py ...``)."""
    script = Path(sys.argv[0])
    with contextlib.suppress(ValueError):
        script = script.resolve().relative_to(Path(__file__).resolve().parents[1])
    return " ".join(["python", str(script), *sys.argv[1:]])


def now() -> str:
    """The current UTC date-time in ISO 8601, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def write(path: str | os.PathLike[str], tables: list[Table], *, machine_text: str, when: str | None = None) -> None:
    """Write ``tables`` to ``path`` in the schema, after checking them with `check`.

    ``machine_text`` is `machine` taken when the run started (the load at the start is the honest one);
    ``when`` defaults to now.
    """
    data = {
        "machine": machine_text,
        "when": when or now(),
        "command": command(),
        "tables": [
            {
                "title": t.title,
                "columns": t.columns,
                "rows": [[_tidy(c) for c in row] for row in t.rows],
                "notes": t.notes,
            }
            for t in tables
        ],
    }
    check(data, str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _tidy(value: Cell) -> Cell:
    """Floats to 6 significant digits (a timing has fewer true ones; the file stays readable)."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def _fail(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what} (schema: bench/report.py)")


def check(data: object, where: str) -> None:
    """Raise ValueError naming ``where`` and the field if ``data`` does not follow the schema."""
    if not isinstance(data, dict):
        raise _fail(where, "the top level must be an object")
    for key in ("machine", "when", "command"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise _fail(where, f"{key!r} must be a non-empty string")
    try:
        datetime.datetime.fromisoformat(data["when"])
    except ValueError:
        raise _fail(where, f"'when' is not an ISO 8601 date: {data['when']!r}") from None
    tables = data.get("tables")
    if not isinstance(tables, list) or not tables:
        raise _fail(where, "'tables' must be a non-empty list")
    for i, table in enumerate(tables):
        at = f"tables[{i}]"
        if not isinstance(table, dict):
            raise _fail(where, f"{at} must be an object")
        if not isinstance(table.get("title"), str) or not table["title"].strip():
            raise _fail(where, f"{at}.title must be a non-empty string")
        if not isinstance(table.get("notes", ""), str):
            raise _fail(where, f"{at}.notes must be a string")
        columns = table.get("columns")
        if not isinstance(columns, list) or not columns or not all(isinstance(c, str) for c in columns):
            raise _fail(where, f"{at}.columns must be a non-empty list of strings")
        rows = table.get("rows")
        if not isinstance(rows, list):
            raise _fail(where, f"{at}.rows must be a list")
        for j, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != len(columns):
                raise _fail(where, f"{at}.rows[{j}] must be a list of {len(columns)} cells")
            for cell in row:
                if isinstance(cell, bool) or not isinstance(cell, str | int | float):
                    raise _fail(where, f"{at}.rows[{j}] holds {cell!r}: cells are strings or numbers")


def load(path: Path) -> dict:
    """One result file, checked against the schema."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise _fail(str(path), f"not JSON ({exc})") from None
    check(data, str(path))
    return data


def cell(value: Cell) -> str:
    """A cell as table text: numbers to four significant digits (no exponent below 10^6), pipes escaped."""
    if isinstance(value, float):
        text = f"{value:.0f}" if 1e4 <= abs(value) < 1e15 else f"{value:.4g}"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _numeric(rows: list[list[Cell]], column: int) -> bool:
    values = [row[column] for row in rows]
    return bool(values) and all(isinstance(v, int | float) for v in values)


def render(name: str, data: dict) -> str:
    """One result as Markdown: a heading named for the file, the command, machine and date, then its tables."""
    lines = [
        f"## {name}",
        "",
        f"`{data['command']}`, run {data['when']} on {data['machine']}.",
        "",
    ]
    for table in data["tables"]:
        columns, rows = table["columns"], table["rows"]
        lines += [f"**{cell(table['title'])}**", ""]
        lines.append("| " + " | ".join(cell(c) for c in columns) + " |")
        lines.append("| " + " | ".join("---:" if _numeric(rows, i) else "---" for i in range(len(columns))) + " |")
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        lines.append("")
        if table.get("notes", "").strip():
            lines += [table["notes"].strip(), ""]
    return "\n".join(lines)


def render_dir(directory: Path = RESULTS) -> str:
    """Every ``*.json`` result in ``directory`` rendered, by file name; a line saying so when there is none."""
    files = sorted(directory.glob("*.json"))
    if not files:
        return f"No result files in `{directory.name}/` yet: run a bench script with `--json`.\n"
    return "\n".join(render(path.stem, load(path)) for path in files)
