"""The folded MoE block in SimWorld and on real process groups: per-rank dumps compared bit for bit."""

import importlib.util
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import simdist
import simdist.cli
from simdist.cli import main
from simdist.reduce.gloo import Gloo
from simdist.studies.crosscheck import CrossCheck, train_and_dump
from simdist.studies.dumps import compare_dumps, format_comparison, load_dump
from simdist.world.simworld import SimWorld

ROOT = Path(__file__).resolve().parents[2]
CHECK = CrossCheck(steps=3, policies=("bf16_writeback", "fp32_staging"))
HOOKS = CrossCheck(steps=3, gas=2, policies=("bf16_writeback",), update_path="hooks", marker="per_micro_step")


def both_checks(comm, out: str, where: dict) -> list[str]:
    """Rank program: the 3-step cross-check of both policies, and a GAS-2 run delivering from gradient hooks."""
    return train_and_dump(comm, CHECK, out, where) + train_and_dump(comm, HOOKS, str(Path(out) / "hooks"), where)


@pytest.mark.gloo
@pytest.mark.slow  # by default: test_gradpath_gloo.py (the gradient path, SimWorld vs 4 real gloo ranks, bitwise)
def test_real_gloo_and_simworld_dumps_are_bitwise_equal(tmp_path):
    spec = CHECK.spec
    real = simdist.run(
        both_checks,
        spec,
        api="comm",
        where="gloo",
        args=(str(tmp_path / "gloo"), {"world": "gloo", "backend": "gloo"}),
        timeout_s=240,
    )
    simulated = SimWorld(spec, reduction=Gloo()).run(
        both_checks, str(tmp_path / "sim"), {"world": "sim", "reduction": "gloo"}
    )
    assert len(real[0]) == len(simulated[0]) == 3
    for name in ("bf16_writeback", "fp32_staging", "hooks/bf16_writeback"):
        result = compare_dumps(tmp_path / "sim" / name, tmp_path / "gloo" / name)
        assert result.ok and all(r.bitwise == r.tensors for r in result.rows), format_comparison(result)
        assert result.tensors > 1000
        metas, tensors = load_dump(tmp_path / "gloo" / name)
        stages = {key.split("|")[1] for key in tensors[0]}
        assert stages == {"local", "corrected", "hp", "dp_reduced", "master", "adam_m", "adam_v"}
        assert metas[0]["spec"]["tp"] == 2 and metas[0]["steps"] == 3 and metas[0]["shapes"]["router.weight"] == [4, 16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_simworld_dump_runs_and_is_deterministic(tmp_path):
    """One GPU: the rank program on CUDA tensors in SimWorld, twice, bitwise equal."""
    check = CrossCheck(steps=2, policies=("fp32_staging",), device="cuda")
    for run in ("a", "b"):
        SimWorld(check.spec).run(train_and_dump, check, str(tmp_path / run), {"world": "sim"})
    assert compare_dumps(tmp_path / "a" / "fp32_staging", tmp_path / "b" / "fp32_staging").ok


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices (NCCL cross-check)")
def test_nccl_and_cuda_simworld_dumps_are_bitwise_equal(tmp_path):
    script = str(ROOT / "experiments" / "crosscheck.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            script,
            "--world",
            "torch",
            "--backend",
            "nccl",
            "--device",
            "cuda",
            "--out",
            str(tmp_path / "nccl"),
        ],
        check=True,
        env=env,
        timeout=600,
    )
    subprocess.run(
        [
            sys.executable,
            script,
            "--world",
            "sim",
            "--device",
            "cuda",
            "--reduction",
            "sequential",
            "--out",
            str(tmp_path / "sim"),
        ],
        check=True,
        env=env,
        timeout=600,
    )
    for name in ("bf16_writeback", "fp32_staging"):
        result = compare_dumps(tmp_path / "sim" / name, tmp_path / "nccl" / name)
        assert result.ok, format_comparison(result)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    """Two one-step SimWorld dumps made by experiments/crosscheck.py (both policies)."""
    out = tmp_path_factory.mktemp("dumps")
    spec = importlib.util.spec_from_file_location("crosscheck", ROOT / "experiments" / "crosscheck.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--world", "sim", "--steps", "1", "--out", str(out / "a")]) == 0
    assert script.main(["--world", "sim", "--steps", "1", "--reduction", "sequential", "--out", str(out / "b")]) == 0
    return out


def test_compare_prints_bitwise_equal_and_exits_0(dumps, capsys):
    # TP2/EP2: every group has two ranks, so the reduction order cannot change a bit
    assert main(["compare", str(dumps / "a" / "fp32_staging"), str(dumps / "b" / "fp32_staging")]) == 0
    out = capsys.readouterr().out
    assert "router.weight    hp grad          bitwise equal (4 tensors)" in out
    assert out.rstrip().splitlines()[-1].startswith("356/356 tensors bitwise equal (sim vs sim)")


def test_compare_reports_ulps_and_exits_1_beyond_the_tolerance(dumps, tmp_path, capsys):
    tampered = tmp_path / "tampered"
    shutil.copytree(dumps / "a" / "bf16_writeback", tampered)
    path = tampered / "rank2.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    name = "router.weight|master|s0|mb"
    bits = tensors[name].view(torch.int32).clone()
    bits[0, 0] += 3  # three ulps up
    tensors[name] = bits.view(torch.float32)
    save_file(tensors, str(path), metadata=metadata)
    a = str(dumps / "a" / "bf16_writeback")
    assert main(["compare", a, str(tampered)]) == 1
    out = capsys.readouterr().out
    assert "router.weight    fp32 master      1/4 tensors differ: max 3 ulp" in out
    assert "first at rank 2, step 0, boundary  BEYOND TOLERANCE" in out
    assert main(["compare", a, str(tampered), "--tolerance-ulp", "3"]) == 0


def test_compare_says_in_one_line_when_dumps_are_not_the_same_run(dumps, tmp_path, capsys, monkeypatch):
    other = tmp_path / "other"
    shutil.copytree(dumps / "a" / "bf16_writeback", other)
    for path in other.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["simdist"])
        meta["steps"] = 5
        save_file(load_file(str(path)), str(path), metadata={"simdist": json.dumps(meta)})
    a = str(dumps / "a" / "bf16_writeback")
    # ``python -m simdist.cli``'s module, run here (a new interpreter costs seconds of torch import; the slow
    # test_cli.py::test_the_installed_command_gives_one_line_and_status_2 runs it as a real process)
    monkeypatch.setattr(sys, "argv", ["simdist", "compare", a, str(dumps / "a" / "fp32_staging")])
    with pytest.raises(SystemExit) as exited:
        # run_path, not run_module: under pytest the package is marked for assertion rewriting (its pytest11
        # plugin), and that import hook cannot hand runpy a module's code (AttributeError: get_code)
        runpy.run_path(str(Path(simdist.cli.__file__).with_name("__main__.py")), run_name="__main__")
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        'simdist: error: the dumps do not describe the same run: policy differs ("bf16_writeback" vs "fp32_staging")'
    )
    for b, message in [(other, "steps differs (1 vs 5)"), (tmp_path, "holds no rank*.safetensors dump")]:
        assert main(["compare", a, str(b)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_repro_on_the_moe_model_reproduces_8913(capsys):
    assert main(["repro", "8913", "--source", "moe"]) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("verdict: #8913 REPRODUCED on the MoE model")
    assert "at the BF16 writeback on step 0 for router.weight" in last
    assert "fp32_staging matches bitwise in all 608 compared tensors" in last  # the default: 8 ranks
