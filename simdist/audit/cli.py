"""``simdist audit SCRIPT [ARGS...]``: run a script under the audit and print its report."""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import traceback

from simdist.audit.mode import Audit
from simdist.errors import UsageError


def _path(text: str) -> str:
    """An argparse type: a script path or ``--skip`` prefix must not be empty (an empty prefix skips every frame)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def _count(text: str) -> int:
    """An argparse type: an integer >= 0 (``--top``), with a one-line error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def exit_status(exc: SystemExit) -> tuple[int, str | None]:
    """What Python does with ``sys.exit(code)``: ``(status, message for stderr)``.

    ``None`` is 0, an integer is itself, anything else (``sys.exit("msg")``) is printed and gives 1.
    """
    code = exc.code
    if code is None:
        return 0, None
    if isinstance(code, int):
        return code, None
    return 1, str(code)


def add_audit_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add ``audit`` to a ``simdist`` sub-command table (``parser.add_subparsers(...)``)."""
    parser = subparsers.add_parser(
        "audit",
        help="run a Python script under the precision audit and report where it narrows precision",
        epilog="exit status: the script's own\n"
        "  sys.exit(n): n; sys.exit('msg'): 1, with msg on stderr; an uncaught exception: 1, with its traceback\n"
        "  2 when simdist audit's own arguments are bad (no such script, a negative --top)",
        description="Run SCRIPT (with ARGS as its sys.argv[1:]) under simdist.audit and print every site that "
        "narrows a floating dtype or accumulates narrower than its inputs, most frequent first. Options go "
        "before SCRIPT; threads the script starts (SimWorld ranks) are audited too.",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON on stdout (the script's own stdout goes to stderr)",
    )
    parser.add_argument(
        "--skip",
        action="append",
        type=_path,
        default=[],
        metavar="PREFIX",
        help="a module, package or path whose frames are not sites (repeatable)",
    )
    parser.add_argument("--no-errors", action="store_true", help="do not compute rounding errors (faster)")
    parser.add_argument("--main-thread-only", action="store_true", help="do not audit threads the script starts")
    parser.add_argument(
        "--top", type=_count, default=None, metavar="N", help="print only the N most frequent sites (N >= 0)"
    )
    parser.add_argument("--records", action="store_true", help="with --json: include every raw record")
    parser.add_argument("script", type=_path, help="path of the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    return parser


def run_audit(args: argparse.Namespace) -> int:
    """Run ``args.script`` under an audit and print the report; returns the script's exit status.

    As Python would: ``sys.exit(n)`` gives ``n``, ``sys.exit("msg")`` prints ``msg`` on stderr and gives 1,
    an uncaught exception prints its traceback and gives 1. The report is printed in every case.
    """
    script = args.script
    if not os.path.isfile(script):
        raise UsageError(f"no such script: {script!r}")
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
        status, message = exit_status(exc)
        if message is not None:
            print(message, file=sys.stderr)
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
