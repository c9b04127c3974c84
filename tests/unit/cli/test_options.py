"""The command line is generated from the configuration dataclasses: defaults, choices, help and the trees built
back from the parsed arguments (`simdist.cli.options`, `simdist.cli.configs`); the glossary's option names."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest

from simdist import cli
from simdist.cases.ranks import CASE_WHERES, CaseWhere
from simdist.cli import configs
from simdist.cli.commands import COMMANDS
from simdist.cli.options import add_options, choices, from_args, option_defaults
from simdist.reduce import ReductionName
from simdist.studies.growth import GrowthConfig
from simdist.studies.repro import REPRO_SPEC, ReproConfig
from simdist.world.options import Where
from simdist.world.spec import DEFAULT_SPEC, ParallelSpec

MINIMAL = {
    "repro": ["repro", "8913"],
    "growth": ["growth", "--out", "runs/x"],
    "policies": ["policies"],
    "compare": ["compare", "a", "b"],
    "audit": ["audit", "train.py"],
    "blame": ["blame", "train.py"],
    "run": ["run", "--nproc", "2", "train.py"],
    "doctor": ["doctor"],
    "case list": ["case", "list"],
    "case run": ["case", "run", "x"],
    "case export": ["case", "export", "production", "out"],
}
"""The shortest command line of every command and case action."""

GIVEN = {
    "growth": {"out": "runs/x"},
    "compare": {"dump_a": "a", "dump_b": "b"},
    "audit": {"script": "train.py"},
    "blame": {"script": "train.py"},
    "run": {"nproc": 2, "script": "train.py"},
    "case run": {"name": "x"},
    "case export": {"directory": "out"},
}
"""What `MINIMAL` gives beyond the defaults."""


def _tree(argv: list[str]):
    return cli._configuration(cli.build_parser().parse_args(argv))


def _config_class(name: str) -> type:
    first, _, action = name.partition(" ")
    command = next(c for c in COMMANDS if c.name == first)
    if action:
        command = next(c for c in command.actions if c.name == action)
    return command.config_class()


@pytest.mark.parametrize("name", list(MINIMAL))
def test_the_parsed_defaults_are_the_configuration_defaults(name):
    """Nothing given on the command line: the tree is the dataclass built with its own defaults."""
    assert _tree(MINIMAL[name]) == _config_class(name)(**GIVEN.get(name, {}))


def test_the_study_sections_are_the_studies_own_configurations():
    assert _tree(MINIMAL["repro"]).study == ReproConfig()
    assert _tree(MINIMAL["repro"]).study.spec == REPRO_SPEC
    assert _tree(MINIMAL["growth"]).study == GrowthConfig()
    assert _tree(MINIMAL["growth"]).study.spec == DEFAULT_SPEC


def test_a_changed_dataclass_default_is_the_parsers_default(monkeypatch):
    """By construction: the parser reads its defaults from the dataclass fields, it keeps no copy."""
    steps = next(f for f in dataclasses.fields(ReproConfig) if f.name == "steps")
    monkeypatch.setattr(steps, "default", 11)
    assert cli.build_parser().parse_args(["repro", "8913"]).steps == 11
    assert option_defaults(configs.ReproCommand)["steps"] == 11


def test_every_option_is_set_from_the_command_line():
    layout = ["--world-size", "4", "--tp", "2", "--ep", "2", "--steps", "2", "--gas", "3", "--seed", "5"]
    choices_ = ["--marker", "per_micro_step", "--reduction", "ring", "--update-path", "hooks", "--source", "moe"]
    more = ["--code", "deepspeed", "--inputs", "narrow", "--policies", "fp32_staging,bf16_only"]
    report = ["--policy-module", "m.py", "--policy-module", "n", "--no-progress", "--expect", "fixed", "--json"]
    tree = _tree(["repro", "8913", *layout, *choices_, *more, *report, "--shape", "production", "--all-tensors"])
    assert tree.study == ReproConfig(
        spec=ParallelSpec(4, tp=2, ep=2),
        steps=2,
        gas=3,
        seed=5,
        policies=("fp32_staging", "bf16_only"),
        marker="per_micro_step",
        reduction="ring",
        update_path="hooks",
        source="moe",
        code="deepspeed",
        inputs="narrow",
    )
    assert tree.study.source == "moe" and tree.study.code == "deepspeed" and tree.study.inputs == "narrow"
    assert tree.study.reduction is ReductionName.RING  # the enum member, not its string
    assert (tree.policy_module, tree.no_progress, tree.expect, tree.json) == (("m.py", "n"), True, "fixed", True)
    assert (tree.shape, tree.all_tensors) == ("production", True)
    assert _tree(["repro", "8913", "--diff-only"]).all_tensors is False
    growth = _tree(["growth", "--out", "o", "--source", "moe", "--metrics-dense", "0", "--world-size", "8"])
    assert (growth.study.source, growth.study.metrics_dense, growth.study.spec) == ("moe", 0, ParallelSpec(8, 2, 2))
    case = _tree(["case", "run", "x", "--where", "processes", "--expect", "not-ok", "--json"])
    assert (case.where, case.expect, case.json) == ("processes", "not-ok", True)
    blame = _tree(["blame", "--promote", "3", "--promote", "a.py:4", "--nproc", "2", "s.py", "--x", "y"])
    assert (blame.promote, blame.nproc, blame.script, blame.script_args) == (("3", "a.py:4"), 2, "s.py", ("--x", "y"))


@pytest.mark.parametrize(
    ("argv", "old"),
    [
        (["repro", "8913", "--model", "moe"], "--model"),  # retired
        (["repro", "8913", "--engine", "deepspeed"], "--engine"),  # retired
        (["growth", "--out", "o", "--model", "moe"], "--model"),  # retired
        (["case", "run", "x", "--world", "threads"], "--world"),  # retired
    ],
)
def test_the_old_spellings_are_argparse_errors(capsys, argv, old):
    """The glossary's words only: the retired ``--model``, ``--engine`` and cases' ``--world`` have no alias."""
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and old in err and err.count("\n") == 1


def test_the_old_field_names_are_gone():
    for old in ("model", "engine"):
        with pytest.raises(TypeError):
            ReproConfig(**{old: "synthetic" if old == "model" else "transcribed"})
    with pytest.raises(TypeError):
        GrowthConfig(model="moe")


def _actions(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = _subparsers(sub)
                out.update({f"{name} {k}": v for k, v in inner.items()} if inner else {name: sub})
    return out


def test_every_option_of_every_command_has_help_and_every_field_an_option():
    parsers = _subparsers(cli.build_parser())
    assert set(parsers) == set(MINIMAL)
    for name, parser in parsers.items():
        for action in _actions(parser):
            assert action.help, (name, action.dest)
        dests = {a.dest for a in _actions(parser)}
        expected = set(option_defaults(_config_class(name))) - {"spec"}
        assert expected <= dests, (name, expected - dests)


def test_a_default_is_shown_in_the_help_once():
    text = cli.build_parser()._subparsers._group_actions[0].choices["repro"].format_help()
    flat = " ".join(text.split())
    assert "(default: 3)" in flat and "(default: gloo)" in flat and "(default: synthetic)" in flat
    assert "(default: bf16_writeback,fp32_staging)" in flat
    assert flat.count("(default: transcribed)") == 1


class _Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"
    GREEN = "green"


@dataclass(frozen=True)
class _Inner:
    colour: _Colour = field(default=_Colour.RED, metadata={"help": "a colour", "skip": ("green",)})
    layout: ParallelSpec = field(default=ParallelSpec(4, tp=2), metadata={"etp": False})


@dataclass(frozen=True)
class _Toy:
    inner: _Inner = field(default_factory=_Inner, metadata={"section": True})
    count: int = field(default=2, metadata={"help": "a count", "minimum": 1})
    names: tuple[str, ...] = field(default=("a", "b"), metadata={"help": "names"})
    mode: Literal["x", "y"] = field(default="x", metadata={"help": "a mode"})
    hidden: float = field(default=0.5, metadata={"cli": False})
    loud: bool = field(default=False, metadata={"help": "loud"})


def _toy(argv: list[str]) -> _Toy:
    parser = cli._Parser(prog="toy")
    add_options(parser, _Toy)
    return from_args(_Toy, parser.parse_args(argv))


def test_the_generator_on_a_toy_tree(capsys):
    assert _toy([]) == _Toy()
    got = _toy(["--colour", "blue", "--world-size", "6", "--tp", "3", "--count", "4", "--names", "p, q,", "--loud"])
    assert got == _Toy(_Inner(_Colour.BLUE, ParallelSpec(6, tp=3)), 4, ("p", "q"), "x", 0.5, True)
    assert got.inner.colour is _Colour.BLUE
    for argv, needle in (
        (["--colour", "green"], "invalid choice: 'green'"),  # skipped
        (["--count", "0"], "expected a positive integer, got 0"),
        (["--mode", "z"], "invalid choice: 'z'"),
        (["--hidden", "1"], "unrecognized arguments"),
        (["--etp", "1"], "unrecognized arguments"),
        (["--names", ","], "expected a comma-separated list"),
    ):
        with pytest.raises(SystemExit) as exc:
            _toy(argv)
        assert exc.value.code == cli.EXIT_BAD_INPUT
        assert needle in capsys.readouterr().err, argv


def test_a_field_name_used_twice_and_a_true_flag_are_refused():
    @dataclass(frozen=True)
    class Twice:
        inner: _Inner = field(default_factory=_Inner, metadata={"section": True})
        colour: str = field(default="x", metadata={"help": "again"})

    @dataclass(frozen=True)
    class OnByDefault:
        on: bool = field(default=True, metadata={"help": "on"})

    for cls in (Twice, OnByDefault):
        with pytest.raises(TypeError):
            add_options(argparse.ArgumentParser(), cls)


def test_choices_are_the_enum_values():
    assert choices(ReductionName) == [m.value for m in ReductionName]
    assert choices(ReductionName, skip=("upcast",)) == [m.value for m in ReductionName if m != ReductionName.UPCAST]
    assert choices(CaseWhere) == list(CASE_WHERES) == ["threads", "processes", "gloo"] == list(Where)


def test_the_script_runner_sets_and_restores_argv_and_path(tmp_path):
    from simdist.cli.script import as_main, exit_status

    script = tmp_path / "s.py"
    argv, path = list(sys.argv), list(sys.path)
    with pytest.raises(RuntimeError), as_main(str(script), ("a", "b")):
        assert sys.argv == [str(script), "a", "b"] and sys.path[0] == str(tmp_path)
        raise RuntimeError
    assert (sys.argv, sys.path) == (argv, path)
    assert [exit_status(SystemExit(c)) for c in (None, 0, 4, "msg")] == [(0, None), (0, None), (4, None), (1, "msg")]


def test_the_stdout_guard_keeps_a_replaced_stdout_for_the_report(capsys):
    from simdist.cases.stdout import stdout_to_stderr

    with stdout_to_stderr() as report:
        print("noise")
        print("report", file=report)
    captured = capsys.readouterr()
    assert captured.out == "report\n" and "noise" in captured.err
