"""What makes a test a unit test here: it runs in this process only -- no child process, no subprocess, no gloo.

Every test under ``tests/unit`` runs with process creation and the gloo backend refused: ``subprocess`` (every
``run``/``check_output``/``Popen`` goes through ``Popen``), ``multiprocessing`` and ``torch.multiprocessing``
(``BaseProcess.start``), ``os.fork``/``os.posix_spawn``/``os.system``, and ``dist.init_process_group`` with
a gloo (or unnamed, hence gloo on CPU) backend. A test that needs any of them belongs in ``tests/integration``.
Rank threads (`simdist.run`, `SimWorld`) are in-process and allowed. The Hypothesis profiles, the ``slow`` and
``nightly`` markers and the policy-registry reset come from ``tests/conftest.py``, shared by both directories.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest
import torch.distributed as dist


class ProcessInUnitTestError(AssertionError):
    """A unit test tried to start a process or a gloo group (move it to tests/integration)."""


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise ProcessInUnitTestError(f"{what} in a unit test: tests/unit runs in one process (see its conftest.py)")

    return refused


@pytest.fixture(autouse=True)
def _in_process_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("subprocess.Popen"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("starting a multiprocessing Process"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
    init_process_group = dist.init_process_group

    def no_gloo(backend=None, *args, **kwargs):
        if backend is None or "gloo" in str(backend).lower():
            raise ProcessInUnitTestError(f"init_process_group({backend!r}) in a unit test: gloo needs processes")
        return init_process_group(backend, *args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", no_gloo)
    yield
