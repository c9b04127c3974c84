"""The textbook reductions: `Sequential` (rank order), `Tree` (pairwise), `Upcast` (sum in a wider
dtype, round once) and `Ring` (chunked ring with a rotating start rank).

Each is a pure, vectorised function of the stacked per-rank tensors; every partial sum is rounded to the
tensor dtype unless the reduction says otherwise (see `simdist.reduce.base` for the ops and the rounding facts).
``PRODUCT`` uses the same order as the sum, with multiplication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simdist.errors import UsageError
from simdist.numerics.rounding import round_to
from simdist.reduce.base import AvgMode, Reduction, Tensors, as_stacked
from simdist.reduce.plan import FoldPlan, Hops, fold


@dataclass(frozen=True, repr=False)
class Sequential(Reduction):
    """Left fold in group-rank order: ``((x0 + x1) + x2) + ...``, each partial rounded."""

    avg: AvgMode = "postdiv"

    @property
    def name(self) -> str:
        return "sequential"

    def fold_plan(self, n: int, numel: int, dtype: torch.dtype) -> FoldPlan:
        return FoldPlan.uniform(range(n), numel)


@dataclass(frozen=True, repr=False)
class Tree(Reduction):
    """Balanced pairwise sum over ranks.

    Each level adds neighbours ``(x0+x1), (x2+x3), ...``; an odd one out is
    carried to the next level unchanged. For 4 ranks: ``(x0+x1) + (x2+x3)``;
    for 3: ``(x0+x1) + x2``.
    """

    avg: AvgMode = "postdiv"
    position_free = True  # the same pairs at every element: a stacked [n, *batch, *shape] tensor reduces as is

    @property
    def name(self) -> str:
        return "tree"

    def sum(self, tensors: Tensors) -> torch.Tensor:
        return self._pairwise(tensors, torch.add)

    def product(self, tensors: Tensors) -> torch.Tensor:
        return self._pairwise(tensors, torch.mul)

    @staticmethod
    def _pairwise(tensors: Tensors, combine) -> torch.Tensor:
        level = as_stacked(tensors)
        while level.shape[0] > 1:
            pairs = level.shape[0] // 2
            combined = combine(level[0 : 2 * pairs : 2], level[1 : 2 * pairs : 2])
            level = torch.cat([combined, level[2 * pairs :]]) if level.shape[0] % 2 else combined
        return level[0].clone()


@dataclass(frozen=True, repr=False)
class Upcast(Reduction):
    """Left fold in group-rank order in ``acc_dtype``, rounded once to the tensor dtype.

    With ``acc_dtype=torch.float64`` and inputs whose partial sums are exact
    in fp64 (a span of at most ``53 - p - 3`` binades for ``p``-bit inputs on
    up to 8 ranks), the result is the correctly rounded sum: the final
    rounding avoids torch's double rounding of fp64 -> bf16 (`round_to`).
    """

    acc_dtype: torch.dtype = torch.float32
    avg: AvgMode = "postdiv"

    @property
    def name(self) -> str:
        return f"upcast({str(self.acc_dtype).removeprefix('torch.')})"

    def fold_plan(self, n: int, numel: int, dtype: torch.dtype) -> FoldPlan:
        return FoldPlan.uniform(range(n), numel)

    def fold_hops(self, hops: Hops, multiply: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fold in ``acc_dtype``, rounded once to the members' dtype."""
        result = round_to(fold([t.to(self.acc_dtype) for t in hops], multiply), hops[0].dtype)
        return result if out is None else out.copy_(result)


@dataclass(frozen=True, repr=False)
class Ring(Reduction):
    """NCCL-style ring: chunked, with a start rank that rotates with the chunk.

    The flat tensor is cut into chunks of ``chunk_size`` elements. Chunk ``c``
    is reduced by a walk round the ring that starts at ring position
    ``(c + shift) mod n`` and visits every rank once, each hop adding the next
    rank's value and rounding to the dtype. ``ring`` lists group ranks in ring
    order (default ``0..n-1``). NCCL's ring all-reduce ends chunk ``c`` at the
    rank that owns it, so it starts one position later: ``shift=1``.
    """

    chunk_size: int = 1
    shift: int = 1
    ring: tuple[int, ...] | None = None
    avg: AvgMode = "postdiv"

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise UsageError(f"chunk_size must be >= 1, got {self.chunk_size}")

    @property
    def name(self) -> str:
        order = "" if self.ring is None else f", ring={list(self.ring)}"
        return f"ring(chunk={self.chunk_size}, shift={self.shift}{order})"

    def fold_plan(self, n: int, numel: int, dtype: torch.dtype) -> FoldPlan:
        """Chunk ``c`` adds ``ring[(c + shift + j) mod n]`` at hop ``j``: chunks repeat with period ``n``."""
        ring = tuple(range(n)) if self.ring is None else tuple(self.ring)
        if sorted(ring) != list(range(n)):
            raise UsageError(f"ring order {list(ring)} is not a permutation of the {n} group ranks")
        chunks = -(-numel // self.chunk_size)
        period = max(1, min(n, chunks))
        rows = tuple(ring[(self.shift + t) % n] for t in range(n + period - 1))
        if period == 1:
            return FoldPlan.uniform(rows, numel)
        return FoldPlan(n, numel, self.chunk_size, period, rows)
