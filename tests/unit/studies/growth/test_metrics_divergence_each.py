"""`divergence_each` (the growth run's metrics, one policy at a time) gives the bits of one `divergence` call
over every policy: finite errors in int32 and int64 ulps, and the non-finite branch taken for every policy when
one policy's error is NaN or inf."""

from __future__ import annotations

import pytest
import torch

from simdist.numerics.floats import bitwise_equal
from simdist.studies.growth.metrics import Reference, divergence, divergence_each


def _case(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(kind))
    expected = torch.randn(8, 4, 300, generator=gen) * 2.0 ** torch.randint(-30, 10, (8, 4, 300), generator=gen)
    noise = 1 + torch.randn(3, 8, 4, 300, generator=gen) * 2.0 ** torch.randint(-30, -8, (3, 8, 4, 300), generator=gen)
    actual = expected * noise
    actual[..., :40] = expected[..., :40]  # equal elements: 0 ulps
    if kind == "int64":  # ordered integers past 2**30: the ulps are counted in int64
        actual[1, 2, 0, 7] = -3e38
    elif kind == "nan_one_policy":
        actual[2, 5, 1, 3] = float("nan")
    elif kind == "inf_one_policy":
        actual[0, 1, 3, 9] = float("inf")
    elif kind == "nan_reference":
        expected[4, 0, 11] = float("nan")
    return actual, expected


@pytest.mark.parametrize("kind", ["finite", "int64", "nan_one_policy", "inf_one_policy", "nan_reference"])
def test_divergence_each_gives_the_bits_of_one_call(kind):
    actual, expected = _case(kind)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the growth run computes its metrics
    try:
        reference = Reference(expected)
        whole, each = divergence(actual, reference), divergence_each(actual, reference)
    finally:
        torch.set_num_threads(threads)
    assert each.shape == whole.shape == (3, 8, 4)
    assert bitwise_equal(each, whole), kind
    if kind in ("nan_one_policy", "inf_one_policy"):  # the policies without a NaN still take the fp64 logs
        finite = [p for p in range(3) if bool(torch.isfinite(actual[p]).all())]
        alone = torch.stack([divergence(actual[p], reference) for p in finite])
        assert not bitwise_equal(alone[..., 1], whole[finite][..., 1]), "the case does not tell the branches apart"
