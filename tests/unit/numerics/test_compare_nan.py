"""A NaN on one side is never "no distance": written to kill the ``ulp-nan-is-zero`` mutant of bench/mutations.py.

Only what any NaN-aware definition must keep is asserted (issue 18 item 3 is redefining the NaN figures): a
NaN against a number, or a NaN against a NaN with another payload, is a differing element, and the ulp
distance of a NaN against a number is not 0 (0 means "the same value").
"""

import torch

from simdist.numerics.compare import difference
from simdist.numerics.floats import ulp_distance


def test_a_nan_against_a_number_differs_and_has_a_nonzero_distance():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        nan = torch.tensor([float("nan"), 1.0], dtype=dtype)
        number = torch.tensor([1.0, 1.0], dtype=dtype)
        assert ulp_distance(nan, number)[0] != 0 and ulp_distance(number, nan)[0] != 0, dtype
        assert ulp_distance(nan, number)[1] == 0, dtype
        d = difference(nan, number)
        assert not d.bitwise_equal and d.differing == 1, dtype


def test_nans_with_different_payloads_differ():
    a = torch.tensor([float("nan")])
    b = a.clone()
    b.view(torch.int32)[0] |= 1
    assert difference(a, b).differing == 1
    assert difference(a, a.clone()).bitwise_equal
