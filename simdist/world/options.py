"""What every launcher of rank programs shares: where ranks live, what they are handed, the reduction model's
spelling and default, and the default deadline (`simdist.world.runner.run` and its older names).

One spelling, ``reduction=``, chooses how collectives sum: a model name (``"gloo"``), a `Reduction` member
(``Reduction.GLOO``), a `ReductionModel` (``Gloo()``) or, where per-group choices make sense, a mapping from
group kind to one of those (``{"tp": "ring", "default": "gloo"}``). The older keyword spellings (``model=`` of
`simdist.spawn`, `spawn_procs` and the ``simdist_world`` fixture, ``models=``/``default_model=`` of `SimWorld` and
the rank-batched engine) are kept as deprecated aliases (a `DeprecationWarning` at each use:
`warn_deprecated_spelling`) because users' scripts call them; `pick_reduction` (and
`simdist.world.simworld.reduction_table` for the kind -> model table) merges them and refuses two at once
(`check_one_reduction`, the one check and message of every front end).
"""

from __future__ import annotations

import enum
import math
import warnings
from typing import Any

from simdist.reduce import Reduction

DEFAULT_REDUCTION: Reduction = Reduction.GLOO
"""The one default reduction model of every launcher: gloo's order, found by experiment against real gloo.

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
    """One thread per rank in this process; collectives by the reduction model (`simdist.world.inproc`)."""
    PROCESSES = "processes"
    """One process per rank, ``torch.distributed`` backend ``simdist`` in process mode: gloo transport, the
    reduction model's arithmetic (`simdist.world.process`). For frameworks with per-rank module globals."""
    GLOO = "gloo"
    """One process per rank on real ``torch.distributed`` gloo: the real thing the models are checked against."""


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
        raise ValueError("timeout_s=None (no deadline) is for threads only: a process stuck in gloo blocks forever")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise TypeError(f"timeout_s must be a number of seconds or None, got {type(timeout_s).__name__} {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive, finite number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def choose(enum_type: type[enum.StrEnum], value: Any, name: str) -> Any:
    """``value`` as a member of ``enum_type`` (a member or its string); ``ValueError`` listing the valid values."""
    try:
        return enum_type(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"{name}={value!r} is unknown; valid: {valid}") from None


_UNSET: Any = object()
"""A keyword the caller did not pass (``None`` is a value some spellings accept)."""


def check_one_reduction(*given: str) -> None:
    """``TypeError`` if the reduction model was given in more than one spelling; ``given`` names the keywords
    the caller received (``"reduction"``, ``"model"``, ...). The one check and message of every launcher,
    `SimWorld`, the rank-batched engine, the ``simdist_world`` fixture and `simdist.testing.compact`."""
    if len(given) > 1:
        names = [f"{name}=" for name in given]
        got = ", ".join(names[:-1]) + " and " + names[-1]
        raise TypeError(f"give the reduction model once, as reduction= (got {got})")


def warn_deprecated_spelling(*older: str, stacklevel: int = 2) -> None:
    """A `DeprecationWarning` that the keywords ``older`` (``"model"``, ...) are old spellings of ``reduction=``.

    ``stacklevel`` as for `warnings.warn`, counted from the caller of this function: the warning names the
    line that passed the old keyword."""
    if older:
        names = " and ".join(f"{name}=" for name in older)
        warnings.warn(
            f"{names} is a deprecated spelling of reduction= (same values); pass reduction= instead",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )


def pick_reduction(reduction: Any, *, stacklevel: int = 2, **older: Any) -> Any:
    """The reduction choice from ``reduction=`` or one older spelling (``model=`` ...); ``TypeError`` if two
    are given, a `DeprecationWarning` for an older one (``stacklevel``: `warn_deprecated_spelling`'s, counted from
    the caller). Unset ones are `_UNSET`; all unset gives `DEFAULT_REDUCTION`."""
    given = {name: value for name, value in older.items() if value is not _UNSET}
    if reduction is not _UNSET:
        given = {"reduction": reduction, **given}
    check_one_reduction(*given)
    warn_deprecated_spelling(*(name for name in given if name != "reduction"), stacklevel=stacklevel + 1)
    return next(iter(given.values()), DEFAULT_REDUCTION)
