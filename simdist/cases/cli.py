"""``simdist case list``, ``simdist case run NAME [--json] [--world gloo|simdist|threads] [--expect ok|not-ok]`` and
``simdist case export production DIR [--only NAME]`` (the upstream packages, `simdist.cases.upstream`).

Kept here, beside the cases, so that the CLI module only adds the
subcommand (`add_case_subcommand`) and dispatches to `run_case_command`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def add_case_subcommand(sub) -> None:
    """Add ``case`` with its ``list``, ``run`` and ``export`` actions to the CLI's subparsers."""
    from simdist.cases.world import WORLDS

    case = sub.add_parser("case", help="run a real framework next to simdist's policies (simdist/cases)")
    actions = case.add_subparsers(dest="case_action", required=True, parser_class=type(case))
    actions.add_parser("list", help="list the cases, what they ask and what they need")
    run = actions.add_parser("run", help="run one case and print its verdict")
    run.add_argument("name", help="a case name (see: simdist case list)")
    run.add_argument(
        "--world",
        choices=WORLDS,
        default="gloo",
        help="real gloo processes (default), the simdist backend in process mode, or simdist "
        "threads (cases whose framework allows it)",
    )
    run.add_argument("--json", action="store_true", help="print the verdict dataclass as JSON")
    run.add_argument(
        "--expect",
        choices=("ok", "not-ok"),
        default="ok",
        help="the verdict the exit status gates on: ok (default; exit 1 when the case's ok is false) or not-ok "
        "(exit 1 when it is true, e.g. a run meant to show a defect)",
    )
    export = actions.add_parser(
        "export", help="write the upstream packages (standalone reproducer, fix diff, report) of the DeepSpeed defects"
    )
    export.add_argument("set", choices=("production",), help="production: #8913, the ZeRO norm and the load defects")
    export.add_argument("directory", help="where to write one folder per defect (created if missing)")
    export.add_argument("--only", action="append", metavar="NAME", help="one package (repeatable; default: all)")


def run_case_command(args: argparse.Namespace) -> int:
    """Exit 0 when the case's verdict is what ``--expect`` names (``ok`` by default), 1 when it is not (2 for bad
    input, raised as ValueError)."""
    from simdist.cases import case_names, get_case, run_case

    if args.case_action == "export":
        return _export(args)
    if args.case_action == "list":
        for name in case_names():
            case = get_case(name)
            missing = case.missing()
            status = f"needs {', '.join(missing)}" if missing else "runnable"
            print(
                f"{name} [{status}]\n    question: {case.question}\n    real code: {case.real_code}\n"
                f"    compared with: {', '.join(case.policies)}"
            )
        return 0
    if args.json:  # the framework's logging (this process and its ranks) goes to stderr: stdout is the JSON
        from simdist.cases.stdout import stdout_to_stderr

        with stdout_to_stderr() as report:
            verdict = run_case(args.name, world=args.world)
            print(json.dumps(asdict(verdict), indent=2, default=str), file=report)
    else:
        verdict = run_case(args.name, world=args.world)
        print(verdict.summary)
    return 0 if bool(verdict.ok) == (getattr(args, "expect", "ok") == "ok") else 1


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from simdist.cases.upstream.packages import PACKAGES, export

    for folder in export(Path(args.directory), args.only):
        package = PACKAGES[folder.name]
        print(f"{folder}: reproduce.py fix.diff REPORT.md -- {package.title}\n    run: {package.command}")
    return 0
