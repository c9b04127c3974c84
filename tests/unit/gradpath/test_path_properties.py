"""Properties of the BF16 gradient path (DeepSpeed #8913) against the FP32 oracle, found and checked by Hypothesis.

Every property runs the gradient path on the rank-batched gradient path
(`simdist.gradpath.batched.BatchedPath`: every rank in one thread, the same
kernel `train_rank` runs, proven bitwise equal to it in
``tests/unit/gradpath/test_batched.py``) for a drawn topology and drawn BF16 local
gradients (`simdist.testing.strategies.gradient_batches`: bytes read as BF16 bits --
zeros, small integers, subnormals, huge magnitudes -- with cancellation between
TP peers and TP averages on BF16 rounding ties) and compares captures bit for
bit, or against a stated rounding bound.
"""

from fractions import Fraction

import pytest
import torch
from hypothesis import assume, find, given, settings
from hypothesis import strategies as st

from simdist.gradpath.families import Correction, Family, ParamSpec
from simdist.gradpath.matched_policy import MATCHED_FP32
from simdist.gradpath.path import PathConfig
from simdist.gradpath.probes import BOUNDARY, first_divergence
from simdist.numerics.floats import bitwise_equal, float_format, unit_roundoff
from simdist.policies.catalogue import get_policy, policy_names
from simdist.reduce import Reduction, Ring, Sequential, Tree
from simdist.reduce.gloo import Gloo
from simdist.testing._internal.case_batches import oracle_case_batches
from simdist.testing._internal.compact import (
    OPTIMIZER_STAGES,
    PARAMS,
    ROUTER,
    SHARD,
    cases_depart_from_oracle,
    run_batched,
    run_oracle,
)
from simdist.testing.strategies import (
    PEER_LAYOUTS,
    VALUE_MODES,
    bf16_gradients,
    bf16_values,
    gradient_batches,
    parallel_specs,
    policies,
)
from simdist.world.spec import ParallelSpec

PER_MICRO = "per_micro_step"
BF16 = torch.bfloat16
SEQUENTIAL = Sequential()
REDUCTIONS = [Sequential(), Tree(), Ring(chunk_size=1, shift=1), Gloo()]


def run(spec, policy, grads, config, keep=None, *, reduction=SEQUENTIAL, params=PARAMS, norm=True):
    """Every rank's `Trace` of ``policy`` on ``spec`` (rank-batched gradient path), each group summing in
    ``reduction``."""
    return run_batched(
        spec, policy, grads, config, keep=keep, reduction=reduction, params=params, norm=norm
    ).rank_traces(0)


def assert_bitwise(traces, oracle, stages) -> None:
    """The two runs captured the same keys for ``stages`` on every rank, with the same bits."""
    for trace, reference in zip(traces, oracle, strict=True):
        keys = {k for k in trace.values if k[3] in stages}
        assert keys == {k for k in reference.values if k[3] in stages}, trace.rank
        assert keys, "nothing was captured"
        for key in keys:
            assert bitwise_equal(trace.values[key], reference.values[key]), (trace.rank, key)


