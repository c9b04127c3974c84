"""The command line tells the user's mistakes (`UsageError`: one line, exit 2) from simdist's bugs (exit 3).

An internal ``ValueError`` -- raised by simdist, torch or NumPy where the input was fine -- must not be shown as
bad input: it gets its traceback and a request for a report. Each exception class the CLI documents as bad input
is a `UsageError`, and a bad option or policy name still ends in one line with exit status 2.
"""

from __future__ import annotations

import pytest

import simdist.cli as cli
from simdist.errors import UsageError


def _dispatching(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def broken(args):
        raise exc

    monkeypatch.setattr(cli, "_dispatch", broken)


def test_an_internal_value_error_is_a_bug_with_its_traceback(monkeypatch, capsys):
    _dispatching(monkeypatch, ValueError("an invariant of simdist broke"))
    assert cli.main(["policies"]) == cli.EXIT_BUG
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "an invariant of simdist broke" in err
    assert "please report" in err


def test_a_usage_error_is_one_line_with_exit_status_2(monkeypatch, capsys):
    _dispatching(monkeypatch, UsageError("--tp 3 must divide --world-size 4\nsecond line"))
    assert cli.main(["policies"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == "simdist: error: --tp 3 must divide --world-size 4\n"


def test_the_documented_bad_input_classes_are_usage_errors():
    from simdist.attribution.api import SiteNotFound
    from simdist.cli.blame import TorchrunStyle
    from simdist.cli.inputs import BadInput
    from simdist.cli.limits import SizeError
    from simdist.studies.dumps import NotSameRun

    for cls in (BadInput, SizeError, NotSameRun, SiteNotFound, TorchrunStyle):
        assert issubclass(cls, UsageError), cls
    assert issubclass(UsageError, ValueError)  # library callers that catch ValueError keep working


@pytest.mark.parametrize(
    "argv",
    [
        ["repro", "8913", "--world-size", "4", "--tp", "3"],  # a broken layout (ParallelSpec)
        ["repro", "8913", "--policies", "no_such_policy"],  # an unknown policy (the catalogue)
    ],
)
def test_library_validation_reaches_the_cli_as_usage(argv, capsys):
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("simdist: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_closed_stdout_is_141_without_a_traceback(monkeypatch, capsys):
    """``simdist ... | head``: the reader went away; no traceback, no "error" line (the module docstring's 141)."""
    _dispatching(monkeypatch, BrokenPipeError())
    assert cli.main(["policies"]) == 141
    assert capsys.readouterr().err == ""


def test_an_unreadable_file_is_one_line_naming_it_with_exit_status_2(monkeypatch, capsys):
    _dispatching(monkeypatch, FileNotFoundError(2, "No such file or directory", "dumps/a"))
    assert cli.main(["policies"]) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "simdist: error: dumps/a: No such file or directory\n"
