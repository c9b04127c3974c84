"""Strategies that draw exact values of one dtype and the per-rank tensors of a group: `float_values`, `tensors`,
`bit_patterns` and `pattern_tensor` (raw bits, NaN payloads and infinities included), `rank_tensors` (with exact
cancellation between ranks and sums on a rounding tie). Public through `simdist.testing.strategies`."""

from __future__ import annotations

import functools
import math

import torch
from hypothesis import strategies as st

from simdist.numerics.floats import float_format


def float_values(
    dtype: torch.dtype,
    *,
    min_exponent: int | None = None,
    max_exponent: int | None = None,
    subnormals: bool = True,
    nan: bool = False,
    infinity: bool = False,
) -> st.SearchStrategy[float]:
    """Exact values of ``dtype`` as Python floats.

    Normal values have exponents in ``[min_exponent, max_exponent]`` (default:
    the dtype's full range) and any significand; subnormals, signed zeros,
    NaN and infinities are mixed in when allowed.
    """
    fmt = float_format(dtype)
    lo = fmt.emin if min_exponent is None else max(min_exponent, fmt.emin)
    hi = fmt.emax if max_exponent is None else min(max_exponent, fmt.emax)
    frac_bits = fmt.precision - 1
    sign = st.sampled_from([1.0, -1.0])
    normal = st.builds(
        lambda s, e, m: s * (1.0 + m / 2.0**frac_bits) * 2.0**e,
        sign,
        st.integers(lo, hi),
        st.integers(0, 2**frac_bits - 1),
    )
    options = [normal, st.sampled_from([0.0, -0.0] + ([1.0, -1.0] if lo <= 0 <= hi else []))]
    if subnormals and (min_exponent is None or min_exponent <= fmt.emin):
        quantum = 2.0 ** (fmt.emin - frac_bits)
        options.append(st.builds(lambda s, m: s * m * quantum, sign, st.integers(1, 2**frac_bits - 1)))
    if nan:
        options.append(st.just(float("nan")))
    if infinity:
        options.append(st.sampled_from([float("inf"), float("-inf")]))
    return st.one_of(*options)


@functools.lru_cache(maxsize=256)
def tensors(dtype: torch.dtype, numel: int, elements: st.SearchStrategy[float] | None = None):
    """A 1-D tensor of ``numel`` values of ``dtype`` (default elements: `float_values` of finite values).

    Cached per argument tuple: `rank_tensors` draws one per rank, and building and validating a fresh
    strategy for each draw cost more than the draw itself.
    """
    elements = elements if elements is not None else float_values(dtype)
    return st.lists(elements, min_size=numel, max_size=numel).map(lambda v: torch.tensor(v, dtype=dtype))


_INT_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_patterns(dtype: torch.dtype) -> st.SearchStrategy[int]:
    """Raw bit patterns of ``dtype`` as signed integers of its width, covering every class of value.

    Arbitrary patterns, plus the corners arbitrary patterns rarely hit: both zeros, both infinities, the
    largest finite values, subnormals, the quiet NaN torch makes, and NaNs of either sign with any payload
    (quiet or signalling). `pattern_tensor` turns a list of them into a tensor.
    """
    width = torch.finfo(dtype).bits
    fmt = float_format(dtype)
    mantissa = fmt.precision - 1
    exponent_ones = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    sign_bit = 1 << (width - 1)

    def signed(raw: int) -> int:
        return raw - (1 << width) if raw & sign_bit else raw

    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, info.max, -info.max, info.tiny], dtype=dtype)
    special = st.sampled_from(specials.view(_INT_DTYPE[width // 8]).tolist())
    nan = st.builds(
        lambda sign, payload: signed((sign_bit if sign else 0) | exponent_ones | payload),
        st.booleans(),
        st.integers(1, (1 << mantissa) - 1),
    )
    subnormal = st.builds(
        lambda sign, m: signed((sign_bit if sign else 0) | m), st.booleans(), st.integers(1, (1 << mantissa) - 1)
    )
    anything = st.integers(-(1 << (width - 1)), (1 << (width - 1)) - 1)
    return st.one_of(anything, special, nan, subnormal)


def pattern_tensor(patterns: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` holding exactly the raw bit patterns ``patterns`` (see `bit_patterns`)."""
    width = torch.finfo(dtype).bits
    return torch.tensor(patterns, dtype=_INT_DTYPE[width // 8]).view(dtype)


@st.composite
def rank_tensors(
    draw,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    elements: st.SearchStrategy[float] | None = None,
) -> list[torch.Tensor]:
    """The per-rank tensors of one group, in group-rank order.

    Besides independent draws, two structured shapes are mixed in:

    * cancellation -- rank 1 holds rank 0's values negated, so the exact sum
      cancels and rounding errors of later partials are exposed;
    * ties -- rank 0 holds ``x`` and the others hold half an ulp of ``x``
      (for ``x`` a power-of-two multiple of 1), so sums land on rounding ties.
    """
    elements = elements if elements is not None else float_values(dtype)
    shape = draw(st.sampled_from(["independent", "independent", "cancellation", "ties"]))
    per_rank = [draw(tensors(dtype, numel, elements)) for _ in range(group_size)]
    if shape == "cancellation" and group_size >= 2:
        per_rank[1] = -per_rank[0]
    elif shape == "ties":
        fmt = float_format(dtype)
        base = draw(st.integers(-8, 8))
        x = draw(tensors(dtype, numel, st.sampled_from([1.0, -1.0, 1.5, 3.0]))) * 2.0**base
        _, exponent = torch.frexp(x.float())
        half_ulp = torch.ldexp(torch.ones(numel), exponent - 1 - fmt.precision).to(dtype)
        per_rank = [x] + [half_ulp.clone() for _ in range(group_size - 1)]
    return per_rank
