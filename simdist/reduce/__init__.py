"""Reductions: how a collective sums and where it rounds (pure functions of the per-rank tensors).

`plan` holds `FoldPlan`, an order precomputed once and applied as one copy, one strided view and the adds;
`base` defines `ReduceOp` and the `Reduction` interface (a reduction's order is its plan; its capabilities
are attributes); `textbook` the textbook orders (sequential, tree, upcast, ring); `gloo` the order of torch's
gloo backend found by experiment (`gloo.reduction`: the reduction `Gloo`; its schedule, one hop's arithmetic and
which elements it reads: `gloo.schedule`, `gloo.arith`, `gloo.layout`); `nccl` NCCL's order from its source
(`nccl.reduction`: `Nccl`; likewise `nccl.schedule`, `nccl.arith`, `nccl.layout`); `native` an optional C kernel
that applies fold plans with the same bits; `registry` builds a reduction by name (`ReductionName`: each name with
its class). Adding a reduction is one `Reduction` subclass and one `ReductionName` member; nothing else names its
class.
"""

from simdist.reduce.base import AvgMode, PerItemWarning, ReduceOp, Reduction, Tensors, as_stacked
from simdist.reduce.gloo import Gloo
from simdist.reduce.nccl import Nccl
from simdist.reduce.plan import FoldPlan, fold
from simdist.reduce.registry import REDUCTION_NAMES, REDUCTIONS, ReductionName, make_reduction
from simdist.reduce.textbook import Ring, Sequential, Tree, Upcast

__all__ = [
    "REDUCTIONS",
    "REDUCTION_NAMES",
    "AvgMode",
    "FoldPlan",
    "Gloo",
    "Nccl",
    "PerItemWarning",
    "ReduceOp",
    "Reduction",
    "ReductionName",
    "Ring",
    "Sequential",
    "Tensors",
    "Tree",
    "Upcast",
    "as_stacked",
    "fold",
    "make_reduction",
]
