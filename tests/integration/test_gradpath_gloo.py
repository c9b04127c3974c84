"""The gradient path as one rank program: SimWorld and 4 real gloo processes give the same bits."""

import pytest

import simdist
from simdist.gradpath.path import PathConfig, train_rank
from simdist.numerics.floats import bitwise_equal
from simdist.policies.catalogue import get_policy
from simdist.reduce.gloo import Gloo
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, SyntheticGradients
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2, ep=2)
CONFIG = PathConfig(steps=3, gas=2, seed=5)


def both_policies(comm):
    """Rank program: bf16_writeback and fp32_staging, 3 steps x GAS 2, every capture."""
    grads = SyntheticGradients(SPEC, seed=5)
    initial = InitialWeights(SPEC, seed=5)
    return {
        name: train_rank(comm, list(DEFAULT_PARAMS), initial, grads, get_policy(name), CONFIG)
        for name in ("bf16_writeback", "fp32_staging")
    }


@pytest.mark.gloo
def test_simworld_and_real_gloo_agree_on_every_captured_tensor():
    real = simdist.run(both_policies, SPEC, api="comm", where="gloo", timeout_s=240)
    simulated = SimWorld(SPEC, reduction=Gloo()).run(both_policies)
    compared = 0
    for rank in range(SPEC.world_size):
        for name in ("bf16_writeback", "fp32_staging"):
            sim, got = simulated[rank][name], real[rank][name]
            assert sim.values.keys() == got.values.keys()
            for key, value in sim.values.items():
                assert bitwise_equal(value, got.values[key]), key
                compared += 1
            assert sim.scalars == got.scalars  # the global gradient norm, a Python float
    assert compared > 1000
