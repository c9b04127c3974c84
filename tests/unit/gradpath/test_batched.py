"""One kernel, two adapters: the rank-batched gradient path gives `train_rank`'s bits on SimWorld threads.

`simdist.gradpath.batched.BatchedPath` runs every rank of a layout and a batch
of seeds in one thread; `train_rank` runs one rank per thread with modelled
collectives. Both execute `simdist.gradpath.kernel.GradPath`. Here they are
compared on raw bits: every step, rank, seed and captured tensor (every stage
of every micro-step and of the boundary), and the gradient norm.

The default suite runs a representative subset (every policy and the oracle,
every layout, every reduction, both update paths, both markers,
clipping); the whole cross product is marked slow (``pytest --run-slow``, run by ``.ci/run``).
"""

from __future__ import annotations

import itertools
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.gradpath.batched import BatchedPath, batched_sum
from simdist.gradpath.matched_policy import MATCHED_FP32
from simdist.gradpath.path import PathConfig, train_rank
from simdist.numerics.compare import same_bits
from simdist.policies.catalogue import get_policy, policy_names
from simdist.reduce import REDUCTION_NAMES, Ring, Sequential, make_reduction
from simdist.reduce.gloo import Gloo
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights
from simdist.studies.growth import BatchedGradients
from simdist.testing.strategies import float_values
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

LAYOUTS = {
    "tp2-ep2-on-4": ParallelSpec(4, tp=2, ep=2),
    "tp2-on-8-dp4": ParallelSpec(8, tp=2, ep=2),
    "tp4-on-8": ParallelSpec(8, tp=4, ep=2),
}
POLICIES = [*policy_names(), "matched_fp32"]
SEEDS = (3, 11)


def compare(spec, name, model_name, *, gas=2, steps=2, update_path="epilogue", max_norm=0.0) -> int:
    """Run ``name`` both ways on ``spec`` with every group reducing in ``model_name``; count compared tensors."""
    policy = MATCHED_FP32 if name == "matched_fp32" else get_policy(name)
    marker = "per_micro_step" if name == "matched_fp32" else "deepspeed"
    reduction = make_reduction(model_name)
    stream = BatchedGradients(spec, DEFAULT_PARAMS, list(SEEDS))
    configs = [
        PathConfig(steps=steps, gas=gas, seed=s, marker=marker, update_path=update_path, max_norm=max_norm)
        for s in SEEDS
    ]
    batched = BatchedPath(
        spec,
        DEFAULT_PARAMS,
        policy,
        configs[0],
        [InitialWeights(spec, s) for s in SEEDS],
        SEEDS,
        reduction=reduction,
        keep=None,
        norm=True,
    )
    trace = batched.run(stream.draw)
    compared = 0
    for item, seed in enumerate(SEEDS):
        threads = SimWorld(spec, reduction=reduction).run(
            train_rank, list(DEFAULT_PARAMS), InitialWeights(spec, seed), stream.local(item), policy, configs[item]
        )
        for rank, (expected, got) in enumerate(zip(threads, trace.rank_traces(item), strict=True)):
            assert expected.values.keys() == got.values.keys(), (name, seed, rank)
            for key, value in expected.values.items():
                assert same_bits(got.values[key], value), (name, model_name, seed, rank, key)
                compared += 1
            assert expected.scalars.keys() == got.scalars.keys()
            for key, value in expected.scalars.items():  # Python floats: compare their bits
                assert struct.pack("<d", value) == struct.pack("<d", got.scalars[key]), (name, seed, rank, key)
    return compared


# Every policy once, cycling through layouts and models so that each layout and each model meets several
# policies; update path, clipping and GAS vary too.
REPRESENTATIVE = [
    (
        name,
        layout,
        REDUCTION_NAMES[i % len(REDUCTION_NAMES)],
        "hooks" if i % 3 == 2 else "epilogue",
        0.01 if i % 2 else 0.0,
    )
    for i, (name, layout) in enumerate(zip(POLICIES, itertools.cycle(LAYOUTS), strict=False))
]


@pytest.mark.parametrize(("name", "layout", "reduction", "update_path", "max_norm"), REPRESENTATIVE)
def test_rank_batched_equals_per_rank_threads(name, layout, reduction, update_path, max_norm):
    """Every captured tensor of every step, micro-step, rank and seed, and the gradient norm, bit for bit."""
    assert compare(LAYOUTS[layout], name, reduction, update_path=update_path, max_norm=max_norm) > 0


def test_clipping_that_does_not_bind_changes_no_bit():
    """A max_norm far above the gradient norm leaves every buffer alone on both adapters (the rank-batched one
    selects per rank whether to scale; scaling by a coefficient above 1 would change the bits)."""
    spec = LAYOUTS["tp2-ep2-on-4"]
    assert compare(spec, "bf16_writeback", "gloo", gas=1, steps=2, max_norm=1e6) > 0


