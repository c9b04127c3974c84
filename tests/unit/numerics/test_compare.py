"""One comparison vocabulary: `difference` of a tensor pair and `Difference.pool` of many."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.cli import main
from simdist.gradpath.probes import Trace
from simdist.numerics.compare import Difference, difference
from simdist.numerics.floats import bits, ordered_integers, ulp_distance
from simdist.studies.dumps import write_rank_dump
from simdist.testing.strategies import bit_patterns, float_values, pattern_tensor


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


# -- every bit: NaN payloads, infinities, signed zeros (issue 18 item 3) ------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _pairs(dtype):
    return st.lists(st.tuples(bit_patterns(dtype), bit_patterns(dtype)), min_size=1, max_size=30)


@given(st.sampled_from(DTYPES).flatmap(lambda dtype: st.tuples(st.just(dtype), _pairs(dtype), bit_patterns(dtype))))
def test_ulp_distance_is_defined_for_every_pair_never_negative_and_zero_only_for_equal_bits_or_zeros(case):
    """A metric on bit patterns: non-negative, symmetric, 0 exactly for the same bits (or two zeros), triangle."""
    dtype, pairs, third = case
    a = pattern_tensor([p for p, _ in pairs], dtype)
    b = pattern_tensor([q for _, q in pairs], dtype)
    c = pattern_tensor([third] * len(pairs), dtype)
    d = ulp_distance(a, b)
    assert d.dtype == torch.int64 and bool((d >= 0).all())
    assert torch.equal(d, ulp_distance(b, a))
    same_bits = bits(a) == bits(b)
    both_zero = (a == 0) & (b == 0)
    assert torch.equal(d == 0, same_bits | both_zero)
    if dtype != torch.float64:  # fp64 saturates at 2**63 - 1 (docstring): the triangle can fail only there
        assert bool((d <= ulp_distance(a, c) + ulp_distance(c, b)).all())
    nan_pair = torch.isnan(a) & torch.isnan(b) & (torch.signbit(a) == torch.signbit(b))
    payload = (bits(a).to(torch.int64) - bits(b).to(torch.int64)).abs()  # same sign: the payloads' difference
    assert torch.equal(d[nan_pair], payload[nan_pair])


@given(st.sampled_from(DTYPES).flatmap(lambda dtype: st.tuples(st.just(dtype), _pairs(dtype))))
def test_difference_sees_every_differing_bit_and_no_tolerance_admits_a_nan_or_infinity(case):
    dtype, pairs = case
    a = pattern_tensor([p for p, _ in pairs], dtype)
    b = pattern_tensor([q for _, q in pairs], dtype)
    d = difference(a, b)
    differing = bits(a) != bits(b)
    assert d.differing == int(differing.sum()) and d.bitwise_equal == (not bool(differing.any()))
    nonfinite = differing & ~(torch.isfinite(a) & torch.isfinite(b))
    assert d.nonfinite_differing == int(nonfinite.sum())
    assert d.max_ulp >= (1 if differing.any() else 0)
    assert d.within(0) == d.bitwise_equal
    if nonfinite.any():
        assert not d.within(1 << 62) and d.norm_relative == math.inf
    else:
        assert d.within(d.max_ulp)
    assert not math.isnan(d.norm_relative) and not math.isnan(d.max_relative)


def test_nan_against_a_number_differs_and_all_nan_tensors_are_equal_with_zero_ulps():
    nan = torch.full((3,), math.nan)
    d = difference(torch.tensor([math.nan, 1.0, 2.0]), torch.tensor([0.5, 1.0, 2.0]))
    assert (d.differing, d.nonfinite_differing) == (1, 1) and not d.within(1 << 40)
    assert d.max_ulp > 0 and "NaN or infinity" in str(d)
    same = difference(nan, nan.clone())
    assert same.bitwise_equal and same.max_ulp == 0 and same.within(0)
    other_payload = nan.view(torch.int32).clone()
    other_payload[1] += 1
    d = difference(other_payload.view(torch.float32), nan)
    assert (d.differing, d.max_ulp, d.nonfinite_differing) == (1, 1, 1) and not d.within(10)
    d = difference(torch.tensor([-0.0]), torch.tensor([0.0]))
    assert d.max_ulp == 1 and not d.within(0) and d.within(1)  # a sign-of-zero difference counts 1 ulp
    d = difference(torch.tensor([math.inf]), torch.tensor([torch.finfo(torch.float32).max]))
    assert d.max_ulp == 1 and not d.within(1)  # one step in the order, but an infinity: beyond every tolerance


def test_a_narrowing_cast_that_changes_a_value_is_a_difference():
    """An fp32 value compared with a bf16 reference differs if the cast to bf16 had to round it."""
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    assert not difference(torch.tensor([1.0 + 2.0**-20]), one).bitwise_equal  # rounds to 1.0 in bf16
    assert difference(torch.tensor([1.0]), one).bitwise_equal


def _dump_of(directory, values: list[torch.Tensor]):
    meta = {"spec": {"world_size": len(values)}, "policy": "p", "steps": 1, "gas": 1, "seed": 0, "marker": "m"}
    meta |= {"update_path": "u", "model": "synthetic", "shapes": {"w": [3]}, "world": "test"}
    for rank, value in enumerate(values):
        trace = Trace(rank)
        trace.capture(0, 0, "w", "local", value)
        write_rank_dump(directory, trace, meta)
    return str(directory)


@pytest.mark.parametrize(
    "left, right, status",
    [
        ([math.nan, 1.0, 2.0], [0.5, 1.0, 2.0], 1),  # one NaN against a number
        ([math.nan] * 3, [math.nan] * 3, 0),  # all NaN, same payload
        ([-0.0, 1.0, 2.0], [0.0, 1.0, 2.0], 1),  # signed zero
        ([math.inf, 1.0, 2.0], [torch.finfo(torch.float32).max, 1.0, 2.0], 1),  # infinity vs the largest finite
    ],
)
def test_simdist_compare_exit_status_sees_nan_infinity_and_signed_zero(tmp_path, capsys, left, right, status):
    a = _dump_of(tmp_path / "a", [torch.tensor(left)])
    b = _dump_of(tmp_path / "b", [torch.tensor(right)])
    tolerance = ["--tolerance-ulp", "1"] if left[0] == math.inf else []  # 1 ulp apart, but an infinity
    assert main(["compare", a, b, *tolerance]) == status
    out = capsys.readouterr().out
    assert "-1 ulp" not in out
    assert ("BEYOND TOLERANCE" in out) == (status == 1)
