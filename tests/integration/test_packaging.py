"""How the project is installed: its distribution name (``simdist`` on PyPI is an unrelated package), the
install hints of README and errors, and the Megatron extra across the Python versions pip serves."""

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import simdist
from simdist.cases import install_hint, run_case
from simdist.cases.base import Case

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_distribution_is_simdist_lab_and_every_install_hint_uses_it():
    assert PYPROJECT["project"]["name"] == simdist.DISTRIBUTION == "simdist-lab"
    docs = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("simdist/**/*.py"), *ROOT.glob("tests/**/*.py")]
    for path in docs:
        text = path.read_text()
        assert not re.search(r"""['"]simdist\[""", text), f"{path}: installs the unrelated PyPI package 'simdist'"
        for line in text.splitlines():  # DeepSpeed is installed without compiling ops, wherever it is meant
            if re.search(r"pip install .*deepspeed", line) and "DS_BUILD_OPS=0" not in line:
                pytest.fail(f"{path}: {line.strip()!r} installs DeepSpeed without DS_BUILD_OPS=0")
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"deepspeed", "megatron"} <= extras.keys()
    assert install_hint("megatron") == (
        "pip install 'simdist-lab[megatron]' (from a source checkout: pip install -e '.[megatron]')"
    )
    assert install_hint("deepspeed").startswith("DS_BUILD_OPS=0 pip install 'simdist-lab[deepspeed]' (")


def test_a_case_whose_framework_is_missing_names_the_extra(monkeypatch):
    import simdist.cases as cases

    fake = Case("fake", "-", "-", (), ("megatron",), lambda **_: None)
    monkeypatch.setattr(Case, "missing", lambda self: list(self.requires))
    monkeypatch.setattr(cases, "get_case", lambda name: fake)
    with pytest.raises(ValueError, match=r"needs the megatron extra: pip install 'simdist-lab\[megatron\]'"):
        run_case("fake")


def _megatron_for(python: str) -> list[Requirement]:
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux"}
    found = [Requirement(text) for text in PYPROJECT["project"]["optional-dependencies"]["megatron"]]
    return [r for r in found if r.marker is None or r.marker.evaluate(env)]


@pytest.mark.parametrize(
    ("python", "admitted", "refused"),
    [
        ("3.11", ["0.16.1"], ["0.16.0", "0.17.0"]),  # pip's newest for 3.11 is 0.16.1 (0.17+ require 3.12)
        ("3.12", ["0.16.1", "0.17.1", "0.18.2", "0.19.2"], ["0.15.3", "0.20.0"]),
        ("3.13", ["0.19.2"], ["0.20.0"]),
    ],
)
def test_the_megatron_extra_spans_the_versions_pip_offers(python, admitted, refused):
    megatron = [r for r in _megatron_for(python) if r.name == "megatron-core"]
    assert len(megatron) == 1, megatron
    assert all(megatron[0].specifier.contains(v) for v in admitted), (megatron, admitted)
    assert not any(megatron[0].specifier.contains(v) for v in refused), (megatron, refused)
    assert any(r.name == "triton" for r in _megatron_for(python)) is (python != "3.11")


def test_the_policies_are_real_files_inside_the_package():
    """``simdist/policies`` was a symlink to a top-level folder: absent where checkouts have no symlinks (Windows)
    and outside the package in an sdist. Now the catalogue is plain files that setuptools finds as a package."""
    import setuptools

    import simdist.policies

    folder = ROOT / "simdist" / "policies"
    links = [p for p in (ROOT / "simdist").rglob("*") if p.is_symlink()]
    assert not links, f"symlinks in the package: {links}"
    assert folder.is_dir() and Path(simdist.policies.__file__).resolve().parent == folder.resolve()
    found = setuptools.find_packages(str(ROOT), include=PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
    assert "simdist.policies" in found
    git = ROOT / ".git"
    if git.exists():  # a checkout: no file of the index is a symlink (mode 120000)
        staged = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
        assert not [line for line in staged.stdout.splitlines() if line.startswith("120000")]
    assert not list((ROOT / "policies").glob("*.py")), "policies/ holds only the README for users' own policies"


@pytest.mark.slow
def test_a_built_wheel_holds_every_policy_module(tmp_path):
    """A non-editable wheel (what ``pip install simdist-lab`` gets) ships the whole catalogue."""
    source = tmp_path / "source"  # a copy: the build leaves build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "simdist", source / "simdist", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("simdist_lab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"simdist/policies/{p.name}" for p in (ROOT / "simdist" / "policies").glob("*.py")}
    assert len(expected) >= 8 and expected <= names, sorted(expected - names)
    scripts = {f"simdist/cases/reproducers/{p.name}" for p in (ROOT / "simdist" / "cases" / "reproducers").glob("*.py")}
    assert len(scripts) == 4 and scripts <= names, sorted(
        scripts - names
    )  # package data: the upstream reports' scripts
