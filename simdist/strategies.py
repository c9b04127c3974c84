"""Hypothesis strategies for numerics properties of distributed reductions.

Public, composable building blocks used by simdist's own tests:

* `parallel_specs` -- valid `ParallelSpec` layouts (optionally with fixed sizes);
* `float_values` -- exact values of one dtype, with the adversarial corners a
  reduction meets: subnormals, the largest finite values, signed zeros and,
  when allowed, NaN and infinities;
* `tensors` -- a tensor of such values;
* `rank_tensors` -- the per-rank tensors of one group, including structured
  cases that plain independent draws almost never hit: exact cancellation
  between ranks and sums that land on a rounding tie.

All values are built from sign, exponent and significand integers, so every
drawn value is exactly representable in the requested dtype and shrinks
towards small, simple numbers.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from simdist.floats import float_format
from simdist.spec import ParallelSpec


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def parallel_specs(
    draw,
    max_world_size: int = 8,
    tp: int | None = None,
    min_ep: int = 1,
    ep_layout: str = "contiguous",
) -> ParallelSpec:
    """Valid `ParallelSpec` values with ``world_size <= max_world_size``.

    ``tp`` fixes the tensor-parallel size (only layouts where it fits are
    drawn); ``min_ep`` asks for expert parallelism of at least that size.
    """
    worlds = [w for w in range(1, max_world_size + 1) if tp is None or w % tp == 0]
    world = draw(st.sampled_from(worlds))
    pp = draw(st.sampled_from([p for p in _divisors(world) if tp is None or (world // p) % tp == 0]))
    stage = world // pp
    tp_size = tp if tp is not None else draw(st.sampled_from(_divisors(stage)))
    widths = [w for w in _divisors(stage) if w >= min_ep]
    width = draw(st.sampled_from(widths))
    etp = draw(st.sampled_from([e for e in _divisors(width) if width // e >= min_ep]))
    return ParallelSpec(world, tp=tp_size, ep=width // etp, etp=etp, pp=pp, ep_layout=ep_layout)


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


def tensors(dtype: torch.dtype, numel: int, elements: st.SearchStrategy[float] | None = None):
    """A 1-D tensor of ``numel`` values of ``dtype`` (default elements: `float_values` of finite values)."""
    elements = elements if elements is not None else float_values(dtype)
    return st.lists(elements, min_size=numel, max_size=numel).map(lambda v: torch.tensor(v, dtype=dtype))


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
