"""Strategies that draw what the gradient path runs: registered precision policies (`policies`) and property (a)'s
cases (`oracle_cases`: a layout, GAS, steps and a gradient batch for the compact workload of
`simdist.testing._internal.compact`). Public through `simdist.testing.strategies`."""

from __future__ import annotations

from hypothesis import strategies as st

from simdist.testing._internal.compact import PARAMS as COMPACT_PARAMS
from simdist.testing.strategies.batches import gradient_batches
from simdist.testing.strategies.layouts import parallel_specs
from simdist.world.spec import ParallelSpec


def policies() -> st.SearchStrategy:
    """Registered precision policies (`simdist.gradpath.policy.Policy`), sampled by name from `policy_names`.

    The names are read when the strategy is first drawn from, so policies
    registered after this call (for instance by a test module) are included.
    """
    from simdist.policies.catalogue import get_policy, policy_names

    return st.deferred(lambda: st.sampled_from(policy_names()).map(get_policy))


@st.composite
def oracle_cases(draw, spec: ParallelSpec | None = None, max_world_size: int = 8):
    """``(spec, gas, steps, gradients)`` for property (a): a layout with 2-rank TP groups (or ``spec``),
    GAS 1..4, 1..2 steps, and a `GradientBatch` drawn cheaply (`simdist.testing.strategies.gradient_batches`)."""
    if spec is None:
        spec = draw(parallel_specs(max_world_size=max_world_size, tp=2))
    gas = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 2))
    return spec, gas, steps, draw(gradient_batches(spec, COMPACT_PARAMS, steps, gas))
