"""Run by tests/integration/test_cpu_kernels.py under one ``ATEN_CPU_CAPABILITY``: prints one JSON line of
digests of what simdist computes (growth metrics, a growth run's files, ``simdist repro 8913``) and of one torch
op whose bits are known to depend on the kernel (the power check that the capability took effect)."""

import contextlib
import hashlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

from simdist.cli import main
from simdist.numerics.kernels import kernel_family
from simdist.studies.growth import GrowthConfig, run_growth
from simdist.studies.growth.metrics import Reference, divergence, divergence_each


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def tensor_digest(t: torch.Tensor) -> str:
    return digest(t.contiguous().reshape(-1).numpy().tobytes())


def uniform(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Values from ``torch.rand`` (integer bits scaled: the same on every kernel, unlike ``randn``)."""
    return (torch.rand(*shape, generator=gen) - 0.5) * 2.0 ** torch.randint(-30, 10, shape, generator=gen).float()


def main_probe(out: Path) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    expected = uniform(gen, 8, 4, 300)
    actual = expected * (1 + uniform(gen, 3, 8, 4, 300) * 2.0**-12)
    reference = Reference(expected)
    found = {
        "family": kernel_family(),
        "metrics": tensor_digest(divergence(actual, reference)),
        "metrics_each": tensor_digest(divergence_each(actual, reference)),
        "lerp": tensor_digest(torch.lerp(expected, actual[0], 0.1)),  # fused multiply-add on AVX2/AVX-512 only
    }
    run_growth(GrowthConfig(steps=40, seeds=2), out, progress=False, plot=True)
    for name in ("metrics.csv", "summary.json", "growth.png", "checkpoint.safetensors"):
        found[name] = digest((out / name).read_bytes())
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main(["repro", "8913", "--json"])
    found["repro"] = digest(text.getvalue().encode())
    return found


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(main_probe(Path(tmp) / "growth")))
    sys.exit(0)