def test_the_representative_subset_covers_every_policy_layout_and_model():
    assert {c[0] for c in REPRESENTATIVE} == set(POLICIES)
    assert {c[1] for c in REPRESENTATIVE} == set(LAYOUTS)
    assert {c[2] for c in REPRESENTATIVE} == set(REDUCTION_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("reduction", REDUCTION_NAMES)
@pytest.mark.parametrize("name", POLICIES)
def test_rank_batched_equals_per_rank_threads_everywhere(name, layout, reduction):
    """The whole cross product: every policy and the oracle x layouts x reductions (GAS 2, clipping)."""
    assert compare(LAYOUTS[layout], name, reduction, max_norm=0.01) > 0


def test_the_comparison_is_not_vacuous():
    """bf16_writeback departs from the oracle in the batched gradient path; fp32_staging does not."""
    spec = LAYOUTS["tp2-ep2-on-4"]
    stream = BatchedGradients(spec, DEFAULT_PARAMS, [0, 1])
    initial = [InitialWeights(spec, s) for s in (0, 1)]

    def master(policy, marker="deepspeed"):
        path = BatchedPath(spec, DEFAULT_PARAMS, policy, PathConfig(steps=3, marker=marker), initial, [0, 1])
        path.run(stream.draw)
        return path.path.master

    oracle = master(MATCHED_FP32, "per_micro_step")
    assert not torch.equal(master(get_policy("bf16_writeback")), oracle)
    assert same_bits(master(get_policy("fp32_staging")), oracle)


# -- the batched reduction --------------------------------------------------------------------------------------------


class _Reversed(Sequential):
    """A model the batched reduction does not know: it must fall back to one reduction at a time."""

    def sum(self, tensors):
        return super().sum(list(tensors)[::-1])


BATCHED_MODELS = [make_reduction(n) for n in REDUCTION_NAMES] + [
    Ring(chunk_size=3, shift=2),
    Ring(chunk_size=1, ring=(2, 0, 1, 3)),
    Gloo(max_segment_bytes=16),
    _Reversed(),
]


@pytest.mark.parametrize("reduction", BATCHED_MODELS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_sum_is_each_reduction_in_turn(reduction, dtype):
    """``batched_sum`` over ``M`` reductions == ``model.reduce`` of each, bit for bit (any group size, shape)."""
    gen = torch.Generator().manual_seed(0)
    sizes = (4,) if isinstance(reduction, Ring) and reduction.ring is not None else (1, 2, 3, 4, 5, 8)
    for k in sizes:
        for shape in [(1,), (3,), (4, 16), (7, 5), (0,), (16, 32)]:
            x = torch.randn(k, 6, *shape, generator=gen) * torch.exp2(
                torch.randint(-20, 20, (k, 6, *shape), generator=gen).float()
            )
            x = x.to(dtype)
            expected = torch.stack([reduction.reduce(x[:, i]) for i in range(6)])
            assert same_bits(batched_sum(reduction, x), expected), (k, shape)


@pytest.mark.parametrize(
    "spec",
    [
        ParallelSpec(8, tp=2, ep=2, pp=2),
        ParallelSpec(8, tp=2, ep=2, etp=2),
        ParallelSpec(8, tp=2, ep=4),
        ParallelSpec(8, tp=2, ep=2, ep_layout="tp_lane_major"),
        ParallelSpec(6, tp=3, ep=2),
        ParallelSpec(8, tp=8, ep=1),
    ],
    ids=lambda s: s.describe(),
)
@pytest.mark.parametrize(
    "reduction", [make_reduction("gloo"), make_reduction("ring"), make_reduction("tree")], ids=repr
)
def test_batched_all_reduce_is_the_simworld_all_reduce_for_every_group_kind(spec, reduction):
    """Blocks, strided and irregular group tables (PP, ETP, TP-lane-major EP, odd sizes): per rank, the bits of
    ``comm.all_reduce`` on SimWorld threads."""
    from simdist.gradpath.batched import BatchedOps

    gen = torch.Generator().manual_seed(spec.world_size)
    x = torch.randn(2, spec.world_size, 5, 7, generator=gen) * torch.exp2(
        torch.randint(-30, 30, (2, spec.world_size, 5, 7), generator=gen).float()
    )
    ops = BatchedOps(spec, [0, 1], reduction=reduction)
    for kind in ("tp", "dp", "edp", "ep"):
        got = ops.all_reduce(x, kind)

        def program(comm, kind=kind):
            return [_reduced(comm, x[b, comm.get_rank()], kind) for b in range(2)]

        per_rank = SimWorld(spec, reduction=reduction).run(program)
        for rank, values in enumerate(per_rank):
            for b, value in enumerate(values):
                assert same_bits(got[b, rank], value), (kind, rank, b)


def _reduced(comm, value, kind):
    out = value.clone()
    comm.all_reduce(out, group=comm.group(kind))
    return out


@given(
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    st.integers(2, 6),
    st.integers(1, 3),
    st.integers(1, 40),
    st.data(),
)
def test_batched_gloo_sums_keep_gloos_nan_bits(dtype, k, count, numel, data):
    """NaN, infinities and NaN payloads (quiet and signalling): the batched gloo sum has `Gloo.sum`'s bits for
    every reduction, NaN bits included (gloo's NaN depends on which operand was NaN at which hop)."""
    values = data.draw(
        st.lists(float_values(dtype, nan=True, infinity=True), min_size=k * count * numel, max_size=k * count * numel)
    )
    stacked = torch.tensor(values, dtype=dtype).reshape(k, count, numel)
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    nan = stacked.isnan()
    nans = int(nan.sum())  # payloads for the NaNs only (drawing one per element cost half the test's time)
    payloads = data.draw(st.lists(st.integers(1, 63), min_size=nans, max_size=nans))
    raw = stacked.view(width).reshape(-1)
    raw[nan.reshape(-1)] ^= torch.tensor(payloads, dtype=width)  # other payloads, some signalling
    assert stacked.isnan().equal(nan)
    result = batched_sum(Gloo(), stacked, (numel,))
    for i in range(count):
        assert torch.equal(result[i].view(width), Gloo().sum(stacked[:, i]).view(width)), i
