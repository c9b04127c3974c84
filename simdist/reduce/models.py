"""The textbook reduction models: `Sequential` (rank order), `Tree` (pairwise), `Upcast` (sum in a wider
dtype, round once) and `Ring` (chunked ring with a rotating start rank).

Each is a pure, vectorised function of the stacked per-rank tensors; every partial sum is rounded to the
tensor dtype unless the model says otherwise (see `simdist.reduce.base` for the ops and the rounding facts).
``PRODUCT`` uses the same order as the sum, with multiplication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simdist.numerics.rounding import round_to
from simdist.reduce.base import AvgMode, ReductionModel, Tensors, as_stacked, fold


@dataclass(frozen=True, repr=False)
class Sequential(ReductionModel):
    """Left fold in group-rank order: ``((x0 + x1) + x2) + ...``, each partial rounded."""

    avg: AvgMode = "postdiv"

    @property
    def name(self) -> str:
        return "sequential"

    def sum(self, tensors: Tensors) -> torch.Tensor:
        return fold(tensors)

    def product(self, tensors: Tensors) -> torch.Tensor:
        return fold(tensors, multiply=True)


@dataclass(frozen=True, repr=False)
class Tree(ReductionModel):
    """Balanced pairwise sum over ranks.

    Each level adds neighbours ``(x0+x1), (x2+x3), ...``; an odd one out is
    carried to the next level unchanged. For 4 ranks: ``(x0+x1) + (x2+x3)``;
    for 3: ``(x0+x1) + x2``.
    """

    avg: AvgMode = "postdiv"

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
class Upcast(ReductionModel):
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

    def sum(self, tensors: Tensors) -> torch.Tensor:
        return round_to(fold([t.to(self.acc_dtype) for t in tensors]), tensors[0].dtype)

    def product(self, tensors: Tensors) -> torch.Tensor:
        return round_to(fold([t.to(self.acc_dtype) for t in tensors], multiply=True), tensors[0].dtype)


@dataclass(frozen=True, repr=False)
class Ring(ReductionModel):
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
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    @property
    def name(self) -> str:
        order = "" if self.ring is None else f", ring={list(self.ring)}"
        return f"ring(chunk={self.chunk_size}, shift={self.shift}{order})"

    def sum(self, tensors: Tensors) -> torch.Tensor:
        return self._walk(tensors, multiply=False)

    def product(self, tensors: Tensors) -> torch.Tensor:
        return self._walk(tensors, multiply=True)

    def fold_order(self, n: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``index[j, e]``: the group rank whose value element ``e`` of an ``n``-rank sum adds at hop ``j``."""
        ring = tuple(range(n)) if self.ring is None else tuple(self.ring)
        if sorted(ring) != list(range(n)):
            raise ValueError(f"ring order {list(ring)} is not a permutation of the {n} group ranks")
        return _ring_index(numel, n, self.chunk_size, self.shift, ring, device)

    def _walk(self, tensors: Tensors, multiply: bool) -> torch.Tensor:
        stacked = as_stacked(tensors)
        n = stacked.shape[0]
        ring = list(range(n)) if self.ring is None else list(self.ring)
        if sorted(ring) != list(range(n)):
            raise ValueError(f"ring order {ring} is not a permutation of the {n} group ranks")
        flat = stacked.reshape(n, -1)
        index = _ring_index(flat.shape[1], n, self.chunk_size, self.shift, tuple(ring), flat.device)
        return fold(flat.gather(0, index), multiply).reshape(stacked.shape[1:])


_RING_INDEX_CACHE: dict[tuple, torch.Tensor] = {}
_RING_INDEX_BYTES = 1 << 29
"""The cached int64 indexes together stay below this (one index is ``8 * n * numel`` bytes: 256 MiB for 512
ranks of 65536 elements, so a sweep over sizes at large worlds would otherwise keep gigabytes)."""


def _ring_index(numel: int, n: int, chunk: int, shift: int, ring: tuple[int, ...], device) -> torch.Tensor:
    """``index[j, e]``: the group rank whose value element ``e`` adds at hop ``j``."""
    key = (numel, n, chunk, shift, ring, str(device))
    cached = _RING_INDEX_CACHE.get(key)
    if cached is None:
        start = ((torch.arange(numel) // chunk) + shift) % n
        positions = (start.unsqueeze(0) + torch.arange(n).unsqueeze(1)) % n
        cached = torch.tensor(ring)[positions].to(device)
        held = sum(index.numel() for index in _RING_INDEX_CACHE.values())
        if len(_RING_INDEX_CACHE) > 256 or 8 * (held + cached.numel()) > _RING_INDEX_BYTES:
            _RING_INDEX_CACHE.clear()
        _RING_INDEX_CACHE[key] = cached
    return cached
