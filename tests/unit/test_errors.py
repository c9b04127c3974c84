"""The command line tells the user's mistakes (`UsageError`: one line, exit 2) from simdist's bugs (exit 3).

An internal ``ValueError`` -- raised by simdist, torch or NumPy where the input was fine -- must not be shown as
bad input: it gets its traceback and a request for a report. Each exception class the CLI documents as bad input
is a `UsageError`, and a bad option or policy name still ends in one line with exit status 2.
"""

from __future__ import annotations

from pathlib import Path

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


def _simdist_modules() -> list[str]:
    """Every module of the package but the ``__main__`` ones (importing those runs the command line)."""
    import pkgutil

    import simdist

    found = pkgutil.walk_packages(simdist.__path__, "simdist.")
    return [info.name for info in found if info.name.rsplit(".", 1)[-1] != "__main__"]


def _builtin_exception_bases(module: str) -> list[str]:
    """``class X(<builtin exception>)`` statements in a module's source (for a module that cannot be imported
    here: its optional framework is not installed)."""
    import ast
    import builtins
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    return [
        f"{module}.{node.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for base in node.bases
        if isinstance(base, ast.Name)
        and isinstance(getattr(builtins, base.id, None), type)
        and issubclass(getattr(builtins, base.id), BaseException)
    ]


def test_every_exception_simdist_defines_is_a_simdist_error():
    """One root: ``except SimdistError`` catches whatever simdist raises. Warnings are categories, not raised
    errors; `Aborted` unwinds a rank thread and must stay outside `Exception` (user code cannot swallow it)."""
    import importlib

    from simdist.errors import SimdistError

    outside, unrooted, checked = [], [], 0
    for name in _simdist_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            assert exc.name is not None and not exc.name.startswith("simdist"), exc
            unrooted += _builtin_exception_bases(name)
            continue
        for value in vars(module).values():
            if not (isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name):
                continue
            checked += 1
            if not issubclass(value, Exception):
                outside.append(value.__qualname__)
            elif not issubclass(value, (SimdistError, Warning)):
                unrooted.append(f"{name}.{value.__qualname__}")
    assert checked >= 15  # the walk found the package's exception classes
    assert _builtin_exception_bases("simdist.world.rendezvous.meeting") == ["simdist.world.rendezvous.meeting.Aborted"]
    assert unrooted == []
    assert outside == ["Aborted"]


def test_the_root_keeps_each_error_catchable_as_before():
    """A run-time error is still a `RuntimeError`, a usage error a `ValueError`; neither is the other."""
    from simdist.errors import SimdistError, SimdistRuntimeError
    from simdist.world.errors import CollectiveDeadlockError, CollectiveMismatchError, SimTimeoutError
    from simdist.world.processes.supervise import RankFailure
    from simdist.world.threads.rank_rngs import SharedGlobalStateError
    from simdist.world.threads.spawn import RankExitError

    for cls in (CollectiveMismatchError, CollectiveDeadlockError, SimTimeoutError, RankFailure, RankExitError,
                SharedGlobalStateError):  # fmt: skip
        assert issubclass(cls, SimdistRuntimeError) and issubclass(cls, RuntimeError), cls
        assert not issubclass(cls, UsageError), cls
    assert issubclass(UsageError, SimdistError) and not issubclass(UsageError, RuntimeError)


def test_a_run_time_error_escaping_a_command_is_still_a_bug(monkeypatch, capsys):
    """The root changes no exit status: only a `UsageError` is the user's (2); a `SimdistRuntimeError` is 3."""
    from simdist.world.errors import CollectiveDeadlockError

    _dispatching(monkeypatch, CollectiveDeadlockError("every live rank waits"))
    assert cli.main(["policies"]) == cli.EXIT_BUG
    assert "Traceback (most recent call last)" in capsys.readouterr().err
