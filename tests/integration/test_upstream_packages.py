"""``simdist case export production DIR``: for #8913, the ZeRO norm defect and the load defect, a standalone
reproducer, a unified diff against the installed DeepSpeed 0.19.8 and a report.

Fast (default): the export writes the three packages, each diff applies with ``patch -p1`` to a copy of the
installed package and changes exactly the lines its report names, an already-patched copy is refused, the
reproducers import only torch, deepspeed and the standard library. Slow: each reproducer, run with torchrun
on real gloo processes, exits 1 on the installed DeepSpeed and 0 on a copy with its own diff applied (the
venv's installed copy is never modified).
"""

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from simdist.cases.upstream.packages import PACKAGES, deepspeed_root, export


def _has_deepspeed() -> bool:
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except ModuleNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not _has_deepspeed(), reason="needs the deepspeed extra")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("export")
    export(directory)
    return directory


def _patched_copy(tmp_path: Path, diff: str) -> Path:
    """A copy of the installed ``deepspeed`` package under ``tmp_path/ds`` with ``diff`` applied by ``patch``."""
    root = tmp_path / "ds"
    shutil.copytree(deepspeed_root() / "deepspeed", root / "deepspeed", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["patch", "-p1"], input=diff, text=True, cwd=root, check=True, capture_output=True)
    return root


def test_export_writes_three_packages(exported):
    assert sorted(p.name for p in exported.iterdir()) == sorted(PACKAGES)
    for name in PACKAGES:
        assert sorted(p.name for p in (exported / name).iterdir()) == ["REPORT.md", "fix.diff", "reproduce.py"]
        report = (exported / name / "REPORT.md").read_text()
        assert "DeepSpeed 0.19.8" in report and "torchrun --standalone" in report


@pytest.mark.parametrize("name", list(PACKAGES))
def test_diff_applies_and_changes_the_lines_the_report_names(exported, tmp_path, name):
    diff = (exported / name / "fix.diff").read_text()
    root = _patched_copy(tmp_path, diff)
    for edit in PACKAGES[name].patch.edits:
        patched = (root / edit.path).read_text()
        assert all(line in patched for line in edit.new)
        # the report's "Where" section (`code_lines`) names the file and the first edited line (DeepSpeed 0.19.8)
        assert any(re.search(rf"{edit.path}:{edit.first}\b", line) for line in PACKAGES[name].code_lines)
    with pytest.raises(ValueError, match="already patched"):  # a patched copy is refused, not diffed again
        export(tmp_path / "again", [name], root=root)


@pytest.mark.parametrize("name", list(PACKAGES))
def test_reproducer_imports_only_torch_deepspeed_and_the_standard_library(exported, name):
    tree = ast.parse((exported / name / "reproduce.py").read_text())
    roots = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert roots - {"torch", "deepspeed"} <= set(sys.stdlib_module_names), roots


def _torchrun(package_dir: Path, nproc: int, pythonpath: Path | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run(
        [*command, "reproduce.py"], capture_output=True, text=True, env=env, timeout=600, cwd=package_dir
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PACKAGES))
def test_reproducer_fails_on_shipped_deepspeed_and_passes_with_its_diff(exported, tmp_path, name):
    package, folder = PACKAGES[name], exported / name
    shipped = _torchrun(folder, package.nproc, None)
    assert shipped.returncode == 1, shipped.stdout + shipped.stderr[-3000:]
    assert re.search(r"DEFECT|WRONG", shipped.stdout)
    root = _patched_copy(tmp_path, (folder / "fix.diff").read_text())
    fixed = _torchrun(folder, package.nproc, root)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr[-3000:]
    assert "OK" in fixed.stdout and not re.search(r"DEFECT|WRONG", fixed.stdout)
