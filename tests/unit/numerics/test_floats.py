"""`numerics.floats.bits` for every dtype torch has: raw bit patterns survive it exactly.

The reference is torch's own ``Tensor.view(int dtype)`` on a tensor built from the patterns, never `bits`.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.numerics.floats import bits, from_bits
from simdist.testing.strategies import bit_patterns

SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype) and not torch.empty(0, dtype=d).is_quantized},
    key=str,
)
"""Every dtype this torch defines except the quantized ones (which `bits` refuses): a new torch dtype joins."""
CORNERED = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
"""Floats with a sign, an exponent and a mantissa: `bit_patterns` adds their corners (zeros, NaN payloads)."""


def _width(dtype: torch.dtype) -> int:
    """Bytes of one stored element (of one component, for a complex dtype)."""
    size = torch.empty(0, dtype=dtype).element_size()
    return size // 2 if dtype.is_complex else size


def _patterns(dtype: torch.dtype) -> st.SearchStrategy[int]:
    """Arbitrary signed patterns of the width; for a float with `torch.finfo`, also its corners (zeros, NaNs)."""
    bits_ = 8 * _width(dtype)
    arbitrary = st.integers(-(1 << (bits_ - 1)), (1 << (bits_ - 1)) - 1)
    if dtype in CORNERED:
        return st.one_of(arbitrary, bit_patterns(dtype))
    return arbitrary


def test_the_dtype_list_holds_bool_integers_and_the_eight_bit_floats():
    names = {str(d) for d in DTYPES}
    assert {"torch.bool", "torch.uint8", "torch.int8", "torch.int64", "torch.uint64"} <= names
    assert {"torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz"} <= names
    assert len(DTYPES) >= 30


@given(
    st.sampled_from(DTYPES).flatmap(lambda d: st.tuples(st.just(d), st.lists(_patterns(d), min_size=1, max_size=24)))
)
def test_bits_of_any_pattern_is_that_pattern_contiguous_or_strided(case):
    """bits -> tensor -> bits is the identity: NaN payloads, both zeros, bool bytes that are neither 0 nor 1."""
    dtype, patterns = case
    signed = SIGNED[_width(dtype)]
    raw = torch.tensor(patterns, dtype=signed)
    if dtype.is_complex:
        raw = raw.repeat_interleave(2).reshape(-1, 2).clone()
        raw[:, 1] = raw[:, 1].flip(0)  # real and imaginary parts differ
        t = raw.view(torch.view_as_real(torch.empty(0, dtype=dtype)).dtype)
        t = torch.view_as_complex(t)
    else:
        t = raw.view(dtype)
    got = bits(t)
    assert got.dtype == signed and got.is_contiguous()
    assert torch.equal(got, raw)
    assert torch.equal(bits(t[::2]), raw[::2])  # a strided view: reinterpreted before any copy
    assert torch.equal(bits(t.unsqueeze(0).expand(2, *t.shape)), raw.unsqueeze(0).expand(2, *raw.shape))
    assert torch.equal(bits(from_bits(raw, dtype)), raw) and from_bits(raw, dtype).dtype == dtype


@pytest.mark.parametrize(
    "dtype", [*CORNERED, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu], ids=str
)
def test_both_zeros_and_nans_of_different_payloads_have_distinct_bits(dtype):
    """Equal values, different bits (the zeros); NaNs that differ only in payload stay apart."""
    width = 8 * _width(dtype)
    signed = SIGNED[width // 8]
    zeros = torch.tensor([0, -(1 << (width - 1))], dtype=signed).view(dtype).double()
    if zeros[1] == 0:  # the format has a negative zero (the fnuz formats and e8m0 do not)
        assert zeros[0] == zeros[1] and bits(zeros.to(dtype))[0] != bits(zeros.to(dtype))[1]
    patterns = torch.arange(-(1 << (width - 1)), 1 << (width - 1), dtype=signed) if width == 8 else None
    if patterns is None:  # a quiet NaN and the same NaN with its lowest payload bit set
        mantissa = round(-torch.log2(torch.tensor(torch.finfo(dtype).eps)).item())
        quiet = ((1 << (width - 1 - mantissa)) - 1) << mantissa | 1 << (mantissa - 1)
        patterns = torch.tensor([quiet, quiet | 1], dtype=signed)
    values = patterns.view(dtype)
    nans = torch.isnan(values.double())
    assert nans.any() and torch.equal(bits(values)[nans], patterns[nans])  # every NaN pattern, each its own bits
    assert torch.equal(bits(values.clone()), patterns)


def test_bool_bytes_survive_a_strided_view():
    """A bool tensor holding a count (gloo's SUM of bools) keeps it: copying a bool tensor writes 0 or 1."""
    raw = torch.tensor([1, 2, 0, 3], dtype=torch.int8)
    assert bits(raw.view(torch.bool)[1::2]).tolist() == [2, 3]


def test_bits_of_a_tensor_that_requires_grad_and_a_conjugate():
    x = torch.tensor([1.5, -0.0], requires_grad=True)
    assert bits(x).tolist() == [0x3FC00000, -(1 << 31)]
    z = torch.tensor([1 + 2j], dtype=torch.complex64)
    assert torch.equal(bits(z.conj()), torch.tensor([[1.0, -2.0]]).view(torch.int32))


def test_quantized_tensors_and_wrong_widths_are_refused():
    q = torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.qint8)
    with pytest.raises(ValueError, match="quantized"):
        bits(q)
    with pytest.raises(ValueError, match=r"needs torch\.int16"):
        from_bits(torch.zeros(2, dtype=torch.int32), torch.bfloat16)
