"""Rounding modes for narrowing conversions beyond torch's round-to-nearest-even."""

from __future__ import annotations

import torch


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down with probability proportional to the distance to each neighbour.

    A uniform random integer in ``[0, 2**16)`` is added to the 16 bits that
    bf16 drops, then they are truncated: exact values stay exact, and the
    result is unbiased in expectation. NaN and infinities pass through
    unchanged; a value within one bf16 ulp of the largest finite bf16 may
    round up to infinity, as stochastic rounding does in hardware.
    """
    if x.dtype != torch.float32 or dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding is implemented for fp32 -> bf16, got {x.dtype} -> {dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32)
    rounded = ((bits + noise) & ~0xFFFF).view(torch.float32)
    rounded = torch.where(torch.isfinite(x), rounded, x)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero
