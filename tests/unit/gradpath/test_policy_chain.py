"""The printed chain is the stage list that runs: micro-step, DP reduction with its dtype, optimizer."""

import dataclasses

from simdist.gradpath.families import Family
from simdist.policies.catalogue import get_policy, policy_names

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


def test_policies_with_different_settings_print_different_chains():
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
                    "tp_reduction",
                )
                if getattr(first, f) != getattr(other, f)
            ]
            # expert_in_grad_dtype only shows for experts; the two must still agree on every printed stage
            assert not settings, (first.name, other.name, settings)


# Every registered policy's chain for every family at TP2/DP4, written out by hand from the policy's settings
# (its module in policies/ and the Policy docstring), not printed by the code under test: a change to a stage
# list, a dtype, a divisor or the boundary order changes a string here.
BOUNDARY_FP32 = " | boundary: fp32 -> all_reduce[dp] -> *1/4 -> adamw(fp32)"
BOUNDARY_FP32_EDP = " | boundary: fp32 -> all_reduce[edp] -> *1/4 -> adamw(fp32)"
BF16_COMM = " | boundary: fp32 -> bf16 -> all_reduce[{}] -> *1/4 -> fp32 -> adamw(fp32)"
FSDP2_TAIL = " -> fp32 -> /2 -> all_reduce[{}] -> /2 -> +=hp | boundary: fp32 -> adamw(fp32)"
MEGATRON = "bf16 -> fp32 -> +=hp | boundary: fp32 -> *1/4 -> all_reduce[{}]{} -> adamw(fp32)"
R, P, D, M, E = "ROUTER_GATE_REPLICATED", "ROUTER_GATE_PARTIAL", "DENSE", "MODEL_PARALLEL", "EXPERT"
EXPECTED_CHAINS = {
    "bf16_only": {
        R: "bf16 -> all_reduce[tp] -> /2 -> +=hp | boundary: bf16 -> all_reduce[dp] -> *1/4 -> adamw(fp32)",
        P: "bf16 -> all_reduce[tp] -> +=hp | boundary: bf16 -> all_reduce[dp] -> *1/4 -> adamw(fp32)",
        D: "bf16 -> all_reduce[tp] -> /2 -> +=hp | boundary: bf16 -> all_reduce[dp] -> *1/4 -> adamw(fp32)",
        M: "bf16 -> +=hp | boundary: bf16 -> all_reduce[dp] -> *1/4 -> adamw(fp32)",
        E: "bf16 -> /2 -> +=hp | boundary: bf16 -> all_reduce[edp] -> *1/4 -> adamw(fp32)",
    },
    "bf16_writeback": {
        R: "bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp" + BOUNDARY_FP32,
        P: "bf16 -> fp32 -> all_reduce[tp] -> bf16 -> fp32 -> +=hp" + BOUNDARY_FP32,
        D: "bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp" + BOUNDARY_FP32,
        M: "bf16 -> fp32 -> +=hp" + BOUNDARY_FP32,
        E: "bf16 -> /2 -> fp32 -> +=hp" + BOUNDARY_FP32_EDP,
    },
    "bf16_writeback_bf16_comm": {
        R: "bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp" + BF16_COMM.format("dp"),
        P: "bf16 -> fp32 -> all_reduce[tp] -> bf16 -> fp32 -> +=hp" + BF16_COMM.format("dp"),
        D: "bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp" + BF16_COMM.format("dp"),
        M: "bf16 -> fp32 -> +=hp" + BF16_COMM.format("dp"),
        E: "bf16 -> /2 -> fp32 -> +=hp" + BF16_COMM.format("edp"),
    },
    "fp32_staging": {
        R: "bf16 -> fp32 -> all_reduce[tp] -> /2 -> +=hp" + BOUNDARY_FP32,
        P: "bf16 -> fp32 -> all_reduce[tp] -> +=hp" + BOUNDARY_FP32,
        D: "bf16 -> fp32 -> all_reduce[tp] -> /2 -> +=hp" + BOUNDARY_FP32,
        M: "bf16 -> fp32 -> +=hp" + BOUNDARY_FP32,
        E: "bf16 -> fp32 -> /2 -> +=hp" + BOUNDARY_FP32_EDP,
    },
    "fsdp2_reduce_dtype": {
        R: "bf16 -> all_reduce[tp] -> /2" + FSDP2_TAIL.format("dp"),
        P: "bf16 -> all_reduce[tp]" + FSDP2_TAIL.format("dp"),
        D: "bf16 -> all_reduce[tp] -> /2" + FSDP2_TAIL.format("dp"),
        M: "bf16" + FSDP2_TAIL.format("dp"),
        E: "bf16 -> /2" + FSDP2_TAIL.format("edp"),
    },
    "megatron_grad_reduce_fp32": {
        R: MEGATRON.format("dp", " -> all_reduce[tp] -> /2"),
        P: MEGATRON.format("dp", " -> all_reduce[tp]"),
        D: MEGATRON.format("dp", " -> all_reduce[tp] -> /2"),
        M: MEGATRON.format("dp", ""),
        E: MEGATRON.format("edp", " -> /2"),
    },
    "stochastic_writeback": {
        R: "bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 (stochastic) -> fp32 -> +=hp" + BOUNDARY_FP32,
        P: "bf16 -> fp32 -> all_reduce[tp] -> bf16 (stochastic) -> fp32 -> +=hp" + BOUNDARY_FP32,
        D: "bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 (stochastic) -> fp32 -> +=hp" + BOUNDARY_FP32,
        M: "bf16 -> fp32 -> +=hp" + BOUNDARY_FP32,
        E: "bf16 -> /2 -> fp32 -> +=hp" + BOUNDARY_FP32_EDP,
    },
}


