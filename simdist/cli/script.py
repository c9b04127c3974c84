"""Running a user's script as ``python SCRIPT ARGS...`` would: the one script runner of ``audit`` and ``blame``.

`as_main` sets what Python sets for a script (``sys.argv``, the script's folder first on ``sys.path``) and
restores it afterwards; `run_main` runs the file as ``__main__``; `exit_status` is what Python makes of
``sys.exit(code)``, and `ScriptExit` carries a non-zero one out of a run. ``simdist audit`` and ``simdist
blame`` (its thread mode and, in each rank, `simdist.attribution.processes`) run scripts through these.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator, Sequence

from simdist.errors import SimdistError, UsageError


class ScriptExit(SimdistError):
    """The script exited with a non-zero status (``sys.exit``): in this process or on a rank process."""

    def __init__(self, status: int, message: str | None) -> None:
        super().__init__(message or f"exit status {status}")
        self.status = status
        self.message = message


def check_script(script: str) -> None:
    """`UsageError` unless ``script`` is a file: checked before anything runs."""
    if not os.path.isfile(script):
        raise UsageError(f"no such script: {script!r}")


@contextlib.contextmanager
def as_main(script: str, argv: Sequence[str]) -> Iterator[None]:
    """Inside the block ``sys.argv`` is ``[script, *argv]`` and the script's folder is first on ``sys.path``."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def run_main(script: str) -> None:
    """Run ``script`` as ``__main__`` (inside `as_main`); its ``SystemExit`` and exceptions propagate."""
    runpy.run_path(script, run_name="__main__")


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
