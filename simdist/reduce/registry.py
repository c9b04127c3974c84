"""Reduction models by name: what ``--reduction`` and per-group settings accept.

`Reduction` is the registry: one member per model, its name and its class. Adding a model is one
`ReductionModel` subclass and one member here; `MODELS` (the ``{name: class}`` table), `MODEL_NAMES` and
`make_model` follow from it.
"""

from __future__ import annotations

import enum

from simdist.errors import UsageError
from simdist.reduce.base import ReductionModel
from simdist.reduce.gloo import Gloo
from simdist.reduce.models import Ring, Sequential, Tree, Upcast
from simdist.reduce.nccl import Nccl


class Reduction(enum.StrEnum):
    """The registered reduction models: each member is a model's name (its value) and its class (``model``)."""

    _value_: str
    model: type[ReductionModel]

    SEQUENTIAL = "sequential", Sequential
    RING = "ring", Ring
    TREE = "tree", Tree
    UPCAST = "upcast", Upcast
    GLOO = "gloo", Gloo
    NCCL = "nccl", Nccl

    def __new__(cls, name: str, model: type[ReductionModel]) -> Reduction:
        member = str.__new__(cls, name)
        member._value_ = name
        member.model = model
        return member


MODELS: dict[str, type[ReductionModel]] = {member.value: member.model for member in Reduction}
"""The ``{name: class}`` table `make_model` reads."""

MODEL_NAMES: tuple[str, ...] = tuple(MODELS)


def make_model(name: str, **params) -> ReductionModel:
    """Build a reduction model by name (``sequential``, ``ring``, ``tree``, ``upcast``, ``gloo``, ``nccl``)."""
    model = MODELS.get(name)
    if model is None:
        raise UsageError(f"unknown reduction model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    return model(**params)
