"""MkDocs hook: pages generated at build time.

* the command-line reference, from ``simdist.cli.build_parser`` (marker ``<!-- simdist-cli-reference -->``);
* the benchmark results, from every ``bench/results/*.json`` through ``bench/report.py``
  (marker ``<!-- simdist-bench-results -->``): the page never holds a hand-copied figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

MARK = "<!-- simdist-cli-reference -->"
BENCH_MARK = "<!-- simdist-bench-results -->"
BENCH_REPORT = Path(__file__).resolve().parents[1] / "bench" / "report.py"


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{prefix} {name}")
    return found


def reference() -> str:
    from simdist.cli import build_parser

    parts = []
    for name, parser in _commands(build_parser(), "simdist"):
        parser.prog = name
        parts.append(f"## `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def bench_report() -> ModuleType:
    """``bench/report.py`` loaded by path (``bench/`` holds scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("simdist_bench_report", BENCH_REPORT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARK in markdown:
        markdown = markdown.replace(MARK, reference())
    if BENCH_MARK in markdown:
        markdown = markdown.replace(BENCH_MARK, bench_report().render_dir())
    return markdown
