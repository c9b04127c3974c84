"""The command line: the main job's verdict, JSON output, and one-line errors with exit status 2."""

import json
import subprocess
import sys

import pytest

from simdist.cli import main


def test_repro_prints_the_reproduced_verdict(capsys):
    assert main(["repro", "8913"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("verdict: #8913 REPRODUCED")
    assert "bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp" in out
    assert "router.weight: first differs at 'hp' after 'written_back' (rank 0, step 0, micro-step 0)" in out


def test_repro_json_has_every_tensor_of_every_rank(capsys):
    assert main(["repro", "8913", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    writeback = report["policies"][0]
    assert writeback["name"] == "bf16_writeback"
    assert {row["rank"] for row in writeback["rows"]} == {0, 1, 2, 3}
    assert {row["kind"] for row in writeback["rows"]} == {
        "local grad", "corrected grad", "hp grad", "fp32 master", "adam m", "adam v"}


def test_gas_two_names_the_correction_once_marker(capsys):
    assert main(["repro", "8913", "--gas", "2"]) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert "NOT reproduced" in last and "correction-once marker" in last
    assert main(["repro", "8913", "--gas", "2", "--marker", "per_micro_step"]) == 0
    assert "REPRODUCED" in capsys.readouterr().out.rstrip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["repro", "8913", "--policies", "nope"], "unknown policy 'nope'; valid: bf16_only, bf16_writeback"),
        (["repro", "8913", "--tp", "3"], "tp=3 must divide the stage size"),
        (["repro", "8913", "--gas", "0"], "argument --gas: expected a positive integer, got 0"),
        (["repro", "9999"], "invalid choice: '9999' (choose from '8913')"),
        (["repro", "8913", "--reduction", "abacus"], "argument --reduction: invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(argv, message):
    done = subprocess.run([sys.executable, "-m", "simdist.cli", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_policies_lists_every_policy_with_its_chain(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "fp32_staging:" in out and "bf16 -> fp32 -> all_reduce[tp] -> /2 -> +=hp" in out


def test_repro_lists_only_differing_tensors_unless_asked_for_all(capsys):
    assert main(["repro", "8913", "--steps", "1"]) == 0
    diff_only = capsys.readouterr().out
    assert main(["repro", "8913", "--steps", "1", "--all-tensors"]) == 0
    every = capsys.readouterr().out
    table = [line for line in diff_only.splitlines() if line.split()[:1] != [] and line.split()[0].isdigit()
             and line.split()[1] != "of"]
    assert table and all(" NO " in line for line in table)
    differing = len(table)  # 32: router and router_partial hp grad, master, m, v on 4 ranks
    assert differing == 32 and f"{140 - differing} of 140 tensors bitwise equal to the oracle (not listed)" in diff_only
    assert sum(" yes " in line for line in every.splitlines()) == (140 - differing) + 140  # fp32_staging: all equal
