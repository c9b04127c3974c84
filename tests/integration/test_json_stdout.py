"""``--json`` prints JSON alone on stdout: framework logging goes to stderr (issue 19, item 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_NOISY = textwrap.dedent(
    """
    import importlib.util, json, logging, os, subprocess, sys

    # the module by its path, not through `import simdist` (which imports torch: seconds); it needs only the stdlib
    spec = importlib.util.spec_from_file_location("stdout_under_test", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stdout_to_stderr = module.stdout_to_stderr

    log = logging.getLogger("framework")
    log.addHandler(logging.StreamHandler(stream=sys.stdout))  # bound before the block, as DeepSpeed's is
    with stdout_to_stderr() as report:
        print("a print")
        log.warning("a log line")
        os.write(1, b"a raw write\\n")
        subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
        print(json.dumps({"answer": 42}), file=report)
    print("after the block")
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_stdout_to_stderr_leaves_only_the_report_on_stdout():
    module = str(ROOT / "simdist" / "cases" / "stdout.py")
    done = subprocess.run(
        [sys.executable, "-c", _NOISY, module], capture_output=True, text=True, env=_env(), check=True
    )
    assert done.stdout == '{"answer": 42}\nafter the block\n'
    for line in ("a print", "a log line", "a raw write", "a child process"):
        assert line in done.stderr


def test_a_replaced_sys_stdout_still_receives_the_report(capsys):
    from simdist.cases.stdout import stdout_to_stderr

    with stdout_to_stderr() as report:
        print('{"answer": 42}', file=report)
    assert capsys.readouterr().out == '{"answer": 42}\n'


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["case", "run", "deepspeed-gas-marker", "--json"],
        pytest.param(["case", "run", "deepspeed-8913", "--json"], marks=pytest.mark.nightly),  # ~25 s: TP2 + TP4
        ["repro", "8913", "--code", "deepspeed", "--json", "--steps", "1", "--gas", "1", "--no-progress"],
    ],
    ids=["gas-marker", "8913", "repro-engine"],
)
def test_json_commands_print_json_alone(argv):
    done = subprocess.run(
        [sys.executable, "-m", "simdist.cli", *argv], capture_output=True, text=True, env=_env(), timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    json.loads(done.stdout)  # the whole of stdout is one JSON document
    assert "[WARNING]" in done.stderr  # DeepSpeed did log: the test would see it if it went to stdout


_PRINTING_RANKS = textwrap.dedent(
    """
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} prints")  # a rank's own output: stderr under --json (one write per rank)
    os.write(1, b"a raw write on fd 1\\n")
    x = torch.full((8,), 0.1, dtype=torch.bfloat16)
    dist.all_reduce(x)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_blame_json_in_rank_processes_prints_json_alone(tmp_path):
    """The rank processes of ``blame --processes`` send their prints to stderr: stdout is the report alone."""
    script = tmp_path / "printing_ranks.py"
    script.write_text(_PRINTING_RANKS)
    argv = ["blame", "--json", "--processes", "--nproc", "2", str(script)]
    done = subprocess.run(
        [sys.executable, "-m", "simdist.cli", *argv], capture_output=True, text=True, env=_env(), timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    json.loads(done.stdout)
    assert "rank 0 prints" in done.stderr and "rank 1 prints" in done.stderr
    assert done.stderr.count("a raw write on fd 1") == 2
