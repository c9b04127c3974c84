"""Precision policies as data: printed chains, the registry, a policy added from outside simdist/, the #8913 repro."""

import dataclasses

import pytest
import torch

from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.policy import Policy, dtype_name, register
from simdist.gradpath.probes import Divergence
from simdist.numerics.floats import bitwise_equal
from simdist.policies.catalogue import get_policy, policy_names
from simdist.reduce import make_reduction
from simdist.sources.synthetic import DEFAULT_PARAMS
from simdist.studies.repro import CORRECTION_MARKER, ReproConfig, findings, reproduce, run
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

# A new policy is one `register(Policy(...))` call, here in a test file: nothing in simdist/ or policies/ changes.
# It is registered inside the test that uses it (conftest forgets it afterwards), so it leaks into no other test.
# FP32 staging as in the #8913 fix, but the DP all-reduce pre-scales by 1/dp (Megatron's gradient_scaling_factor)
# instead of dividing after the sum; with a power-of-two DP size both orders are exact.
PRESCALED = Policy(
    name="test_fp32_staging_prescaled",
    summary="#8913 fix with the DP all-reduce pre-scaled by 1/dp",
    staging=torch.float32,
    writeback=None,
    expert_in_grad_dtype=False,
    dp_scale="prescale",
)

ROUTERS = {"router.weight", "router_partial.weight"}
DEPARTING_KINDS = {"hp grad", "fp32 master", "adam m", "adam v"}


@pytest.fixture(scope="module")
def default_repro():
    return reproduce(ReproConfig())


def test_every_registered_policy_prints_a_consistent_chain_for_every_family():
    """The chain starts in the grad dtype, every cast names a new dtype, and ``+=hp`` adds a value that is
    already in the accumulation dtype (else the buffer would take a silent cast the chain does not show)."""
    names = {"fp64", "fp32", "bf16", "fp16"}
    for name in policy_names():
        policy = get_policy(name)
        assert policy.name == name
        for family in Family:
            chain = policy.chain(family, 2)
            labels = chain.split(" | boundary:")[0].split(" -> ")
            assert labels[0] == dtype_name(policy.grad_dtype), (name, family, chain)
            dtype = labels[0]
            for label in labels[1:]:
                cast = label.split(" ")[0]
                if cast in names:
                    assert cast != dtype, (name, family, chain)  # a cast to the same dtype is not a stage
                    dtype = cast
            assert "+=hp" in labels and dtype == dtype_name(policy.accumulate), (name, family, chain)


def test_router_chains_of_the_writeback_and_the_fix():
    router = Family.ROUTER_GATE_REPLICATED
    boundary = " | boundary: fp32 -> all_reduce[dp] -> *1/dp -> adamw(fp32)"
    writeback = "bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp"
    assert get_policy("bf16_writeback").chain(router, 2) == writeback + boundary
    assert get_policy("fp32_staging").chain(router, 2) == "bf16 -> fp32 -> all_reduce[tp] -> /2 -> +=hp" + boundary


def test_an_unknown_policy_name_raises_listing_the_valid_names():
    with pytest.raises(ValueError, match="unknown policy 'bf16_writebak'") as info:
        get_policy("bf16_writebak")
    for name in policy_names():
        assert name in str(info.value)


def test_a_policy_registered_in_a_test_runs_through_the_repro_path():
    assert PRESCALED.name not in policy_names()  # nothing leaked in from another test
    register(PRESCALED)
    assert PRESCALED.name in policy_names()
    config = ReproConfig(policies=("bf16_writeback", "fp32_staging", PRESCALED.name), steps=2)
    reports, verdict = reproduce(config)
    report = next(r for r in reports if r.name == PRESCALED.name)
    assert report.chains["router.weight"] == (
        "bf16 -> fp32 -> all_reduce[tp] -> /4 -> +=hp | boundary: fp32 -> *1/dp -> all_reduce[dp] -> adamw(fp32)"
    )
    assert report.rows and all(r.bitwise_equal for r in report.rows)
    assert all(d is None for d in report.first_divergence.values())
    assert verdict.reproduced, verdict


def test_the_default_repro_reproduces_8913(default_repro):
    reports, verdict = default_repro
    assert verdict.reproduced, verdict
    writeback, staging = (next(r for r in reports if r.name == n) for n in ("bf16_writeback", "fp32_staging"))
    ranks = {r.rank for r in writeback.rows}
    assert ranks == set(range(ReproConfig().spec.world_size))
    for rank in ranks:
        for router in ROUTERS:
            differing = {r.kind for r in writeback.rows if r.rank == rank and r.param == router and not r.bitwise_equal}
            assert differing == DEPARTING_KINDS, (rank, router, differing)
    assert all(r.bitwise_equal for r in writeback.rows if r.param not in ROUTERS)
    assert {r.param for r in writeback.rows if r.param not in ROUTERS} >= {"dense.weight", "norm.weight", "expert.w1"}
    assert writeback.departs == sorted(ROUTERS)
    assert staging.rows and all(r.bitwise_equal for r in staging.rows)
    assert staging.departs == []


