"""Reduction models: how a collective sums and where it rounds (pure functions of the per-rank tensors).

`base` defines `ReduceOp` and the `ReductionModel` interface; `models` the textbook orders (sequential,
tree, upcast, ring); `gloo` the order of torch's gloo backend found by experiment; `registry` builds a
model by name (`Reduction` lists the names).
"""

from simdist.reduce.base import AvgMode, ReduceOp, ReductionModel, Tensors, as_stacked, fold
from simdist.reduce.gloo import Gloo
from simdist.reduce.models import Ring, Sequential, Tree, Upcast
from simdist.reduce.registry import MODEL_NAMES, Reduction, make_model

__all__ = [
    "MODEL_NAMES",
    "AvgMode",
    "Gloo",
    "ReduceOp",
    "Reduction",
    "ReductionModel",
    "Ring",
    "Sequential",
    "Tensors",
    "Tree",
    "Upcast",
    "as_stacked",
    "fold",
    "make_model",
]
