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

Every command is one row of `simdist.cli.commands.COMMANDS`: its name, help, configuration dataclass
(`simdist.cli.configs`, whose study sections are the studies' own configurations), from which its options,
defaults and help are generated (`simdist.cli.options`), and the function that runs it, in a module of this
package (``repro``, ``growth``, ``audit``, ``blame``, ``case``, ``policies``; ``tools`` for ``compare``, ``run``
and ``doctor``), imported only when the command runs.

Exit status (`EXIT_CODES`, also in every ``--help``): 0 ok / equal, 1 differs beyond the
tolerance (``compare``), the case's verdict is not ok (``case run``) or the verdict is not the one
``--expect`` names (``repro``, ``case run``; `simdist.cli.commands.EXPECT_CODES`), 2 bad input. Bad input
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

from simdist.cli.commands import COMMANDS, EXIT_CODES, Command
from simdist.errors import UsageError

# This module imports no torch (and nothing of simdist that does) at load. `main` builds the parser with each
# command's options added only when that command is parsed (`_Parser`), so ``simdist --help``, ``--version`` and
# a mistyped command import no configuration; each command imports what it needs when it runs.

DESCRIPTION = "A single-process numerics lab for distributed training."

EXIT_OK, EXIT_DIFFERS, EXIT_BAD_INPUT, EXIT_BUG = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: one-line errors with status 2, and the exit statuses after ``--help``.

    The epilog (`EXIT_CODES` unless a command gives its own) is printed as written, line by line; the
    description is wrapped as usual. A parser given a ``command`` (a `simdist.cli.commands.Command` with a
    configuration) adds that configuration's options on first use (parsing, usage or help), not when made.
    """

    def __init__(self, *args, command: Command | None = None, **kwargs) -> None:
        self._raw_epilog = kwargs.pop("epilog", None) or EXIT_CODES
        self._pending = command
        super().__init__(*args, **kwargs)

    def add_command_options(self) -> None:
        """Add the options of this parser's command now (once), generated from its configuration."""
        command, self._pending = self._pending, None
        if command is not None:
            from simdist.cli.options import add_options

            add_options(self, command.config_class())

    def parse_known_args(self, args=None, namespace=None):
        self.add_command_options()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.add_command_options()
        return super().format_usage()

    def format_help(self) -> str:
        self.add_command_options()
        return f"{super().format_help().rstrip()}\n\n{self._raw_epilog}\n"

    def error(self, message: str) -> NoReturn:  # one line, exit status 2
        self.exit(EXIT_BAD_INPUT, f"simdist: error: {message}\n")


def installed_version() -> str:
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
        print(f"simdist {installed_version()}")
        parser.exit()


def build_parser(*, lazy: bool = False) -> argparse.ArgumentParser:
    """The parser of every command in `COMMANDS`, each with its options generated from its configuration
    (`simdist.cli.configs`) and its `Command` set as the namespace's ``command_entry`` (``set_defaults``).

    ``lazy``: each command's options are added when that command is parsed or its help printed (what `main`
    does, so that ``simdist --help`` imports no configuration); otherwise all at once (the docs, the tests).
    """
    parser = _Parser(prog="simdist", description=DESCRIPTION)
    parser.add_argument("--version", action=_Version, help="show program's version number and exit")
    _add_commands(parser, COMMANDS, "command", lazy)
    return parser


def _add_commands(parser: argparse.ArgumentParser, commands: tuple[Command, ...], dest: str, lazy: bool) -> None:
    sub = parser.add_subparsers(dest=dest, required=True, parser_class=_Parser)
    for command in commands:
        options = None if command.actions else command
        made = sub.add_parser(
            command.name,
            help=command.help,
            description=command.description or command.help,
            epilog=command.epilog,
            command=options,
        )
        if command.actions:
            _add_commands(made, command.actions, f"{command.name}_action", lazy)
        else:
            made.set_defaults(command_entry=command)
            if not lazy:
                made.add_command_options()


def _configuration(args: argparse.Namespace):
    """The parsed command's configuration tree (`simdist.cli.options.from_args`)."""
    from simdist.cli.options import from_args

    return from_args(args.command_entry.config_class(), args)


def _dispatch(args: argparse.Namespace) -> int:
    """Build the command's configuration and run the command on it."""
    return args.command_entry.runner()(_configuration(args))


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
        args = build_parser(lazy=True).parse_args(argv)
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
