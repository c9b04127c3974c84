"""``simdist case list``, ``simdist case run NAME [--json] [--where threads|processes|gloo] [--expect ok|not-ok]`` and
``simdist case export production DIR [--only NAME]`` (the upstream packages, `simdist.cases.upstream`).

The options are those of `simdist.cli.configs.CaseRunCommand` and `simdist.cli.configs.CaseExportCommand`;
``--where`` takes the cases' places to run (`simdist.cases.ranks.CASE_WHERES`).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from simdist.cli.configs import CaseExportCommand, CaseListCommand, CaseRunCommand

CaseCommand = CaseListCommand | CaseRunCommand | CaseExportCommand


def run_case_command(command: CaseCommand) -> int:
    """``list`` and ``export``: 0. ``run``: 0 when the case's verdict is what ``--expect`` names (``ok`` by
    default), 1 when it is not; a `simdist.errors.UsageError` for bad input (exit 2)."""
    if isinstance(command, CaseExportCommand):
        return _export(command)
    if isinstance(command, CaseListCommand):
        return _list()
    return _run(command)


def _list() -> int:
    from simdist.cases import case_names, get_case

    for name in case_names():
        case = get_case(name)
        missing = case.missing()
        status = f"needs {', '.join(missing)}" if missing else "runnable"
        print(
            f"{name} [{status}]\n    question: {case.question}\n    real code: {case.real_code}\n"
            f"    compared with: {', '.join(case.policies)}"
        )
    return 0


def _run(command: CaseRunCommand) -> int:
    from simdist.cases import run_case
    from simdist.cli.progress import ticking

    if command.json:  # the framework's logging (this process and its ranks) goes to stderr: stdout is the JSON
        from simdist.cases.stdout import stdout_to_stderr

        with stdout_to_stderr() as report:
            verdict = run_case(command.name, where=command.where)
            print(json.dumps(asdict(verdict), indent=2, default=str), file=report)
    else:
        with ticking(f"case {command.name}"):
            verdict = run_case(command.name, where=command.where)
        print(verdict.summary)
    return 0 if bool(verdict.ok) == (command.expect == "ok") else 1


def _export(command: CaseExportCommand) -> int:
    from pathlib import Path

    from simdist.cases.upstream.packages import PACKAGES, export

    for folder in export(Path(command.directory), list(command.only) or None):
        package = PACKAGES[folder.name]
        print(f"{folder}: reproduce.py fix.diff REPORT.md -- {package.title}\n    run: {package.command}")
    return 0
