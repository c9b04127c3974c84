"""MkDocs hook: the command-line reference page, generated from ``simdist.cli.build_parser`` at build time."""

from __future__ import annotations

import argparse

MARK = "<!-- simdist-cli-reference -->"


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


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARK, reference()) if MARK in markdown else markdown
