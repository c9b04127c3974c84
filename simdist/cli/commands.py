"""The one command table: each ``simdist`` command's name, help, configuration and what runs it (`COMMANDS`).

`simdist.cli.build_parser` makes every (sub)command's parser from this table and stores its `Command` in the
parsed namespace (``set_defaults``); `simdist.cli.main` builds the command's configuration from the namespace and
calls its ``run``. The configuration class and the ``run`` function are named by strings and imported only when
used, so reading the table (``simdist --help``) imports no command and no configuration.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["COMMANDS", "EXIT_CODES", "Command"]

CONFIGS = "simdist.cli.configs"
"""The module that holds every command's configuration class."""


@dataclass(frozen=True)
class Command:
    """One command (or one action of a command, e.g. ``case run``).

    ``config`` is the name of its configuration dataclass in `simdist.cli.configs` (its options are generated
    from it); ``run`` is ``"module:function"``, the function called with the built configuration, returning the
    exit status. A command with ``actions`` has neither: each action is a `Command` of its own.
    """

    name: str
    help: str
    config: str | None = None
    run: str | None = None
    description: str | None = None
    """The text at the top of the command's ``--help`` (default: ``help``)."""
    epilog: str | None = None
    """The text at the end of its ``--help`` (default: `EXIT_CODES`)."""
    actions: tuple[Command, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.actions) == (self.config is not None and self.run is not None):
            raise TypeError(f"command {self.name!r}: give either a config and a run, or actions")

    def config_class(self) -> type:
        """The configuration dataclass (imports `simdist.cli.configs`)."""
        assert self.config is not None, self.name
        return getattr(importlib.import_module(CONFIGS), self.config)

    def runner(self) -> Callable[[Any], int]:
        """The function that runs the command (imports its module)."""
        assert self.run is not None, self.name
        module, _, function = self.run.partition(":")
        return getattr(importlib.import_module(module), function)


EXIT_CODES = """exit status:
  0  ok: the run finished; for compare, every tensor is within the tolerance
  1  differs: compare found tensors beyond --tolerance-ulp; case run: the case's verdict is not ok
  2  bad input: unknown option or policy, invalid layout, a size above its limit, a missing,
     unreadable or corrupt file, an unusable --out (one line on stderr naming it; nothing written)
  3  internal error: an unexpected exception (a bug); its traceback is printed
  audit and blame exit with the script's own status instead (its sys.exit code and message)"""
"""The exit statuses, printed after every ``--help`` unless a command gives its own epilog."""

AUDIT_EPILOG = (
    "exit status: the script's own\n"
    "  sys.exit(n): n; sys.exit('msg'): 1, with msg on stderr; an uncaught exception: 1, with its traceback\n"
    "  2 when simdist audit's own arguments are bad (no such script, a negative --top)"
)
AUDIT_DESCRIPTION = (
    "Run SCRIPT (with ARGS as its sys.argv[1:]) under simdist.audit and print every site that narrows a floating "
    "dtype or accumulates narrower than its inputs, most frequent first. Options go before SCRIPT; threads the "
    "script starts (SimWorld ranks) are audited too."
)
BLAME_EPILOG = (
    "exit status: the script's own (sys.exit(n): n; an uncaught exception: 1, with its traceback);\n"
    "  2 when blame's own arguments are bad (no such script, a --promote naming no site)"
)
BLAME_DESCRIPTION = (
    "Run SCRIPT under simdist blame: every reducing collective of the simdist backend is compared with the FP64 "
    "sum of the same inputs, every narrowing cast with its wide input, grouped by call site and ranked by error "
    "mass. --promote reruns the script with a site exact and reports how far the final parameters, optimizer "
    "state and loss move. Options go before SCRIPT."
)
EXPECT_CODES = """
  repro exits 0 whatever its verdict, unless --expect names one: then 1 when the verdict is not that one
  (reproduced: the #8913 writeback finding shows; fixed: every policy bitwise equal to the oracle) or a
  power check shows no power; case run --expect not-ok exits 1 when the case's verdict IS ok"""
"""What ``simdist repro --help`` adds to the exit statuses."""

_CASE_RUN = "simdist.cli.case:run_case_command"

COMMANDS: tuple[Command, ...] = (
    Command(
        "repro",
        "reproduce a known precision issue in the simulator",
        "ReproCommand",
        "simdist.cli.repro:run_repro",
        epilog=EXIT_CODES + EXPECT_CODES,
    ),
    Command(
        "policies",
        "list the registered precision policies, their chains and origins",
        "PoliciesCommand",
        "simdist.cli.policies:run_policies",
    ),
    Command(
        "compare",
        "compare two per-rank tensor dumps (experiments/crosscheck.py)",
        "CompareCommand",
        "simdist.cli.tools:run_compare",
    ),
    Command(
        "audit",
        "run a Python script under the precision audit and report where it narrows precision",
        "AuditCommand",
        "simdist.cli.audit:run_audit",
        description=AUDIT_DESCRIPTION,
        epilog=AUDIT_EPILOG,
    ),
    Command(
        "blame",
        "rank a script's collective and cast sites by rounding error against the exact result; promote some",
        "BlameCommand",
        "simdist.cli.blame:run_blame",
        description=BLAME_DESCRIPTION,
        epilog=BLAME_EPILOG,
    ),
    Command(
        "run",
        "run an unmodified torchrun script on N simdist rank processes (like torchrun --nproc-per-node N)",
        "RunCommand",
        "simdist.cli.tools:run_script_launch",
    ),
    Command(
        "growth",
        "error growth of policies against the FP32 oracle over many steps",
        "GrowthCommand",
        "simdist.cli.growth:run_growth_command",
    ),
    Command(
        "case",
        "run a real framework next to simdist's policies (simdist/cases)",
        actions=(
            Command("list", "list the cases, what they ask and what they need", "CaseListCommand", _CASE_RUN),
            Command("run", "run one case and print its verdict", "CaseRunCommand", _CASE_RUN),
            Command(
                "export",
                "write the upstream packages (standalone reproducer, fix diff, report) of the DeepSpeed defects",
                "CaseExportCommand",
                _CASE_RUN,
            ),
        ),
    ),
    Command(
        "doctor",
        "what this installation has: versions, the native fold kernel, the torch.distributed backend",
        "DoctorCommand",
        "simdist.cli.tools:run_doctor_command",
    ),
)
"""Every command, in ``simdist --help``'s order."""
