"""The torchrun route: a script that does only ``import simdist`` and ``dist.init_process_group("simdist")``
runs under real torchrun (``torch.distributed.run``, rendezvous on 127.0.0.1), and ``python -m simdist.launch``
runs a rank program there. Both start real processes (seconds each): marked slow.

The reference is a left fold written here in plain torch (no simdist code): ``SIMDIST_REDUCTION=sequential`` sums
``((x0 + x1) + x2) + x3`` in BF16, one rounding per add, on every rank.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import simdist

REPO = Path(simdist.__file__).resolve().parents[1]

SCRIPT = """
import sys
import torch
import simdist  # registers the torch.distributed backend "simdist"
import torch.distributed as dist

dist.init_process_group("simdist")
rank = dist.get_rank()
g = torch.Generator().manual_seed(1234 + rank)
x = (torch.randn(4096, generator=g) * 2.0 ** torch.randint(-12, 12, (4096,), generator=g)).to(torch.bfloat16)
out = x.clone()
dist.all_reduce(out)
run = {"x": x, "out": out, "backend": dist.get_backend(), "world": dist.get_world_size()}
torch.save(run, f"{sys.argv[1]}/r{rank}.pt")
dist.destroy_process_group()
"""

RANK_PROGRAM = """
import os
from pathlib import Path


def rank_fn(comm):
    Path(os.environ["OUT_DIR"], f"rank{os.environ['RANK']}.txt").write_text(type(comm).__name__)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(cwd)]),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *argv]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300, cwd=cwd)


@pytest.mark.slow
def test_plain_import_simdist_is_enough_for_init_process_group_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = _torchrun(4, [str(script), str(tmp_path)], tmp_path, SIMDIST_REDUCTION="sequential")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [torch.load(tmp_path / f"r{rank}.pt") for rank in range(4)]
    assert {(r["backend"], r["world"]) for r in runs} == {("simdist", 4)}
    expected = runs[0]["x"]
    for r in runs[1:]:
        expected = expected + r["x"]  # bf16 + bf16: one rounding to bf16 per add
    reversed_order = runs[3]["x"]
    for r in runs[2::-1]:
        reversed_order = reversed_order + r["x"]
    assert not torch.equal(expected.view(torch.int16), reversed_order.view(torch.int16))  # the order shows
    for r in runs:
        assert torch.equal(r["out"].view(torch.int16), expected.view(torch.int16))


@pytest.mark.slow
def test_python_m_simdist_launch_runs_a_rank_program_under_torchrun(tmp_path):
    (tmp_path / "myprog.py").write_text(RANK_PROGRAM)
    argv = ["-m", "simdist.launch", "myprog:rank_fn", "--tp", "2", "--backend", "gloo"]
    done = _torchrun(2, argv, tmp_path, OUT_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["TorchComm", "TorchComm"]
