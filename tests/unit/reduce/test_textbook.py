"""Reductions: documented orders, exactness, error bounds, consistency."""

from fractions import Fraction

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from simdist.numerics.floats import bits, bitwise_equal, float_format, round_exact, unit_roundoff
from simdist.numerics.rounding import round_to
from simdist.reduce import ReduceOp, Ring, Sequential, Tree, Upcast, make_reduction
from simdist.testing.strategies import float_values, rank_tensors

DTYPES = [torch.float32, torch.bfloat16]


def models_for(n: int, chunk: int = 3, shift: int = 1):
    return [
        Sequential(),
        Tree(),
        Ring(chunk_size=chunk, shift=shift),
        Upcast(torch.float32),
        Upcast(torch.float64),
        make_reduction("gloo"),
    ]


def exact_sums(per_rank: list[torch.Tensor]) -> list[Fraction]:
    columns = zip(*[t.double().tolist() for t in per_rank], strict=True)
    return [sum((Fraction(v) for v in col), Fraction(0)) for col in columns]


@st.composite
def groups(draw, dtype=None, max_exponent_margin=4, **value_kwargs):
    """(dtype, per-rank tensors) with finite values whose partial sums cannot overflow."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 8))
    numel = draw(st.integers(1, 12))
    fmt = float_format(dtype)
    elements = float_values(dtype, max_exponent=fmt.emax - max_exponent_margin, **value_kwargs)
    return dtype, draw(rank_tensors(n, numel, dtype, elements))


@given(groups(), st.integers(1, 5), st.integers(0, 7))
def test_every_model_is_within_the_recursive_summation_bound(group, chunk, shift):
    dtype, per_rank = group
    n = len(per_rank)
    u = Fraction(unit_roundoff(dtype))
    exact = exact_sums(per_rank)
    magnitude = exact_sums([t.abs() for t in per_rank])
    for reduction in models_for(n, chunk, shift):
        got = reduction.reduce(torch.stack(per_rank), ReduceOp.SUM).double().tolist()
        for g, s, m in zip(got, exact, magnitude, strict=True):
            assert abs(Fraction(g) - s) <= (n - 1) * u * m, (reduction, g, s)


@given(st.sampled_from(DTYPES), st.integers(1, 8), st.integers(1, 40), st.data())
def test_small_integers_sum_exactly_under_every_model(dtype, n, numel, data):
    per_rank = [data.draw(st.lists(st.integers(-16, 16), min_size=numel, max_size=numel)) for _ in range(n)]
    tensors = [torch.tensor(v, dtype=dtype) for v in per_rank]
    expected = torch.tensor([sum(col) for col in zip(*per_rank, strict=True)], dtype=dtype)
    for reduction in models_for(n):
        assert bitwise_equal(reduction.reduce(torch.stack(tensors)) + 0.0, expected + 0.0), reduction


@st.composite
def exact_in_fp64_groups(draw):
    """Groups whose values span few enough binades that every fp64 partial sum is exact."""
    dtype = draw(st.sampled_from(DTYPES))
    fmt = float_format(dtype)
    window = 53 - fmt.precision - 4  # spread + significand + log2(8 ranks) + 1 <= 53
    low = draw(st.integers(fmt.emin, fmt.emax - window))
    elements = float_values(dtype, min_exponent=low, max_exponent=low + window, subnormals=low == fmt.emin)
    n = draw(st.integers(1, 8))
    return dtype, draw(rank_tensors(n, draw(st.integers(1, 8)), dtype, elements))


@given(exact_in_fp64_groups())
def test_upcast_fp64_is_the_correctly_rounded_sum(group):
    dtype, per_rank = group
    got = Upcast(torch.float64).reduce(torch.stack(per_rank))
    expected = torch.tensor([round_exact(s, dtype) for s in exact_sums(per_rank)], dtype=dtype)
    assert bitwise_equal(got + 0.0, expected + 0.0)  # +0.0 folds -0.0 into +0.0 (exact sums carry no sign)


@given(groups(), st.integers(1, 5), st.integers(0, 7), st.sampled_from(list(ReduceOp)))
def test_reduce_scatter_blocks_are_slices_of_the_reduction(group, chunk, shift, op):
    _, per_rank = group
    n = len(per_rank)
    flat = torch.stack([torch.cat([t] * n) for t in per_rank])  # numel divisible by n
    for reduction in models_for(n, chunk, shift):
        blocks = reduction.reduce_scatter(flat, op)
        assert bitwise_equal(blocks.reshape(-1), reduction.reduce(flat, op)), reduction


@given(groups(), st.integers(1, 5), st.integers(0, 7))
def test_a_list_of_rank_tensors_and_their_stack_give_the_same_bits(group, chunk, shift):
    _, per_rank = group
    for reduction in models_for(len(per_rank), chunk, shift):
        assert bitwise_equal(reduction.reduce(per_rank), reduction.reduce(torch.stack(per_rank))), reduction


def ring_reference(per_rank: list[torch.Tensor], chunk: int, shift: int, ring: list[int]) -> torch.Tensor:
    """The documented ring order, element by element, without vectorisation."""
    n = len(per_rank)
    out = []
    for e in range(per_rank[0].numel()):
        start = (e // chunk + shift) % n
        acc = per_rank[ring[start]][e].clone()
        for hop in range(1, n):
            acc = acc + per_rank[ring[(start + hop) % n]][e]
        out.append(acc)
    return torch.stack(out)


def tree_reference(values: list[torch.Tensor]) -> torch.Tensor:
    while len(values) > 1:
        paired = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
        values = paired + (values[-1:] if len(values) % 2 else [])
    return values[0]


@given(groups(), st.integers(1, 5), st.integers(0, 7), st.randoms(use_true_random=False))
def test_ring_and_tree_follow_their_documented_order(group, chunk, shift, rnd):
    _, per_rank = group
    n = len(per_rank)
    ring = list(range(n))
    rnd.shuffle(ring)
    got = Ring(chunk_size=chunk, shift=shift, ring=tuple(ring)).reduce(per_rank)
    assert bitwise_equal(got, ring_reference(per_rank, chunk, shift, ring))
    assert bitwise_equal(Tree().reduce(per_rank), tree_reference(list(per_rank)))


@pytest.mark.parametrize("position", range(4))
def test_a_fingerprint_reveals_where_the_ring_starts(position):
    # bf16 has 8 significant bits, so the ulp of 1.0 is 2**-7 and 1.0 + 2**-8 is a tie.
    # k small values summed before the 1.0 give (hand-rounded, ties to even):
    #   k=0: 1 (+2**-8 three times: each a tie back to 1)      -> 1
    #   k=1: 2**-8 + 1 is a tie -> 1, and the rest tie back      -> 1
    #   k=2: 2**-7 + 1 = 1+2**-7, + 2**-8 ties up to 1+2**-6      -> 1+2**-6
    #   k=3: 3*2**-8 + 1 is a tie -> 1+2**-6                      -> 1+2**-6
    after_k_small = {0: 1.0, 1: 1.0, 2: 1 + 2.0**-6, 3: 1 + 2.0**-6}
    per_rank = [torch.full((4,), 2.0**-8, dtype=torch.bfloat16) for _ in range(4)]
    per_rank[position] = torch.ones(4, dtype=torch.bfloat16)
    got = Ring(chunk_size=1, shift=1).reduce(per_rank)
    for chunk in range(4):
        start = (chunk + 1) % 4
        assert got[chunk].item() == after_k_small[(position - start) % 4], (chunk, got)


@given(st.integers(1, 8), st.sampled_from(DTYPES))
def test_avg_divides_the_model_sum_once_or_premultiplies(n, dtype):
    per_rank = [torch.full((3,), float(r + 1), dtype=dtype) / 3 for r in range(n)]
    stacked = torch.stack(per_rank)
    assert bitwise_equal(Sequential().reduce(stacked, ReduceOp.AVG), Sequential().sum(stacked) / n)
    scale = torch.tensor(1.0 / n, dtype=dtype)
    assert bitwise_equal(Sequential(avg="premul").reduce(stacked, ReduceOp.AVG), Sequential().sum(stacked * scale))


def test_max_and_min_propagate_nan():
    stacked = torch.tensor([[1.0, float("nan")], [2.0, 0.0]])
    for op, first in ((ReduceOp.MAX, 2.0), (ReduceOp.MIN, 1.0)):
        out = Sequential().reduce(stacked, op)
        assert out[0].item() == first and torch.isnan(out[1])


def test_reduce_op_accepts_torch_distributed_ops_and_names():
    import torch.distributed as dist

    assert ReduceOp.coerce(dist.ReduceOp.SUM) is ReduceOp.SUM
    assert ReduceOp.coerce("avg") is ReduceOp.AVG
    assert ReduceOp.coerce(dist.ReduceOp.PRODUCT) is ReduceOp.PRODUCT
    with pytest.raises(ValueError, match="valid: SUM, AVG, PRODUCT, MAX, MIN"):
        ReduceOp.coerce("band")


def test_unknown_model_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid: sequential, ring, tree, upcast, gloo"):
        make_reduction("butterfly")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@given(groups(), st.integers(1, 5), st.integers(0, 7))
def test_models_give_the_same_bits_on_cuda(group, chunk, shift):
    _, per_rank = group
    for reduction in models_for(len(per_rank), chunk, shift):
        cpu = reduction.reduce(per_rank)
        gpu = reduction.reduce([t.cuda() for t in per_rank]).cpu()
        assert torch.equal(bits(cpu), bits(gpu)), reduction


@given(st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from([torch.bfloat16, torch.float16]))
@example(16973823.0, torch.bfloat16)  # torch's own fp64 -> bf16 cast rounds this twice, to 17039360
def test_round_to_is_correctly_rounded_from_fp64(value, dtype):
    got = round_to(torch.tensor([value], dtype=torch.float64), dtype).item()
    assert got == round_exact(Fraction(value), dtype)


def test_the_upcast_fp64_counterexample_to_double_rounding():
    per_rank = [torch.tensor([v], dtype=torch.bfloat16) for v in (8388608.0, 8585216.0, -1.0)]
    assert Upcast(torch.float64).sum(per_rank).item() == 16908288.0  # exact 16973823 rounded once


@given(float_values(torch.bfloat16, max_exponent=126), float_values(torch.bfloat16, max_exponent=126))
def test_a_bf16_addition_in_torch_is_correctly_rounded(a, b):
    """The models' premise: torch adds BF16 in FP32 and rounds once, which equals one correct BF16 rounding."""
    got = (torch.tensor([a], dtype=torch.bfloat16) + torch.tensor([b], dtype=torch.bfloat16)).item()
    assert got == round_exact(Fraction(a) + Fraction(b), torch.bfloat16)
