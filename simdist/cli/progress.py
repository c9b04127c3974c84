"""Progress on stderr for CLI runs: a tqdm bar that appears only once a run has taken 2 seconds.

`bar` is a counted bar (steps, runs); `ticking` shows elapsed time for work that reports no progress of
its own (a real framework's case run, a large dump comparison). Both write to stderr, so stdout stays the
report, and stay silent for runs shorter than `DELAY_S`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

DELAY_S = 2.0
"""Seconds before a bar is drawn: quick runs print nothing on stderr."""


def bar(total: int, desc: str, unit: str = "it", enabled: bool = True):
    """A tqdm bar on stderr that shows itself after `DELAY_S`; ``None`` when not ``enabled``."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, delay=DELAY_S, file=sys.stderr, leave=False)


@contextlib.contextmanager
def ticking(desc: str, enabled: bool = True) -> Iterator[None]:
    """Elapsed time on stderr (after `DELAY_S`) while the block runs, from a daemon thread."""
    if not enabled:
        yield
        return
    from tqdm import tqdm

    stop = threading.Event()
    with tqdm(
        total=None, desc=desc, bar_format="{desc}: {elapsed} elapsed", delay=DELAY_S, file=sys.stderr, leave=False
    ) as shown:

        def tick() -> None:
            while not stop.wait(0.5):
                if shown._time() - shown.start_t >= DELAY_S:  # refresh() alone would ignore the delay
                    shown.refresh()

        thread = threading.Thread(target=tick, name="simdist-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
