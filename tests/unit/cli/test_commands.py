"""The one command table (`simdist.cli.commands`): each row resolves, and the parser is made from it."""

from __future__ import annotations

import dataclasses

import pytest

from simdist import cli
from simdist.cli.commands import COMMANDS, Command


def _leaves() -> list[tuple[str, Command]]:
    return [(f"{c.name} {a.name}" if a is not c else c.name, a) for c in COMMANDS for a in (c.actions or (c,))]


@pytest.mark.parametrize(("name", "command"), _leaves(), ids=[n for n, _ in _leaves()])
def test_every_row_names_a_configuration_and_a_function_that_exist(name, command):
    assert dataclasses.is_dataclass(command.config_class()), name
    assert callable(command.runner()), name


def test_the_parsers_commands_are_the_tables_in_order():
    choices = cli.build_parser()._subparsers._group_actions[0].choices
    assert list(choices) == [c.name for c in COMMANDS]


@pytest.mark.parametrize("argv", [["repro", "8913"], ["case", "run", "x"], ["doctor"]])
def test_the_parsed_namespace_holds_its_row(argv):
    entry = cli.build_parser(lazy=True).parse_args(argv).command_entry
    assert entry.name == argv[1 if argv[0] == "case" else 0]


def test_the_lazy_parser_prints_the_eager_ones_help():
    def helps(parser) -> list[str]:
        subs = parser._subparsers._group_actions[0].choices
        return [parser.format_help()] + [sub.format_help() for sub in subs.values()]

    assert helps(cli.build_parser(lazy=True)) == helps(cli.build_parser())


def test_a_row_is_either_a_command_or_a_group_of_actions():
    with pytest.raises(TypeError):
        Command("x", "help")
    with pytest.raises(TypeError):
        Command("x", "help", "DoctorCommand", "m:f", actions=(Command("y", "h", "DoctorCommand", "m:f"),))
