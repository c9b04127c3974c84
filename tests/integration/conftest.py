"""Set-up for the integration tests: a private folder for the C++ extensions torch would build during the session.

Process launches fork their ranks from a forkserver per preload set, kept between launches
(`simdist.world.processes.forkservers`): a test module whose ranks preload a framework pays its import once, and the
other
tests' ranks do not carry it.
"""

from __future__ import annotations

import os
import tempfile

import pytest

EXTENSIONS_DIR = tempfile.mkdtemp(prefix="simdist-torch-extensions-")
"""Where torch would build C++ extensions during this session (``TORCH_EXTENSIONS_DIR``, set before the
first forkserver starts, so every rank inherits it): the tests never touch the user's cache, and
`test_cases_deepspeed.py` checks that the DeepSpeed cases built nothing there (they avoid DeepSpeed's CPU
ops, which compile on first use: about 75 s on 2 cores)."""
os.environ["TORCH_EXTENSIONS_DIR"] = EXTENSIONS_DIR


def pytest_sessionfinish(session: pytest.Session) -> None:
    import shutil

    shutil.rmtree(EXTENSIONS_DIR, ignore_errors=True)
