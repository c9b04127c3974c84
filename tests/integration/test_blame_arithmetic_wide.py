"""Arithmetic sites whose FP32 terms span more than FP64's 53 bits: an ``add`` is measured against the exact sum
(a TwoSum pair), its figures equal to those of exact rational arithmetic (`fractions.Fraction`), and a promoted
one is the exact sum rounded once (`simdist.attribution.arithmetic.round_pair`)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from simdist.attribution import blame_target
from simdist.attribution.arithmetic import round_pair

FP32_BITS, FP32_MIN_EXP = 24, -126


def _floor_log2(x: Fraction) -> int:
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    return e if x >= Fraction(2) ** e else e - 1


def _spacing(x: Fraction) -> Fraction:
    """The FP32 spacing at ``|x|`` (the subnormal spacing below 2**-126)."""
    e = max(_floor_log2(x), FP32_MIN_EXP) if x else FP32_MIN_EXP
    return Fraction(2) ** (e - FP32_BITS + 1)


def _round_fp32(x: Fraction) -> Fraction:
    """``x`` rounded to nearest FP32, ties to even (Python's ``round`` of a Fraction rounds half to even)."""
    step = _spacing(x)
    return round(x / step) * step


def _fp32(mantissa: int, exponent: int, negative: bool) -> float:
    value = float(Fraction(mantissa) * Fraction(2) ** (exponent - FP32_BITS + 1))
    return -value if negative else value


FP32_VALUES = st.builds(
    _fp32, st.integers(2**23, 2**24 - 1), st.integers(-70, 70), st.booleans()
)  # normal FP32 values over 141 binades: sums of two span up to 164 bits


def _add(a: list[float], b: list[float]) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32)  # LINE_ADD


@given(st.lists(st.tuples(FP32_VALUES, FP32_VALUES), min_size=1, max_size=8))
@example([(2.0**30, 2.0**-30), (1.0, -(2.0**-60)), (3.0, 2.0**-24 * 1.5)])  # spans of 61 and 61 bits; a tie
def test_an_fp32_add_spanning_more_than_53_bits_has_exact_figures(pairs):
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    out: list[torch.Tensor] = []
    report = blame_target(lambda: out.append(_add(a, b)), ops="add")  # no rank threads: one op, measured
    (site,) = [s for s in report.sites if s.kind == "arith"]
    (result,) = out
    ulps, scaled, rel, mass = [], [], [], Fraction(0)
    for r, x, y in zip(result.tolist(), a, b, strict=True):
        exact = Fraction(x) + Fraction(y)
        assert Fraction(r) == _round_fp32(exact)  # the op itself is one FP32 rounding
        err = abs(Fraction(r) - exact)
        terms = abs(Fraction(x)) + abs(Fraction(y))
        ulps.append(err / _spacing(exact))
        scaled.append(err / terms)
        if exact:
            rel.append(err / abs(exact))
        mass += err / terms
    e = site.errors
    assert e.elements == len(pairs)
    # blame's error is (r - high) - low in FP64: one rounding of the error itself, 2**-53 of it
    assert e.max_ulp == pytest.approx(float(max(ulps)), rel=2**-50, abs=0)
    assert e.max_term_relative == pytest.approx(float(max(scaled)), rel=2**-50, abs=0)
    assert e.max_relative == pytest.approx(float(max(rel, default=0)), rel=2**-50, abs=0)
    assert e.mass == pytest.approx(float(mass), rel=2**-48, abs=0)


def test_the_draws_reach_sums_fp64_cannot_hold():
    """Power: a plain FP64 reference would measure 2**30 + 2**-30 (rounded to 2**30 in FP64 and FP32 alike) as
    exact; blame's error is the 2**-30 the FP32 result lost."""
    exact = Fraction(2) ** 30 + Fraction(2) ** -30
    assert Fraction(2.0**30 + 2.0**-30) != exact
    report = blame_target(lambda: _add([2.0**30], [2.0**-30]), ops="add")
    (site,) = [s for s in report.sites if s.kind == "arith"]
    assert site.errors.max_term_relative == float(Fraction(2) ** -30 / exact)
    assert site.errors.max_ulp == 2.0**-30 / 2.0**7  # FP32 spacing at 2**30 is 2**7


FP64_NORMAL = st.floats(min_value=2.0**-60, max_value=2.0**60, allow_nan=False, allow_infinity=False)


@given(FP64_NORMAL, st.floats(min_value=-0.5, max_value=0.5), st.booleans())
@example(1.0 + 2.0**-24, 2.0**-70, False)  # an FP32 midpoint in FP64: rounding high alone gives the even side
@example(1.0 + 3 * 2.0**-24, -(2.0**-70), False)
def test_round_pair_rounds_the_exact_sum_once(high, fraction, negative):
    high = -high if negative else high
    ulp = Fraction(abs(high)) * Fraction(2) ** -53  # below FP64's half ulp at high: high + low is a TwoSum pair
    low = float(ulp * Fraction(fraction)) if fraction else 0.0
    exact = Fraction(high) + Fraction(low)
    got = round_pair(torch.tensor([high], dtype=torch.float64), torch.tensor([low], dtype=torch.float64), torch.float32)
    assert Fraction(float(got[0])) == _round_fp32(exact)


def test_rounding_high_alone_is_wrong_at_a_midpoint():
    """Power of the test above: the FP32 midpoint 1 + 2**-24 plus a tiny low rounds up, not to even."""
    high, low = 1.0 + 2.0**-24, 2.0**-70
    assert float(torch.tensor(high, dtype=torch.float64).to(torch.float32)) == 1.0
    got = round_pair(torch.tensor([high], dtype=torch.float64), torch.tensor([low], dtype=torch.float64), torch.float32)
    assert float(got[0]) == 1.0 + 2.0**-23


def _sum(terms: list[float]) -> torch.Tensor:
    return torch.tensor(terms, dtype=torch.float32).sum()


@given(st.lists(FP32_VALUES, min_size=2, max_size=40))
@example([2.0**60, 1.0, -(2.0**60)])  # FP64 loses the 1: the reference itself is off by 1 / (2**61 + 1)
def test_a_longer_fp32_sum_is_within_the_stated_bound_of_its_exact_figure(terms):
    """The FP64 reference of ``sum`` is itself rounded: ``err/sum|t|`` is within ``(n - 1) 2**-53`` (gamma)."""
    out: list[torch.Tensor] = []
    report = blame_target(lambda: out.append(_sum(terms)), ops="sum")
    (site,) = [s for s in report.sites if s.kind == "arith"]
    exact = sum((Fraction(t) for t in terms), Fraction(0))
    true = abs(Fraction(float(out[0])) - exact) / sum((abs(Fraction(t)) for t in terms), Fraction(0))
    n = len(terms)
    gamma = (n - 1) * 2.0**-53 / (1 - (n - 1) * 2.0**-53)
    assert abs(site.errors.max_term_relative - float(true)) <= gamma + 2.0**-50 * float(true)
