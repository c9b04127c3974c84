"""The ``simdist`` command line: the parsers, the dispatch and the exit statuses.

    simdist repro 8913 [--world-size 8 --tp 4 --ep 2 --etp 1 --steps 3 --gas 1 --seed 0 --inputs rounding
                        --policies bf16_writeback,fp32_staging --marker deepspeed --update-path epilogue
                        --reduction gloo --source synthetic --code transcribed --shape toy --json
                        --expect reproduced|fixed --diff-only|--all-tensors --policy-module M --no-progress]
    simdist policies [--policy-module my_policies.py]
    simdist compare DUMP_A DUMP_B [--tolerance-ulp 0 --no-progress]
    simdist audit [--json] [--skip PREFIX] [--no-errors] [--main-thread-only] [--top N] [--records]
                  path/to/script.py [args...]
    simdist blame [--json] [--top N] [--promote SITE]... [--promote-top K] [--ops OPS] [--figure PNG]
                  [--nproc N [--processes]] script.py [args...]
    simdist run --nproc N [--reduction gloo] [--report-backend] [--timeout S] script.py [args...]
    simdist growth --out runs/NAME [--policies bf16_writeback,fp32_staging,bf16_only --steps 10000 --seeds 8
                   --source synthetic --seed 0 --gas 1 --marker deepspeed --world-size 4 --tp 2 --ep 2
                   --checkpoint-every 500 --metrics-dense 1000 --metrics-every 10 --policy-module M
                   --force --no-progress]
    simdist case list | run NAME [--where gloo|simdist|threads] [--json] [--expect ok|not-ok]
                      | export production DIR [--only NAME]
    simdist doctor

Every command's options, defaults and help are generated (`simdist.cli.options`) from its configuration
dataclass (`simdist.cli.configs`, whose study sections are the studies' own configurations); `_dispatch`
runs each command from a module of this package (``repro``, ``growth``, ``audit``, ``blame``, ``case``,
``policies``; ``tools`` for ``compare``, ``run`` and ``doctor``).

Exit status (`EXIT_CODES`, also in every ``--help``): 0 ok / equal, 1 differs beyond the
tolerance (``compare``), the case's verdict is not ok (``case run``) or the verdict is not the one
``--expect`` names (``repro``, ``case run``; `EXPECT_CODES`), 2 bad input. Bad input
-- an unknown policy, an invalid layout, a size above its limit, a missing, unreadable or
corrupt file (a `simdist.errors.UsageError` or an ``OSError``) -- prints one line naming the file or
option and what is wrong, never a traceback, and writes nothing. ``audit`` and ``blame`` exit with the
script's own status. An unexpected exception (a bug) prints its traceback and exits 3. Ctrl-C prints one
line and exits 130; a closed stdout (``| head``) exits 141 quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from typing import NoReturn

from simdist.errors import UsageError

# This module imports no torch (and nothing of simdist that does) at load: ``simdist --help``, ``--version`` and a
# mistyped command are answered by `_light_parser` alone; each command imports what it needs when it runs.

COMMANDS: tuple[tuple[str, str], ...] = (
    ("repro", "reproduce a known precision issue in the simulator"),
    ("policies", "list the registered precision policies, their chains and origins"),
    ("compare", "compare two per-rank tensor dumps (experiments/crosscheck.py)"),
    ("audit", "run a Python script under the precision audit and report where it narrows precision"),
    ("blame", "rank a script's collective and cast sites by rounding error against the exact result; promote some"),
    ("run", "run an unmodified torchrun script on N simdist rank processes (like torchrun --nproc-per-node N)"),
    ("growth", "error growth of policies against the FP32 oracle over many steps"),
    ("case", "run a real framework next to simdist's policies (simdist/cases)"),
    ("doctor", "what this installation has: versions, the native fold kernel, the torch.distributed backend"),
)
"""The commands and their one-line help, in order: what ``simdist --help`` lists without building the full
parser (``tests/integration/test_light_import.py`` checks both parsers print the same help)."""

DESCRIPTION = "A single-process numerics lab for distributed training."

EXIT_OK, EXIT_DIFFERS, EXIT_BAD_INPUT, EXIT_BUG = 0, 1, 2, 3
EXIT_CODES = """exit status:
  0  ok: the run finished; for compare, every tensor is within the tolerance
  1  differs: compare found tensors beyond --tolerance-ulp; case run: the case's verdict is not ok
  2  bad input: unknown option or policy, invalid layout, a size above its limit, a missing,
     unreadable or corrupt file, an unusable --out (one line on stderr naming it; nothing written)
  3  internal error: an unexpected exception (a bug); its traceback is printed
  audit and blame exit with the script's own status instead (its sys.exit code and message)"""


