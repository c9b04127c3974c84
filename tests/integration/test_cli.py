"""The command line: the main job's verdict, JSON output, exit statuses (0 ok, 1 differs, 2 bad input: one
line on stderr, nothing written), size limits, --version, user policies."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simdist.cli import EXIT_CODES, main
from simdist.cli.limits import LIMITS
from simdist.gradpath.probes import Trace
from simdist.policies import catalogue
from simdist.studies.dumps import write_rank_dump


def test_repro_prints_the_reproduced_verdict(capsys):
    assert main(["repro", "8913"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("verdict: #8913 REPRODUCED")
    assert "bf16 -> fp32 -> all_reduce[tp] -> /4 -> bf16 -> fp32 -> +=hp" in out  # TP4 x DP2 x EP2 on 8 ranks
    assert "router.weight: first differs at 'hp' after 'written_back' (rank 0, step 0, micro-step 0)" in out
    assert _readme_verdict_lines() == out.rstrip().splitlines()[-3:]  # README shows the run's last lines as they are


def _readme_verdict_lines() -> list[str]:
    """The output block README shows after "its last lines are:" (the front door's `simdist repro 8913`)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme[readme.index("its last lines are:") :].split("```")[1]
    return block.strip().splitlines()


def test_repro_json_has_every_tensor_of_every_rank(capsys):
    assert main(["repro", "8913", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    writeback = report["policies"][0]
    assert writeback["name"] == "bf16_writeback"
    assert {row["rank"] for row in writeback["rows"]} == set(range(8))
    assert {row["kind"] for row in writeback["rows"]} == {
        "local grad",
        "corrected grad",
        "hp grad",
        "fp32 master",
        "adam m",
        "adam v",
    }


@pytest.mark.slow  # seconds of the default suite; CI runs it with the slow tests
def test_gas_two_states_the_writeback_and_the_marker_separately(capsys):
    assert main(["repro", "8913", "--gas", "2"]) == 0
    out = capsys.readouterr().out
    writeback, marker = out.rstrip().splitlines()[-2:]
    assert "NOT reproduced" not in out
    assert writeback.startswith("verdict: #8913 REPRODUCED: bf16_writeback first departs from the FP32 oracle")
    assert marker.startswith("verdict: correction-once marker defect SHOWN")
    assert main(["repro", "8913", "--gas", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["reproduced"] is True and report["marker_defect"] is True
    assert {k: (f["shown"], f["applies"]) for k, f in report["findings"].items()} == {
        "writeback_8913": (True, True),
        "correction_marker": (True, True),
    }
    assert report["verdict"].splitlines() == [writeback.removeprefix("verdict: "), marker.removeprefix("verdict: ")]
    assert main(["repro", "8913", "--gas", "2", "--marker", "per_micro_step"]) == 0
    assert "REPRODUCED" in capsys.readouterr().out.rstrip().splitlines()[-1]


def _one_line_error(capsys, argv: list[str], message: str) -> str:
    """Run ``main(argv)`` in-process: exit status 2, ``message`` on one line of stderr, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["repro", "8913", "--policies", "nope"], "unknown policy 'nope'; valid: bf16_only, bf16_writeback"),
        (["repro", "8913", "--tp", "3"], "tp=3 must divide the stage size"),
        (["repro", "8913", "--gas", "0"], "argument --gas: expected a positive integer, got 0"),
        (["repro", "9999"], "invalid choice: '9999' (choose from '8913')"),
        (["repro", "8913", "--reduction", "abacus"], "argument --reduction: invalid choice"),
        (
            ["repro", "8913", "--world-size", "100000000"],
            f"--world-size 100000000 is above the limit {LIMITS['world_size']} (this run would need an estimated",
        ),
        (["repro", "8913", "--steps", "100000000"], f"--steps 100000000 is above the limit {LIMITS['steps']}"),
        (["repro", "8913", "--gas", "5000"], f"--gas 5000 is above the limit {LIMITS['gas']}"),
        (["repro", "8913", "--seed", str(2**70)], "--seed 1180591620717411303424 is outside the limit"),
        (
            ["repro", "8913", "--steps", "1000000", "--world-size", "64", "--tp", "2", "--ep", "2"],
            "this run needs an estimated",
        ),
        (["audit", "--top", "-1", "script.py"], "argument --top: expected a non-negative integer, got -1"),
        (["audit", "no_such_script.py"], "no such script: 'no_such_script.py'"),
        (["policies", "--policy-module", "no_such_file.py"], "--policy-module no_such_file.py: no such file"),
        (["policies", "--policy-module", "no_such_pkg.mod"], "no module named 'no_such_pkg.mod'"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(capsys, argv, message):
    _one_line_error(capsys, argv, message)


@pytest.mark.slow  # by default: test_crosscheck.py runs `python -m simdist.cli compare`'s module in-process
def test_the_installed_command_gives_one_line_and_status_2():
    """One subprocess check of the real entry point (``python -m simdist.cli``): argparse's exit goes through."""
    done = subprocess.run(
        [sys.executable, "-m", "simdist.cli", "repro", "8913", "--gas", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "simdist: error: argument --gas: expected a positive integer, got 0\n"


def test_version_and_exit_codes_in_help(capsys):
    from importlib.metadata import PackageNotFoundError, version

    from simdist import DISTRIBUTION

    try:  # the version of this project's distribution, never of PyPI's unrelated "simdist"
        expected = version(DISTRIBUTION)
    except PackageNotFoundError:  # a source tree on PYTHONPATH, installed under no name or under the old one
        expected = "unknown (not installed)"
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"simdist {expected}"
    for argv in (["--help"], ["compare", "--help"], ["growth", "--help"], ["repro", "--help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert EXIT_CODES in out
    assert main(["audit", "--help"]) == 0
    assert "exit status: the script's own" in capsys.readouterr().out
    readme = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli-overview.md").read_text()
    assert EXIT_CODES in readme, "the docs' exit-status block must be the CLI's"


# -- compare: 0 equal, 1 beyond tolerance, 2 unreadable --------------------------------------------------------


def _dump(directory: Path, values: list[torch.Tensor]) -> Path:
    meta = {
        "spec": {"world_size": len(values)},
        "policy": "p",
        "steps": 1,
        "gas": 1,
        "seed": 0,
        "marker": "m",
        "update_path": "u",
        "model": "synthetic",
        "shapes": {"w": [4]},
        "world": "test",
    }
    for rank, value in enumerate(values):
        trace = Trace(rank)
        trace.capture(0, 0, "w", "local", value)
        write_rank_dump(directory, trace, meta)
    return directory


@pytest.fixture
def dumps(tmp_path):
    value = torch.tensor([1.0, 2.0, 3.0, 4.0])
    a = _dump(tmp_path / "a", [value, value * 2])
    bumped = value.clone()
    bumped.view(torch.int32)[0] += 1  # one FP32 ulp
    b = _dump(tmp_path / "b", [bumped, value * 2])
    return a, b


def test_compare_exit_status_is_0_when_equal_and_1_beyond_tolerance(dumps, capsys):
    a, b = dumps
    assert main(["compare", str(a), str(a)]) == 0
    assert "2/2 tensors bitwise equal" in capsys.readouterr().out
    assert main(["compare", str(a), str(b)]) == 1
    assert "BEYOND TOLERANCE" in capsys.readouterr().out
    assert main(["compare", str(a), str(b), "--tolerance-ulp", "1"]) == 0


def test_compare_unreadable_dumps_are_one_line_naming_the_file(dumps, tmp_path, capsys):
    a, b = dumps
    rank0 = b / "rank0.safetensors"
    data = rank0.read_bytes()
    rank0.write_bytes(data[:-7])  # truncated
    _one_line_error(capsys, ["compare", str(a), str(b)], f"{rank0}: not a readable safetensors file")
    rank0.write_bytes(b"\x00" * 3)  # shorter than a header
    _one_line_error(capsys, ["compare", str(a), str(b)], f"{rank0}: not a readable safetensors file (3 bytes")
    rank0.write_bytes(b"not a safetensors file at all, just words")
    _one_line_error(capsys, ["compare", str(a), str(b)], f"{rank0}: not a readable safetensors file")
    rank0.unlink()
    _one_line_error(capsys, ["compare", str(a), str(b)], "rank file rank0.safetensors is missing (world size 2)")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(rank0))
    _one_line_error(capsys, ["compare", str(a), str(b)], f"{rank0}: not a simdist dump (no 'simdist' metadata)")
    save_file({"x": torch.zeros(1)}, str(rank0), metadata={"simdist": "{not json"})
    _one_line_error(capsys, ["compare", str(a), str(b)], f"{rank0}: corrupt 'simdist' metadata")
    _one_line_error(capsys, ["compare", str(a), str(tmp_path / "nowhere")], "nowhere: no such dump directory")
    _one_line_error(capsys, ["compare", str(a), str(rank0)], "not a directory")
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, ["compare", str(tmp_path / "empty"), str(a)], "holds no rank*.safetensors dump")


# -- user policies -----------------------------------------------------------------------------------------------

USER_POLICY = """
import torch
from simdist.gradpath.policy import Policy, register

POLICY = register(Policy(name="{name}", summary="fp32 staging with a BF16 data-parallel all-reduce",
                         staging=torch.float32, writeback=None, expert_in_grad_dtype=False,
                         dp_reduce=torch.bfloat16))
"""


def test_policy_module_from_a_file_is_listed_with_its_origin_and_runs(tmp_path, capsys):
    module = tmp_path / "my_policies.py"
    module.write_text(USER_POLICY.format(name="mine_bf16_dp"))
    assert main(["policies", "--policy-module", str(module)]) == 0
    out = capsys.readouterr().out
    assert f"mine_bf16_dp: fp32 staging with a BF16 data-parallel all-reduce\n    from: --policy-module {module}" in out
    assert "fp32_staging: " in out and "    from: built-in (simdist.policies)" in out
    assert (
        main(
            ["repro", "8913", "--steps", "1", "--policy-module", str(module), "--policies", "mine_bf16_dp,fp32_staging"]
        )
        == 0
    )
    assert "== mine_bf16_dp: fp32 staging with a BF16 data-parallel all-reduce" in capsys.readouterr().out


def test_policy_module_by_dotted_name_and_its_errors(tmp_path, monkeypatch, capsys):
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pols.py").write_text(USER_POLICY.format(name="dotted_policy"))
    (package / "broken.py").write_text("x = 1\ny = 1 / 0\n")
    (package / "empty.py").write_text("x = 1\n")
    (package / "clash.py").write_text(USER_POLICY.format(name="fp32_staging"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["policies", "--policy-module", "userpkg.pols"]) == 0
    assert "dotted_policy: fp32 staging" in capsys.readouterr().out
    _one_line_error(
        capsys,
        ["policies", "--policy-module", "userpkg.broken"],
        "--policy-module userpkg.broken failed at broken.py:2: ZeroDivisionError: division by zero",
    )
    _one_line_error(capsys, ["policies", "--policy-module", "userpkg.empty"], "registered no policy")
    _one_line_error(
        capsys,
        ["policies", "--policy-module", "userpkg.clash"],
        "a different policy is already registered as 'fp32_staging'",
    )
    _one_line_error(
        capsys,
        ["policies", "--policy-module", str(package / "broken.py")],
        f"--policy-module {package / 'broken.py'} failed at broken.py:2: ZeroDivisionError",
    )


def test_entry_point_policies_are_loaded_and_shown_with_their_origin(tmp_path, monkeypatch, capsys):
    """An installed package's ``simdist.policies`` entry point (a dist-info on sys.path, as pip leaves it)."""
    (tmp_path / "plugin_policies.py").write_text(USER_POLICY.format(name="plugin_policy"))
    info = tmp_path / "simdist_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: simdist-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[simdist.policies]\nplugin = plugin_policies\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(catalogue, "_loaded_entry_points", set())
    monkeypatch.setattr(catalogue, "_ORIGINS", dict(catalogue._ORIGINS))
    assert catalogue.load_entry_point_policies() == ["plugin_policy"]
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert (
        "plugin_policy: fp32 staging with a BF16 data-parallel all-reduce\n"
        "    from: entry point plugin = plugin_policies (package simdist-plugin)"
    ) in out
    (info / "entry_points.txt").write_text("[simdist.policies]\nbroken = no_such_plugin_module\n")
    importlib.invalidate_caches()
    with pytest.raises(ValueError, match="policy entry point 'broken' \\(no_such_plugin_module\\) failed to load"):
        catalogue.load_entry_point_policies()


def test_policies_lists_every_policy_with_its_chain(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "fp32_staging:" in out and "bf16 -> fp32 -> all_reduce[tp] -> /2 -> +=hp" in out


def test_repro_lists_only_differing_tensors_unless_asked_for_all(capsys):
    layout = ["--world-size", "4", "--tp", "2", "--inputs", "narrow"]  # the counts below are of this run
    assert main(["repro", "8913", "--steps", "1", *layout]) == 0
    diff_only = capsys.readouterr().out
    assert main(["repro", "8913", "--steps", "1", "--all-tensors", *layout]) == 0
    every = capsys.readouterr().out
    table = [
        line
        for line in diff_only.splitlines()
        if line.split()[:1] != [] and line.split()[0].isdigit() and line.split()[1] != "of"
    ]
    assert table and all(" NO " in line for line in table)
    differing = len(table)  # 32: router and router_partial hp grad, master, m, v on 4 ranks
    assert differing == 32 and f"{140 - differing} of 140 tensors bitwise equal to the oracle (not listed)" in diff_only
    assert sum(" yes " in line for line in every.splitlines()) == (140 - differing) + 140  # fp32_staging: all equal


def test_readme_parallel_specs_are_valid_and_name_no_file_outside_the_repository():
    import re

    from simdist.world.spec import ParallelSpec

    root = Path(__file__).resolve().parents[2]
    readme = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))])
    calls = re.findall(r"ParallelSpec\([^()]*\)", readme)
    assert calls
    for call in calls:
        assert isinstance(eval(call, {"ParallelSpec": ParallelSpec}), ParallelSpec), call
    assert "../shared" not in readme and "/work/" not in readme


def test_growth_bad_sizes_and_unusable_out_write_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["growth", "--steps", "4", "--seeds", "1", "--no-progress", "--out"]
    _one_line_error(
        capsys,
        [*base, str(out), "--seeds", "100000000"],
        f"--seeds 100000000 is above the limit {LIMITS['seeds']} (this run would need an estimated",
    )
    _one_line_error(
        capsys,
        [*base, str(out), "--seeds", "50000", "--steps", "1000000"],
        "this run needs an estimated 39.3 TiB of memory (metrics 39.3 TiB",
    )
    _one_line_error(capsys, [*base, str(out), "--world-size", "8", "--tp", "3"], "tp=3 must divide")
    assert not out.exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _one_line_error(capsys, [*base, str(a_file)], f"--out {a_file}: exists and is not a directory")
    _one_line_error(capsys, [*base, str(a_file / "sub")], f"--out {a_file / 'sub'}: {a_file} is not a directory")
    assert a_file.read_text() == "x"
    out.mkdir()
    (out / "config.json").write_text('{"truncated": ')
    _one_line_error(capsys, [*base, str(out)], f"{out / 'config.json'}: corrupt (JSONDecodeError")
    (out / "config.json").unlink()
    (out / "checkpoint.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    _one_line_error(capsys, [*base, str(out)], f"{out / 'checkpoint.safetensors'}: not a readable safetensors file")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.safetensors"]  # nothing written


BAD_POLICIES = [
    ('staging="fp32"', "staging='fp32' is not a dtype the path computes in; valid: torch.float64, torch.float32"),
    ("accumulate=torch.int32", "accumulate=torch.int32 is not a dtype the path computes in; valid: torch.float64"),
    ("writeback=torch.int8", "writeback=torch.int8 is not a floating torch.dtype; valid: None or one"),
    ('rounding="up"', "rounding='up'; valid: 'nearest', 'stochastic'"),
]


@pytest.mark.parametrize(("field", "message"), BAD_POLICIES)
def test_an_invalid_policy_field_is_one_line_naming_it_and_exit_2(tmp_path, capsys, field, message):
    module = tmp_path / "bad_policy.py"
    module.write_text(
        f"import torch\nfrom simdist.gradpath.policy import Policy\nPolicy(name='bad', summary='-', {field})\n"
    )
    err = _one_line_error(capsys, ["repro", "8913", "--policy-module", str(module)], f"Policy 'bad': {message}")
    assert err.startswith(f"simdist: error: --policy-module {module} at bad_policy.py:3: Policy 'bad': ")


def test_a_policy_listed_twice_is_bad_input(capsys):
    _one_line_error(
        capsys,
        ["repro", "8913", "--policies", "bf16_writeback,fp32_staging,bf16_writeback"],
        "--policies bf16_writeback,fp32_staging,bf16_writeback: 'bf16_writeback' listed more than once",
    )
    _one_line_error(
        capsys, ["growth", "--policies", "bf16_only, bf16_only", "--out", "x"], "'bf16_only' listed more than once"
    )


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["growth", "--steps", "1", "--seeds", "1", "--out", ""], "--out"),
        (["growth", "--steps", "1", "--seeds", "1", "--out", "  "], "--out"),
        (["compare", "", "b"], "dump_a"),
        (["compare", "a", ""], "dump_b"),
        (["repro", "8913", "--policy-module", ""], "--policy-module"),
        (["policies", "--policy-module", " "], "--policy-module"),
        (["audit", ""], "script"),
        (["audit", "--skip", "", "script.py"], "--skip"),
    ],
)
def test_an_empty_path_is_bad_input_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, option):
    monkeypatch.chdir(tmp_path)  # an empty path would mean this directory
    _one_line_error(capsys, argv, f"argument {option}: expected a path, got ")
    assert list(tmp_path.iterdir()) == []


def test_fsdp2_reduce_dtype_on_threads_is_refused_for_its_own_spy_not_for_fsdp2(capsys):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    assert hasattr(_fsdp_collectives, "_get_gradient_divide_factors")  # the function the message names exists
    err = _one_line_error(
        capsys,
        ["case", "run", "fsdp2-reduce-dtype", "--where", "threads"],
        "the case records FSDP2's divide factors by replacing the module function "
        "torch.distributed.fsdp._fully_shard._fsdp_collectives._get_gradient_divide_factors in each rank",
    )
    assert "FSDP2 itself keeps no per-rank module globals" in err and "its framework keeps" not in err
