"""The growth metrics' shortcuts (a policy with the oracle's bits, the count and range checks) give the bits of
the metrics written plainly, restated here from their definition (`simdist.studies.growth.metrics.divergence`)."""

from __future__ import annotations

import math

import pytest
import torch

from simdist.numerics.floats import bitwise_equal
from simdist.studies.growth.metrics import Reference, divergence, divergence_each


def _ordered(t: torch.Tensor) -> torch.Tensor:
    raw = t.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return torch.where(raw < 0, -(raw & 0x7FFFFFFF), raw)  # -0.0 and +0.0 both 0; order follows the value


def _in_order(rows: torch.Tensor) -> torch.Tensor:
    """``[..., N] -> [...]``: each row summed in fp64 from its first element, one Python float at a time."""
    sums = []
    for row in rows.double().reshape(-1, rows.shape[-1]).tolist():
        total = 0.0
        for value in row:
            total += value
        sums.append(total)
    return torch.tensor(sums, dtype=torch.float64).reshape(rows.shape[:-1])


def _exp2(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([math.exp2(v) for v in x.reshape(-1).tolist()], dtype=torch.float64).reshape(x.shape)


def _plain(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """The metrics as defined, without any shortcut: ulps in int64, count_nonzero, fp32 logs summed in fp64, every
    sum in element order (the same bits on every CPU kernel and for any batch shape), ``2**x`` from the C
    library."""
    a64 = actual.to(torch.float32).double().flatten(-2)
    e64 = expected.to(torch.float32).double().flatten(-2)
    norm = _in_order(e64 * e64).sqrt()
    err = _in_order((a64 - e64) * (a64 - e64)).sqrt()
    rel = torch.where(norm > 0, err / norm, torch.where(err > 0, math.inf, 0.0))
    ulps = (_ordered(actual).flatten(-2) - _ordered(expected).flatten(-2)).abs()
    if bool(torch.isfinite(err).all()):
        count = torch.count_nonzero(ulps, dim=-1)
        top = ulps.amax(dim=-1).double()
        logs = _in_order(ulps.clamp(min=1).to(torch.float32).log2())
    else:
        u = ulps.double()
        u = torch.where(torch.isnan(a64) ^ torch.isnan(e64), math.inf, torch.where(torch.isnan(a64), 0.0, u))
        count = torch.count_nonzero(u, dim=-1)
        logs = _in_order(torch.where(u != 0, u, 1.0).log2())
        top = u.amax(dim=-1)
    gmean = torch.where(count > 0, _exp2(logs / count.clamp(min=1)), 0.0)
    return torch.stack([rel, gmean, top, count.double() / ulps.shape[-1]], dim=-1)


def _case(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(actual [3, S, R, N], expected [S, R, N])``: policy 1 always holds the oracle's bits unless said."""
    gen = torch.Generator().manual_seed(len(kind))
    expected = torch.randn(4, 2, 96, generator=gen) * 2.0 ** torch.randint(-30, 10, (4, 2, 96), generator=gen)
    noise = 1 + torch.randn(3, 4, 2, 96, generator=gen) * 2.0 ** torch.randint(-30, -8, (3, 4, 2, 96), generator=gen)
    actual = expected * noise
    actual[0, 2] = expected[2]  # policy 0: seed 2 equal, the other seeds not
    actual[1] = expected
    if kind == "inf_reference":  # equal bits, but inf - inf is NaN: rel is NaN, not 0
        expected[1, 0, 5] = float("inf")
        actual[1, 1, 0, 5] = float("inf")
    elif kind == "nan_reference":
        expected[3, 1, 7] = float("nan")
        actual[1, 3, 1, 7] = float("nan")
    elif kind == "signed_zero":  # -0.0 against +0.0: bits differ, values do not (0 ulps)
        expected[0, 0, 0] = 0.0
        actual[1, 0, 0, 0] = -0.0
    elif kind == "subnormal":
        expected[2, 1, :4] = torch.tensor([1e-45, -1e-45, 1e-40, 0.0])
        actual[1, 2, 1, :4] = expected[2, 1, :4]
        actual[0, 2, 1, :4] = torch.tensor([-1e-45, 1e-45, 1e-40, 1e-45])
    elif kind == "int64":  # ordered integers past 2**30 on both sides: ulps counted in int64
        actual[2, 1, 0, 7] = -3e38
        expected[1, 0, 7] = 3e38
        actual[1, 1, 0, 7] = 3e38
    elif kind == "zeros":  # an all-zero oracle: norm 0, rel +0.0 where equal and inf where not
        expected.zero_()
        actual[1].zero_()
    return actual, expected


@pytest.mark.parametrize(
    "kind", ["finite", "inf_reference", "nan_reference", "signed_zero", "subnormal", "int64", "zeros"]
)
def test_the_metrics_give_the_bits_of_their_plain_definition(kind):
    actual, expected = _case(kind)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the growth run computes its metrics
    try:
        reference = Reference(expected)
        each = divergence_each(actual, reference)
        alone = [divergence(actual[p], reference) for p in range(3)]
        plain = [_plain(actual[p], expected) for p in range(3)]
        bf16 = divergence(expected.to(torch.bfloat16), Reference(expected.to(torch.bfloat16).float()))
        bf16_plain = _plain(expected.to(torch.bfloat16), expected.to(torch.bfloat16).float())
    finally:
        torch.set_num_threads(threads)
    for p in range(3):
        assert bitwise_equal(alone[p], plain[p]), (kind, p, alone[p], plain[p])
    if kind not in ("inf_reference", "nan_reference"):  # there one call holds the non-finite branch for every policy
        assert bitwise_equal(each, torch.stack(plain)), kind
    assert bitwise_equal(bf16, bf16_plain), kind
    if kind == "finite":
        assert bitwise_equal(alone[1], torch.zeros(4, 4, dtype=torch.float64))  # the oracle's bits: +0.0 everywhere