EXPECT_CODES = """
  repro exits 0 whatever its verdict, unless --expect names one: then 1 when the verdict is not that one
  (reproduced: the #8913 writeback finding shows; fixed: every policy bitwise equal to the oracle) or a
  power check shows no power; case run --expect not-ok exits 1 when the case's verdict IS ok"""


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: one-line errors with status 2, and the exit statuses after ``--help``.

    The epilog (`EXIT_CODES` unless a command gives its own) is printed as written, line by line; the
    description is wrapped as usual.
    """

    def __init__(self, *args, **kwargs) -> None:
        self._raw_epilog = kwargs.pop("epilog", None) or EXIT_CODES
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        return f"{super().format_help().rstrip()}\n\n{self._raw_epilog}\n"

    def error(self, message: str) -> NoReturn:  # one line, exit status 2
        self.exit(EXIT_BAD_INPUT, f"simdist: error: {message}\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from simdist import DISTRIBUTION

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """``--version``, looked up only when asked for (`importlib.metadata` is a tenth of ``--help``'s time)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> NoReturn:
        print(f"simdist {_version()}")
        parser.exit()


def _light_parser() -> argparse.ArgumentParser:
    """``simdist`` with each command's name and help but none of its options: enough to answer ``--help``,
    ``--version`` and a mistyped command, fast, without importing torch; `build_parser` does the rest."""
    parser = _Parser(prog="simdist", description=DESCRIPTION)
    parser.add_argument("--version", action=_Version, help="show program's version number and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text in COMMANDS:
        sub.add_parser(name, help=text, add_help=False)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The full parser: every command with its options, generated from its configuration (`simdist.cli.configs`)."""
    from simdist.cli import audit, blame, configs
    from simdist.cli.options import add_options

    parser = _Parser(prog="simdist", description=DESCRIPTION)
    parser.add_argument("--version", action=_Version, help="show program's version number and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    epilogs = {"repro": EXIT_CODES + EXPECT_CODES, "audit": audit.EPILOG, "blame": blame.EPILOG}
    descriptions = {"audit": audit.DESCRIPTION, "blame": blame.DESCRIPTION}
    commands = _configs(configs)
    for name, text in COMMANDS:
        command = sub.add_parser(name, help=text, epilog=epilogs.get(name), description=descriptions.get(name, text))
        if name == "case":
            actions = command.add_subparsers(dest="case_action", required=True, parser_class=_Parser)
            for action, (action_text, action_config) in CASE_ACTIONS.items():
                parser_of_action = actions.add_parser(action, help=action_text, description=action_text)
                add_options(parser_of_action, getattr(configs, action_config))
        else:
            add_options(command, commands[name])
    return parser


CASE_ACTIONS = {
    "list": ("list the cases, what they ask and what they need", "CaseListCommand"),
    "run": ("run one case and print its verdict", "CaseRunCommand"),
    "export": (
        "write the upstream packages (standalone reproducer, fix diff, report) of the DeepSpeed defects",
        "CaseExportCommand",
    ),
}
"""``simdist case ACTION``: each action's help and configuration class (in `simdist.cli.configs`)."""


def _configs(configs) -> dict[str, type]:
    """Each command's configuration class (``case`` has none: each of its `CASE_ACTIONS` has one)."""
    return {
        "repro": configs.ReproCommand,
        "policies": configs.PoliciesCommand,
        "compare": configs.CompareCommand,
        "audit": configs.AuditCommand,
        "blame": configs.BlameCommand,
        "run": configs.RunCommand,
        "growth": configs.GrowthCommand,
        "doctor": configs.DoctorCommand,
    }


def _configuration(args: argparse.Namespace):
    """The parsed command's configuration tree (`simdist.cli.options.from_args`)."""
    from simdist.cli import configs
    from simdist.cli.options import from_args

    if args.command == "case":
        return from_args(getattr(configs, CASE_ACTIONS[args.case_action][1]), args)
    return from_args(_configs(configs)[args.command], args)


def _dispatch(args: argparse.Namespace) -> int:
    """Build the command's configuration and run the command on it."""
    command = _configuration(args)
    name = args.command
    if name == "repro":
        from simdist.cli.repro import run_repro

        return run_repro(command)
    if name == "growth":
        from simdist.cli.growth import run_growth_command

        return run_growth_command(command)
    if name == "audit":
        from simdist.cli.audit import run_audit

        return run_audit(command)
    if name == "blame":
        from simdist.cli.blame import run_blame

        return run_blame(command)
    if name == "case":
        from simdist.cli.case import run_case_command

        return run_case_command(command)
    if name == "policies":
        from simdist.cli.policies import load_policy_modules, print_policies

        load_policy_modules(command.policy_module)
        return print_policies()
    from simdist.cli import tools

    if name == "compare":
        return tools.run_compare(command)
    if name == "run":
        return tools.run_script_launch(command)
    return tools.run_doctor(_version())


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (`EXIT_CODES`), also for argparse errors and ``--help``.

    Without ``argv`` this is the ``simdist`` process itself: Ctrl-C then ends it at once with one line and
    status 130 wherever the signal lands (`simdist.cli.interrupt`); with ``argv`` (a library call) Python's
    ``KeyboardInterrupt`` gives the same line and status."""
    if argv is None:
        from simdist.cli.interrupt import exit_on_interrupt

        exit_on_interrupt()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while parsing or importing: one line, as during a run
        print("simdist: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    try:
        _light_parser().parse_known_args(argv)  # --help, --version, a mistyped command: answered without torch
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, a usage error (already printed on one line)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        return _dispatch(args)
    except UsageError as exc:  # what the user can fix: BadInput, SizeError, an unknown policy, a broken layout, ...
        message = " ".join(str(exc).split("\n")[0].split())
        print(f"simdist: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # stdout closed early (| head): stop quietly, as a killed-by-SIGPIPE tool would
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # a file that cannot be read or written
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"simdist: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("simdist: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("simdist: internal error (a bug in simdist: please report the traceback above)", file=sys.stderr)
        return EXIT_BUG