def test_every_policy_prints_the_chain_written_out_by_hand():
    """Each listed policy's chain for every family at TP2/DP4 is the literal above."""
    for name, by_family in EXPECTED_CHAINS.items():
        policy = get_policy(name)
        for family in Family:
            assert policy.chain(family, 2, 4) == by_family[family.name], (name, family)


def test_chains_at_tp4_and_dp3_name_their_own_sizes():
    """The TP divisor is the TP size and the DP factors come from the DP size (no 2 or 4 baked in)."""
    router = Family.ROUTER_GATE_REPLICATED
    assert get_policy("fp32_staging").chain(router, 4, 3) == (
        "bf16 -> fp32 -> all_reduce[tp] -> /4 -> +=hp | boundary: fp32 -> all_reduce[dp] -> *1/3 -> adamw(fp32)"
    )
    assert get_policy("bf16_writeback").chain(Family.EXPERT, 4, 2) == (
        "bf16 -> /4 -> fp32 -> +=hp | boundary: fp32 -> all_reduce[edp] -> *1/2 -> adamw(fp32)"
    )
    # FSDP's split of 1/world (torch's _get_gradient_divide_factors): double f while world % f == 0 and
    # world / f > f; 16 gives 4 and 4, and 6 stops at 4 (not a divisor of 6), leaving a post-divide of 1.5
    assert get_policy("fsdp2_reduce_dtype").chain(Family.MODEL_PARALLEL, 1, 16) == (
        "bf16 -> fp32 -> /4 -> all_reduce[dp] -> /4 -> +=hp | boundary: fp32 -> adamw(fp32)"
    )
    assert get_policy("fsdp2_reduce_dtype").chain(Family.MODEL_PARALLEL, 1, 6) == (
        "bf16 -> fp32 -> /4 -> all_reduce[dp] -> /1.5 -> +=hp | boundary: fp32 -> adamw(fp32)"
    )


def test_every_stage_that_runs_is_in_the_chain():
    """The labels of the stage lists the kernel executes, in order, are the hand-written chain."""
    for name, by_family in EXPECTED_CHAINS.items():
        policy = get_policy(name)
        for family in Family:
            micro_text, boundary_text = by_family[family.name].split(" | boundary: ")
            boundary_labels = boundary_text.split(" -> ")[1:-1]  # the buffer's dtype first, the optimizer last
            micro = [s.label for s in policy.micro_step_stages(family, 2, 4)]
            boundary = [s.label for s in policy.boundary_stages(family, 2, 4)]
            assert ["bf16", *micro] == micro_text.split(" -> "), (name, family)
            assert boundary == boundary_labels, (name, family)
