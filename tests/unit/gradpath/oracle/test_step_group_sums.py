"""The oracle's batched layouts (`simdist.gradpath.oracle`): group sums of a seed batch give each item the bits
the model gives it alone (two-member groups summed for the whole batch at once, NaN payloads included), and one
flat AdamW parameter gives each piece the bits of its own parameter."""

from __future__ import annotations

import pytest
import torch

from simdist.gradpath.oracle.step import group_sum, group_sums
from simdist.numerics.floats import bitwise_equal
from simdist.reduce import REDUCTION_NAMES, make_reduction
from simdist.world.spec import ParallelSpec

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


@pytest.mark.parametrize("name", REDUCTION_NAMES)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("nan", [False, True])
def test_each_batch_item_gets_the_bits_it_gets_alone(name, k, nan):
    reduction = make_reduction(name)
    members = _members(k, nan)
    together = group_sum(reduction, members, SHAPE)
    for i in range(members[0].shape[0]):
        assert bitwise_equal(together[i], reduction.reduce([m[i] for m in members])), (name, k, i)


def test_one_flat_adamw_parameter_gives_each_piece_the_bits_of_its_own_parameter():
    """The oracle's masters are one flat parameter of torch.optim.AdamW: element-wise, so each rank's and
    parameter's elements get the bits one optimizer parameter per piece gives them (masters and moments)."""
    gen = torch.Generator().manual_seed(5)
    flat = torch.nn.Parameter(torch.randn(3, 2, 7, generator=gen))  # [seed, rank, N]: pieces of 3 and 4 elements
    spans = ((0, 3), (3, 7))
    pieces = [torch.nn.Parameter(flat.detach()[:, r, a:b].clone()) for r in range(2) for a, b in spans]
    settings = {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    one, many = torch.optim.AdamW([flat], **settings), torch.optim.AdamW(pieces, **settings)
    for _ in range(3):
        grad = torch.randn(3, 2, 7, generator=gen) * 2.0 ** torch.randint(-30, 5, (3, 2, 7), generator=gen)
        flat.grad = grad
        for piece, (r, (a, b)) in zip(pieces, [(r, s) for r in range(2) for s in spans], strict=True):
            piece.grad = grad[:, r, a:b].clone()
        one.step()
        many.step()
    for piece, (r, (a, b)) in zip(pieces, [(r, s) for r in range(2) for s in spans], strict=True):
        assert bitwise_equal(flat.detach()[:, r, a:b].contiguous(), piece.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert bitwise_equal(one.state[flat][key][:, r, a:b].contiguous(), many.state[piece][key])


@pytest.mark.parametrize("name", REDUCTION_NAMES)
@pytest.mark.parametrize("kind", ["tp", "dp"])
@pytest.mark.parametrize("nan", [False, True])
def test_two_member_groups_summed_together_give_each_group_its_own_bits(name, kind, nan):
    """`oracle_sums.group_sums` sums every two-member group's pair at once (TP groups are blocks of the rank
    dimension, DP groups strided): each rank of each item gets its own group's sum, NaN payloads included."""
    reduction = make_reduction(name)
    spec = ParallelSpec(4, tp=2, ep=2)
    value = torch.stack(_members(4, nan), dim=1)  # [item, rank, *shape]
    out = group_sums(spec, reduction, kind, value, SHAPE)
    for group in spec.groups(kind):
        for i in range(value.shape[0]):
            alone = reduction.reduce([value[i, r] for r in group])
            for r in group:
                assert bitwise_equal(out[i, r], alone), (name, kind, group, i, r)
