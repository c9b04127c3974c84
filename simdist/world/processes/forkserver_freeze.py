"""Imported last by every forkserver of the launcher (`simdist.world.processes.forkservers`): ``gc.freeze()`` there.

Every rank process is forked from the forkserver after it imported torch and the launch's frameworks; those
modules' objects (hundreds of thousands) then sit in each rank's garbage-collector generations, and every full
collection walks them again. DeepSpeed calls ``gc.collect()`` in each ``see_memory_usage`` (six times per
``BF16_Optimizer``): measured at about 0.23 s a call in a rank with torch's inductor imported, 11 s of a 25 s
case launch. ``gc.freeze()`` moves the server's objects to the permanent generation, which collections skip
(Python's documented recipe for a pre-forking server: freeze right before ``fork()``); what the ranks allocate
is still collected. Anywhere but inside the forkserver's preloading, importing this module does nothing.
"""

from __future__ import annotations

import gc
import sys
import types


def _in_forkserver() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main``'s preloading."""
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


FROZE: bool = _in_forkserver()
"""True in a forkserver that froze its objects on importing this module."""

if FROZE:
    gc.collect()  # what is garbage now need not be kept forever
    gc.freeze()
