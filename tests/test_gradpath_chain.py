"""The printed chain is the stage list that runs: micro-step, DP reduction with its dtype, optimizer."""

import dataclasses

import pytest

from simdist.gradpath.catalogue import get_policy, policy_names
from simdist.gradpath.families import Family

ROUTER = Family.ROUTER_GATE_REPLICATED


def test_the_dp_reduction_and_its_dtype_are_printed():
    """bf16_writeback and its BF16-communication twin differ only in the DP reduction's dtype: so do the chains."""
    fp32 = get_policy("bf16_writeback").chain(ROUTER, 2)
    bf16 = get_policy("bf16_writeback_bf16_comm").chain(ROUTER, 2)
    assert fp32.endswith("| boundary: fp32 -> all_reduce[dp] -> *1/dp -> adamw(fp32)")
    assert bf16.endswith("| boundary: fp32 -> bf16 -> all_reduce[dp] -> *1/dp -> fp32 -> adamw(fp32)")


def test_a_dp_reduction_every_micro_step_is_printed_where_it_runs():
    """FSDP2 reduces over DP every micro-step with FSDP's pre/post divide factors, before ``+=hp``; a TP
    reduction runs before its cast to the reduce dtype, in BF16 (confirmed by the fsdp2-reduce-dtype-tp case)."""
    tail = " -> +=hp | boundary: fp32 -> adamw(fp32)"
    assert get_policy("fsdp2_reduce_dtype").chain(ROUTER, 2) == (
        "bf16 -> all_reduce[tp] -> /2 -> fp32 -> /pre -> all_reduce[dp] -> /post" + tail
    )
    assert get_policy("fsdp2_reduce_dtype").chain(ROUTER, 2, dp=8) == (
        "bf16 -> all_reduce[tp] -> /2 -> fp32 -> /4 -> all_reduce[dp] -> /2" + tail
    )


def test_experts_reduce_over_edp_and_megatron_corrects_after_the_dp_reduction():
    """Megatron-Core's finalize_model_grads runs the TP reduction after the DP all-reduce (confirmed against
    megatron-core 0.16.1 by the megatron-grad-reduce-fp32 case); ``correct_at="boundary"`` runs it before."""
    assert "all_reduce[edp]" in get_policy("fp32_staging").chain(Family.EXPERT, 2)
    megatron = get_policy("megatron_grad_reduce_fp32")
    assert megatron.chain(ROUTER, 2, dp=4) == (
        "bf16 -> fp32 -> +=hp | boundary: fp32 -> *1/4 -> all_reduce[dp] -> all_reduce[tp] -> /2 -> adamw(fp32)"
    )
    assert dataclasses.replace(megatron, correct_at="boundary").chain(ROUTER, 2, dp=4) == (
        "bf16 -> fp32 -> +=hp | boundary: fp32 -> all_reduce[tp] -> /2 -> *1/4 -> all_reduce[dp] -> adamw(fp32)"
    )


@pytest.mark.parametrize("family", list(Family))
def test_policies_with_different_settings_print_different_chains(family):
    """Two registered policies print the same chains for every family only if they run the same stages."""
    chains = {}
    for name in policy_names():
        policy = get_policy(name)
        key = tuple(policy.chain(f, 2, dp) for f in Family for dp in (None, 4))
        chains.setdefault(key, []).append(policy)
    for same in chains.values():
        for other in same[1:]:
            first = same[0]
            settings = [
                f
                for f in (
                    "staging",
                    "writeback",
                    "rounding",
                    "accumulate",
                    "correct_at",
                    "dp_reduce",
                    "dp_scale",
                    "dp_at",
                    "master",
                    "moments",
                    "grad_dtype",
                    "tp_model",
                )
                if getattr(first, f) != getattr(other, f)
            ]
            # expert_in_grad_dtype only shows for experts; the two must still agree on every printed stage
            assert not settings, (first.name, other.name, settings)


def test_every_stage_that_runs_is_in_the_chain():
    """The labels of the stage lists the kernel executes, in order, are the chain."""
    for name in policy_names():
        policy = get_policy(name)
        for family in Family:
            micro = [s.label for s in policy.micro_step_stages(family, 2, 4)]
            boundary = [s.label for s in policy.boundary_stages(family, 2, 4)]
            chain = policy.chain(family, 2, 4)
            assert chain.startswith(" -> ".join(["bf16", *micro]) + " | boundary: "), (name, family)
            assert " -> ".join(boundary) in chain, (name, family)
