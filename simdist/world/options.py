"""What every launcher of rank programs shares: where ranks live, what they are handed, the reduction's
spelling and default, and the default deadline (`simdist.world.runner.run` and its older names).

One spelling, ``reduction=``, chooses how collectives sum: a reduction name (``"gloo"``), a `ReductionName` member
(``ReductionName.GLOO``), a `Reduction` (``Gloo()``), a mapping from group kind to one of those
(``{"tp": "ring", "default": "gloo"}``) or a callable ``(ranks) -> Reduction`` (`ReductionChoice`). `read_reduction`
is its one parser, used by every front end (`SimWorld`, the ``simdist`` backend's `Chooser`, the rank-batched
gradient path, process launches and the command line), so a mistake reads the same wherever it is made. It is the
only spelling: the older
keywords (``model=``, ``models=``, ``default_model=``, the ``SIMDIST_MODEL`` variable) were removed before 0.1.0
and are unknown keywords now (``TypeError``). Not given (or ``None``) is `DEFAULT_REDUCTION`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from simdist.errors import UsageError
from simdist.reduce import REDUCTION_NAMES, Reduction, ReductionName, make_reduction
from simdist.world.spec import GROUP_KINDS

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


_UNSET: Any = object()
"""A keyword the caller did not pass (``None`` is a value some spellings accept)."""


def pick_reduction(reduction: Any) -> Any:
    """The reduction choice: ``reduction`` itself, or `DEFAULT_REDUCTION` when the caller did not give one
    (`_UNSET` or ``None``)."""
    return DEFAULT_REDUCTION if reduction is _UNSET or reduction is None else reduction


ReductionChoice = str | Reduction | Mapping[str, str | Reduction] | Callable[[tuple[int, ...]], Reduction]
"""What every front end accepts as ``reduction=``: a name or `ReductionName` member, a `Reduction`, a mapping from
group kind (`REDUCTION_KINDS`) to either, or a callable from a group's sorted global ranks to a `Reduction`."""

REDUCTION_KINDS: tuple[str, ...] = (*GROUP_KINDS, "world", "group", "default")
"""The keys a kind -> reduction mapping accepts: a `ParallelSpec` kind, ``world`` (the group of all ranks),
``group`` (any other group) and ``default`` (every kind not named)."""


def as_reduction(reduction: Any, where: str | None = None) -> Reduction:
    """A `Reduction` from a reduction or its name; an unknown name is a `UsageError`, another type a ``TypeError``,
    both naming the valid values (prefixed with ``where``, e.g. ``reduction['tp']`` or ``--reduction``, if given)."""
    prefix = f"{where}: " if where else ""
    if isinstance(reduction, Reduction):
        return reduction
    if isinstance(reduction, str):
        try:
            return make_reduction(reduction)
        except UsageError as error:
            raise UsageError(f"{prefix}{error}") from None
    raise TypeError(
        f"{prefix}{_CHOICE_GRAMMAR if where is None else _ONE_GRAMMAR}; got {type(reduction).__name__} {reduction!r}"
    )


_ONE_GRAMMAR = f"a reduction must be a reduction name ({', '.join(REDUCTION_NAMES)}) or a Reduction"
_CHOICE_GRAMMAR = (
    f"reduction must be a reduction name ({', '.join(REDUCTION_NAMES)}), a Reduction, a mapping from group kind "
    f"({', '.join(REDUCTION_KINDS)}) to one of those, or a callable (ranks) -> Reduction"
)

_PER_KIND_GRAMMAR = (
    f"reduction must be a reduction name ({', '.join(REDUCTION_NAMES)}), a Reduction or a mapping from group kind "
    f"({', '.join(REDUCTION_KINDS)}) to one of those here (a callable (ranks) -> Reduction chooses per group: "
    "simdist.run with api='dist' in threads reads it)"
)


@dataclass(frozen=True)
class ReductionTable:
    """A checked ``reduction=``: one `Reduction` per group kind named (and ``default``), or a callable."""

    by_kind: Mapping[str, Reduction]
    call: Callable[[tuple[int, ...]], Reduction] | None = None

    @property
    def default(self) -> Reduction:
        """The reduction of every kind not named."""
        return self.by_kind["default"]

    @property
    def named(self) -> dict[str, Reduction]:
        """The kinds named, each with its reduction (``default`` left out)."""
        return {kind: reduction for kind, reduction in self.by_kind.items() if kind != "default"}

    def for_kind(self, kind: str) -> Reduction:
        """The reduction of groups of ``kind`` (a kind that is neither a spec kind nor ``world`` reads ``group``);
        not for a callable table (`for_group`)."""
        if kind not in REDUCTION_KINDS:
            kind = "group"
        return self.by_kind.get(kind, self.by_kind["default"])

    def for_group(self, kind: str, ranks: tuple[int, ...]) -> Reduction:
        """The reduction of the group of ``kind`` with the sorted global ``ranks``."""
        if self.call is None:
            return self.for_kind(kind)
        reduction = self.call(ranks)
        if not isinstance(reduction, Reduction):
            raise TypeError(
                f"the reduction callable returned {type(reduction).__name__} {reduction!r} for ranks {ranks}, "
                "not a Reduction"
            )
        return reduction


def read_reduction(choice: Any = _UNSET, *, spec_given: bool = True, callable_ok: bool = True) -> ReductionTable:
    """The one parser of ``reduction=`` (see the module docstring): every name, kind and type is checked now, so a
    typo fails at once, listing the valid values. ``spec_given=False``: the run has no `ParallelSpec`, so spec kinds
    cannot match and are an error; ``callable_ok=False``: the front end chooses per kind only (`SimWorld`, the
    rank-batched path), so a callable is a ``TypeError``."""
    choice = pick_reduction(choice)
    if isinstance(choice, str | Reduction):
        return ReductionTable({"default": as_reduction(choice)})
    if isinstance(choice, Mapping):
        for kind in choice:
            if not isinstance(kind, str) or kind not in REDUCTION_KINDS:
                raise UsageError(f"reduction: unknown group kind {kind!r}; valid: {', '.join(REDUCTION_KINDS)}")
        needs_spec = [kind for kind in choice if kind in GROUP_KINDS]
        if needs_spec and not spec_given:
            raise UsageError(
                f"reduction: kind(s) {', '.join(needs_spec)} name groups of a ParallelSpec; pass spec= "
                "(without it only 'world', 'group' and 'default' can match)"
            )
        table = {kind: as_reduction(entry, f"reduction[{kind!r}]") for kind, entry in choice.items()}
        table.setdefault("default", as_reduction(DEFAULT_REDUCTION))
        return ReductionTable(table)
    if callable(choice):
        if not callable_ok:
            raise TypeError(f"{_PER_KIND_GRAMMAR}; got {type(choice).__name__} {choice!r}")
        return ReductionTable({"default": as_reduction(DEFAULT_REDUCTION)}, choice)
    raise TypeError(f"{_CHOICE_GRAMMAR}; got {type(choice).__name__} {choice!r}")
