"""Megatron's order at the boundary, checked against plain loops: the DP all-reduce first, then the TP correction.

``correct_at="after_dp"`` (Megatron-Core's finalize_model_grads) and ``"boundary"`` sum the same four values
of a TP2 x DP2 router gradient in different pairings; with gradients over 33 binades the FP32 sums round, so
the pairing shows in the bits. The expected values are computed here from the local gradients with explicit
loops over the spec's groups (no kernel, no Policy stage list); every two-member sum is one IEEE addition, so
no reduction's order is involved.
"""

from __future__ import annotations

import torch

from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.probes import BOUNDARY
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.sources.synthetic import InitialWeights, SyntheticGradients
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2, ep=2)
ROUTER = ParamSpec("router.weight", Family.ROUTER_GATE_REPLICATED, (8, 64))


def test_megatron_reduces_over_dp_before_the_tp_correction():
    grads = SyntheticGradients(SPEC, seed=5, spread=16)
    policy = get_policy("megatron_grad_reduce_fp32")
    config = PathConfig(steps=1, gas=1, seed=5, marker="per_micro_step")
    traces = SimWorld(SPEC, reduction=make_reduction("gloo")).run(
        train_rank, [ROUTER], InitialWeights(SPEC, 5), grads, policy, config
    )
    local = {r: grads(0, 0, r, ROUTER).float() for r in range(SPEC.world_size)}
    dp = len(SPEC.group_of("dp", 0))

    def dp_sum(rank: int) -> torch.Tensor:
        first, second = (local[m] * (1.0 / dp) for m in SPEC.group_of("dp", rank))
        return first + second

    def tp_average(rank: int) -> torch.Tensor:
        first, second = (local[m] for m in SPEC.group_of("tp", rank))
        return (first + second) / 2

    differ = 0
    for rank, trace in enumerate(traces):
        a, b = (dp_sum(m) for m in SPEC.group_of("tp", rank))
        expected = (a + b) / 2
        got = trace.get(0, BOUNDARY, ROUTER.name, "dp_reduced")
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), rank
        # the other pairing (TP correction first) differs: the check above can tell the orders apart
        c, d = (tp_average(m) * (1.0 / dp) for m in SPEC.group_of("dp", rank))
        differ += int(((c + d).view(torch.int32) != expected.view(torch.int32)).sum())
    assert differ > 0
