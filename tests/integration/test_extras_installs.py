"""Every install a user can make collects and passes or skips cleanly: ``[dev,deepspeed]`` and
``[dev,megatron]`` here (CI builds venvs for ``[dev]`` alone and for every extra).

Each install is emulated by hiding the other framework from the import system (`hide_frameworks.py`): the whole
suite must collect, and the tests that list or run cases, whose outcome depends on what is installed, must pass
(those needing the hidden framework skip, naming its extra).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from simdist.extras import installed

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
DEPENDS_ON_THE_INSTALL = [
    "tests/unit/test_extras.py",
    "tests/integration/test_packaging.py",
    "tests/integration/test_reruns.py::test_only_the_listed_cases_allow_the_threads_world",
]
HIDDEN_FRAMEWORKS_TESTS = {
    "megatron": "tests/integration/test_cases_megatron.py",
    "deepspeed": "tests/integration/test_cases_deepspeed.py",
}
"""A test module of the hidden framework: it must skip as a whole."""


def _pytest(hidden: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(HERE / "hide_frameworks.py"), hidden, "--", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("hidden", ["megatron", "deepspeed"], ids=lambda h: f"without-{h}")
def test_an_install_without_one_framework_collects_and_passes(hidden):
    present = "deepspeed" if hidden == "megatron" else "megatron"
    if not installed(present):
        pytest.skip(f"emulates [dev,{present}]: needs {present} installed")
    collected = _pytest(hidden, "--collect-only")
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    ran = _pytest(hidden, "-rs", *DEPENDS_ON_THE_INSTALL, HIDDEN_FRAMEWORKS_TESTS[hidden])
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert f"the {hidden} extra is not installed: " in ran.stdout  # the skips name the extra to install
