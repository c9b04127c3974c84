"""The oracle's group sums of a seed batch (`simdist.gradpath.reference._reduce`): each item gets the bits the
model gives it alone, for two-member groups (summed for the whole batch at once) and NaN payloads included."""

from __future__ import annotations

import pytest
import torch

from simdist.gradpath.reference import _reduce
from simdist.numerics.floats import bitwise_equal
from simdist.reduce import MODEL_NAMES, make_model

SHAPE = (4, 16)  # a gloo member of 64 fp32 elements is cut into two chunks, whose walks start at different ranks


def _members(k: int, nan: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(k)
    members = [
        torch.randn(6, *SHAPE, generator=gen) * 2.0 ** torch.randint(-20, 20, (6, *SHAPE), generator=gen)
        for _ in range(k)
    ]
    if not nan:
        return members
    bits = [m.view(torch.int32) for m in members]
    for j, b in enumerate(bits):  # NaNs with a payload per member, in both chunks of item 2, and inf - inf in item 4
        b[2, 0, :3] = 0x7FC00001 + j
        b[2, 3, 13:] = 0x7FC00011 + j
    members[0][4, 1, 1], members[-1][4, 1, 1] = float("inf"), float("-inf")
    return members


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("nan", [False, True])
def test_each_batch_item_gets_the_bits_it_gets_alone(name, k, nan):
    model = make_model(name)
    members = _members(k, nan)
    together = _reduce(model, members, SHAPE)
    for i in range(members[0].shape[0]):
        assert bitwise_equal(together[i], model.reduce([m[i] for m in members])), (name, k, i)
