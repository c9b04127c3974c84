"""Checks of the CLI's input and output paths, before any work: one line naming the file and what is wrong.

A failed check is a `BadInput` (a `simdist.errors.UsageError`: one line, exit status 2). They cover what a
user can get wrong or what a crash can leave behind -- a missing or non-directory dump, a truncated or corrupt
safetensors file, a file that is not a simdist dump, a growth ``--out`` that is a file or not writable, a
corrupt run file -- so that none of them reaches a traceback, and none is confused with exit status 1
("differs").
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from simdist.errors import UsageError

_RANK_FILE = re.compile(r"rank(\d+)\.safetensors")


class BadInput(UsageError):
    """An unreadable, corrupt or missing input (or an unusable output path): one line naming the file."""


def path_argument(text: str) -> str:
    """An argparse type for every path the CLI takes: an empty or blank path is bad input (exit 2).

    Without it ``--out ""`` would mean the current directory (a growth run wrote its files there) and an empty
    dump or module name would fail later with a message that names nothing.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def _safetensors_header(path: Path) -> dict:
    """The metadata of a safetensors file; `BadInput` if it cannot be opened or its header is corrupt."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except SafetensorError as exc:
        size = path.stat().st_size
        raise BadInput(
            f"{path}: not a readable safetensors file ({size} bytes; truncated or corrupt: "
            f"{str(exc).strip().splitlines()[0]})"
        ) from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read ({exc.strerror or exc})") from None


def check_dump(directory: str) -> None:
    """`BadInput` unless ``directory`` holds ``rank0..N-1.safetensors`` with readable simdist metadata."""
    path = Path(directory)
    if not path.exists():
        raise BadInput(f"{directory}: no such dump directory")
    if not path.is_dir():
        raise BadInput(f"{directory}: not a directory (a dump is a directory of rank*.safetensors files)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise BadInput(f"{directory}: cannot read the directory (permission denied)")
    files = sorted(path.glob("rank*.safetensors"))
    if not files:
        raise BadInput(f"{directory}: holds no rank*.safetensors dump")
    ranks = []
    for file in files:
        match = _RANK_FILE.fullmatch(file.name)
        if match is None:
            raise BadInput(f"{file}: unexpected file name (expected rank<N>.safetensors)")
        meta_text = _safetensors_header(file).get("simdist")
        if meta_text is None:
            raise BadInput(f"{file}: not a simdist dump (no 'simdist' metadata)")
        try:
            meta = json.loads(meta_text)
            rank, world = int(meta["rank"]), int(meta["spec"]["world_size"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{file}: corrupt 'simdist' metadata ({type(exc).__name__}: {exc})") from None
        if rank != int(match[1]):
            raise BadInput(f"{file}: holds rank {rank}, not rank {match[1]}")
        ranks.append((rank, world))
    world = ranks[0][1]
    missing = sorted(set(range(world)) - {r for r, _ in ranks})
    if missing:
        raise BadInput(f"{directory}: rank file rank{missing[0]}.safetensors is missing (world size {world})")


def check_growth_out(out: str, files: dict[str, str], force: bool) -> None:
    """`BadInput` when ``out`` cannot hold a growth run: a file, not writable, or holding corrupt run files.

    Nothing is created here; an existing run's ``config.json`` / ``summary.json`` must parse and its
    checkpoint must be a readable safetensors file (unless ``force``, which starts over).
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise BadInput(f"--out {out}: exists and is not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise BadInput(f"--out {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"--out {out}: {existing} is not writable")
    if force or not path.is_dir():
        return
    for key in ("config", "summary"):
        file = path / files[key]
        if file.exists():
            try:
                json.loads(file.read_text())
            except (ValueError, OSError) as exc:
                raise BadInput(f"{file}: corrupt ({type(exc).__name__}: {exc}); use --force to start over") from None
    checkpoint = path / files["checkpoint"]
    if checkpoint.exists():
        try:
            _safetensors_header(checkpoint)
        except BadInput as exc:
            raise BadInput(f"{exc}; use --force to start over") from None
