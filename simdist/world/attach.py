"""Scripts that initialise their own process group, with any backend name, run on simdist's ranks.

The torch tutorial's ``mp.spawn`` worker and every torchrun script call
``dist.init_process_group("gloo" | "nccl" | "cpu:gloo,cuda:nccl", init_method="env://" | "tcp://...",
rank=..., world_size=...)`` themselves. On a simdist rank (a rank thread of `simdist.spawn`/`simdist.run`,
a rank process of ``where="processes"`` or of ``simdist run``), `install` makes these calls work unchanged:

* ``init_process_group`` with any backend name and init method **attaches** to the rank's simdist default
  group (the launcher made it) after checking that ``rank``/``world_size``, where given, are this rank's; a
  second call raises c10d's own "initialize the default process group twice" ``ValueError``. After the script's
  ``destroy_process_group()`` a further ``init_process_group`` makes a new simdist default group.
* ``destroy_process_group()`` (c10d's own, untouched) **detaches**: the default group is destroyed; the
  launcher's end-of-rank teardown then has nothing left to do.
* ``new_group(..., backend="gloo")`` (any name) makes a simdist group: on a simdist rank every group is one.
* ``dist.get_backend()`` answers ``"simdist"``, or with ``report_backend=True`` the name the script asked
  for, so code gated on ``get_backend() == "nccl"`` takes the path it takes on that backend.

`Attachment` is one rank's record (the thread launcher keeps one per rank thread, a rank process one for
itself); ``lookup`` finds the calling rank's (``None``: not a simdist rank, the originals run untouched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from simdist.errors import UsageError
from simdist.world.backend import BACKEND_NAME

__all__ = ["Attachment", "install"]


@dataclass
class Attachment:
    """One simdist rank's view of the script's own ``init_process_group`` calls."""

    rank: int
    world_size: int
    reinit: Callable[[int], None]  # makes a fresh simdist default group; the argument counts re-inits from 1
    report_backend: bool = False
    asked: str | None = None  # the backend name the script passed (None: it has not called init)
    initialised_by_script: bool = False
    reinits: int = 0


_MODULES = (dist, c10d)


def _check_rank(att: Attachment, rank: Any, world_size: Any) -> None:
    if rank is not None and rank != -1 and rank != att.rank:
        raise UsageError(
            f"init_process_group(rank={rank}) on simdist rank {att.rank}: a script's rank must be the launcher's"
        )
    if world_size is not None and world_size != -1 and world_size != att.world_size:
        raise UsageError(
            f"init_process_group(world_size={world_size}) on simdist rank {att.rank} of a {att.world_size}-rank "
            "launch: the world sizes must agree"
        )


def install(lookup: Callable[[], Attachment | None]) -> Callable[[], None]:
    """Replace ``init_process_group``, ``new_group`` and ``get_backend`` in
    ``torch.distributed`` and its ``distributed_c10d`` by simdist-rank-aware versions; returns the undo.
    A launcher makes its own default group with the original function (saved before installing) or before
    its rank's `Attachment` exists."""
    original_init = c10d.init_process_group
    original_new_group = c10d.new_group
    original_get_backend = c10d.get_backend

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, *args, **kwargs):
        att = lookup()
        if att is None:
            return original_init(backend, init_method, timeout, world_size, rank, *args, **kwargs)
        _check_rank(att, rank, world_size)
        if c10d.is_initialized():
            if att.initialised_by_script:
                raise UsageError("trying to initialize the default process group twice!")
        else:
            att.reinits += 1
            att.reinit(att.reinits)
        att.asked = None if backend is None else str(backend)
        att.initialised_by_script = True
        return None

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        if lookup() is not None:
            backend = None  # the default group's backend: simdist
        return original_new_group(ranks, timeout, backend, *args, **kwargs)

    def get_backend(group=None):
        name = original_get_backend(group)
        att = lookup()
        if att is not None and att.report_backend and att.asked is not None and name == BACKEND_NAME:
            return dist.Backend(att.asked)
        return name

    replacements = {
        "init_process_group": init_process_group,
        "new_group": new_group,
        "get_backend": get_backend,
    }
    saved = [(module, name, getattr(module, name)) for module in _MODULES for name in replacements]
    for module in _MODULES:
        for name, function in replacements.items():
            function.__doc__ = getattr(module, name).__doc__
            function.simdist_original = getattr(module, name)  # type: ignore[attr-defined]
            setattr(module, name, function)

    def undo() -> None:
        for module, name, value in saved:
            setattr(module, name, value)

    return undo
