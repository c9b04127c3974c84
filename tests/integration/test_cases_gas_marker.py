"""The deepspeed-gas-marker case and its standalone reproducer."""

import ast
import dataclasses
import os
import subprocess
import sys

import pytest

from simdist.extras import installed, not_installed_reason

if not installed("deepspeed"):  # found, not imported: only the ranks import it
    pytest.skip(not_installed_reason("deepspeed"), allow_module_level=True)

from simdist.cases.deepspeed.gas_marker import REPRODUCER, Config, judge, run_real, write_reproducer
from simdist.policies.catalogue import get_policy

pytestmark = pytest.mark.gloo

CONFIG = Config(gas=3)


@pytest.fixture(scope="module")
def real():
    return run_real(CONFIG)


def test_epilogue_skips_every_later_micro_step_and_hooks_none(real):
    verdict = judge(CONFIG, real)
    assert verdict.ok, verdict.summary
    epilogue, hooks = verdict.paths
    assert epilogue.skipped_micro_steps["router.weight"] == [1, 2]
    assert set(epilogue.skipped_micro_steps) == {
        "router.weight",
        "router_partial.weight",
        "dense.weight",
        "norm.weight",
        "expert.w1",
    }
    assert hooks.skipped_micro_steps == {}
    assert not epilogue.real_vs_per_micro_step.bitwise_equal
    assert {e.param for e in epilogue.errors} == {"router.weight", "router_partial.weight", "expert.w1"}
    assert all(e.relative_error > 0.1 for e in epilogue.errors)
    assert hooks.real_vs_per_micro_step.bitwise_equal and hooks.errors == []
    assert verdict.inputs.startswith("rounding")
    assert [(c.name, c.applies, c.shown) for c in verdict.power_checks] == [
        ("marker_never_set", True, True),
        ("writeback_removed", True, True),
    ]
    assert all(0 < c.differing <= c.compared for c in verdict.power_checks), verdict.power_checks


def test_mutated_policy_fails_the_case(real):
    mutated = dataclasses.replace(get_policy("bf16_writeback"), writeback=None)
    verdict = judge(CONFIG, real, policy=mutated)
    assert not verdict.ok
    assert not verdict.paths[0].real_vs_transcription.bitwise_equal


def test_reproducer_imports_only_torch_and_deepspeed(tmp_path):
    tree = ast.parse(REPRODUCER.read_text())
    roots = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert roots <= {"argparse", "importlib", "logging", "torch", "deepspeed"}
    assert write_reproducer(tmp_path).read_text() == REPRODUCER.read_text()


@pytest.mark.slow
def test_reproducer_runs_under_torchrun_and_shows_the_skip(tmp_path):
    script = write_reproducer(tmp_path)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the reproducer needs no simdist
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            str(script),
            "--gas",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode != 0, done.stdout
    assert "micro-step 0: corrected" in done.stdout
    assert "micro-step 1: NOT corrected: the raw local gradient was added" in done.stdout
    assert "FAIL: 2 micro-steps on the epilogue (default) path, 4 wrong hp gradients over 4 ranks" in done.stdout
