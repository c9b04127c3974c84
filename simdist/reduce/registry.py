"""Reduction models by name: what ``--reduction`` and per-group settings accept."""

from __future__ import annotations

import enum

from simdist.reduce.base import ReductionModel
from simdist.reduce.models import Ring, Sequential, Tree, Upcast


class Reduction(enum.StrEnum):
    """The registered reduction models, by the name ``--reduction`` and per-group settings accept."""

    SEQUENTIAL = "sequential"
    RING = "ring"
    TREE = "tree"
    UPCAST = "upcast"
    GLOO = "gloo"
    NCCL = "nccl"


MODEL_NAMES: tuple[str, ...] = tuple(member.value for member in Reduction)


def make_model(name: str, **params) -> ReductionModel:
    """Build a reduction model by name (``sequential``, ``ring``, ``tree``, ``upcast``, ``gloo``, ``nccl``)."""
    if name == "sequential":
        return Sequential(**params)
    if name == "tree":
        return Tree(**params)
    if name == "ring":
        return Ring(**params)
    if name == "upcast":
        return Upcast(**params)
    if name == "gloo":
        from simdist.reduce.gloo import Gloo

        return Gloo(**params)
    if name == "nccl":
        from simdist.reduce.nccl import Nccl

        return Nccl(**params)
    raise ValueError(f"unknown reduction model {name!r}; valid: {', '.join(MODEL_NAMES)}")
