"""One comparison vocabulary: `difference` of a tensor pair and `Difference.pool` of many."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.numerics.compare import Difference, difference
from simdist.numerics.floats import ordered_integers
from simdist.strategies import float_values


def test_bitwise_equal_distinguishes_signed_zeros_and_counts_elements():
    d = difference(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    assert not d.bitwise_equal and d.differing == 1 and d.numel == 2 and d.fraction_differing == 0.5
    assert d.error_norm == 0.0  # equal values, different bits


def test_relative_to_the_sum_of_terms_stays_small_where_a_sum_cancels():
    terms = torch.tensor([[1.0, 3.0], [-1.0 + 2.0**-20, 1.0]], dtype=torch.float64)
    exact = terms.sum(0)  # [2**-20, 4.0]
    actual = exact + torch.tensor([2.0**-40, 0.0], dtype=torch.float64)
    d = difference(actual, exact, magnitude=terms.abs().sum(0))
    assert d.max_term_relative == pytest.approx(2.0**-41, rel=1e-12)  # |err| / (1 + 1 - 2**-20), all exact in fp64
    assert d.max_relative == pytest.approx(2.0**-20, rel=1e-12)  # the per-element relative error explodes
    assert d.max_ulp > 1 << 20


def test_pool_adds_counts_and_squared_norms_and_takes_maxima():
    a = difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    b = difference(torch.tensor([3.0]), torch.tensor([4.0]), magnitude=torch.tensor([8.0]))
    pooled = Difference.pool([a, b])
    assert (pooled.numel, pooled.differing) == (3, 2)
    assert pooled.max_ulp == max(a.max_ulp, b.max_ulp)
    assert pooled.norm_relative == pytest.approx(math.sqrt(0.25 + 1.0) / math.sqrt(1 + 6.25 + 16))
    assert pooled.max_term_relative == 0.125  # only b had magnitudes
    assert Difference.pool([]).bitwise_equal and Difference.pool([]).norm_relative == 0.0


def test_zero_size_and_shape_mismatch():
    empty = difference(torch.empty(0), torch.empty(0))
    assert empty.bitwise_equal and empty.numel == 0
    with pytest.raises(ValueError, match="shapes differ"):
        difference(torch.zeros(2), torch.zeros(3))


@given(
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]).flatmap(
        lambda dtype: st.tuples(st.just(dtype), st.lists(float_values(dtype, infinity=True), min_size=2, max_size=40))
    )
)
def test_ordered_integers_count_the_representable_values_between_two_floats(case):
    """Sorted values get sorted integers, +0 and -0 the same one, and a value and its successor differ by 1."""
    dtype, values = case
    t = torch.tensor(values, dtype=dtype)
    ordered = ordered_integers(t)
    assert ordered.dtype == torch.int64
    by_value = torch.sort(t.double()).indices
    assert bool((ordered[by_value].diff() >= 0).all())
    assert bool(((t == 0) <= (ordered == 0)).all())
    finite = t[torch.isfinite(t) & (t.abs() < torch.finfo(dtype).max)]
    successors = torch.nextafter(finite, torch.full_like(finite, math.inf))
    assert torch.equal(
        ordered_integers(successors) - ordered_integers(finite), torch.ones_like(finite, dtype=torch.int64)
    )
