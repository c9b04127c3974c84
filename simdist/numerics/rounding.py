"""Rounding modes for narrowing conversions beyond torch's round-to-nearest-even."""

from __future__ import annotations

import torch

from simdist.errors import UsageError


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down with probability proportional to the distance to each neighbour.

    A uniform random integer in ``[0, 2**16)`` is added to the 16 bits that
    bf16 drops, then they are truncated: exact values stay exact, and the
    result is unbiased in expectation. NaN and infinities pass through
    unchanged; a value within one bf16 ulp of the largest finite bf16 may
    round up to infinity, as stochastic rounding does in hardware.
    """
    if x.dtype != torch.float32 or dtype != torch.bfloat16:
        raise UsageError(f"stochastic rounding is implemented for fp32 -> bf16, got {x.dtype} -> {dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32)
    rounded = ((bits + noise) & ~0xFFFF).view(torch.float32)
    rounded = torch.where(torch.isfinite(x), rounded, x)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` correctly rounded (to nearest, ties to even) to ``dtype``.

    torch converts fp64 to bf16 and fp16 through fp32, rounding twice: fp64
    ``16973823.0`` becomes fp32 ``16973824.0`` (a tie), then bf16
    ``17039360.0``, where the correctly rounded bf16 value is ``16908288.0``.
    Here fp64 is first rounded to fp32 *to odd* (an inexact result keeps an
    odd last bit, so it can never sit on a bf16/fp16 tie), then to ``dtype``;
    rounding to odd with at least two extra bits makes the second rounding
    correct. Every other conversion is left to torch.
    """
    if x.dtype != torch.float64 or dtype not in (torch.bfloat16, torch.float16):
        return x.to(dtype)
    single = x.to(torch.float32)
    inexact = single.double() != x
    even = (single.view(torch.int32) & 1) == 0
    toward_x = torch.where(single.double() > x, float("-inf"), float("inf")).to(torch.float32)
    odd = torch.where(inexact & even & torch.isfinite(single), torch.nextafter(single, toward_x), single)
    return odd.to(dtype)