def _traces(name: str):
    return run(ParallelSpec(4, tp=2, ep=2), get_policy(name), PathConfig(steps=2), make_reduction("gloo"))


def test_stochastic_writeback_is_reproducible_and_differs_from_round_to_nearest():
    first, second = _traces("stochastic_writeback"), _traces("stochastic_writeback")
    for a, b in zip(first, second, strict=True):
        assert a.values.keys() == b.values.keys()
        assert all(bitwise_equal(a.values[k], b.values[k]) for k in a.values)
    nearest = _traces("bf16_writeback")
    differing = [
        k
        for a, b in zip(first, nearest, strict=True)
        for k in a.values
        if k[3] == "written_back" and not bitwise_equal(a.values[k], b.values[k])
    ]
    assert differing
    assert {k[2] for k in differing} <= ROUTERS  # dense peers are identical: their average is exact


def test_a_policy_can_carry_its_own_tp_reduction_order():
    """``Policy.tp_reduction`` replaces the world's order for the TP all-reduce, and only there."""
    from simdist.reduce import Ring, Sequential

    spec = ParallelSpec(4, tp=4, ep=1)
    params = [ParamSpec("r", Family.ROUTER_GATE_PARTIAL, (64,))]

    def initial(rank, p):
        return torch.zeros(p.shape, dtype=torch.bfloat16)

    def grads(step, micro, rank, p):
        g = torch.Generator().manual_seed(rank)
        return (torch.randn(64, generator=g) * 2.0 ** torch.randint(-30, 30, (64,), generator=g)).to(torch.bfloat16)

    base = dict(name="tp_model_probe", summary="-", staging=torch.float32, writeback=None, expert_in_grad_dtype=False)
    config = PathConfig(steps=1)

    def corrected(world_reduction, policy):
        traces = SimWorld(spec, reduction=world_reduction).run(train_rank, params, initial, grads, policy, config)
        return traces[0].get(0, 0, "r", "corrected")

    own_order = corrected(Sequential(), Policy(**base, tp_reduction=Ring(chunk_size=1)))
    assert bitwise_equal(own_order, corrected(Ring(chunk_size=1), Policy(**base)))
    assert not bitwise_equal(own_order, corrected(Sequential(), Policy(**base)))


@pytest.mark.parametrize("gas", [2, 3])
def test_deepspeed_marker_per_update_path(gas):
    """As DeepSpeed 0.19.8 ships it: the hooks path clears the correction-once marker after every hook call
    (every micro-step corrected, so #8913 alone shows), the epilogue path only at the boundary (micro-steps
    1.. of each step are accumulated uncorrected: the marker defect)."""
    spec = ParallelSpec(4, tp=2, ep=2)
    policy = get_policy("fp32_staging")  # no writeback: any difference from the oracle is the marker's
    oracle_path = PathConfig(steps=2, gas=gas, marker="per_micro_step")
    oracle = run(spec, policy, oracle_path, make_reduction("gloo"))
    for update_path, equal in (("hooks", True), ("epilogue", False)):
        config = PathConfig(steps=2, gas=gas, marker="deepspeed", update_path=update_path)
        traces = run(spec, policy, config, make_reduction("gloo"))
        hp_equal = [
            bitwise_equal(t.values[k], o.values[k])
            for t, o in zip(traces, oracle, strict=True)
            for k in t.values
            if k[3] == "hp" and k[2] in ROUTERS
        ]
        assert hp_equal and all(hp_equal) is equal, update_path
        if not equal:  # micro-step 0 is corrected on both paths; the first uncorrected one is micro-step 1
            first = {
                k[1]
                for t, o in zip(traces, oracle, strict=True)
                for k in t.values
                if k[3] == "hp" and k[2] in ROUTERS and not bitwise_equal(t.values[k], o.values[k])
            }
            assert min(first) == 1


