"""Reduction models: how a collective sums, and where it rounds.

A reduction model is a pure, vectorised function from the per-rank tensors of
one group (stacked along dim 0 in group-rank order) to the reduced tensor. It
never looks at threads, devices or arrival order, so the same model gives the
same bits on CPU and CUDA and can be property-tested on its own.

Every model rounds each partial sum to the dtype of the tensors unless it says
otherwise. Additions run as torch element-wise adds in that dtype: for fp32
that is one IEEE-754 round-to-nearest-even addition; for bf16 and fp16 torch
adds in fp32 and rounds once to the narrow type, which equals the correctly
rounded narrow sum because fp32 carries more than ``2p + 2`` bits of the narrow
format (double rounding is innocuous for a single addition).

Operations (`ReduceOp`):

* ``SUM`` -- the model's summation order.
* ``AVG`` -- the model's SUM, then one division by the group size in the
  tensor dtype (``postdiv``, one extra rounding); or, with ``avg="premul"``,
  each input multiplied by ``1/n`` rounded to the dtype, before the SUM
  (NCCL's ``ncclAvg`` pre-multiplies floating types in this way).
* ``MAX`` / ``MIN`` -- element-wise; order-free; NaN propagates.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from simdist.rounding import round_to

AvgMode = Literal["postdiv", "premul"]
Tensors = torch.Tensor | Sequence[torch.Tensor]
"""Per-rank tensors of one group: stacked on dim 0, or a sequence, in group-rank order."""


class ReduceOp(enum.Enum):
    """Reduction operations of a collective (mirrors ``torch.distributed.ReduceOp``)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"

    @classmethod
    def coerce(cls, op: object) -> ReduceOp:
        """Accept a `ReduceOp`, its name, or a ``torch.distributed.ReduceOp``."""
        if isinstance(op, cls):
            return op
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unsupported reduce op {op!r}; valid: {', '.join(o.name for o in cls)}") from None


class ReductionModel(ABC):
    """How a group reduces: a summation order plus the dtype each partial is rounded to."""

    avg: AvgMode = "postdiv"

    @property
    @abstractmethod
    def name(self) -> str:
        """A short name that identifies the model and its parameters."""

    @abstractmethod
    def sum(self, tensors: Tensors) -> torch.Tensor:
        """Sum the per-rank ``tensors`` (group-rank order) with this model's order and rounding.

        ``tensors`` is either one stacked tensor of shape ``[n, *shape]`` or a
        sequence of ``n`` tensors of one shape; both give the same bits.
        """

    def reduce(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """The reduced tensor for ``op`` over the per-rank ``tensors`` (stacked or a sequence)."""
        n = len(tensors)
        if n == 0:
            raise ValueError("a reduction needs the tensors of at least one rank")
        if op is ReduceOp.SUM:
            return self.sum(tensors)
        if op is ReduceOp.MAX:
            return torch.amax(as_stacked(tensors), dim=0)  # propagates NaN
        if op is ReduceOp.MIN:
            return torch.amin(as_stacked(tensors), dim=0)  # propagates NaN
        if op is ReduceOp.AVG:
            if self.avg == "premul":
                stacked = as_stacked(tensors)
                return self.sum(stacked * torch.tensor(1.0 / n, dtype=stacked.dtype, device=stacked.device))
            return self.sum(tensors) / n
        raise ValueError(f"unsupported reduce op {op!r}")

    def reduce_scatter(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Per-rank output blocks, shape ``[n, numel / n]``: block ``i`` goes to group rank ``i``.

        By default this is the matching slice of `reduce` on the flat tensor, so
        ``all_gather(reduce_scatter(x)) == all_reduce(x)`` bit for bit.
        """
        n = len(tensors)
        flat = as_stacked(tensors).reshape(n, -1)
        if flat.shape[1] % n:
            raise ValueError(f"reduce_scatter needs numel divisible by the group size {n}, got {flat.shape[1]}")
        return self.reduce(flat, op).reshape(n, -1)

    def __repr__(self) -> str:
        return self.name


def as_stacked(tensors: Tensors) -> torch.Tensor:
    """Per-rank tensors as one ``[n, *shape]`` tensor (no copy when already stacked)."""
    return tensors if isinstance(tensors, torch.Tensor) else torch.stack(list(tensors))


def fold(ordered: Tensors) -> torch.Tensor:
    """Left fold over the leading dimension, rounding each partial sum to the tensor dtype."""
    if len(ordered) == 1:
        return ordered[0].clone()
    acc = ordered[0] + ordered[1]
    for i in range(2, len(ordered)):
        acc += ordered[i]
    return acc


@dataclass(frozen=True, repr=False)
class Sequential(ReductionModel):
    """Left fold in group-rank order: ``((x0 + x1) + x2) + ...``, each partial rounded."""

    avg: AvgMode = "postdiv"

    @property
    def name(self) -> str:
        return "sequential"

    def sum(self, tensors: Tensors) -> torch.Tensor:
        return fold(tensors)


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
        level = as_stacked(tensors)
        while level.shape[0] > 1:
            pairs = level.shape[0] // 2
            summed = level[0 : 2 * pairs : 2] + level[1 : 2 * pairs : 2]
            level = torch.cat([summed, level[2 * pairs :]]) if level.shape[0] % 2 else summed
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
        stacked = as_stacked(tensors)
        n = stacked.shape[0]
        ring = list(range(n)) if self.ring is None else list(self.ring)
        if sorted(ring) != list(range(n)):
            raise ValueError(f"ring order {ring} is not a permutation of the {n} group ranks")
        flat = stacked.reshape(n, -1)
        index = _ring_index(flat.shape[1], n, self.chunk_size, self.shift, tuple(ring), flat.device)
        return fold(flat.gather(0, index)).reshape(stacked.shape[1:])


_RING_INDEX_CACHE: dict[tuple, torch.Tensor] = {}


def _ring_index(numel: int, n: int, chunk: int, shift: int, ring: tuple[int, ...], device) -> torch.Tensor:
    """``index[j, e]``: the group rank whose value element ``e`` adds at hop ``j``."""
    key = (numel, n, chunk, shift, ring, str(device))
    cached = _RING_INDEX_CACHE.get(key)
    if cached is None:
        start = ((torch.arange(numel) // chunk) + shift) % n
        positions = (start.unsqueeze(0) + torch.arange(n).unsqueeze(1)) % n
        cached = torch.tensor(ring)[positions].to(device)
        if len(_RING_INDEX_CACHE) > 256:
            _RING_INDEX_CACHE.clear()
        _RING_INDEX_CACHE[key] = cached
    return cached


MODEL_NAMES: tuple[str, ...] = ("sequential", "ring", "tree", "upcast", "gloo")


def make_model(name: str, **params) -> ReductionModel:
    """Build a reduction model by name (``sequential``, ``ring``, ``tree``, ``upcast``, ``gloo``)."""
    if name == "sequential":
        return Sequential(**params)
    if name == "tree":
        return Tree(**params)
    if name == "ring":
        return Ring(**params)
    if name == "upcast":
        return Upcast(**params)
    if name == "gloo":
        from simdist.gloo_model import Gloo

        return Gloo(**params)
    raise ValueError(f"unknown reduction model {name!r}; valid: {', '.join(MODEL_NAMES)}")
