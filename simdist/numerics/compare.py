"""Comparing tensors from two runs: bitwise first, then ulps, relative error and differing fraction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simdist.numerics.floats import bits, ulp_distance


@dataclass(frozen=True)
class Difference:
    """How ``actual`` departs from ``expected``, measured in ``expected``'s dtype."""

    bitwise_equal: bool
    max_ulp: int
    fraction_differing: float
    max_relative: float
    numel: int

    def __str__(self) -> str:
        if self.bitwise_equal:
            return "bitwise equal"
        return f"max {self.max_ulp} ulp, {100 * self.fraction_differing:.1f}% differ, rel {self.max_relative:.2e}"


def difference(actual: torch.Tensor, expected: torch.Tensor) -> Difference:
    """Compare ``actual`` with ``expected``, after casting ``actual`` to ``expected``'s dtype.

    The cast is exact when ``expected`` is at least as wide (a BF16 or FP32
    capture against an FP32 or FP64 oracle). ``bitwise_equal`` compares raw
    bits (so ``-0.0 != +0.0``); ``max_ulp`` counts representable values of
    ``expected.dtype`` between the two (a NaN on one side only counts as a
    differing element but adds no ulps); ``max_relative`` is
    ``|a - e| / |e|`` over finite non-zero ``e``, in fp64.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    expected = expected.detach().cpu()
    actual = actual.detach().cpu().to(expected.dtype)
    differing = bits(actual) != bits(expected)
    ulps = ulp_distance(actual, expected)
    e64, a64 = expected.double(), actual.double()
    usable = (e64 != 0) & torch.isfinite(e64)
    rel = ((a64 - e64).abs() / e64.abs())[usable]
    numel = expected.numel()
    return Difference(
        bitwise_equal=not bool(differing.any()),
        max_ulp=int(ulps.max().item()) if numel else 0,
        fraction_differing=float(differing.float().mean().item()) if numel else 0.0,
        max_relative=float(rel.max().item()) if rel.numel() else 0.0,
        numel=numel,
    )
