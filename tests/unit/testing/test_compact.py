"""Property (a)'s check (`simdist.testing._internal.compact.staging_departs_from_oracle`) reports a departure: its one
byte comparison of every capture must not hide one, and it names the first differing capture."""

from __future__ import annotations

import zlib

import torch

from simdist.policies.catalogue import get_policy
from simdist.testing._internal import compact
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2, ep=2)


def _grads(step, micro, rank, param):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((step, micro, rank, param.name)).encode()))
    return (torch.randn(param.shape, generator=gen) * 2.0 ** torch.randint(-9, 9, param.shape, generator=gen)).to(
        torch.bfloat16
    )


def test_the_unperturbed_engine_does_not_depart():
    assert compact.staging_departs_from_oracle(SPEC, 2, 2, _grads) is None


def test_a_policy_that_rounds_the_router_gradient_departs_at_the_first_router_capture(monkeypatch):
    monkeypatch.setattr(compact, "get_policy", lambda name: get_policy("bf16_writeback"))
    where = compact.staging_departs_from_oracle(SPEC, 2, 2, _grads)
    assert where == "(rank, step, micro, param, stage) = (0, 0, 0, 'router', 'hp')"


def test_captures_of_another_dtype_depart(monkeypatch):
    """bf16_only accumulates in BF16: its captures' dtype differs from the oracle's FP32 (the byte comparison is
    only reached when every capture's dtype and shape agree)."""
    monkeypatch.setattr(compact, "get_policy", lambda name: get_policy("bf16_only"))
    assert (
        compact.staging_departs_from_oracle(SPEC, 1, 1, _grads)
        == "(rank, step, micro, param, stage) = (0, 0, 0, 'router', 'hp')"
    )
