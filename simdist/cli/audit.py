"""``simdist audit SCRIPT [ARGS...]``: run a script under the precision audit and print its report."""

from __future__ import annotations

import sys
import traceback

from simdist.cli.configs import AuditCommand
from simdist.cli.script import as_main, check_script, exit_status, run_main


def run_audit(command: AuditCommand) -> int:
    """Run ``command.script`` under an audit and print the report; returns the script's exit status.

    As Python would: ``sys.exit(n)`` gives ``n``, ``sys.exit("msg")`` prints ``msg`` on stderr and gives 1,
    an uncaught exception prints its traceback and gives 1. The report is printed in every case; with
    ``--json`` the script's own output goes to stderr (`simdist.cases.stdout.stdout_to_stderr`).
    """
    from simdist.audit.mode import Audit
    from simdist.cases.stdout import stdout_to_stderr

    script = command.script
    check_script(script)
    audit = Audit(skip=command.skip, errors=not command.no_errors, threads=not command.main_thread_only)
    status = 0
    guard = stdout_to_stderr() if command.json else _stdout()
    with guard as report:
        try:
            with as_main(script, command.script_args), audit:
                run_main(script)
        except SystemExit as exc:
            status, message = exit_status(exc)
            if message is not None:
                print(message, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            status = 1
        result = audit.report()
        if command.json:
            print(result.to_json(records=command.records), file=report)
    if not command.json:
        print(f"simdist audit {script}: exit status {status}")
        print(result.format(limit=command.top))
    return status


def _stdout():
    import contextlib

    return contextlib.nullcontext(sys.stdout)
