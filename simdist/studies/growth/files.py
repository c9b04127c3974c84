"""Atomic file writes for growth runs (a killed run never leaves a half-written file)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file and an atomic rename, so a kill never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    """`atomic_write` of a text file."""
    atomic_write(path, lambda tmp: tmp.write_text(text))
