"""The megatron-grad-reduce-fp32 case: real Megatron-Core DDP on gloo processes against megatron_grad_reduce_fp32.

Skipped when megatron-core is not installed (CI installs it through the megatron extra):
``pip install -e '.[megatron]'`` runs them. The default tests drive DP2 (two processes); TP2 x DP2 and
the simdist backend are in the slow tests.
"""

import dataclasses

import pytest
import torch

from simdist.extras import installed, not_installed_reason

if not installed("megatron"):  # found, not imported: only the ranks import it
    pytest.skip(not_installed_reason("megatron"), allow_module_level=True)

from simdist.cases.megatron_grad_reduce import Config, judge, policy_for, run_real
from simdist.numerics.floats import unit_roundoff

pytestmark = pytest.mark.gloo

DP2 = Config(layouts=("dp2",))
TP2DP2 = Config(layouts=("tp2dp2",))


@pytest.fixture(scope="module")
def dp2():
    return {"dp2": run_real(DP2, "dp2")}


def _mutated(config, real, fp32, mutation):
    policies = {flag: policy_for(flag) for flag in config.fp32_reduce}
    policies[fp32] = dataclasses.replace(policies[fp32], **mutation)
    verdict = judge(config, real, policies)
    assert not verdict.ok
    assert not next(r for r in verdict.results if r.grad_reduce_in_fp32 == fp32).claimed.bitwise_equal


def test_megatron_ddp_on_dp2_is_the_policy_chain_bitwise(dp2):
    verdict = judge(DP2, dp2)
    assert verdict.ok, verdict.summary
    results = {r.grad_reduce_in_fp32: r for r in verdict.results}
    assert results[True].main_grad_dtype == "torch.float32" and results[False].main_grad_dtype == "torch.bfloat16"
    for r in results.values():
        assert r.groups_match_spec and r.order_effect is None
        assert r.claimed.compared == 2 * 5 * 3  # ranks x params x (2 micro-steps + boundary)


@pytest.mark.parametrize(
    "fp32,mutation",
    [
        (True, {"accumulate": torch.bfloat16}),
        (True, {"dp_reduce": torch.bfloat16}),
        (False, {"accumulate": torch.float32}),
    ],
)
def test_mutated_policy_fails_the_case(dp2, fp32, mutation):
    _mutated(DP2, dp2, fp32, mutation)


@pytest.mark.slow
def test_tp2dp2_is_the_policy_bitwise_with_the_tp_correction_after_the_dp_reduction():
    real = {"tp2dp2": run_real(TP2DP2, "tp2dp2")}
    verdict = judge(TP2DP2, real)
    assert verdict.ok, verdict.summary
    results = {r.grad_reduce_in_fp32: r for r in verdict.results}
    for r in results.values():
        assert r.groups_match_spec
        assert r.claimed.compared == 4 * 5 * 3  # ranks x params x (2 micro-steps + boundary)
    # the order matters: the TP correction before the DP reduction rounds differently, in BF16 ...
    bf16 = results[False].order_effect
    assert bf16.tensors_differing > 0 and 0 < bf16.max_error_over_terms < 2 * verdict.bf16_unit_roundoff
    # ... and in FP32 too: over 25 binades the four-term FP32 sums round, in a different order
    fp32 = results[True].order_effect
    assert fp32.tensors_differing > 0 and 0 < fp32.max_error_over_terms < 2 * unit_roundoff(torch.float32)
    _mutated(TP2DP2, real, True, {"correct_at": "boundary"})
    _mutated(TP2DP2, real, True, {"correct_at": "micro_step"})
    _mutated(TP2DP2, real, False, {"accumulate": torch.float32})


@pytest.mark.slow
def test_dp4_boundary_is_the_flat_bucket_reduction():
    config = Config(layouts=("dp4",))
    verdict = judge(config, {"dp4": run_real(config, "dp4")})
    assert verdict.ok, verdict.summary
    results = {r.grad_reduce_in_fp32: r for r in verdict.results}
    for r in results.values():
        assert r.boundary_vs_flat_bucket.bitwise_equal and r.boundary_vs_flat_bucket.compared == 4 * 5
    # reducing each parameter alone (the policy) sums in another order than the flat bucket
    for fp32, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        figures = results[fp32].boundary_vs_policy
        assert figures.tensors_differing > 0 and figures.max_error_over_terms < 3 * unit_roundoff(dtype)


@pytest.mark.slow
def test_simdist_process_mode_gives_the_same_verdict():
    config = Config()
    real = {layout: run_real(config, layout, "processes") for layout in config.layouts}
    verdict = judge(config, real, where="processes")
    assert verdict.ok, verdict.summary
