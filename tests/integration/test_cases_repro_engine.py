"""``simdist repro 8913 --code deepspeed``: the real code path through the repro report and verdict."""

import dataclasses

import pytest

from simdist.extras import installed, not_installed_reason

if not installed("deepspeed"):  # found, not imported: only the ranks import it
    pytest.skip(not_installed_reason("deepspeed"), allow_module_level=True)

from simdist.cli import main
from simdist.studies.repro import ReproConfig, reproduce


@pytest.mark.parametrize("option,value", [("marker", "per_micro_step"), ("source", "moe"), ("reduction", "tree")])
def test_code_deepspeed_refuses_options_the_real_code_cannot_take(option, value):
    config = dataclasses.replace(ReproConfig(code="deepspeed"), **{option: value})
    with pytest.raises(ValueError, match=f"--code deepspeed needs --{option}"):
        reproduce(config)


def test_code_deepspeed_refuses_other_policies(capsys):
    assert main(["repro", "8913", "--code", "deepspeed", "--policies", "bf16_only"]) == 2
    assert "runs only bf16_writeback, fp32_staging" in capsys.readouterr().err


@pytest.mark.gloo
@pytest.mark.slow
def test_code_deepspeed_reproduces_8913_with_the_transcribed_verdict_logic():
    config = ReproConfig(steps=1, code="deepspeed")
    reports, verdict = reproduce(config)
    assert verdict.reproduced, verdict.line
    assert "router hp grad differ" in verdict.line
    transcribed_reports, transcribed = reproduce(dataclasses.replace(config, code="transcribed"))
    assert transcribed.reproduced
    real_rows = {(p.name, r.rank, r.param, r.kind): r for p in reports for r in p.rows}
    assert {key[3] for key in real_rows} == {"local grad", "hp grad"}
    model_rows = {(p.name, r.rank, r.param, r.kind): r for p in transcribed_reports for r in p.rows}
    assert all(model_rows[key] == row for key, row in real_rows.items())  # same figures against the oracle
