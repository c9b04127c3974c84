"""Property (a) several cases at a time (`simdist.testing._internal.case_batches`,
`simdist.testing._internal.compact.run_cases`): each case is drawn as one `gradient_batches` draw is, each
gets the bits it gets alone, and a departure in any one case is found and named."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simdist.gradpath.kernel import Marker
from simdist.gradpath.oracle import oracle_values
from simdist.gradpath.path import PathConfig
from simdist.numerics.floats import bitwise_equal
from simdist.policies.catalogue import get_policy
from simdist.reduce import Sequential
from simdist.testing._internal import compact
from simdist.testing._internal.case_batches import (
    BYTE_BUDGET,
    MAX_GAS,
    MAX_STEPS,
    CaseBatch,
    case_batches,
    cases_per_example,
    decode_cases,
    oracle_case_batches,
)
from simdist.testing._internal.compact import (
    OPTIMIZER_STAGES,
    PARAMS,
    cases_depart_from_oracle,
    initial,
    run_batched,
    run_cases,
)
from simdist.testing.strategies import PEER_LAYOUTS, VALUE_MODES, parallel_specs
from simdist.testing.strategies.batches import decode_batch
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2, ep=2)
NUMEL = sum(p.shape[0] for p in PARAMS)


def _fill(kind: str, pattern: int, seed: int, size: int) -> bytes:
    """``size`` bytes: random, or one 16-bit pattern repeated (all zeros, all ones, a chosen exponent corner)."""
    if kind == "random":
        return random.Random(seed).randbytes(size)
    return pattern.to_bytes(2, "big") * (size // 2)


@given(
    parallel_specs(max_world_size=8),
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(1, 3),
    st.lists(st.sampled_from(VALUE_MODES), min_size=1, max_size=4, unique=True),
    st.lists(st.sampled_from(PEER_LAYOUTS), min_size=1, max_size=3, unique=True),
    st.sampled_from(["random", "pattern"]),
    st.sampled_from([0x0000, 0xFFFF, 0x7F7F, 0xFF80, 0x8000, 0x0001, 0x7FFF]) | st.integers(0, 0xFFFF),
    st.integers(0, 2**32),
)
def test_decode_cases_reads_each_case_as_decode_batch_reads_one(
    spec, steps, gas, cases, modes, layouts, kind, pattern, seed
):
    """The numpy decoder gives every case the bits the torch decoder (`decode_batch`, what `gradient_batches`
    uses) gives that case's bytes alone: every mode and peer layout (TP groups of any size), random bytes and
    repeated patterns at the corners (zero, all ones, the largest exponents, NaN and infinity patterns)."""
    modes, layouts = tuple(modes), tuple(layouts)
    cells = steps * gas
    size, picks = 2 * cells * spec.world_size * NUMEL, 2 * cells * len(PARAMS)
    raw = _fill(kind, pattern, seed, size * cases)
    choice = random.Random(seed + 1).randbytes(picks * cases)
    new = decode_cases(spec, PARAMS, steps, gas, raw, choice, cases, modes, layouts)
    assert new.dtype == torch.bfloat16 and new.shape == (cases, steps, gas, spec.world_size, NUMEL)
    for c in range(cases):
        old = decode_batch(
            spec,
            PARAMS,
            steps,
            gas,
            raw[c * size : (c + 1) * size],
            choice[c * picks : (c + 1) * picks],
            modes,
            layouts,
        )
        start = 0
        for p in PARAMS:
            stop = start + p.shape[0]
            for (step, micro, name), value in old.values.items():
                if name == p.name:
                    assert bitwise_equal(new[c, step, micro, :, start:stop], value), (c, step, micro, name)
            start = stop


def test_an_example_holds_as_many_cases_as_its_bytes_allow():
    """8 cases of TP2/EP2 (its most bytes are the budget), 4 on 8 ranks, never fewer than one; the count depends on
    the layout only."""
    assert cases_per_example(SPEC, 8) == 8
    assert cases_per_example(ParallelSpec(8, tp=2, ep=2), 8) == 4
    assert cases_per_example(ParallelSpec(2, tp=2), 8) == 8
    assert cases_per_example(ParallelSpec(2, tp=2), 3) == 3
    assert cases_per_example(ParallelSpec(64, tp=2), 8) == 1
    for world in (2, 4, 6, 8):
        spec = ParallelSpec(world, tp=2)
        count = cases_per_example(spec, 8)
        assert 2 * count * MAX_GAS * MAX_STEPS * world * NUMEL <= BYTE_BUDGET


@settings(max_examples=8)
@given(oracle_case_batches(max_world_size=8, cases=3))
def test_each_case_of_a_batch_gets_the_bits_it_gets_alone(case):
    """Run together (the gradient path's batch items, the oracle's batch dimension), every case's captures are the bits
    of that case run alone: the gradient path on one batch item (`run_batched`), the oracle unbatched."""
    spec, gas, steps, grads = case
    assert isinstance(grads, CaseBatch) and grads.cases == cases_per_example(spec, 3)
    staging, oracle = run_cases(spec, gas, steps, grads)
    config = PathConfig(steps=steps, gas=gas, marker=Marker.PER_MICRO_STEP)
    for c in range(grads.cases):
        alone = grads.case(c)
        engine = run_batched(
            spec,
            get_policy("fp32_staging"),
            alone,
            config,
            keep=OPTIMIZER_STAGES,
            norm=False,
            reduction=Sequential(),
        ).values
        reference = oracle_values(
            spec,
            list(PARAMS),
            initial,
            alone,
            steps=steps,
            gas=gas,
            tp_reduction=Sequential(),
            dp_reduction=Sequential(),
            keep=OPTIMIZER_STAGES,
        )
        assert staging.keys() == engine.keys() == oracle.keys() == reference.keys()
        for key in engine:
            assert bitwise_equal(staging[key][c], engine[key][0]), (c, key)
            assert bitwise_equal(oracle[key][c], reference[key]), (c, key)


def _grads(step, micro, rank, param):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((step, micro, rank, param.name)).encode()))
    return (torch.randn(param.shape, generator=gen) * 2.0 ** torch.randint(-9, 9, param.shape, generator=gen)).to(
        torch.bfloat16
    )


def _batch_with_one_live_case(live: int, cases: int = 3, steps: int = 2, gas: int = 2) -> CaseBatch:
    """``cases`` cases, all zero gradients but case ``live`` (random BF16 values, where rounding shows)."""
    values = {}
    for step in range(steps):
        for micro in range(gas):
            for p in PARAMS:
                value = torch.zeros(cases, SPEC.world_size, *p.shape, dtype=torch.bfloat16)
                value[live] = torch.stack([_grads(step, micro, r, p) for r in range(SPEC.world_size)])
                values[(step, micro, p.name)] = value
    return CaseBatch(values, cases)


def test_the_unperturbed_engine_departs_in_no_case():
    assert cases_depart_from_oracle(SPEC, 2, 2, _batch_with_one_live_case(1)) is None


@pytest.mark.parametrize("live", [0, 2])
def test_a_departure_in_one_case_is_found_and_named(monkeypatch, live):
    """bf16_writeback rounds the router's TP average to BF16: only the case with non-zero gradients departs, and
    the check names it and its first differing capture."""
    monkeypatch.setattr(compact, "get_policy", lambda name: get_policy("bf16_writeback"))
    where = cases_depart_from_oracle(SPEC, 2, 2, _batch_with_one_live_case(live))
    assert where == f"case {live}: (rank, step, micro, param, stage) = (0, 0, 0, 'router', 'hp')"


def test_captures_of_another_dtype_depart(monkeypatch):
    """bf16_only accumulates in BF16: its captures' dtype differs from the oracle's FP32."""
    monkeypatch.setattr(compact, "get_policy", lambda name: get_policy("bf16_only"))
    where = cases_depart_from_oracle(SPEC, 1, 1, _batch_with_one_live_case(0, steps=1, gas=1))
    assert where is not None and where.startswith("capture (0, 0, 'router', 'hp'): torch.bfloat16")


def test_case_batches_refuse_unknown_modes_and_layouts():
    with pytest.raises(ValueError, match="unknown value mode 'bit'"):
        case_batches(SPEC, PARAMS, 1, 1, 2, modes=("bit",))
    with pytest.raises(ValueError, match="unknown peer layout 'tie'"):
        case_batches(SPEC, PARAMS, 1, 1, 2, layouts=("tie",))
