"""What simdist computes is the same on every CPU kernel family it claims, and differs where torch's does.

Each capability runs `kernels_probe.py` in its own interpreter (``ATEN_CPU_CAPABILITY`` is read once, at
torch's start): ``default`` (no vector unit), ``avx2`` and, where the CPU has it, ``avx512``.

* The growth metrics (`simdist.studies.growth.metrics`: sums in element order, the C library's ``exp2``) give
  the same bits under every capability, for one batched call and one call per policy.
* AVX2 and AVX-512 form one family (`simdist.numerics.kernels`): a growth run's files, PNG included, and
  ``simdist repro 8913 --json`` are byte-identical between them.
* Power: ``torch.lerp`` differs between ``default`` and ``avx2`` (a fused multiply-add on one only), so the
  capability did take effect; the growth files differ there too, through torch's own ops (AdamW, randn), which
  is why README promises them only within a family.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).with_name("kernels_probe.py")
FILES = ("metrics.csv", "summary.json", "growth.png", "checkpoint.safetensors", "repro")


def _capabilities() -> list[str]:
    here = torch.backends.cpu.get_cpu_capability()
    if here not in ("AVX2", "AVX512"):
        pytest.skip(f"the kernel families are measured on x86-64 with AVX2 or AVX-512; this CPU runs {here}")
    return ["default", "avx2"] + (["avx512"] if here == "AVX512" else [])


@pytest.mark.slow
def test_figures_across_cpu_kernels():
    runs = {}
    procs = {
        cap: subprocess.Popen(
            [sys.executable, str(PROBE)],
            env={**os.environ, "ATEN_CPU_CAPABILITY": cap},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cap in _capabilities()
    }
    for cap, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        runs[cap] = json.loads(out.strip().splitlines()[-1])
    assert runs["default"]["family"] == "default" and runs["avx2"]["family"] == "x86-fma"
    assert runs["default"]["lerp"] != runs["avx2"]["lerp"], "ATEN_CPU_CAPABILITY did not change torch's kernels"
    assert len({r["metrics"] for r in runs.values()} | {r["metrics_each"] for r in runs.values()}) == 1, runs
    if "avx512" in runs:
        assert {name: runs["avx2"][name] for name in FILES} == {name: runs["avx512"][name] for name in FILES}
    assert runs["default"]["metrics.csv"] != runs["avx2"]["metrics.csv"], "README's caveat for `default` is stale"
