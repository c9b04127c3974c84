"""The one rule for "the user's call site": the first frame of a stack that is the user's own code.

A site (a collective, a cast, a narrowing op) is named by the frame that caused it. Frames that are not the
user's are skipped: torch's, simdist's own machinery (the world layer, which runs the collectives; the audit
and blame, which observe them), the wrappers torch's functions are decorated with (``warnings.deprecated``,
``typing_extensions.deprecated``: their ``wrapper`` frame sits between a user's call and torch), frozen
import machinery, and whatever the caller adds (``simdist audit --skip``). `is_internal` says whether a file is
one of those; `user_frame` walks a stack to the first frame that is not; `site_of` names it.

Every layer that names a site uses this rule: the world's call sites in error messages
(`simdist.world.rendezvous.calls.site`), the audit's records (``simdist.audit.mode.Audit._site``, which caches the
verdict per code object) and blame's collective sites (``simdist.attribution.run.Recorder.site_of``).

This module imports nothing of simdist and does not import torch (it finds torch's folder without loading it),
so every layer may use it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterable
from types import FrameType

__all__ = ["NO_SITE", "Site", "frame_site", "internal_prefixes", "is_internal", "site_of", "user_frame"]

Site = tuple[str, int, str]
"""``(absolute path or <pseudo-file>, line, function)`` of a frame."""

NO_SITE: Site = ("<no Python frame>", 0, "")
"""The site of a stack with no user frame at all."""


@functools.cache
def _folder(module: str) -> str | None:
    """``module``'s folder (with a trailing separator), found once: a folder does not move while a process runs."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.abspath(spec.origin)) + os.sep


def _wrapper_files() -> tuple[str, ...]:
    files = []
    for module in ("warnings", "typing_extensions"):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            files.append(os.path.abspath(spec.origin))
    return tuple(files)


_SIMDIST = os.path.dirname(os.path.abspath(__file__))
MACHINERY: tuple[str, ...] = tuple(os.path.join(_SIMDIST, part) + os.sep for part in ("world", "audit", "attribution"))
"""simdist's own folders whose frames are never a user's call site: the world layer, the audit and blame."""

WRAPPER_FILES: tuple[str, ...] = _wrapper_files()
"""The modules whose decorators wrap torch's functions: their frames are no call site either."""


def internal_prefixes(skip: Iterable[str] = ()) -> tuple[str, ...]:
    """The path prefixes `is_internal` skips: torch, simdist's machinery, the wrappers, frozen modules, ``skip``."""
    torch_dir = _folder("torch")
    return (*((torch_dir,) if torch_dir else ()), *MACHINERY, *WRAPPER_FILES, "<frozen ", *skip)


def is_internal(filename: str, prefixes: tuple[str, ...] | None = None) -> bool:
    """Whether a frame of ``filename`` is not the user's (``prefixes``: `internal_prefixes`'s by default)."""
    prefixes = internal_prefixes() if prefixes is None else prefixes
    path = filename if filename.startswith("<") else os.path.abspath(filename)
    return path.startswith(prefixes)


def user_frame(
    frame: FrameType | None, skip: Iterable[str] = (), prefixes: tuple[str, ...] | None = None
) -> FrameType | None:
    """The first frame from ``frame`` outwards that is the user's (``skip``: more path prefixes to pass over;
    ``prefixes``: the whole list instead, as `internal_prefixes` made it once for many calls)."""
    prefixes = internal_prefixes(skip) if prefixes is None else prefixes
    while frame is not None and is_internal(frame.f_code.co_filename, prefixes):
        frame = frame.f_back
    return frame


def site_of(frame: FrameType | None, skip: Iterable[str] = (), prefixes: tuple[str, ...] | None = None) -> Site:
    """The `Site` of `user_frame` (`NO_SITE` when every frame is internal)."""
    found = user_frame(frame, skip, prefixes)
    return NO_SITE if found is None else frame_site(found)


def frame_site(frame: FrameType) -> Site:
    """The `Site` of ``frame`` itself: its file (absolute unless a ``<pseudo-file>``), line and function."""
    name = frame.f_code.co_filename
    return (name if name.startswith("<") else os.path.abspath(name), frame.f_lineno, frame.f_code.co_name)
