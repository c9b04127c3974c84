"""``simdist audit SCRIPT [ARGS...]``: run a script under the audit and print its report."""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import traceback

from simdist.audit.mode import Audit


def add_audit_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add ``audit`` to a ``simdist`` sub-command table (``parser.add_subparsers(...)``)."""
    parser = subparsers.add_parser(
        "audit",
        help="run a Python script under the precision audit and report where it narrows precision",
        description="Run SCRIPT (with ARGS as its sys.argv[1:]) under simdist.audit and print every site that "
        "narrows a floating dtype or accumulates narrower than its inputs, most frequent first. Options go "
        "before SCRIPT; threads the script starts (SimWorld ranks) are audited too.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout (the script's "
                        "own stdout goes to stderr)")
    parser.add_argument("--skip", action="append", default=[], metavar="PREFIX",
                        help="a module, package or path whose frames are not sites (repeatable)")
    parser.add_argument("--no-errors", action="store_true", help="do not compute rounding errors (faster)")
    parser.add_argument("--main-thread-only", action="store_true", help="do not audit threads the script starts")
    parser.add_argument("--top", type=int, default=None, metavar="N", help="print only the N most frequent sites")
    parser.add_argument("--records", action="store_true", help="with --json: include every raw record")
    parser.add_argument("script", help="path of the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    return parser


def run_audit(args: argparse.Namespace) -> int:
    """Run ``args.script`` under an audit and print the report; returns the script's exit status."""
    script = args.script
    if not os.path.isfile(script):
        raise ValueError(f"no such script: {script!r}")
    a = Audit(skip=tuple(args.skip), errors=not args.no_errors, threads=not args.main_thread_only)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    status = 0
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with redirect, a:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:
        traceback.print_exc()
        status = 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    report = a.report()
    if args.json:
        print(report.to_json(records=args.records))
    else:
        print(f"simdist audit {script}: exit status {status}")
        print(report.format(limit=args.top))
    return status
