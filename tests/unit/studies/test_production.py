"""The #8913 production study on a tiny layer (the full-shape run is slow; its table is in docs/production.md)."""

import math

import pytest
import torch

from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.kernel import Marker
from simdist.studies.production import bf16_ulp, format_table, meets, study_model

TINY = (
    ParamSpec("router.weight", Family.ROUTER_GATE_REPLICATED, (4, 64)),
    ParamSpec("norm.weight", Family.DENSE, (64,)),
    ParamSpec("attn[slice]", Family.MODEL_PARALLEL, (1, 64)),
    ParamSpec("expert[slice]", Family.EXPERT, (1, 64)),
)


def test_bf16_ulp_is_the_gap_to_the_next_bf16_value():
    values = torch.tensor([1.0, 1.5, 3.0, -0.015625, 2.0**-120, 6.0e4], dtype=torch.bfloat16)
    following = (values.view(torch.int16) + 1).view(torch.bfloat16)  # next magnitude up (same sign)
    assert torch.equal(bf16_ulp(values.float()), (following.double() - values.double()).abs())


def test_shipped_rounds_only_the_router_and_the_fix_equals_the_oracle():
    rows = {(r.policy, r.family): r for r in study_model("tiny", 12, 2, params=TINY)}
    shipped = rows[("bf16_writeback", "router_gate_replicated")]
    assert shipped.differ > 0 and shipped.max_rel > 0 and shipped.first_step_over_bf16_ulp is not None
    for family in ("dense", "model_parallel", "expert"):  # identical TP peers / no TP sum: nothing rounds
        assert rows[("bf16_writeback", family)].differ == 0
    for family in ("router_gate_replicated", "dense", "model_parallel", "expert"):
        fixed = rows[("fp32_staging", family)]
        assert fixed.differ == 0 and fixed.max_rel == 0 and fixed.first_step_over_bf16_ulp is None
        assert fixed.growth_exponent is None  # no error to fit (a fit through log 0 would be NaN)
    assert shipped.growth_exponent is not None and math.isfinite(shipped.growth_exponent)
    assert "| tiny | bf16_writeback | router_gate_replicated | 256 |" in format_table(list(rows.values()))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="steps, seeds and gas must be >= 1"):
        study_model("tiny", 0, 1, params=TINY)
    with pytest.raises(ValueError, match="unknown model"):
        study_model("tiny", 1, 1)


@pytest.mark.slow
def test_full_mixtral_layer_over_1000_steps():
    rows = {(r.policy, r.family): r for r in study_model("Mixtral-8x7B", 1000, 2)}
    assert rows[("bf16_writeback", "router_gate_replicated")].differ > 0
    assert all(r.differ == 0 for (policy, _), r in rows.items() if policy == "fp32_staging")


def test_cli_repro_shape_runs_the_catalogue_model_and_refuses_unknown_ones(capsys):
    from simdist.cli import main

    assert main(["repro", "8913", "--shape", "Mixtral-8x7B", "--steps", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "#8913 at production shapes (Mixtral-8x7B)" in out
    assert "| Mixtral-8x7B | bf16_writeback | router_gate_replicated | 32768 |" in out
    assert main(["repro", "8913", "--shape", "Mixtral-8x22B", "--no-progress"]) == 2
    assert "unknown model 'Mixtral-8x22B'" in capsys.readouterr().err


def test_gas_is_honoured_with_the_marker_it_is_run_with():
    # per-micro-step marker: the fix is the oracle at GAS 3 too, shipped still rounds the router
    rows = {
        (r.policy, r.family): r for r in study_model("tiny", 4, 1, params=TINY, gas=3, marker=Marker.PER_MICRO_STEP)
    }
    assert rows[("bf16_writeback", "router_gate_replicated")].differ > 0
    assert all(r.differ == 0 for (policy, _), r in rows.items() if policy == "fp32_staging")
    # DeepSpeed's marker skips micro-steps 1 and 2 at GAS 3: the fix then differs too (power: GAS reached the paths)
    marked = {(r.policy, r.family): r for r in study_model("tiny", 4, 1, params=TINY, gas=3)}
    assert marked[("fp32_staging", "router_gate_replicated")].differ > 0
    single = {(r.policy, r.family): r for r in study_model("tiny", 4, 1, params=TINY, gas=1)}
    assert single[("fp32_staging", "router_gate_replicated")].differ == 0


def test_policies_are_honoured():
    rows = study_model("tiny", 2, 1, params=TINY, policies=("fp32_staging",))
    assert {r.policy for r in rows} == {"fp32_staging"}
    assert meets("fixed", rows)
    with pytest.raises(ValueError, match="needs bf16_writeback"):
        meets("reproduced", rows)
    with pytest.raises(ValueError, match="expected one of"):
        meets("improved", rows)
    with pytest.raises(ValueError, match="at least one"):
        study_model("tiny", 2, 1, params=TINY, policies=())


def test_cli_shape_states_its_layout_and_honours_expect_and_policies(capsys):
    from simdist.cli import main

    args = ["repro", "8913", "--shape", "Mixtral-8x7B", "--steps", "1", "--no-progress"]
    layout = ["--world-size", "4", "--tp", "2", "--ep", "2"]
    assert main([*args, *layout, "--expect", "reproduced"]) == 0
    out = capsys.readouterr().out
    assert "layout TP2/DP2/EP2/ETP1/EDP2 on 4 ranks, GAS 1, marker deepspeed" in out
    assert "expect reproduced: met" in out
    assert main([*args, *layout, "--expect", "fixed"]) == 1  # shipped differs from the oracle
    assert "expect fixed: NOT met" in capsys.readouterr().out
    assert main([*args, *layout, "--policies", "fp32_staging", "--expect", "fixed"]) == 0
    out = capsys.readouterr().out
    assert "bf16_writeback" not in out.split("\n\n", 1)[1]
    assert main([*args, *layout, "--policies", "fp32_staging", "--expect", "reproduced"]) == 2
    assert "needs bf16_writeback" in capsys.readouterr().err
    assert main([*args, "--code", "deepspeed"]) == 2
    assert "--code deepspeed is not supported there" in capsys.readouterr().err


def test_the_first_step_over_one_bf16_ulp_agrees_with_shorter_runs_last_step():
    """``first_step_over_bf16_ulp`` is tracked step by step; ``over_bf16_ulp`` is counted once, after the last
    step. A run of exactly that many steps ends with some master over one ulp; a run one step shorter, none."""

    def router(steps: int):
        rows = study_model("tiny", steps, 1, params=TINY, policies=("bf16_writeback",))
        return next(r for r in rows if r.family == "router_gate_replicated")

    first = router(12).first_step_over_bf16_ulp
    assert first is not None and first > 1  # the property needs a step before it
    assert router(first).over_bf16_ulp > 0
    assert router(first - 1).over_bf16_ulp == 0
