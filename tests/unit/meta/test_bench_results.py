"""The benchmarks page is generated from ``bench/results/*.json`` (bench/report.py's schema), never copied by hand.

The docs hook (docs/hooks.py) replaces the page's marker with every result file rendered; a file that breaks the
schema fails the build (and these tests) naming the file and the field.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "benchmarks.md"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


report = _load("bench_report_under_test", ROOT / "bench" / "report.py")
hooks = _load("docs_hooks_under_test", ROOT / "docs" / "hooks.py")

GOOD = {
    "machine": "test CPU, 2 logical CPUs",
    "when": "2026-12-04T15:34:33+00:00",
    "command": "python bench/x.py --json out.json",
    "tables": [{"title": "T", "columns": ["name", "us"], "rows": [["a|b", 1.5], ["c", 20000.25]], "notes": "N"}],
}


def test_the_seeded_results_follow_the_schema_and_each_renders_with_its_machine_date_and_command():
    files = sorted(report.RESULTS.glob("*.json"))
    assert len(files) >= 4, "bench/results/ holds the quick benches' results"
    for path in files:
        data = report.load(path)
        text = report.render(path.stem, data)
        assert text.startswith(f"## {path.stem}\n")
        for key in ("machine", "when", "command"):
            assert data[key] in text, (path, key)
        for table in data["tables"]:
            assert table["title"] in text
            assert text.count("\n| ") >= len(table["rows"]) + 1  # a header and every row


def test_the_built_page_holds_every_result_and_the_hand_written_page_holds_no_table():
    source = PAGE.read_text()
    assert hooks.BENCH_MARK in source
    built = hooks.on_page_markdown(source, None, None, None)
    assert hooks.BENCH_MARK not in built
    for path in sorted(report.RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        assert f"## {path.stem}\n" in built and data["machine"] in built and data["when"] in built
    prose, fenced = [], False
    for line in source.splitlines():
        fenced = fenced != line.startswith("```")
        if not fenced and not line.startswith("```"):
            prose.append(line)
    assert not [line for line in prose if line.lstrip().startswith("|")], "figures belong in bench/results/"


def test_an_empty_results_folder_says_so(tmp_path):
    assert "No result files" in report.render_dir(tmp_path)


def test_write_then_load_round_trips_and_records_the_command(tmp_path):
    table = report.Table("T", ["name", "us"])
    table.add("a", 1.23456789)
    table.add("b", 7)
    path = tmp_path / "r.json"
    report.write(path, [table], machine_text="m", when="2026-01-02")
    data = report.load(path)
    assert data["machine"] == "m" and data["when"] == "2026-01-02"
    assert data["command"].startswith("python ")
    assert data["tables"][0]["rows"] == [["a", 1.23457], ["b", 7]]
    with pytest.raises(ValueError, match="a row of 1 cells for 2 columns"):
        table.add("only one")


def test_cells_escape_pipes_and_keep_large_numbers_plain():
    text = report.render("x", GOOD)
    assert "| a\\|b | 1.5 |" in text
    assert "| c | 20000 |" in text
    assert "| --- | ---: |" in text  # text left, numbers right
    assert report.cell(0.000123456) == "0.0001235"
    assert report.cell(3) == "3"


def _broken(change) -> dict:
    data = json.loads(json.dumps(GOOD))
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("machine"), "'machine' must be a non-empty string"),
        (lambda d: d.update(when="yesterday"), "not an ISO 8601 date"),
        (lambda d: d.update(command=""), "'command' must be a non-empty string"),
        (lambda d: d.update(tables=[]), "'tables' must be a non-empty list"),
        (lambda d: d["tables"][0].update(title=""), r"tables\[0\].title"),
        (lambda d: d["tables"][0].update(columns="name"), r"tables\[0\].columns"),
        (lambda d: d["tables"][0]["rows"].append(["short"]), r"tables\[0\].rows\[2\] must be a list of 2 cells"),
        (lambda d: d["tables"][0]["rows"].append(["x", None]), r"tables\[0\].rows\[2\] holds None"),
        (lambda d: d["tables"][0]["rows"].append(["x", True]), r"tables\[0\].rows\[2\] holds True"),
        (lambda d: d["tables"][0].update(notes=3), r"tables\[0\].notes must be a string"),
    ],
)
def test_a_file_that_breaks_the_schema_is_refused_naming_the_field(change, message):
    report.check(GOOD, "good.json")
    with pytest.raises(ValueError, match=message) as info:
        report.check(_broken(change), "bad.json")
    assert str(info.value).startswith("bad.json: ")


def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json: not JSON"):
        report.load(path)


@pytest.mark.parametrize(
    ("script", "argv", "columns"),
    [
        ("audit", ["--repeats", "1"], ["variant", "wall ms"]),
    ],
)
def test_a_bench_script_writes_its_tables_in_the_schema(tmp_path, capsys, script, argv, columns):
    """``--json PATH`` writes what the page renders (a quick script run here in-process; bench/scale.py is left
    out: it sets process-wide torch and allocator settings)."""
    bench = _load(f"bench_{script}_under_test", ROOT / "bench" / f"{script}.py")
    path = tmp_path / f"{script}.json"
    bench.main([*argv, "--json", str(path)])
    data = report.load(path)
    assert data["command"].startswith("python ") and "load average" in data["machine"]
    table = data["tables"][0]
    assert table["columns"][: len(columns)] == columns and table["rows"]
    assert f"wrote {path}" in capsys.readouterr().err
