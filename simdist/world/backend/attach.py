"""Scripts that initialise their own process group, with any backend name, run on simdist's ranks.

The torch tutorial's ``mp.spawn`` worker and every torchrun script call
``dist.init_process_group("gloo" | "nccl" | "cpu:gloo,cuda:nccl", init_method="env://" | "tcp://...",
rank=..., world_size=...)`` themselves. On a simdist rank (a rank thread of `simdist.run`,
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
* ``from torch.distributed import init_process_group`` taken before the spawn (a module-level import of the
  script) holds torch's own function object, which replacing the module attribute does not reach: `install`
  also points that function's inner call (torch wraps it in logging decorators; the wrapper calls the function
  held in its closure) at the rank-aware version while simdist ranks run, and back afterwards.

`Attachment` is one rank's record (the thread launcher keeps one per rank thread, a rank process one for
itself); ``lookup`` finds the calling rank's (``None``: not a simdist rank, the originals run untouched).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from simdist.errors import UsageError
from simdist.world.backend.process_group import BACKEND_NAME

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


class _Serving(threading.local):
    """Set on a thread while the rank-aware ``init_process_group`` runs: its own calls of torch's (the
    launcher's re-init) reach torch's function, not the rank-aware one again."""

    active = False


def _redirect_bound_init(original: Callable, serve: Callable, serving: _Serving) -> Callable[[], None]:
    """Make torch's ``init_process_group`` function object itself (as a script may have bound it by name)
    call ``serve`` instead of the function it wraps; returns the undo. torch 2.13 wraps the function in
    ``_exception_logger`` and ``_time_logger``: the outer wrapper's closure cell ``func`` holds the next one.
    Where the layout differs (another torch) nothing is redirected and a bound name keeps torch's function."""
    code = getattr(original, "__code__", None)
    cells = getattr(original, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    if "func" not in names:
        return lambda: None
    cell = cells[names.index("func")]
    inner = cell.cell_contents

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if serving.active:
            return inner(*args, **kwargs)
        return serve(*args, **kwargs)

    def undo() -> None:
        cell.cell_contents = inner

    cell.cell_contents = dispatch
    return undo


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
    serving = _Serving()
    replacements = _rank_aware(lookup, serving)
    saved = [(module, name, getattr(module, name)) for module in _MODULES for name in replacements]
    for module in _MODULES:
        for name, function in replacements.items():
            function.__doc__ = getattr(module, name).__doc__
            function.simdist_original = getattr(module, name)  # type: ignore[attr-defined]
            setattr(module, name, function)

    undo_bound = _redirect_bound_init(original_init, replacements["init_process_group"], serving)

    def undo() -> None:
        undo_bound()
        for module, name, value in saved:
            setattr(module, name, value)

    return undo


def _rank_aware(lookup: Callable[[], Attachment | None], serving: _Serving) -> dict[str, Callable[..., Any]]:
    """The rank-aware ``init_process_group``, ``new_group`` and ``get_backend``, by name, wrapping torch's
    current functions (read now, before `install` replaces them)."""
    original_init = c10d.init_process_group
    original_new_group = c10d.new_group
    original_get_backend = c10d.get_backend

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, *args, **kwargs):
        att = lookup()
        if att is None:
            return torch_init(backend, init_method, timeout, world_size, rank, *args, **kwargs)
        _check_rank(att, rank, world_size)
        if c10d.is_initialized():
            if att.initialised_by_script:
                raise UsageError("trying to initialize the default process group twice!")
        else:
            att.reinits += 1
            att.reinit(att.reinits)  # the launcher's call of torch's function: served by torch's own
        att.asked = None if backend is None else str(backend)
        att.initialised_by_script = True
        return None

    def served(*args, **kwargs):
        """The rank-aware init, with torch's own function serving any call it makes meanwhile."""
        previous, serving.active = serving.active, True
        try:
            return init_process_group(*args, **kwargs)
        finally:
            serving.active = previous

    def torch_init(*args, **kwargs):
        previous, serving.active = serving.active, True
        try:
            return original_init(*args, **kwargs)
        finally:
            serving.active = previous

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

    return {"init_process_group": served, "new_group": new_group, "get_backend": get_backend}
