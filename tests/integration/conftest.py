"""One forkserver for the whole session: the frameworks the collected tests' ranks import are preloaded at once.

`simdist.world.launch` restarts its forkserver whenever a launch needs a module the running server lacks (a
framework's ``preload=``): torch, DeepSpeed and Megatron were imported again at each restart (about 5 s each
on the 2-core CI machine). A test module whose ranks preload a framework names it in ``FORKSERVER_PRELOAD``;
if any of its tests is to run, the server starts once with every such module, before the first launch (the
server itself still starts lazily, at the first launch). Ranks of the other tests then also have the
framework imported, as ranks launched after a framework's test always had.
"""

from __future__ import annotations

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    wanted: list[str] = []
    for item in session.items:
        if item.get_closest_marker("skip") is None:  # the slow and nightly tests skipped by tests/conftest.py
            wanted += getattr(getattr(item, "module", None), "FORKSERVER_PRELOAD", ())
    if wanted:
        from simdist.world.launch import _context

        _context(tuple(dict.fromkeys(wanted)))  # sets the server's preload list; the server starts at first use
