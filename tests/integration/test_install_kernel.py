"""The native fold kernel as an install-time extension: in the wheel where a compiler exists, absent (and the
install not failed) where none does; ``simdist doctor`` names which kernel runs, and says when none does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from simdist.cli import main
from simdist.reduce import native

ROOT = Path(__file__).resolve().parents[2]

has_toolchain = shutil.which(os.environ.get("CC") or "cc") is not None and os.path.exists(
    os.path.join(sysconfig.get_paths()["include"], "Python.h")
)


def test_doctor_names_the_kernel_and_the_backend(capsys):
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("simdist ") and "torch" in lines[0]
    assert lines[1] == f"native fold kernel: {native.STATUS}" + (
        "" if native.available() else " -> reductions run the eager path (same bits, 5-8x slower)"
    )
    assert lines[2] == "torch.distributed backend 'simdist': registered"


def test_doctor_says_when_the_eager_path_runs(capsys):
    with native.disabled():
        assert main(["doctor"]) == 0
    assert "-> reductions run the eager path" in capsys.readouterr().out.splitlines()[1]


def _source_tree(tmp_path: Path) -> Path:
    """The checkout's files as git sees them (no build/ folder, no extension built in place by ``pip -e``)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    tree = tmp_path / "src"
    for name in listed.stdout.splitlines():
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    return tree


def _wheel(tmp_path: Path, **env: str) -> list[str]:
    out = tmp_path / "wheel"
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    done = subprocess.run(
        [*pip, str(_source_tree(tmp_path))],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("simdist_lab-*.whl")
    return zipfile.ZipFile(wheel).namelist()


@pytest.mark.slow
@pytest.mark.skipif(not has_toolchain, reason="needs a C compiler and Python's headers")
def test_the_wheel_holds_the_compiled_kernel_its_source_and_py_typed(tmp_path):
    names = _wheel(tmp_path)
    assert any(n.startswith("simdist/reduce/_simdist_fold.") and n.endswith((".so", ".pyd")) for n in names), names
    assert "simdist/reduce/_fold.c" in names and "simdist/py.typed" in names


@pytest.mark.slow
def test_without_a_compiler_the_wheel_builds_without_the_kernel(tmp_path):
    """A failed build of the optional extension leaves it out; the wheel (and so the install) still succeeds."""
    names = _wheel(tmp_path, CC="/bin/false")
    assert not any(n.startswith("simdist/reduce/_simdist_fold.") for n in names)
    assert "simdist/reduce/_fold.c" in names  # the fallback can still build it on first use
    # ... and it installs and runs without one: doctor names the eager path, a 4-rank all_reduce sums
    (wheel,) = (tmp_path / "wheel").glob("simdist_lab-*.whl")
    target = tmp_path / "installed"
    env = {**os.environ, "CC": "/bin/false", "PYTHONPATH": str(target)}
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)]
    done = subprocess.run(pip, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    code = """
import sys, torch, torch.distributed as dist, simdist
from simdist.cli import main
assert simdist.__file__.startswith(sys.argv[1]), simdist.__file__
main(["doctor"])
def add(rank):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return t
print(simdist.run(add, 4)[0].tolist())
"""
    done = subprocess.run(
        [sys.executable, "-c", code, str(target)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "-> reductions run the eager path" in done.stdout and "[10.0, 10.0, 10.0]" in done.stdout, done.stdout