def test_repro_verdict_names_the_marker_only_on_the_epilogue_path():
    _, hooks = reproduce(ReproConfig(gas=2, update_path="hooks"))
    assert hooks.reproduced and not hooks.marker_defect, hooks
    marker = {f.key: f for f in hooks.findings}[CORRECTION_MARKER]
    assert not marker.applies and "not exercised (the hooks update path)" in marker.line
    assert len(hooks.line.splitlines()) == 1  # a finding that does not apply is not printed
    config = ReproConfig(gas=2, update_path="epilogue")
    reports, epilogue = reproduce(config)
    # each finding on its own: the writeback on micro-step 0 AND the marker on micro-step 1
    assert epilogue.reproduced and epilogue.marker_defect, epilogue
    writeback_line, marker_line = epilogue.line.splitlines()
    assert writeback_line.startswith("#8913 REPRODUCED: bf16_writeback first departs")
    assert "after the BF16 writeback on micro-step 0" in writeback_line
    assert "router.weight, router_partial.weight;" in writeback_line
    assert marker_line.startswith("correction-once marker defect SHOWN: on the epilogue update path")
    assert "fp32_staging at 'hp' on micro-step >= 1 for expert.w1, router.weight, router_partial.weight" in marker_line
    # without its writeback (fp32_staging's report under bf16_writeback's name) the #8913 finding is not shown
    staging = next(r for r in reports if r.name == "fp32_staging")
    families = {p.name: p.family for p in DEFAULT_PARAMS}
    alone = findings(config, [dataclasses.replace(staging, name="bf16_writeback"), staging], families)
    assert not alone.reproduced and alone.marker_defect, alone
    assert alone.line.startswith("#8913 NOT reproduced as described: bf16_writeback departs at 'hp' on micro-step 0")
    # a departure neither the writeback nor the marker explains (a local gradient) is named, not absorbed
    writeback = next(r for r in reports if r.name == "bf16_writeback")
    stray = Divergence(rank=1, param="dense.weight", step=0, micro=0, stage="local")
    odd = dataclasses.replace(writeback, divergences={**writeback.divergences, "dense.weight": stray})
    assert not findings(config, [odd, staging], families).reproduced
    odd_staging = dataclasses.replace(staging, divergences={**staging.divergences, "dense.weight": stray})
    unexplained = findings(config, [writeback, odd_staging], families)
    assert not unexplained.reproduced and "fp32_staging dense.weight: first differs at 'local'" in unexplained.line


def test_error_relative_to_the_sum_of_terms_is_bounded_by_the_bf16_unit_roundoff(default_repro):
    """The writeback rounds the FP32 router average to BF16 once: |error| <= u_bf16 |average| <= u_bf16 sum|terms|
    (u = 2**-8; the FP32 adds around it cost a relative 2**-23 or so), however many ulps of the hp value that is
    where the average cancels. Masters and moments are not sums: no such figure."""
    reports, _ = default_repro
    writeback = next(r for r in reports if r.name == "bf16_writeback")
    router_hp = [r for r in writeback.rows if r.param in ROUTERS and r.kind == "hp grad"]
    assert router_hp and all(not r.bitwise_equal for r in router_hp)
    assert all(0 < r.term_relative <= 2**-8 * (1 + 2**-20) for r in router_hp), [r.term_relative for r in router_hp]
    assert all(r.term_relative is None for r in writeback.rows if r.kind in ("fp32 master", "adam m", "adam v"))
    assert all(r.term_relative == 0 for r in writeback.rows if r.kind == "hp grad" and r.bitwise_equal)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"staging": "fp32"}, "Policy 'p': staging='fp32' is not a dtype the path computes in; valid: torch.float64"),
        ({"master": torch.int64}, "master=torch.int64 is not a dtype the path computes in"),
        ({"accumulate": torch.float8_e4m3fn}, "accumulate=torch.float8_e4m3fn is not a dtype the path computes in"),
        ({"grad_dtype": None}, "grad_dtype=None is not a dtype the path computes in"),
        ({"writeback": torch.int32}, "writeback=torch.int32 is not a floating torch.dtype"),
        ({"writeback": "bf16"}, "writeback='bf16' is not a floating torch.dtype"),
        ({"correct_at": "never"}, "correct_at='never'; valid: 'micro_step', 'boundary', 'after_dp'"),
        ({"dp_scale": "half"}, "dp_scale='half'; valid: 'postscale', 'prescale', 'pre_post_divide'"),
        ({"dp_at": "end"}, "dp_at='end'; valid: 'boundary', 'micro_step'"),
        ({"expert_in_grad_dtype": "yes"}, "expert_in_grad_dtype='yes'; valid: True, False"),
        ({"tp_reduction": "ring"}, "tp_reduction='ring' is not a Reduction"),
        ({"name": "a,b"}, "Policy.name='a,b': expected a non-empty string without commas or spaces"),
        ({"name": ""}, "Policy.name='': expected a non-empty string"),
        ({"summary": None}, "summary=None must be a string"),
    ],
)
def test_a_policy_validates_its_fields_on_construction(fields, message):
    with pytest.raises(ValueError) as info:
        Policy(**{"name": "p", "summary": "-", **fields})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_valid_policies_construct_and_names_stay_unique():
    for name in policy_names():  # the catalogue passes its own checks
        assert Policy(**{f.name: getattr(get_policy(name), f.name) for f in dataclasses.fields(Policy)})
    fp8 = Policy(name="fp8_writeback", summary="-", writeback=torch.float8_e4m3fn)  # a writeback is only a cast
    assert register(fp8) is fp8 and register(fp8) is fp8  # the same policy again: a no-op
    with pytest.raises(ValueError, match="a different policy is already registered as 'fp8_writeback'"):
        register(dataclasses.replace(fp8, writeback=torch.float8_e5m2))
    with pytest.raises(ValueError, match="register\\(\\) takes a Policy, got str"):
        register("fp8_writeback")
