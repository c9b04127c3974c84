"""One forkserver for the whole session: the frameworks the collected tests' ranks import are preloaded at once.

`simdist.world.launch` restarts its forkserver whenever a launch needs a module the running server lacks (a
framework's ``preload=``): torch, DeepSpeed and Megatron were imported again at each restart (about 5 s each
on the 2-core CI machine). A test module whose ranks preload a framework names it in ``FORKSERVER_PRELOAD``;
if any of its tests is to run, the server starts once with every such module, before the first launch (the
server itself still starts lazily, at the first launch). Ranks of the other tests then also have the
framework imported, as ranks launched after a framework's test always had.
"""

from __future__ import annotations

import os
import tempfile

import pytest

EXTENSIONS_DIR = tempfile.mkdtemp(prefix="simdist-torch-extensions-")
"""Where torch would build C++ extensions during this session (``TORCH_EXTENSIONS_DIR``, set before the
forkserver starts, so every rank inherits it): the tests never touch the user's cache, and
`test_cases_deepspeed.py` checks that the DeepSpeed cases built nothing there (they avoid DeepSpeed's CPU
ops, which compile on first use: about 75 s on 2 cores)."""
os.environ["TORCH_EXTENSIONS_DIR"] = EXTENSIONS_DIR


def pytest_collection_finish(session: pytest.Session) -> None:
    wanted: list[str] = []
    for item in session.items:
        if item.get_closest_marker("skip") is None:  # the slow and nightly tests skipped by tests/conftest.py
            wanted += getattr(getattr(item, "module", None), "FORKSERVER_PRELOAD", ())
    if wanted:
        from simdist.world.launch import _context

        _context(tuple(dict.fromkeys(wanted)))  # sets the server's preload list; the server starts at first use


def pytest_sessionfinish(session: pytest.Session) -> None:
    import shutil

    shutil.rmtree(EXTENSIONS_DIR, ignore_errors=True)
