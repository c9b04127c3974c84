"""How one step of NCCL's reduction combines values: the op's function, AVG's premultiply factor and the
premultiply fused with the first add (one rounding), as NCCL's ``reduceCopy`` applies them (sources in order, the
rank's own value first). The order of the steps is `simdist.reduce.nccl.schedule`'s;
`simdist.reduce.nccl.reduction.Nccl`
walks it with these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from simdist.errors import UsageError
from simdist.numerics.rounding import round_to
from simdist.reduce.base import ReduceOp


def premul_scale(n: int, dtype: torch.dtype) -> torch.Tensor:
    """NCCL's AVG factor for floating ``dtype``: ``1/n`` as a double, then float, then ``dtype``."""
    if dtype == torch.float64:
        return torch.tensor(1.0 / n, dtype=torch.float64)
    return torch.tensor(1.0 / n, dtype=torch.float64).to(torch.float32).to(dtype)


def combine_op(op: ReduceOp, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return torch.add
    if getattr(ReduceOp, "PRODUCT", None) is not None and op is ReduceOp.PRODUCT:
        return torch.mul
    floating = dtype.is_floating_point
    if op is ReduceOp.MAX:
        return torch.fmax if floating else torch.maximum
    if op is ReduceOp.MIN:
        return torch.fmin if floating else torch.minimum
    raise UsageError(f"unsupported reduce op {op!r}")


def fma_round(x: torch.Tensor, s: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """``x * s + acc`` rounded once to the dtype (fp32, bf16 or fp16), as a fused multiply-add does.

    The product is exact in fp64; the sum is split into its fp64 rounding and
    the exact error (TwoSum), turned into the round-to-odd fp64 value, and
    rounded from there, which is correct for any format of 24 bits or fewer.
    """
    dtype = x.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UsageError(f"a fused premultiply is modelled for fp32, bf16 and fp16, not {dtype}")
    p = x.double() * s.double()
    a = acc.double()
    total = p + a
    back = total - p
    error = (p - (total - back)) + (a - back)
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.where(error > 0, float("inf"), float("-inf")).to(torch.float64)
    odd = torch.where((error != 0) & even & torch.isfinite(total), torch.nextafter(total, toward), total)
    return round_to(odd, dtype)


@dataclass(frozen=True)
class StepArithmetic:
    """How one step combines values: a rank's own value alone, own value plus the first received
    partial, and a further received partial (NCCL's reduceCopy: sources in order, own value first)."""

    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scale: torch.Tensor | None = None  # set for a premultiply fused with the first add

    def own(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.scale is None else x * self.scale

    def own_plus(self, x: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        return self.combine(x, received) if self.scale is None else fma_round(x, self.scale, received)

    def plus(self, acc: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        return self.combine(acc, received)
