"""Comparing tensors from two runs: bitwise first, then ulps, relative figures and the differing fraction.

One vocabulary for every comparison in simdist (the #8913 report, MoE training next to the oracle, dump
comparisons, the cases, growth): `difference` measures one tensor pair, `Difference.pool` combines many (over
ranks, steps, micro-steps or parameters) without losing what a reader needs: whether every element was bitwise
equal, the worst ulp distance, how many elements differ, and norms from which a pooled normwise relative
error follows. `same_bits` is the one bitwise test of two captures, `first_divergence` the one rule for where
two runs first differ (the smallest caller-given order among the pairs that are not `same_bits`), and `compare`
pools many pairs into one `Comparison` (counts, pooled `Difference`, first divergence, names that differ), of
which every report row is a view.

Why a figure relative to the sum of |terms|: near an element whose reduction cancels to ~0, one ulp of the
result is tiny, so a max-ulp figure explodes (a billion ulps for an error at the level of the inputs'
rounding). The classical bound of a recursive sum is ``|error| <= (n-1) u sum|x_i|``, so
``|actual - expected| / sum|terms|`` is the figure that stays comparable to the unit roundoff ``u``:
`difference` takes the per-element ``sum|terms|`` as ``magnitude`` where the caller knows it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from simdist.errors import UsageError
from simdist.numerics.floats import bits, ulp_distance


@dataclass(frozen=True)
class Difference:
    """How ``actual`` departs from ``expected``, measured in ``expected``'s dtype.

    ``max_term_relative`` is ``max |a - e| / sum|terms|`` over elements with a non-zero magnitude, or
    ``None`` when no magnitude was given (a tensor that is not the result of a reduction).
    ``nonfinite_differing`` counts the differing elements where either side is a NaN or an infinity: no ulp
    tolerance admits them (`within`).
    """

    numel: int
    differing: int
    max_ulp: int
    max_relative: float
    error_norm: float
    reference_norm: float
    max_term_relative: float | None = None
    nonfinite_differing: int = 0

    @property
    def bitwise_equal(self) -> bool:
        return self.differing == 0

    def within(self, tolerance_ulp: int) -> bool:
        """Bitwise equal, or every differing element finite on both sides and at most ``tolerance_ulp`` apart.

        A differing element counts at least 1 ulp (``+0`` vs ``-0`` too), so ``within(0)`` is bitwise equality.
        """
        return self.bitwise_equal or (self.nonfinite_differing == 0 and self.max_ulp <= tolerance_ulp)

    @property
    def fraction_differing(self) -> float:
        return self.differing / self.numel if self.numel else 0.0

    @property
    def norm_relative(self) -> float:
        """``||a - e||_2 / ||e||_2`` (0 when both are 0, ``inf`` for an error against a zero reference or an
        infinite error)."""
        if math.isinf(self.error_norm):
            return math.inf
        if self.reference_norm:
            return self.error_norm / self.reference_norm
        return 0.0 if self.error_norm == 0 else math.inf

    @classmethod
    def pool(cls, parts: Iterable[Difference]) -> Difference:
        """One `Difference` for many comparisons: counts and squared norms add, maxima take the max."""
        parts = list(parts)
        terms = [p.max_term_relative for p in parts if p.max_term_relative is not None]
        return cls(
            numel=sum(p.numel for p in parts),
            differing=sum(p.differing for p in parts),
            max_ulp=max((p.max_ulp for p in parts), default=0),
            max_relative=max((p.max_relative for p in parts), default=0.0),
            error_norm=_pooled_norm([p.error_norm for p in parts]),
            reference_norm=_pooled_norm([p.reference_norm for p in parts]),
            max_term_relative=max(terms) if terms else None,
            nonfinite_differing=sum(p.nonfinite_differing for p in parts),
        )

    def __str__(self) -> str:
        if self.bitwise_equal:
            return "bitwise equal"
        terms = "" if self.max_term_relative is None else f", err/sum|terms| {self.max_term_relative:.2e}"
        nonfinite = f", {self.nonfinite_differing} at a NaN or infinity" if self.nonfinite_differing else ""
        return (
            f"max {self.max_ulp} ulp{nonfinite}, {100 * self.fraction_differing:.1f}% differ, "
            f"normwise rel {self.norm_relative:.2e}{terms}"
        )


def _pooled_norm(norms: list[float]) -> float:
    """``sqrt(sum of squares)`` of 2-norms; `math.hypot` where a square overflows (a norm near the fp64 maximum,
    as an infinite reference gives: `difference` counts an infinity as the largest finite value there)."""
    try:
        return math.sqrt(sum(n**2 for n in norms))
    except OverflowError:
        return math.hypot(*norms)


def difference(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor | None = None) -> Difference:
    """Compare ``actual`` with ``expected``, after casting ``actual`` to ``expected``'s dtype.

    The cast is exact when ``expected`` is at least as wide (a BF16 or FP32
    capture against an FP32 or FP64 oracle); where it is not, an element the
    cast changes (rounding, a NaN's payload) counts as differing.
    ``bitwise_equal`` compares raw bits (so ``-0.0 != +0.0`` and NaNs compare
    by sign and payload); ``max_ulp`` is the largest `ulp_distance` in
    ``expected.dtype`` over the differing elements, each counting at least 1
    (so a sign-of-zero difference is 1 ulp); ``nonfinite_differing`` counts
    differing elements with a NaN or infinity on either side. ``max_relative``
    is ``|a - e| / |e|`` over finite non-zero ``e``, in fp64; the norms are
    fp64 2-norms of ``a - e`` and ``e``, where a non-finite differing element
    is an infinite error (so the relative figures are ``inf``, never a NaN or
    a silent 0). ``magnitude`` (same shape) is the per-element ``sum|terms|``
    of the reduction that produced ``expected``.
    """
    if actual.shape != expected.shape:
        raise UsageError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    expected = expected.detach().cpu()
    given = actual.detach().cpu()
    actual = given.to(expected.dtype)
    differing = bits(actual) != bits(expected)
    if torch.promote_types(given.dtype, expected.dtype) != expected.dtype:  # a narrowing cast may lose bits
        differing |= bits(actual.to(given.dtype)) != bits(given)
    numel = expected.numel()
    if numel == 0:
        return Difference(0, 0, 0, 0.0, 0.0, 0.0, None if magnitude is None else 0.0)
    ulps = torch.where(differing, ulp_distance(actual, expected).clamp_min(1), 0)
    nonfinite = differing & ~(torch.isfinite(actual) & torch.isfinite(expected) & torch.isfinite(given))
    e64, a64 = expected.double(), actual.double()
    error = torch.where(differing, (a64 - e64).abs(), 0.0)
    error = torch.where(nonfinite, math.inf, error)
    usable = (e64 != 0) & torch.isfinite(e64)
    rel = (error / e64.abs())[usable]
    term_relative = None
    if magnitude is not None:
        if magnitude.shape != expected.shape:
            raise UsageError(f"magnitude shape {tuple(magnitude.shape)} is not {tuple(expected.shape)}")
        m64 = magnitude.detach().cpu().double()
        scaled = (error / m64)[(m64 > 0) & torch.isfinite(m64)]
        term_relative = float(scaled.max()) if scaled.numel() else 0.0
    return Difference(
        numel=numel,
        differing=int(differing.sum()),
        max_ulp=int(ulps.max()),
        max_relative=float(rel.max()) if rel.numel() else 0.0,
        error_norm=float(torch.linalg.vector_norm(error)),
        reference_norm=float(torch.linalg.vector_norm(torch.nan_to_num(e64, nan=0.0))),
        max_term_relative=term_relative,
        nonfinite_differing=int(nonfinite.sum()),
    )


def same_bits(a: torch.Tensor, b: torch.Tensor | None, exact_across_dtypes: bool = False) -> bool:
    """Whether ``b`` exists and holds ``a``'s shape and bit patterns (`bits`: NaN payloads and the sign of zero
    count). Two dtypes differ, unless ``exact_across_dtypes``: then both are compared exactly in fp64 (a
    BF16 value and its FP32 widening are the same value)."""
    if b is None or a.shape != b.shape:
        return False
    if a.dtype != b.dtype:
        if not exact_across_dtypes:
            return False
        a, b = a.double(), b.double()
    return torch.equal(bits(a.detach().cpu()), bits(b.detach().cpu()))


def first_divergence(
    pairs: Iterable[tuple[Any, torch.Tensor, torch.Tensor | None]], exact_across_dtypes: bool = False
) -> tuple[Any, torch.Tensor, torch.Tensor | None] | None:
    """The ``(order, a, b)`` with the smallest ``order`` whose tensors are not `same_bits`, or ``None``.

    The one first-divergence rule of simdist: the caller's ``order`` says what comes first (path order,
    then rank; step, micro-step, then rank); ``b`` ``None`` (the other run lacks the capture) diverges.
    """
    for pair in sorted(pairs, key=lambda p: p[0]):
        if not same_bits(pair[1], pair[2], exact_across_dtypes):
            return pair
    return None


@dataclass(frozen=True)
class Comparison:
    """Many tensor pairs compared as one row: the one result every report is a view of.

    ``difference`` pools the `Difference` of every pair both runs hold with one shape (a pair that lacks a
    tensor or whose shapes differ adds none); ``tensors`` counts the pairs, ``equal`` those that are
    `same_bits`; ``first`` is the `first_divergence` (its ``(order, a, b)``), ``differing`` the names of the
    pairs that differ, in order.
    """

    difference: Difference
    tensors: int
    equal: int
    first: tuple[Any, torch.Tensor, torch.Tensor | None] | None = None
    differing: tuple[str, ...] = ()

    @property
    def bitwise_equal(self) -> bool:
        """Every pair bitwise equal, and at least one compared."""
        return self.tensors > 0 and self.equal == self.tensors


Pair = tuple[str, Any, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]
"""``(name, order, actual, expected, magnitude)``: one tensor pair for `compare`."""


def compare(pairs: Iterable[Pair], exact_across_dtypes: bool = False) -> Comparison:
    """Compare every `Pair` ``(name, order, actual, expected, magnitude)`` and pool the results (`Comparison`).

    ``actual`` is measured against ``expected`` in ``expected``'s dtype (`difference`); ``magnitude`` is its
    per-element ``sum|terms|`` or ``None``.
    """
    diffs, differing, equal, tensors = [], [], 0, 0
    for name, order, actual, expected, magnitude in pairs:
        tensors += 1
        if expected is not None and actual.shape == expected.shape:
            diffs.append(difference(actual, expected, magnitude))
        if same_bits(actual, expected, exact_across_dtypes):
            equal += 1
        else:
            differing.append((order, name, actual, expected))
    first = first_divergence(((o, a, e) for o, _, a, e in differing), exact_across_dtypes)
    names = tuple(dict.fromkeys(name for _, name, _, _ in sorted(differing, key=lambda d: d[0])))
    return Comparison(Difference.pool(diffs), tensors, equal, first, names)
