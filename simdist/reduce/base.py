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
* ``PRODUCT`` -- the model's order with multiplication in place of addition
  (`ReductionModel.product`; a model that does not define it refuses ``PRODUCT``).
* ``MAX`` / ``MIN`` -- element-wise; order-free; NaN propagates (a model may
  override this: `simdist.reduce.gloo.Gloo` folds with gloo's comparison).
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

import torch

AvgMode = Literal["postdiv", "premul"]


Tensors = torch.Tensor | Sequence[torch.Tensor]
"""Per-rank tensors of one group: stacked on dim 0, or a sequence, in group-rank order."""


class ReduceOp(enum.Enum):
    """Reduction operations of a collective (mirrors ``torch.distributed.ReduceOp``)."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
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
    gloo_rules: bool = False
    """Whether front ends apply torch's gloo backend rules (shape checks, PREMUL_SUM) to collectives on this model."""

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

    def product(self, tensors: Tensors) -> torch.Tensor:
        """Multiply the per-rank ``tensors`` in this model's order, rounding each partial product."""
        raise ValueError(f"the {self.name} reduction model does not model ReduceOp.PRODUCT")

    def reduce(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """The reduced tensor for ``op`` over the per-rank ``tensors`` (stacked or a sequence)."""
        n = len(tensors)
        if n == 0:
            raise ValueError("a reduction needs the tensors of at least one rank")
        if op is ReduceOp.SUM:
            return self.sum(tensors)
        if op is ReduceOp.PRODUCT:
            return self.product(tensors)
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


def fold(ordered: Tensors, multiply: bool = False) -> torch.Tensor:
    """Left fold over the leading dimension, rounding each partial sum (or product) to the tensor dtype."""
    parts = ordered.unbind(0) if isinstance(ordered, torch.Tensor) else ordered  # one call, not n indexings
    if len(parts) == 1:
        return parts[0].clone()
    if multiply:
        acc = parts[0] * parts[1]
        for part in parts[2:]:
            acc *= part
        return acc
    acc = parts[0] + parts[1]
    for part in parts[2:]:
        acc += part
    return acc


def may_hold_nan(t: torch.Tensor) -> bool:
    """False only if ``t`` holds no NaN: one float sum (cheaper than ``isnan().any()``; inf - inf may give a
    false alarm, never a miss). Models use it to take their exact NaN-bits path only where a NaN may be."""
    if not t.is_floating_point() or t.numel() == 0:
        return False
    return math.isnan(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).item())
