"""Keep stdout for the report: send a framework's prints and log lines to stderr at the file-descriptor level.

DeepSpeed's logger writes to the ``sys.stdout`` object it captured at import
(``deepspeed.utils.logging.LoggerFactory``: ``StreamHandler(stream=sys.stdout)``)
and warns on import already ("Setting accelerator to CPU"), so swapping
``sys.stdout`` or re-pointing handlers after the fact misses lines. Pointing
file descriptor 1 at stderr catches every writer: Python objects bound to
fd 1, C extensions, and child processes started inside the block (they
inherit the descriptors; the ranks of ``simdist.run(where="gloo")`` come
from a forkserver, which is why the rank programs call this too). ``sys.stdout`` is pointed at stderr as well,
so that prints reach stderr when ``sys.stdout`` is not fd 1 (replaced by a caller). It is the one such guard:
``simdist repro --json``, ``case run --json``, ``audit --json`` and ``blame --json`` all use it.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import TextIO


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[TextIO]:
    """Inside the block fd 1 and ``sys.stdout`` go to stderr; yields a stream on the original stdout.

    Write the report (the JSON) to the yielded stream; it is flushed and closed
    when the block ends and fd 1 is restored. When ``sys.stdout`` is not fd 1
    (replaced by a caller, e.g. pytest's ``capsys``), the report goes to it.
    """
    sys.stdout.flush()
    try:
        on_fd1 = sys.stdout.fileno() == 1
    except (AttributeError, ValueError, io.UnsupportedOperation):  # replaced (pytest's capsys, a StringIO)
        on_fd1 = False
    saved = os.dup(1)
    # sys.stdout on fd 1 now reaches stderr too, so the report gets its own stream on the original fd 1;
    # a replaced sys.stdout is not fd 1 and keeps receiving the report
    report = os.fdopen(os.dup(saved), "w", encoding="utf-8") if on_fd1 else sys.stdout
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # a replaced sys.stdout (not fd 1) must not take prints either
            yield report
    finally:
        with contextlib.suppress(ValueError, OSError):
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        if on_fd1:
            with contextlib.suppress(BrokenPipeError):
                report.close()
