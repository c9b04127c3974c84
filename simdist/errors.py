"""One root for every exception simdist raises, and the one line between "you can fix this" and "a bug".

`SimdistError` is the root: ``except SimdistError`` catches whatever simdist itself raised, and nothing from
torch or NumPy. Under it, `SimdistRuntimeError` (also a `RuntimeError`) for what goes wrong while a world runs (a
collective mismatch, a deadlock, a rank that failed or exited), and `UsageError` (also a `ValueError`).

`UsageError` is raised for what the caller can fix: an unknown policy or reduction name, a layout that breaks a
constraint, a size above its limit, a missing or corrupt input file, an unusable output path. The command line
prints it as one line and exits 2; everything else that escapes a command is a bug: the command line prints its
traceback, asks for a report and exits 3. `UsageError` is a `ValueError`, so library callers that catch
``ValueError`` keep working; the distinction matters to the command line, which must not present an internal
``ValueError`` (from simdist, torch or NumPy) as the user's mistake.

`coerce` is the one way a name becomes an enum member, so every "unknown ..." message reads alike:
``unknown where 'thread'; valid: threads, processes, gloo``.

This module imports nothing (its type hints are read by the type checker only): every layer may raise these.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import enum
    from typing import TypeVar

    _E = TypeVar("_E", bound=enum.Enum)

__all__ = ["SimdistError", "SimdistRuntimeError", "UsageError", "coerce"]


class SimdistError(Exception):
    """The root of every exception class simdist defines (tests/unit/test_errors.py walks the package)."""


class SimdistRuntimeError(SimdistError, RuntimeError):
    """Something went wrong while running (a world, a rank, a collective); a `RuntimeError`, as before the root."""


class UsageError(SimdistError, ValueError):
    """Input the caller can fix (an option, a name, a layout, a file): one line saying what and where."""


def coerce(enum_type: type[_E], value: object, what: str) -> _E:
    """``value`` as a member of ``enum_type`` (a member or its value); otherwise a `UsageError` naming ``what``,
    the value and every valid value: ``unknown {what} {value!r}; valid: a, b, c``."""
    try:
        return enum_type(value)
    except ValueError:
        valid = ", ".join(str(member.value) for member in enum_type)
        raise UsageError(f"unknown {what} {value!r}; valid: {valid}") from None
