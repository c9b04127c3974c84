"""Which reduction model a group of the ``simdist`` backend uses.

A choice is one of:

* a model name (``"gloo"``, ``"ring"``, ... see `simdist.reduce.MODEL_NAMES`) or a
  `ReductionModel`: every group uses it;
* a mapping from group kind to a name or model. With a `ParallelSpec`, a group
  whose ranks are one of the spec's ``tp``/``dp``/``ep``/``etp``/``edp``/``pp``
  groups has that kind; the group of all ranks is ``world``; any other group is
  ``group``. Kinds not in the mapping use its ``"default"`` entry (else `DEFAULT_REDUCTION`, gloo);
* a callable ``(ranks) -> ReductionModel``, for a per-group choice.

`Chooser` resolves a group's global ranks to ``(kind, model)``. Every choice is checked when the
`Chooser` is made, so a typo fails at once instead of silently falling back to the default: an unknown
kind (``{"tpp": "ring"}``), an unknown model name, a spec kind without ``spec=``, and a value of the wrong
type are errors that list the valid values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from simdist.errors import UsageError
from simdist.reduce import MODEL_NAMES, ReductionModel, make_model
from simdist.world.options import DEFAULT_REDUCTION
from simdist.world.spec import GROUP_KINDS, ParallelSpec

ModelChoice = str | ReductionModel | Mapping[str, str | ReductionModel] | Callable[[tuple], ReductionModel]

MAP_KINDS: tuple[str, ...] = (*GROUP_KINDS, "world", "group", "default")
"""The keys a kind -> model mapping accepts."""


def as_model(model: str | ReductionModel, where: str = "model") -> ReductionModel:
    """A `ReductionModel` from a model or a model name; anything else is a ``TypeError`` naming the valid values."""
    if isinstance(model, ReductionModel):
        return model
    if isinstance(model, str):
        if model not in MODEL_NAMES:
            raise UsageError(f"{where}: unknown reduction model {model!r}; valid names: {', '.join(MODEL_NAMES)}")
        return make_model(model)
    raise TypeError(
        f"{where} must be a model name ({', '.join(MODEL_NAMES)}) or a ReductionModel, got {type(model).__name__} "
        f"{model!r}"
    )


def _check_map(choice: Mapping, spec: ParallelSpec | None) -> None:
    for kind in choice:
        if not isinstance(kind, str) or kind not in MAP_KINDS:
            raise UsageError(f"model map: unknown group kind {kind!r}; valid kinds: {', '.join(MAP_KINDS)}")
    needs_spec = [kind for kind in choice if kind in GROUP_KINDS]
    if needs_spec and spec is None:
        raise UsageError(
            f"model map: kind(s) {', '.join(needs_spec)} name groups of a ParallelSpec; pass spec= "
            "(without it only 'world', 'group' and 'default' can match)"
        )


class Chooser:
    """Maps a group's global ranks to its kind and reduction model (see the module docstring)."""

    def __init__(self, choice: ModelChoice, world_size: int, spec: ParallelSpec | None = None) -> None:
        if spec is not None and spec.world_size != world_size:
            raise UsageError(f"spec {spec.describe()} has {spec.world_size} ranks, the run {world_size}")
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
            _check_map(choice, spec)
            self._models = {kind: as_model(m, f"model map entry {kind!r}") for kind, m in choice.items()}
            self._models.setdefault("default", as_model(DEFAULT_REDUCTION))
        elif callable(choice):
            self._call = choice
        else:
            raise TypeError(
                f"model must be a model name ({', '.join(MODEL_NAMES)}), a ReductionModel, a mapping from group "
                f"kind ({', '.join(MAP_KINDS)}) to one of those, or a callable (ranks) -> ReductionModel; "
                f"got {type(choice).__name__} {choice!r}"
            )

    def kind(self, ranks: tuple[int, ...]) -> str:
        """``world``, a spec kind, or ``group``."""
        if len(ranks) == self.world_size:
            return "world"
        return self._kinds.get(tuple(sorted(ranks)), "group")

    def __call__(self, ranks: tuple[int, ...]) -> tuple[str, ReductionModel]:
        kind = self.kind(ranks)
        if self._call is not None:
            model = self._call(ranks)
            if not isinstance(model, ReductionModel):
                raise TypeError(
                    f"the model callable returned {type(model).__name__} {model!r} for ranks {ranks}, "
                    "not a ReductionModel"
                )
            return kind, model
        return kind, self._models.get(kind, self._models["default"])
