"""Which reduction model a group of the ``simdist`` backend uses.

A choice is one of:

* a model name (``"gloo"``, ``"ring"``, ... see `simdist.reduce.MODEL_NAMES`) or a
  `ReductionModel`: every group uses it;
* a mapping from group kind to a name or model. With a `ParallelSpec`, a group
  whose ranks are one of the spec's ``tp``/``dp``/``ep``/``etp``/``edp``/``pp``
  groups has that kind; the group of all ranks is ``world``; any other group is
  ``group``. Kinds not in the mapping use its ``"default"`` entry (else gloo);
* a callable ``(ranks) -> ReductionModel``, for a per-group choice.

`Chooser` resolves a group's global ranks to ``(kind, model)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from simdist.reduce import ReductionModel, make_model
from simdist.world.spec import GROUP_KINDS, ParallelSpec

ModelChoice = str | ReductionModel | Mapping[str, str | ReductionModel] | Callable[[tuple], ReductionModel]


def as_model(model: str | ReductionModel) -> ReductionModel:
    """A `ReductionModel` from a model or a model name."""
    return make_model(model) if isinstance(model, str) else model


class Chooser:
    """Maps a group's global ranks to its kind and reduction model (see the module docstring)."""

    def __init__(self, choice: ModelChoice, world_size: int, spec: ParallelSpec | None = None) -> None:
        if spec is not None and spec.world_size != world_size:
            raise ValueError(f"spec {spec.describe()} has {spec.world_size} ranks, the run {world_size}")
        self.world_size = world_size
        self.spec = spec
        self._kinds: dict[tuple[int, ...], str] = {}
        if spec is not None:
            for kind in GROUP_KINDS:
                for ranks in spec.groups(kind):
                    self._kinds.setdefault(tuple(sorted(ranks)), kind)
        self._call: Callable[[tuple], ReductionModel] | None = None
        self._models: dict[str, ReductionModel] = {}
        if isinstance(choice, (str, ReductionModel)):
            self._models["default"] = as_model(choice)
        elif isinstance(choice, Mapping):
            self._models = {kind: as_model(m) for kind, m in choice.items()}
            self._models.setdefault("default", as_model("gloo"))
        elif callable(choice):
            self._call = choice
        else:
            raise TypeError(f"model must be a name, a ReductionModel, a mapping or a callable, got {choice!r}")

    def kind(self, ranks: tuple[int, ...]) -> str:
        """``world``, a spec kind, or ``group``."""
        if len(ranks) == self.world_size:
            return "world"
        return self._kinds.get(tuple(sorted(ranks)), "group")

    def __call__(self, ranks: tuple[int, ...]) -> tuple[str, ReductionModel]:
        kind = self.kind(ranks)
        if self._call is not None:
            return kind, self._call(ranks)
        return kind, self._models.get(kind, self._models["default"])
