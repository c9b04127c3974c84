"""The fsdp2-reduce-dtype-tp case: real FSDP2 + TP on a 2x2 mesh (simdist threads) against fsdp2_reduce_dtype."""

import dataclasses

import pytest
import torch

from simdist.cases.fsdp2.tp_mesh import Config, judge, policy_for, run_real
from simdist.numerics.floats import bits

CONFIG = Config()


@pytest.fixture(scope="module")
def real():
    return run_real(CONFIG, "threads")


def _results(verdict):
    return {(r.plan, r.reduce_dtype): r for r in verdict.results}


def test_fsdp2_tp_is_the_policy_chain_bitwise_with_partial_tp_sums_in_bf16(real):
    verdict = judge(CONFIG, real)
    assert verdict.ok, verdict.summary
    results = _results(verdict)
    for (plan, _), r in results.items():
        arrivals = {p.param: p.arrives_as for p in r.params}
        assert arrivals["up.weight"] == "Shard(dim=0)" and arrivals["down.weight"] == "Shard(dim=1)"
        assert arrivals["down.bias"] == "Replicate()"
        assert arrivals["norm.weight"] == ("plain" if plan == "tp" else "Partial(sum)")
        assert r.claimed.compared == 4 * 6 * CONFIG.gas  # ranks x params x micro-steps: every parameter
        assert r.tp_peers_identical
        assert r.rounding_boundaries[0].startswith("local grads in bf16")
        assert r.rounding_boundaries[-2:] == [
            f"DP reduce-scatter in {r.reduce_dtype}",
            "+= into the sharded grad in fp32",
        ]
        assert any("Partial(sum)" in b for b in r.rounding_boundaries) == (plan == "tp_sp")
    assert results[("tp", "fp32")].partial_vs_fp32_tp_sum is None
    # reduce_dtype=fp32: summing the Partial grads over TP in FP32 (staging=fp32) is not torch's BF16 sum
    order = results[("tp_sp", "fp32")].partial_vs_fp32_tp_sum
    assert order.tensors_differing > 0
    assert 0 < order.max_error_over_terms <= verdict.bf16_unit_roundoff
    # reduce_dtype=bf16: the FP32 sum of two BF16 partials rounded to BF16 is the BF16 sum here
    assert results[("tp_sp", "bf16")].partial_vs_fp32_tp_sum.tensors_differing == 0
    for plan in ("tp", "tp_sp"):
        bf16 = results[(plan, "bf16")].vs_fp32_reduce
        assert bf16.tensors_differing > 0 and 0 < bf16.max_error_over_terms < 4 * verdict.bf16_unit_roundoff


@pytest.mark.parametrize(
    "reduce_dtype,mutation",
    [
        ("fp32", {"dp_reduce": torch.bfloat16}),
        ("bf16", {"dp_reduce": torch.float32}),
        ("fp32", {"dp_at": "boundary"}),
        ("fp32", {"accumulate": torch.bfloat16}),
        ("fp32", {"staging": torch.float32}),
    ],
)
def test_mutated_policy_fails_the_case(real, reduce_dtype, mutation):
    policies = {name: policy_for(name) for name in CONFIG.reduce_dtypes}
    policies[reduce_dtype] = dataclasses.replace(policies[reduce_dtype], **mutation)
    verdict = judge(CONFIG, real, policies)
    assert not verdict.ok
    assert not all(r.claimed.bitwise_equal for r in verdict.results if r.reduce_dtype == reduce_dtype)


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("where", ["gloo", "processes"])
def test_simdist_threads_compute_what_real_gloo_and_process_mode_compute(real, where):
    gloo = run_real(CONFIG, where)
    for threads_rank, gloo_rank in zip(real, gloo, strict=True):
        for key, run in threads_rank.items():
            other = gloo_rank[key]
            assert run.hp.keys() == other.hp.keys()
            for k, value in run.hp.items():
                assert torch.equal(bits(value), bits(other.hp[k])), (key, k)
            for k, arrival in run.arrivals.items():
                assert arrival.placement == other.arrivals[k].placement
                assert torch.equal(bits(arrival.local), bits(other.arrivals[k].local)), (key, k)
    assert judge(CONFIG, gloo, where=where).ok
