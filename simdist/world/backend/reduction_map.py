"""Which reduction a group of the ``simdist`` backend uses.

A choice is one of:

* a reduction name (``"gloo"``, ``"ring"``, ... see `simdist.reduce.REDUCTION_NAMES`) or a
  `Reduction`: every group uses it;
* a mapping from group kind to a name or reduction. With a `ParallelSpec`, a group
  whose ranks are one of the spec's ``tp``/``dp``/``ep``/``etp``/``edp``/``pp``
  groups has that kind; the group of all ranks is ``world``; any other group is
  ``group``. Kinds not in the mapping use its ``"default"`` entry (else `DEFAULT_REDUCTION`, gloo);
* a callable ``(ranks) -> Reduction``, for a per-group choice.

`Chooser` resolves a group's global ranks to ``(kind, reduction)``. Every choice is checked when the
`Chooser` is made, so a typo fails at once instead of silently falling back to the default: an unknown
kind (``{"tpp": "ring"}``), an unknown reduction name, a spec kind without ``spec=``, and a value of the wrong
type are errors that list the valid values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from simdist.errors import UsageError
from simdist.reduce import REDUCTION_NAMES, Reduction, make_reduction
from simdist.world.options import DEFAULT_REDUCTION
from simdist.world.spec import GROUP_KINDS, ParallelSpec

ReductionChoice = str | Reduction | Mapping[str, str | Reduction] | Callable[[tuple], Reduction]

MAP_KINDS: tuple[str, ...] = (*GROUP_KINDS, "world", "group", "default")
"""The keys a kind -> reduction mapping accepts."""


def as_reduction(reduction: str | Reduction, where: str = "reduction") -> Reduction:
    """A `Reduction` from a reduction or a reduction name; anything else is a ``TypeError`` naming the valid values."""
    if isinstance(reduction, Reduction):
        return reduction
    if isinstance(reduction, str):
        if reduction not in REDUCTION_NAMES:
            raise UsageError(f"{where}: unknown reduction {reduction!r}; valid names: {', '.join(REDUCTION_NAMES)}")
        return make_reduction(reduction)
    raise TypeError(
        f"{where} must be a reduction name ({', '.join(REDUCTION_NAMES)}) or a Reduction, "
        f"got {type(reduction).__name__} {reduction!r}"
    )


def _check_map(choice: Mapping, spec: ParallelSpec | None) -> None:
    for kind in choice:
        if not isinstance(kind, str) or kind not in MAP_KINDS:
            raise UsageError(f"reduction map: unknown group kind {kind!r}; valid kinds: {', '.join(MAP_KINDS)}")
    needs_spec = [kind for kind in choice if kind in GROUP_KINDS]
    if needs_spec and spec is None:
        raise UsageError(
            f"reduction map: kind(s) {', '.join(needs_spec)} name groups of a ParallelSpec; pass spec= "
            "(without it only 'world', 'group' and 'default' can match)"
        )


class Chooser:
    """Maps a group's global ranks to its kind and reduction (see the module docstring)."""

    def __init__(self, choice: ReductionChoice, world_size: int, spec: ParallelSpec | None = None) -> None:
        if spec is not None and spec.world_size != world_size:
            raise UsageError(f"spec {spec.describe()} has {spec.world_size} ranks, the run {world_size}")
        self.world_size = world_size
        self.spec = spec
        self._kinds: dict[tuple[int, ...], str] = {}
        if spec is not None:
            for kind in GROUP_KINDS:
                for ranks in spec.groups(kind):
                    self._kinds.setdefault(tuple(sorted(ranks)), kind)
        self._call: Callable[[tuple], Reduction] | None = None
        self._reductions: dict[str, Reduction] = {}
        if isinstance(choice, (str, Reduction)):
            self._reductions["default"] = as_reduction(choice)
        elif isinstance(choice, Mapping):
            _check_map(choice, spec)
            self._reductions = {kind: as_reduction(m, f"reduction map entry {kind!r}") for kind, m in choice.items()}
            self._reductions.setdefault("default", as_reduction(DEFAULT_REDUCTION))
        elif callable(choice):
            self._call = choice
        else:
            raise TypeError(
                f"reduction must be a reduction name ({', '.join(REDUCTION_NAMES)}), a Reduction, a mapping from group "
                f"kind ({', '.join(MAP_KINDS)}) to one of those, or a callable (ranks) -> Reduction; "
                f"got {type(choice).__name__} {choice!r}"
            )

    def kind(self, ranks: tuple[int, ...]) -> str:
        """``world``, a spec kind, or ``group``."""
        if len(ranks) == self.world_size:
            return "world"
        return self._kinds.get(tuple(sorted(ranks)), "group")

    def __call__(self, ranks: tuple[int, ...]) -> tuple[str, Reduction]:
        kind = self.kind(ranks)
        if self._call is not None:
            reduction = self._call(ranks)
            if not isinstance(reduction, Reduction):
                raise TypeError(
                    f"the reduction callable returned {type(reduction).__name__} {reduction!r} for ranks {ranks}, "
                    "not a Reduction"
                )
            return kind, reduction
        return kind, self._reductions.get(kind, self._reductions["default"])
