"""Building the native fold kernel (`simdist.reduce.native`) from a fresh clone: processes that first reduce at
the same moment with an empty cache each build, rename into place atomically and load a working kernel; the
cache is then reused; ``SIMDIST_NATIVE=0`` runs the eager path with the same bits."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from simdist.reduce import Gloo, native

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import sys, torch
from simdist.reduce import Gloo, native
xs = [torch.tensor([1.0, float("nan"), -0.0, 2.0**-24, 3.0]) * (r + 1) for r in range(3)]
bits = Gloo(max_segment_bytes=4).reduce(xs).view(torch.int32).tolist()  # the first use: loads (or builds) the kernel
print(native.STATUS.split()[0], bits)
"""

has_toolchain = shutil.which(os.environ.get("CC") or "cc") is not None and os.path.exists(
    os.path.join(sysconfig.get_paths()["include"], "Python.h")
)


def _start(cache: Path, **env: str) -> subprocess.Popen:
    inherited = {key: value for key, value in os.environ.items() if key != "SIMDIST_NATIVE"}
    environment = {**inherited, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen([sys.executable, "-c", PROGRAM], env=environment, stdout=subprocess.PIPE, text=True)


@pytest.mark.skipif(not has_toolchain, reason="needs a C compiler and Python's headers")
def test_threads_building_into_an_empty_cache_leave_one_kernel_that_folds(tmp_path, monkeypatch):
    """In one process (no torch import per builder): concurrent builds into a fresh cache, then a cached load."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        kernels = list(pool.map(lambda _: native._build(), range(2)))
    built = list((tmp_path / "simdist" / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("fold-"), built  # no partial files left behind
    mtime = built[0].stat().st_mtime_ns
    kernels.append(native._build())
    assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    model = Gloo(max_segment_bytes=8)
    xs = [torch.tensor([1.0, float("nan"), -0.0, 2.0**-24, 3.0]) * (r + 1) for r in range(3)]
    plan = model.plan(3, 5, torch.float32)
    expected = native.fold(plan, xs) if native.available() else model.reduce(xs)
    for kernel in kernels:
        out = torch.empty(5)
        assert kernel.fold(native._packed(plan), 0, xs, out, 0)
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


@pytest.mark.slow
@pytest.mark.skipif(not has_toolchain, reason="needs a C compiler and Python's headers")
def test_concurrent_first_builds_load_one_cached_kernel_and_the_switch_gives_the_same_bits(tmp_path):
    builders = [_start(tmp_path, SIMDIST_NATIVE="build") for _ in range(3)]  # not the extension built at install
    outputs = [b.communicate(timeout=240)[0].split(" ", 1) for b in builders]
    assert all(b.returncode == 0 for b in builders)  # three processes, three torch imports: slow
    assert {status for status, _ in outputs} == {"loaded"}
    built = list((tmp_path / "simdist" / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("fold-"), built  # no partial files left behind
    mtime = built[0].stat().st_mtime_ns
    cached = _start(tmp_path, SIMDIST_NATIVE="build").communicate(timeout=240)[0].split(" ", 1)
    assert cached[0] == "loaded" and built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    eager = _start(tmp_path, SIMDIST_NATIVE="0").communicate(timeout=240)[0].split(" ", 1)
    assert eager[0] == "disabled"
    assert {bits for _, bits in outputs} == {cached[1], eager[1]}


IMPORT_ONLY = """
import os, sys
import simdist.reduce, simdist.reduce.gloo, simdist.reduce.nccl
from simdist.reduce import native
cache = os.path.join(os.environ["XDG_CACHE_HOME"], "simdist")
print(native._KERNEL is None and not native._tried, native.STATUS, os.path.exists(cache))
print(native.available() == native.STATUS.startswith("loaded"), native.STATUS.split()[0])
"""


@pytest.mark.skipif(not has_toolchain, reason="needs a C compiler and Python's headers")
def test_importing_the_reductions_builds_and_loads_no_kernel_until_first_use(tmp_path):
    """``import simdist.reduce`` (and its gloo and nccl models) compiles nothing and loads no extension; the first
    `native.available` builds into the empty cache."""
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "SIMDIST_NATIVE": "build"}
    done = subprocess.run([sys.executable, "-c", IMPORT_ONLY], env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["True not loaded False", "True loaded"]
    assert len(list((tmp_path / "simdist" / "native").iterdir())) == 1  # built by the first use, into the cache
