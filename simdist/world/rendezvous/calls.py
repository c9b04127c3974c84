"""A rank's side of a collective (`Call`) and where rank code is: call sites for messages, whereabouts for timeouts.

Every front end describes a collective as one `Call` per member (its
signature, the caller's frame, its tensors); errors show a call with
`Call.describe`, its source line found by `site`: the user's call site by the
one rule of `simdist.callsite` (the first frame outside torch, simdist's world
layer, the audit and blame, and the wrappers torch's functions are decorated
with; the audit and blame name the same frame). A rank stuck
past a run's deadline is shown by `rank_whereabouts`: its own innermost line
and the frame it waits in.

The shapes every collective function shares are here too: `Members` (what a
collective needs of its group), `Complete` (its completion over every
member's call) and `Prepared` (the pair a collective function returns), and
`meta` (tensors' shapes and dtypes as signature details).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from simdist.callsite import frame_site, is_internal, user_frame

if TYPE_CHECKING:
    from simdist.reduce import Reduction

_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))


def site(frame) -> str:
    """``file:line in function`` of the user's call site (`simdist.callsite.user_frame`); of ``frame`` itself when
    every frame is internal."""
    found = user_frame(frame) or frame
    if found is None:
        return "<unknown>"
    path, line, function = frame_site(found)
    return f"{path}:{line} in {function}"


def show(detail: object) -> str:
    """One detail of a call signature as text (``op=SUM``, ``shape=(4,)``, ``dtype=float32``)."""
    name = type(detail).__name__
    if name == "ReduceOp" and hasattr(detail, "name"):
        return f"op={detail.name}"
    if isinstance(detail, torch.Size):
        return f"shape={tuple(detail)}"
    if isinstance(detail, torch.dtype):
        return f"dtype={str(detail).removeprefix('torch.')}"
    if isinstance(detail, torch.device):
        return f"device={detail}"
    return str(detail)


class Call:
    """One rank's side of a collective.

    ``signature`` is a tuple ``(op name, group, *details)`` that every member
    must agree on; it is formatted only when an error needs it. ``frame`` is the
    caller's frame (or an already formatted site string), ``inputs``/``outputs``
    the rank's tensors, ``extra`` anything rank-specific (split sizes, ...).
    """

    __slots__ = ("extra", "frame", "inputs", "outputs", "rank", "signature")

    def __init__(self, rank: int, signature: tuple, frame: Any, inputs: tuple = (), outputs: tuple = (), extra=None):
        self.rank = rank
        self.signature = signature
        self.frame = frame
        self.inputs = inputs
        self.outputs = outputs
        self.extra = extra

    @property
    def site(self) -> str:
        return self.frame if isinstance(self.frame, str) else site(self.frame)

    def describe(self) -> str:
        op, group, *details = self.signature
        shown = ", ".join(show(d) for d in details)
        return f"rank {self.rank}: {op}(group={group}{', ' if shown else ''}{shown}) at {self.site}"


def where_ranks_are(threads: list[threading.Thread], timeout_s: float | None) -> str:
    """What a run that passed its deadline reports: each live rank thread's whereabouts."""
    frames = sys._current_frames()
    lines = [f"the run did not finish within {timeout_s} s; ranks still running:"]
    for rank, t in enumerate(threads):
        frame = frames.get(t.ident) if t.is_alive() and t.ident is not None else None
        if frame is not None:
            lines.append(f"  rank {rank}: {rank_whereabouts(frame)}")
    return "\n".join(lines)


def rank_whereabouts(frame) -> str:
    """Where a rank is stuck: its own code's innermost frame, and the frame it waits in when that is deeper.

    The innermost frame alone (``subprocess.py in communicate`` while a framework compiles an op) does not say
    which line of the rank's program started the wait; the outermost frames are the launcher's. The rank's own
    line is the innermost frame outside torch, simdist's machinery, the standard library and installed
    packages (`site` when every frame is one of those)."""
    chain = traceback.extract_stack(frame)
    innermost = chain[-1]
    own = next((f for f in reversed(chain) if not _is_library(f.filename)), None)
    if own is None:
        return site(frame)
    text = f"{own.filename}:{own.lineno} in {own.name}"
    if own is not innermost:
        text += f", waiting in {innermost.filename}:{innermost.lineno} in {innermost.name}"
    return text


def _is_library(filename: str) -> bool:
    """Not a rank's own code: what the call-site rule skips (`simdist.callsite.is_internal`), the standard library
    and installed packages."""
    if is_internal(filename):
        return True
    path = os.path.abspath(filename)
    return "site-packages" in path.split(os.sep) or path.startswith(_STDLIB_DIR)


Complete = Callable[[list[Call], Sequence[int]], None]
"""``complete(calls, targets)``: compute from every member's call, write the outputs of the members ``targets``."""

Prepared = tuple[Call, Complete]
"""What each collective function returns for the calling rank: its `Call` and the collective's `Complete`."""


class Members(Protocol):
    """What a collective needs to know of its group (a `SimProcessGroup`, or SimComm's view of a `Group`)."""

    label: str  # the group in error messages and call signatures
    reduction: Reduction
    gloo_rules: bool  # refuse what torch's gloo backend refuses (the reduction's ``gloo_rules``)
    ranks: tuple[int, ...]  # global ranks in group-rank order
    checked: dict  # `all_reduce_one`'s cache: checks passed, signature and completion per (op, shape, dtype)


def meta(tensors: Sequence[torch.Tensor]) -> tuple:
    """Shapes and dtypes of ``tensors`` as signature details."""
    if len(tensors) == 1:
        t = tensors[0]
        return (t.shape, t.dtype)
    out: list = []
    for t in tensors:
        out += [t.shape, t.dtype]
    return tuple(out)
