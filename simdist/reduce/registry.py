"""Reductions by name: what ``--reduction`` and per-group settings accept.

`ReductionName` is the registry: one member per reduction, its name and its class. Adding a reduction is one
`Reduction` subclass and one member here; `REDUCTIONS` (the ``{name: class}`` table), `REDUCTION_NAMES` and
`make_reduction` follow from it.
"""

from __future__ import annotations

import enum

from simdist.errors import coerce
from simdist.reduce.base import Reduction
from simdist.reduce.gloo import Gloo
from simdist.reduce.nccl import Nccl
from simdist.reduce.textbook import Ring, Sequential, Tree, Upcast


class ReductionName(enum.StrEnum):
    """The registered reductions: each member is a reduction's name (its value) and its class (``reduction``)."""

    _value_: str
    reduction: type[Reduction]

    SEQUENTIAL = "sequential", Sequential
    RING = "ring", Ring
    TREE = "tree", Tree
    UPCAST = "upcast", Upcast
    GLOO = "gloo", Gloo
    NCCL = "nccl", Nccl

    def __new__(cls, name: str, reduction: type[Reduction]) -> ReductionName:
        member = str.__new__(cls, name)
        member._value_ = name
        member.reduction = reduction
        return member


REDUCTIONS: dict[str, type[Reduction]] = {member.value: member.reduction for member in ReductionName}
"""The ``{name: class}`` table `make_reduction` reads."""

REDUCTION_NAMES: tuple[str, ...] = tuple(REDUCTIONS)


def make_reduction(name: str, **params) -> Reduction:
    """Build a reduction by name (``sequential``, ``ring``, ``tree``, ``upcast``, ``gloo``, ``nccl``)."""
    return coerce(ReductionName, name, "reduction").reduction(**params)
