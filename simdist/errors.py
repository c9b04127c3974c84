"""The one line between "you can fix this" and "this is a bug in simdist".

`UsageError` is raised for what the caller can fix: an unknown policy or reduction name, a layout that breaks a
constraint, a size above its limit, a missing or corrupt input file, an unusable output path. The command line
prints it as one line and exits 2; everything else that escapes a command is a bug: the command line prints its
traceback, asks for a report and exits 3. `UsageError` is a `ValueError`, so library callers that catch
``ValueError`` keep working; the distinction matters to the command line, which must not present an internal
``ValueError`` (from simdist, torch or NumPy) as the user's mistake.

This module imports nothing: every layer may raise these.
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """Input the caller can fix (an option, a name, a layout, a file): one line saying what and where."""
