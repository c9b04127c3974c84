"""Imported by `tests/integration/test_run.py`'s process launches as a ``preload`` module: it records the process that
imported it, so a rank can tell whether the forkserver imported it (another pid) or the rank itself did."""

import os

IMPORTED_IN = os.getpid()
