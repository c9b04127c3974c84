"""Ctrl-C in the ``simdist`` command: one line on stderr and exit status 130, wherever the signal lands.

Python's own answer to SIGINT is a ``KeyboardInterrupt`` raised at whatever bytecode the main thread runs next,
and for a command that spends its first seconds importing torch, numpy and the frameworks that is not safe:
raised inside an import it leaves a half-initialised module behind (a later ``numpy.linalg`` then recurses
until ``RecursionError``), code that catches ``BaseException`` to clean up or report can swallow it (the run
went on and exited 0), and raised under torch's C++ start-up it can abort the process. So the command installs
`exit_on_interrupt`'s handler instead: it never raises; it writes the line, stops the child processes this
process started (process-mode ranks, gloo ranks), and ends the process with ``os._exit(130)``.

What that gives up: ``finally`` blocks and ``atexit`` handlers do not run, so temporary files a command was
writing stay behind; files the studies write are written whole or resumed from their last checkpoint (a
SIGKILL is no different), so nothing a later run reads is left half-written. Library callers of
`simdist.cli.main` (with an ``argv``) keep Python's ``KeyboardInterrupt``, which ``main`` turns into the same
line and status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType

MESSAGE = b"simdist: interrupted\n"
EXIT_INTERRUPTED = 130


def exit_on_interrupt() -> None:
    """Make SIGINT end this process at once with `MESSAGE` and status 130 (from the main thread; else a no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupted)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """The handler: flush what was printed, write the line, stop our child processes, exit 130."""
    with contextlib.suppress(Exception):  # a write the signal interrupted cannot be resumed: drop it
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.write(2, MESSAGE)
    multiprocessing = sys.modules.get("multiprocessing")  # no import in a handler: none started, none to stop
    if multiprocessing is not None:
        with contextlib.suppress(Exception):
            for child in multiprocessing.active_children():
                child.terminate()
    os._exit(EXIT_INTERRUPTED)
