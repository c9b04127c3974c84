"""What every launcher of rank programs shares: where ranks live, what they are handed, the reduction's
spelling and default, and the default deadline (`simdist.world.runner.run` and its older names).

One spelling, ``reduction=``, chooses how collectives sum: a reduction name (``"gloo"``), a `ReductionName` member
(``ReductionName.GLOO``), a `Reduction` (``Gloo()``) or, where per-group choices make sense, a mapping from
group kind to one of those (``{"tp": "ring", "default": "gloo"}``). It is the only spelling: the older
keywords (``model=``, ``models=``, ``default_model=``, the ``SIMDIST_MODEL`` variable) were removed before 0.1.0
and are unknown keywords now (``TypeError``). `pick_reduction` turns "not given" into `DEFAULT_REDUCTION`.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from simdist.errors import UsageError
from simdist.reduce import ReductionName

DEFAULT_REDUCTION: ReductionName = ReductionName.GLOO
"""The one default reduction of every launcher: gloo's order, found by experiment against real gloo.

Why gloo and not the rank-order fold (`Sequential`, once `SimWorld`'s default): a simulated run is a stand-in
for a real one, and on CPU the real one is gloo; with this default a program gives the same bits on simulated
ranks as on ``torch.distributed`` gloo processes (``where="gloo"``), and every study, case and benchmark in this
repository already chose it explicitly. `Sequential` is a textbook order no backend uses; ask for it by name."""

DEFAULT_TIMEOUT_S: float = 300.0
"""The one default deadline (seconds) for a whole run, in every ``where``.

A deadline is needed in processes (a rank stuck in a collective would block the caller forever) and useful in
threads (a rank in an endless loop; collective deadlocks are reported at once without it). 300 s bounds the
longest default runs (a DeepSpeed case launch takes about 40 s, the longest case a few minutes with its own
``timeout_s``) and is below gloo's own 30-minute collective timeout, so the launcher's report comes first.
Long studies pass ``timeout_s=None`` (threads only: no deadline) or a larger bound."""


class Where(enum.StrEnum):
    """Where the ranks of a run live."""

    THREADS = "threads"
    """One thread per rank in this process; each collective summed by its group's reduction
    (`simdist.world.threads.spawn`)."""
    PROCESSES = "processes"
    """One process per rank, ``torch.distributed`` backend ``simdist`` in process mode: gloo transport, the
    reduction's arithmetic (`simdist.world.processes.transport`). For frameworks with per-rank module globals."""
    GLOO = "gloo"
    """One process per rank on real ``torch.distributed`` gloo: the real thing the reductions are checked against."""


class Api(enum.StrEnum):
    """What the rank function is handed."""

    DIST = "dist"
    """``fn(rank, *args, **kwargs)`` with the default ``torch.distributed`` group initialised (as torchrun)."""
    COMM = "comm"
    """``fn(comm, *args, **kwargs)`` with a `simdist.world.groups.Comm` of a `ParallelSpec` (`SimComm` in threads,
    `TorchComm` in processes)."""


def check_timeout(timeout_s: Any, *, none_ok: bool = True) -> float | None:
    """``timeout_s`` as a positive float (or ``None`` where allowed); a one-line error otherwise."""
    if timeout_s is None:
        if none_ok:
            return None
        raise UsageError("timeout_s=None (no deadline) is for threads only: a process stuck in gloo blocks forever")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise TypeError(f"timeout_s must be a number of seconds or None, got {type(timeout_s).__name__} {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UsageError(f"timeout_s must be a positive, finite number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def choose(enum_type: type[enum.StrEnum], value: Any, name: str) -> Any:
    """``value`` as a member of ``enum_type`` (a member or its string); ``ValueError`` listing the valid values."""
    try:
        return enum_type(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_type)
        raise UsageError(f"{name}={value!r} is unknown; valid: {valid}") from None


_UNSET: Any = object()
"""A keyword the caller did not pass (``None`` is a value some spellings accept)."""


def pick_reduction(reduction: Any) -> Any:
    """The reduction choice: ``reduction`` itself, or `DEFAULT_REDUCTION` when the caller did not give one
    (`_UNSET`)."""
    return DEFAULT_REDUCTION if reduction is _UNSET else reduction
