"""Which reduction a group of the ``simdist`` backend uses: `Chooser` resolves a group's global ranks to
``(kind, reduction)``.

The choice is ``reduction=`` as every front end reads it (`simdist.world.options.read_reduction`, the one parser:
a name or a `Reduction` for every group, a mapping from group kind to one of those, or a callable
``(ranks) -> Reduction``). With a `ParallelSpec`, a group whose ranks are one of the spec's
``tp``/``dp``/``ep``/``etp``/``edp``/``pp`` groups has that kind; the group of all ranks is ``world``; any other
group is ``group``; kinds not in the mapping use its ``"default"`` entry (else `DEFAULT_REDUCTION`, gloo).
Every choice is checked when the `Chooser` is made, so a typo fails at once instead of silently falling back to
the default: an unknown kind (``{"tpp": "ring"}``), an unknown reduction name, a spec kind without ``spec=``, and a
value of the wrong type are errors that list the valid values.
"""

from __future__ import annotations

from simdist.errors import UsageError
from simdist.reduce import Reduction
from simdist.world.options import ReductionChoice, read_reduction
from simdist.world.spec import GROUP_KINDS, ParallelSpec

__all__ = ["Chooser"]


class Chooser:
    """Maps a group's global ranks to its kind and reduction (see the module docstring)."""

    def __init__(self, choice: ReductionChoice, world_size: int, spec: ParallelSpec | None = None) -> None:
        if spec is not None and spec.world_size != world_size:
            raise UsageError(f"spec {spec.describe()} has {spec.world_size} ranks, the run {world_size}")
        self.world_size = world_size
        self.spec = spec
        self.table = read_reduction(choice, spec_given=spec is not None)
        self._kinds: dict[tuple[int, ...], str] = {}
        if spec is not None:
            for kind in GROUP_KINDS:
                for ranks in spec.groups(kind):
                    self._kinds.setdefault(tuple(sorted(ranks)), kind)

    def kind(self, ranks: tuple[int, ...]) -> str:
        """``world``, a spec kind, or ``group``."""
        if len(ranks) == self.world_size:
            return "world"
        return self._kinds.get(tuple(sorted(ranks)), "group")

    def __call__(self, ranks: tuple[int, ...]) -> tuple[str, Reduction]:
        kind = self.kind(ranks)
        return kind, self.table.for_group(kind, ranks)
