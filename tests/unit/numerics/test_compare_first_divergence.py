"""The one first-divergence rule and the one comparison row (`simdist.numerics.compare`), on adversarial pairs.

The reference below decides equality from torch's own ``view(torch.int32)`` and picks the first divergence by
brute force; it shares nothing with `same_bits`, `first_divergence` or `compare`.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.numerics.compare import Difference, compare, difference, first_divergence, same_bits
from simdist.testing.strategies import bit_patterns, pattern_tensor

EDITS = ("same", "sign_of_zero", "nan_payload", "low_bit", "missing", "shape", "dtype")


def _edit(a: torch.Tensor, how: str, where: int) -> torch.Tensor | None:
    """``a`` itself or a copy that differs from it in one adversarial way (``where`` picks the element)."""
    raw = a.view(torch.int32).clone()
    i = where % raw.numel()
    if how == "same":
        return raw.view(torch.float32)
    if how == "sign_of_zero":  # -0 and +0 (or any value and the same with the sign bit flipped)
        raw[i] ^= -(1 << 31)
    elif how == "nan_payload":  # a NaN, then the same NaN with another payload bit
        raw[i] = 0x7FC00001
        a.view(torch.int32)[i] = 0x7FC00000
    elif how == "low_bit":
        raw[i] ^= 1
    elif how == "missing":
        return None
    elif how == "shape":
        return raw.view(torch.float32).reshape(1, -1)
    elif how == "dtype":  # the same values, widened exactly: a different dtype is a different capture
        return raw.view(torch.float32).double()
    return raw.view(torch.float32)


def _reference_equal(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return (
        b is not None
        and b.dtype == a.dtype
        and b.shape == a.shape
        and bool((a.view(torch.int32) == b.view(torch.int32)).all())
    )


@st.composite
def pair_lists(draw):
    """Up to 6 fp32 pairs under distinct orders (drawn in any sequence), each edited in one adversarial way."""
    n = draw(st.integers(1, 6))
    orders = draw(st.permutations(range(n)))
    pairs = []
    for order in orders:
        a = pattern_tensor(draw(st.lists(bit_patterns(torch.float32), min_size=1, max_size=4)), torch.float32)
        b = _edit(a, draw(st.sampled_from(EDITS)), draw(st.integers(0, 5)))
        pairs.append((f"p{order % 3}", (order // 2, order % 2), a, b))
    return pairs


@given(pair_lists())
def test_the_first_divergence_is_the_smallest_order_among_the_pairs_that_are_not_bitwise_equal(pairs):
    differing = [(order, a, b) for _, order, a, b in pairs if not _reference_equal(a, b)]
    expected = min(differing, key=lambda p: p[0]) if differing else None
    found = first_divergence([(order, a, b) for _, order, a, b in pairs])
    assert (found is None) == (expected is None)
    if expected is not None:
        assert found is not None and found[0] == expected[0] and found[1] is expected[1] and found[2] is expected[2]


@given(pair_lists())
def test_a_comparison_counts_pools_and_names_what_differs(pairs):
    result = compare([(name, order, a, b, None) for name, order, a, b in pairs])
    equal = [_reference_equal(a, b) for _, _, a, b in pairs]
    assert (result.tensors, result.equal) == (len(pairs), sum(equal))
    assert result.bitwise_equal == all(equal)
    differing = sorted((order, name) for (name, order, _, _), same in zip(pairs, equal, strict=True) if not same)
    assert result.differing == tuple(dict.fromkeys(name for _, name in differing))
    assert (result.first is None) == (not differing) and (result.first is None or result.first[0] == differing[0][0])
    comparable = [difference(a, b) for _, _, a, b in pairs if b is not None and b.shape == a.shape]
    assert result.difference == Difference.pool(comparable)


def test_zeros_nans_and_widened_values():
    zero = torch.tensor([0.0])
    assert not same_bits(zero, -zero) and same_bits(zero, zero.clone())
    nan = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not same_bits(nan[:1], nan[1:]) and same_bits(nan, nan.clone())
    bf16 = torch.tensor([1.0078125, -0.0], dtype=torch.bfloat16)
    assert not same_bits(bf16, bf16.float()) and same_bits(bf16, bf16.float(), exact_across_dtypes=True)
    assert not same_bits(bf16, torch.tensor([1.0078125, 0.0]), exact_across_dtypes=True)  # -0 in fp64 too
    assert first_divergence([]) is None and not compare([]).bitwise_equal  # nothing compared is not "equal"


def test_pooling_an_infinite_reference_does_not_overflow():
    """An infinite reference counts as the largest fp64 in the reference norm: its square overflows a float."""
    inf = torch.tensor([float("inf")])
    pooled = Difference.pool([difference(inf, inf), difference(inf, inf)])
    assert pooled.bitwise_equal and pooled.reference_norm == float("inf") and pooled.norm_relative == 0.0


def test_per_parameter_divergence_names_the_rank_and_the_stages_only_one_run_captured():
    """`probes.first_divergence`: path order before rank; only common captures compared, BF16 against its exact
    FP32 widening is equal; ``after`` lists the captures only run a made right before the divergence."""
    from simdist.gradpath.probes import Divergence, Trace
    from simdist.gradpath.probes import first_divergence as per_parameter

    one = torch.tensor([1.0078125], dtype=torch.bfloat16)
    runs: list[list[Trace]] = [[Trace(0), Trace(1)], [Trace(0), Trace(1)]]
    for rank in (0, 1):
        a, b = runs[0][rank], runs[1][rank]
        for stage in ("local", "staged", "corrected", "written_back", "hp"):
            a.capture(0, 0, "w", stage, one if stage == "local" else one.float() + (stage == "hp"))
            if stage not in ("staged", "written_back"):  # run b lacks the staging copy and the writeback
                b.capture(0, 0, "w", stage, one.float())  # local: the BF16 value widened exactly
        a.capture(0, 0, "v", "local", one)
        b.capture(0, 0, "v", "local", -one)
        a.capture(1, 0, "v", "local", one)
        b.capture(1, 0, "v", "local", one)
    b_rank1 = runs[1][1]
    b_rank1.values[(0, 0, "w", "corrected")] = b_rank1.values[(0, 0, "w", "corrected")] * 2  # rank 1: earlier
    found = per_parameter(*runs)
    assert found["w"] == Divergence(1, "w", 0, 0, "corrected", ("staged",))
    assert found["v"] == Divergence(0, "v", 0, 0, "local", ())
    runs[1][1].values[(0, 0, "w", "corrected")] = one.float()
    assert per_parameter(*runs)["w"] == Divergence(0, "w", 0, 0, "hp", ("written_back",))
