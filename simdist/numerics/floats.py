"""Floating-point facts used everywhere: raw bits, ulps, unit roundoff, exact rounding.

Comparisons in simdist are bit for bit first (`bits` gives the raw bit patterns
of a tensor of any dtype, bool and integers included; `bitwise_equal` compares
them, so ``-0.0 != +0.0`` and NaNs compare by payload), and only then
in ulps (`ulp_distance`: how many representable values lie between two
numbers of one dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from simdist.errors import UsageError

_INT_OF_WIDTH = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


@dataclass(frozen=True)
class FloatFormat:
    """Binary floating-point format parameters: precision ``p`` (with the hidden bit), ``emin``, ``emax``."""

    dtype: torch.dtype
    precision: int
    emin: int
    emax: int

    @property
    def unit_roundoff(self) -> float:
        """``u = 2**-p``: the largest relative error of one round-to-nearest."""
        return 2.0**-self.precision


def float_format(dtype: torch.dtype) -> FloatFormat:
    """The `FloatFormat` of a torch floating dtype."""
    if not dtype.is_floating_point:
        raise UsageError(f"{dtype} is not a floating dtype")
    info = torch.finfo(dtype)
    precision = 1 - round(math.log2(info.eps))
    return FloatFormat(dtype, precision, round(math.log2(info.tiny)), math.floor(math.log2(info.max)))


def unit_roundoff(dtype: torch.dtype) -> float:
    """``2**-p`` for ``dtype`` (bf16: 2**-8, fp16: 2**-11, fp32: 2**-24, fp64: 2**-53)."""
    return float_format(dtype).unit_roundoff


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t`` as a contiguous signed integer tensor of the same element width and shape.

    Every dtype torch stores element by element: floating (the 8-bit floats too), integer, unsigned and bool.
    The dtype is reinterpreted *before* any copy: copying a bool tensor writes 0 or 1, so a byte that is
    neither (gloo's SUM of bools leaves counts) would otherwise be lost; float copies keep NaN payloads, but
    integer copies are bit-exact by definition. A complex tensor gives its components' bits (a trailing
    dimension of 2, real then imaginary). Quantized tensors are refused: their values need a scale and a zero
    point beside the bits.
    """
    if t.is_quantized:
        raise UsageError(f"bits: {t.dtype} is quantized (its bits are not its values); use t.int_repr()")
    t = t.detach().resolve_conj().resolve_neg()
    if t.is_complex():
        return bits(torch.view_as_real(t))
    return t.view(_INT_OF_WIDTH[t.element_size() * 8]).contiguous()


def from_bits(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` whose `bits` are ``raw`` (a signed integer tensor of ``dtype``'s width; for a
    complex ``dtype``, its components' width with a trailing dimension of 2): the inverse of `bits`, a view."""
    if dtype.is_complex:
        real = torch.view_as_real(torch.empty(0, dtype=dtype)).dtype
        return torch.view_as_complex(from_bits(raw, real).contiguous())
    width = torch.empty(0, dtype=dtype).element_size() * 8
    if raw.dtype != _INT_OF_WIDTH[width]:
        raise UsageError(f"from_bits: {dtype} needs {_INT_OF_WIDTH[width]} bits, got {raw.dtype}")
    return raw.view(dtype)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and bit patterns."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.detach().cpu()), bits(b.detach().cpu()))


def ordered_integers(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns as int64 integers monotone in the float value (both zeros map to 0): the difference of two
    is the number of representable values between them."""
    raw = bits(t)
    width = t.element_size() * 8
    sign = raw >> (width - 1)  # 0, or -1 for a negative value
    # negatives: raw ^ magnitude bits, minus -1, is -(magnitude); exact in the raw width, then widened
    return ((raw ^ (sign & ((1 << (width - 1)) - 1))) - sign).to(torch.int64)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise ``|ordered_integers(a) - ordered_integers(b)|`` (int64, same dtype and shape): defined for every
    pair of values and never negative.

    For two finite values it is the number of representable values of the dtype between them (``+0`` and ``-0``
    are 0 apart: equal values). Infinities and NaNs continue the same order of bit patterns, as IEEE 754's
    totalOrder does: ``max`` and ``inf`` are 1 apart, a NaN lies beyond the infinity of its sign by its payload,
    so two NaNs are 0 apart only with the same sign and payload and a NaN is never 0 apart from a number.
    So a distance of 0 means identical bits or two zeros; `bitwise_equal` is the test that tells the zeros apart.
    Only fp64 can have a distance beyond int64 (values of opposite signs near the ends of the order); it is
    reported as ``2**63 - 1``.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        raise UsageError(
            f"ulp_distance needs one dtype and shape, got {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}"
        )
    a, b = a.detach().cpu(), b.detach().cpu()
    oa, ob = ordered_integers(a), ordered_integers(b)
    if a.element_size() < 8:  # at most 2 * (2**31 - 1): no overflow in int64
        return (oa - ob).abs()
    big = torch.iinfo(torch.int64).max
    ma, mb = oa.abs(), ob.abs()  # magnitudes <= 2**63 - 1: abs never overflows
    opposite = (oa < 0) != (ob < 0)
    across = torch.where(ma > big - mb, big, ma + mb)  # |oa| + |ob|, saturated
    return torch.where(opposite, across, (oa - ob).abs())


def round_exact(value: Fraction | int | float, dtype: torch.dtype) -> float:
    """``value`` correctly rounded (to nearest, ties to even) to ``dtype``, returned as a Python float.

    Overflow gives ``inf`` exactly as IEEE-754 prescribes (values at or beyond
    ``max + ulp(max)/2`` round to infinity); gradual underflow is honoured.
    """
    fmt = float_format(dtype)
    x = Fraction(value)
    if x == 0:
        return 0.0
    sign = -1 if x < 0 else 1
    x = abs(x)
    exponent = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** exponent > x:
        exponent -= 1
    quantum = Fraction(2) ** (max(exponent, fmt.emin) - (fmt.precision - 1))
    scaled = x / quantum
    rounded = round(scaled)  # Fraction.__round__ rounds half to even
    result = rounded * quantum
    if result >= Fraction(2) ** (fmt.emax + 1):
        return sign * math.inf
    return sign * float(result)