def same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal after an exact widening of both to fp64 (for captures of different dtypes)."""
    return bitwise_equal(a.double(), b.double())


# -- (a) fp32_staging is the FP32 oracle ---------------------------------------------------------------------------


@given(oracle_case_batches())
def test_fp32_staging_is_bitwise_equal_to_the_fp32_oracle(case):
    """With the correction applied every micro-step, the #8913 fix is the independent FP32 oracle, bit for bit.

    Any layout with 2-rank TP groups (world <= 8, any PP/EP/ETP), GAS 1..4 and
    any BF16 local gradients: hp buffers after every micro-step, DP-reduced
    gradients, FP32 masters and both Adam moments after every step. Each example
    holds up to 8 independent gradient sets (`simdist.testing._internal.case_batches`), every
    one judged by the oracle.
    """
    assert cases_depart_from_oracle(*case) is None


@st.composite
def marker_cases(draw):
    """TP2 layouts, GAS 2..4, small-integer gradients whose router peers differ on micro-step 1."""
    spec = draw(parallel_specs(max_world_size=8, tp=2))
    gas = draw(st.integers(2, 4))
    grads = draw(gradient_batches(spec, PARAMS, 1, gas, modes=("integers",), layouts=("independent",)))
    differ = any(
        not torch.equal(grads.get(0, 1, group[0], ROUTER.name), grads.get(0, 1, r, ROUTER.name))
        for group in spec.groups("tp")
        for r in group
    )
    assume(differ)
    return spec, gas, grads


@given(marker_cases(), st.sampled_from(["bf16_writeback", "fp32_staging"]))
def test_deepspeed_marker_leaves_micro_steps_after_the_first_uncorrected(case, name):
    """FINDING: with DeepSpeed's correction-once marker (cleared only at the boundary) and GAS >= 2, micro-steps
    2..GAS of routers, experts and dense parameters are added to the buffer without the TP correction.

    So *both* bf16_writeback and the #8913 fix fp32_staging leave the oracle at micro-step 1 (0-based): the
    router's first divergent capture is 'hp' of micro-step 1, step 0. The gradients are small integers, so
    micro-step 0 (whose TP average is BF16-representable) matches exactly even for bf16_writeback, and the
    departure is the marker's alone. Model-parallel shards are never corrected and stay equal.
    """
    spec, gas, grads = case
    traces = run(spec, get_policy(name), grads, PathConfig(steps=1, gas=gas, marker="deepspeed"))
    oracle = run(spec, MATCHED_FP32, grads, PathConfig(steps=1, gas=gas, marker=PER_MICRO))
    divergence = first_divergence(traces, oracle)
    router = divergence[ROUTER.name]
    assert router is not None and (router.step, router.micro, router.stage) == (0, 1, "hp"), router
    assert divergence[SHARD.name] is None


# -- (b) bf16_writeback: one round-to-nearest of the corrected value per micro-step -------------------------------


def half_bf16_ulp(value: torch.Tensor) -> torch.Tensor:
    """Half the BF16 ulp of the binade of each finite ``value`` (fp64); subnormals use the subnormal quantum."""
    fmt = float_format(BF16)
    _, exponent = torch.frexp(value.double())
    binade = torch.clamp(exponent - 1, min=fmt.emin)  # floor(log2|x|), clamped to the subnormal binade
    return torch.ldexp(torch.ones_like(value, dtype=torch.float64), binade - fmt.precision)


@given(st.data())
def test_bf16_writeback_is_one_round_to_nearest_of_the_corrected_value(data):
    """Per micro-step, bf16_writeback's BF16 value is exactly ``corrected.to(bfloat16)`` of the oracle's FP32
    corrected value, at most half a BF16 ulp away (zero error when the corrected value is zero).

    Routers and dense parameters are compared at 'written_back'; routed experts, which DeepSpeed divides in
    place in BF16 (no writeback stage), at 'corrected'. Both runs correct every micro-step (``per_micro_step``).
    """
    spec = data.draw(parallel_specs(max_world_size=8, tp=2))
    gas = data.draw(st.integers(1, 3))
    grads = data.draw(gradient_batches(spec, PARAMS, 1, gas))
    keep = frozenset({"corrected", "written_back"})
    config = PathConfig(steps=1, gas=gas, marker=PER_MICRO)
    writeback = run(spec, get_policy("bf16_writeback"), grads, config, keep)
    oracle = run(spec, MATCHED_FP32, grads, config, keep)
    compared = 0
    for trace, reference in zip(writeback, oracle, strict=True):
        for param in PARAMS:
            if param.family.correction(spec.tp) is Correction.SKIP:
                continue
            for micro in range(gas):
                corrected = reference.get(0, micro, param.name, "corrected")
                stage = "written_back" if (0, micro, param.name, "written_back") in trace.values else "corrected"
                value = trace.get(0, micro, param.name, stage)
                assert value.dtype == BF16
                assert bitwise_equal(value, corrected.to(BF16)), (trace.rank, param.name, micro)
                error = (value.double() - corrected.double()).abs()
                assert bool((error <= half_bf16_ulp(corrected)).all()), (trace.rank, param.name, micro)
                compared += 1
    assert compared


def router_hp_departs(peers) -> bool:
    """Whether bf16_writeback's router hp differs from the oracle's on TP2 (two ranks, one router element)."""
    spec = ParallelSpec(2, tp=2, ep=1)
    param = ParamSpec("router", Family.ROUTER_GATE_REPLICATED, (1,))

    def grads(step, micro, rank, p):
        return peers[rank].clone()

    def hp(policy):
        config = PathConfig(steps=1, marker=PER_MICRO)
        traces = run(spec, policy, grads, config, frozenset({"hp"}), params=[param], norm=False)
        return [t.get(0, 0, "router", "hp") for t in traces]

    return any(not bitwise_equal(a, b) for a, b in zip(hp(get_policy("bf16_writeback")), hp(MATCHED_FP32), strict=True))


def test_hypothesis_finds_where_bf16_writeback_departs():
    """Hypothesis searches BF16 router gradients on two TP ranks for a departing hp and shrinks it.

    Shrunk example (hypothesis 6.155, derandomized), full BF16 range: rank 0 holds ``0.0``, rank 1 holds
    ``2**-133 = 9.183549615799121e-41`` (the smallest BF16 subnormal). The FP32 average is ``2**-134``, exactly
    half-way between BF16 ``0`` and ``2**-133``; the writeback rounds the tie to even, ``0``, so
    bf16_writeback's hp is ``0.0`` where the oracle's is ``2**-134``.

    Without subnormals: rank 0 ``1.0``, rank 1 ``1.0078125`` (``1 + 2**-7``, the next BF16 value). The FP32
    average ``1.00390625`` is again a BF16 tie and rounds to ``1.0``; the oracle keeps ``1.00390625``.
    """
    quiet = settings(database=None, max_examples=500, derandomize=True, deadline=None)
    pair = st.tuples(bf16_gradients((1,)), bf16_gradients((1,)))
    found = find(pair, router_hp_departs, settings=quiet)
    assert [t.double().item() for t in found] == [0.0, 2.0**-133]
    normal = bf16_values(subnormals=False)
    pair = st.tuples(bf16_gradients((1,), normal), bf16_gradients((1,), normal))
    found = find(pair, router_hp_departs, settings=quiet)
    assert [t.double().item() for t in found] == [1.0, 1.0078125]


# -- (c) representable TP averages hide the defect -------------------------------------------------------------------


def comparable_capture(policy, trace, param: ParamSpec):
    """The capture of ``policy``'s run that must equal the oracle's first-micro-step TP-corrected buffer.

    * correction at the boundary before the DP reduction: the buffer after its once-per-step TP correction
      ('boundary_corrected'); with GAS 1 it holds the one micro-step's corrected gradient;
    * correction after the DP reduction (Megatron's ``finalize_model_grads``): no TP-corrected value exists
      before the DP sum, whose order differs from the oracle's on purpose; nothing to compare (``None``);
    * DP reduction every micro-step (FSDP2): its hp already holds the DP reduction, whose pre/post division
      differs from the oracle's on purpose, so the TP-corrected value ('corrected') is compared; families with
      no correction have nothing to compare before the DP reduction (``None``);
    * otherwise: 'hp' after micro-step 0 (BF16 for bf16_only, compared exactly in fp64).
    """
    if policy.correct_at == "boundary":
        return "boundary_corrected", trace.get(0, BOUNDARY, param.name, "boundary_corrected")
    if policy.correct_at == "after_dp":
        return None, None
    if policy.dp_at == "micro_step":
        key = (0, 0, param.name, "corrected")
        return ("corrected", trace.values[key]) if key in trace.values else (None, None)
    return "hp", trace.get(0, 0, param.name, "hp")


@given(
    parallel_specs(max_world_size=4, tp=2),
    st.sampled_from([("independent", ("integers",)), ("identical", ("integers", "near_one", "huge"))]),
    st.data(),
)
def test_every_policy_matches_the_oracle_when_the_tp_average_is_bf16_representable(spec, kind, data):
    """Small-integer peers (e.g. 4.0 and 6.0: average 5.0) or identical peers (average = the BF16 value itself):
    every registered policy's TP-corrected buffer on the first micro-step equals the FP32 oracle's.

    This is why DeepSpeed's own unit test (peers holding 4.0, corrected to 2.0, and identical TP peers) misses
    #8913: when the FP32 result of the TP correction is exactly representable in BF16, the BF16 writeback
    rounds nothing, the BF16-only arithmetic is exact (integer sums of 8 bits or fewer, division by 2) and
    stochastic rounding of an exact value is exact. The defect needs TP peers whose average has a ninth
    significant bit (see `test_hypothesis_finds_where_bf16_writeback_departs`). Identical values are drawn
    without subnormals (small integers, binades near one, the top binades below ``2**121``), so that ``x / 2``
    (experts, in BF16) stays normal and ``x + x`` stays finite.
    """
    layout, modes = kind
    grads = data.draw(gradient_batches(spec, PARAMS, 1, 1, modes=modes, layouts=(layout,)))
    config = PathConfig(steps=1, gas=1, marker=PER_MICRO)
    keep = frozenset({"hp", "corrected", "boundary_corrected"})
    oracle = run(spec, MATCHED_FP32, grads, config, keep)
    for name in policy_names():
        policy = get_policy(name)
        traces = run(spec, policy, grads, config, keep)
        for trace, reference in zip(traces, oracle, strict=True):
            for param in PARAMS:
                stage, value = comparable_capture(policy, trace, param)
                if stage is None:
                    continue
                expected = reference.get(0, 0, param.name, "corrected" if stage == "corrected" else "hp")
                assert same_value(value, expected), (name, trace.rank, param.name, stage)


# -- (d) NaN, Inf and zero-size parameters ---------------------------------------------------------------------------


@given(
    parallel_specs(max_world_size=4, tp=2),
    st.sampled_from(["fp32_staging", "bf16_writeback"]),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.data(),
)
def test_nan_and_inf_in_one_local_router_grad_reach_tp_peers_and_masters(spec, name, bad, data):
    """A NaN/Inf in one rank's local router gradient shows up in the corrected value and hp of every TP peer
    (NaN, or an infinity of the sign IEEE-754 arithmetic gives) and makes the FP32 masters of every rank that
    DP-reduces with those peers NaN; the other elements stay finite."""
    grads = data.draw(gradient_batches(spec, PARAMS, 1, 1, modes=("zeros", "integers", "near_one", "tiny")))
    rank = data.draw(st.integers(0, spec.world_size - 1))
    index = data.draw(st.integers(0, ROUTER.shape[0] - 1))
    grads.get(0, 0, rank, ROUTER.name)[index] = bad
    keep = frozenset({"corrected", "hp", "master"})
    traces = run(spec, get_policy(name), grads, PathConfig(steps=1, marker=PER_MICRO), keep)
    peers = spec.group_of("tp", rank)
    exact = sum(grads.get(0, 0, r, ROUTER.name)[index].double() for r in peers) / spec.tp
    others = [i for i in range(ROUTER.shape[0]) if i != index]
    for r in peers:
        for stage in ("corrected", "hp"):
            got = traces[r].get(0, 0, ROUTER.name, stage)[index].double()
            assert bool(torch.isnan(got)) == bool(torch.isnan(exact)), (r, stage)
            assert torch.isnan(exact) or got == exact, (r, stage, got, exact)
            assert bool(torch.isfinite(traces[r].get(0, 0, ROUTER.name, stage)[others]).all()), (r, stage)
    reached = {m for r in peers for m in spec.group_of("dp", r)}
    for r in range(spec.world_size):
        master = traces[r].get(0, BOUNDARY, ROUTER.name, "master")
        assert bool(torch.isnan(master[index])) == (r in reached), r
        assert bool(torch.isfinite(master[others]).all()), r


@pytest.mark.parametrize("marker", ["deepspeed", PER_MICRO])
@pytest.mark.parametrize("spec", [ParallelSpec(4, tp=2, ep=2), ParallelSpec(8, tp=2, ep=2, pp=2)])
def test_zero_size_parameters_run_the_whole_path_for_every_policy(spec, marker):
    """Shape-(0,) parameters of every family go through every stage of every registered policy."""
    params = [ParamSpec(f"empty_{p.family.value}", p.family, (0,)) for p in PARAMS] + [ROUTER]

    def grads(step, micro, rank, param):
        return torch.full(param.shape, 0.25 * (rank + 1), dtype=BF16)

    for name in policy_names():
        traces = run(spec, get_policy(name), grads, PathConfig(steps=2, gas=2, marker=marker), params=params)
        for trace in traces:
            for param in params[:-1]:
                for stage in ("hp", "dp_reduced", "master", "adam_m", "adam_v", "param"):
                    step_micro = (1, BOUNDARY) if stage != "hp" else (1, 1)
                    assert trace.get(*step_micro, param.name, stage).shape == (0,), (name, param.name, stage)
            assert bool(torch.isfinite(trace.get(1, BOUNDARY, ROUTER.name, "master")).all()), name
            assert trace.scalars[(1, "grad_norm")] > 0, name


@given(policies(), st.sampled_from(list(Family)), st.data())
def test_every_policy_captures_exactly_the_stages_of_its_chain(policy, family, data):
    """What is printed is what runs: a micro-step captures exactly the probe points its stage list names."""
    spec = ParallelSpec(2, tp=2, ep=1)
    param = ParamSpec("p", family, (2,))
    grads = data.draw(gradient_batches(spec, [param], 1, 1, modes=("integers",)))
    traces = run(spec, policy, grads, PathConfig(steps=1, marker=PER_MICRO), params=[param])
    expected = {"local"} | {s.capture for s in policy.micro_step_stages(family, spec.tp) if s.capture}
    for trace in traces:
        assert {k[3] for k in trace.values if k[1] == 0} == expected


# -- (e) TP groups of 4: reduction order ------------------------------------------------------------------------------

TP4_SPECS = [ParallelSpec(4, tp=4, ep=2), ParallelSpec(8, tp=4, ep=2)]


@given(st.sampled_from(TP4_SPECS), st.sampled_from(REDUCTIONS), st.integers(1, 2), st.data())
def test_fp32_staging_matches_the_oracle_under_the_same_reduction_model(spec, reduction, gas, data):
    """TP4: with one reduction for both runs, fp32_staging equals the independent oracle bit for bit."""
    grads = data.draw(gradient_batches(spec, PARAMS, 1, gas))
    config = PathConfig(steps=1, gas=gas, marker=PER_MICRO)
    staging = run(spec, get_policy("fp32_staging"), grads, config, OPTIMIZER_STAGES, reduction=reduction)
    oracle = run_oracle(spec, grads, 1, gas, keep=OPTIMIZER_STAGES, reduction=reduction)
    assert_bitwise(staging, oracle, OPTIMIZER_STAGES)


@given(st.sampled_from(TP4_SPECS), st.sampled_from(REDUCTIONS), st.sampled_from(REDUCTIONS), st.data())
def test_a_different_reduction_order_stays_within_the_summation_bound(spec, reduction, oracle_model, data):
    """TP4, GAS 1: fp32_staging under one reduction and the oracle under another each compute the
    corrected value within the recursive-summation bound ``(tp-1) * u_fp32 * sum|x_i|`` of the exact TP sum
    (divided by ``tp`` for AVERAGE: the division by 4 is exact), so they differ by at most twice that; the hp
    buffer (``0 + corrected``) inherits the same bound."""
    grads = data.draw(gradient_batches(spec, PARAMS, 1, 1))
    config = PathConfig(steps=1, gas=1, marker=PER_MICRO)
    keep = frozenset({"corrected", "hp"})
    staging = run(spec, get_policy("fp32_staging"), grads, config, keep, reduction=reduction)
    oracle = run(spec, MATCHED_FP32, grads, config, keep, reduction=oracle_model)
    u = Fraction(unit_roundoff(torch.float32))
    for param in PARAMS:
        correction = param.family.correction(spec.tp)
        if not correction.reduces:
            continue
        scale = Fraction(1, spec.tp) if correction.divides else Fraction(1)
        for group in spec.groups("tp"):
            local = [grads.get(0, 0, r, param.name).double().reshape(-1).tolist() for r in group]
            columns = list(zip(*local, strict=True))
            exact = [sum(map(Fraction, col), Fraction(0)) * scale for col in columns]
            bound = [(spec.tp - 1) * u * sum(abs(Fraction(v)) for v in col) * scale for col in columns]
            for r in group:
                for stage in ("corrected", "hp"):
                    a = staging[r].get(0, 0, param.name, stage).double().reshape(-1).tolist()
                    b = oracle[r].get(0, 0, param.name, stage).double().reshape(-1).tolist()
                    for x, y, s, e in zip(a, b, exact, bound, strict=True):
                        assert abs(Fraction(x) - s) <= e and abs(Fraction(y) - s) <= e, (param.name, r, stage)
                        assert abs(Fraction(x) - Fraction(y)) <= 2 * e, (param.name, r, stage)


# -- the gradient path against an independent transcription ---------------------------------------------------------


def reduced_by_loops(
    spec: ParallelSpec,
    params: list[ParamSpec],
    local_grads,
    step: int,
    gas: int,
    *,
    dtype: torch.dtype,
    tp_reduction: Reduction,
    dp_reduction: Reduction,
) -> dict[tuple[int, str], torch.Tensor]:
    """``{(rank, param): DP-reduced gradient}`` for one step, by explicit TP-then-DP reduction in ``dtype``: loops
    over the TP and DP groups, no rank program, no gradient-path code (the family table's correction rule aside)."""
    tp = spec.tp
    result = {}
    for p in params:
        correction = p.family.correction(tp)
        hp = {r: torch.zeros(p.shape, dtype=dtype) for r in range(spec.world_size)}
        for micro in range(gas):
            staged = {r: local_grads(step, micro, r, p).to(dtype) for r in range(spec.world_size)}
            for group in spec.groups("tp"):
                if correction.reduces:
                    total = tp_reduction.reduce([staged[r] for r in group])
                    corrected = {r: total for r in group}
                else:
                    corrected = {r: staged[r] for r in group}
                for r in group:
                    value = corrected[r] / tp if correction.divides else corrected[r]
                    hp[r] += value
        kind = "edp" if p.family is Family.EXPERT else "dp"
        for group in spec.groups(kind):
            reduced = dp_reduction.reduce([hp[r] for r in group]) * (1.0 / spec.dp)
            for r in group:
                result[(r, p.name)] = reduced
    return result


REFERENCE_SPECS = [
    ParallelSpec(4, tp=2, ep=2),
    ParallelSpec(8, tp=2, ep=4),
    ParallelSpec(8, tp=2, ep=2, etp=2),
    ParallelSpec(8, tp=4, ep=2),
    ParallelSpec(8, tp=2, ep=2, pp=2),
]


@given(st.sampled_from(REFERENCE_SPECS), st.sampled_from(REDUCTIONS), st.integers(1, 3), st.data())
def test_gradient_path_dp_reduced_gradients_equal_a_transcription_by_loops(spec, reduction, gas, data):
    """fp32_staging's DP-reduced gradients (correction every micro-step) equal `reduced_by_loops`,
    which loops over the TP and DP groups explicitly with no rank program, bit for bit, for every step."""
    steps = 2
    grads = data.draw(gradient_batches(spec, PARAMS, steps, gas))
    config = PathConfig(steps=steps, gas=gas, marker=PER_MICRO)
    traces = run(spec, get_policy("fp32_staging"), grads, config, frozenset({"dp_reduced"}), reduction=reduction)
    for step in range(steps):
        expected = reduced_by_loops(
            spec, PARAMS, grads, step, gas, dtype=torch.float32, tp_reduction=reduction, dp_reduction=reduction
        )
        for (rank, name), value in expected.items():
            assert bitwise_equal(traces[rank].get(step, BOUNDARY, name, "dp_reduced"), value), (step, rank, name)


# -- the cheap gradient strategy itself -------------------------------------------------------------------------------


@given(parallel_specs(max_world_size=8, tp=2), st.sampled_from(PEER_LAYOUTS), st.sampled_from(VALUE_MODES), st.data())
def test_gradient_batches_hold_what_their_modes_and_layouts_say(spec, layout, mode, data):
    """Finite BF16 values below the overflow-safe bound, in the drawn mode, with the TP peers laid out as asked."""
    grads = data.draw(gradient_batches(spec, PARAMS, 1, 2, modes=(mode,), layouts=(layout,)))
    assert set(grads.values) == {(0, m, p.name) for m in range(2) for p in PARAMS}
    for (_, _, name), value in grads.values.items():
        shape = next(p.shape for p in PARAMS if p.name == name)
        assert value.dtype == BF16 and value.shape == (spec.world_size, *shape)
        assert bool(torch.isfinite(value).all()) and bool((value.double().abs() < 2.0**121).all())
        for group in spec.groups("tp"):
            a, b = value[group[0]].double(), value[group[1]].double()
            if layout == "identical":
                assert torch.equal(a, b)
            elif layout == "cancellation":
                assert torch.equal(a, -b)
            elif layout == "ties":  # x in {1, 1.5, 3} x 2**k and half a BF16 ulp of x: |x| + h is a rounding tie
                _, exponent = torch.frexp(a)
                assert torch.equal(b, torch.ldexp(torch.ones_like(a), exponent - 9))
                assert bool(((a.abs() + b).to(BF16).double() != a.abs() + b).all())
            elif layout == "midpoint":  # neighbours: their mean is half-way between two BF16 values
                assert bool(((a - b).abs() > 0).all() | (a == b).all() | (a.abs() == 2.0**121).any())
        if layout in ("independent", "identical", "cancellation") and mode == "zeros":
            assert not bool(value.any())
        if layout == "independent" and mode == "integers":
            assert bool((value.double() == value.double().round()).all() & (value.double().abs() <= 16).all())


def test_gradient_batches_refuse_unknown_modes_and_layouts():
    spec = ParallelSpec(2, tp=2, ep=1)
    with pytest.raises(ValueError, match="unknown value mode 'bit'; valid: zeros, integers"):
        gradient_batches(spec, PARAMS, 1, 1, modes=("bit",))
    with pytest.raises(ValueError, match="unknown peer layout 'tie'; valid: independent"):
        gradient_batches(spec, PARAMS, 1, 1, layouts=("tie",))
