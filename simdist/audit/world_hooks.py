"""Collectives of simdist's own worlds, recorded by whichever audit is active on the calling rank thread.

SimWorld's `SimComm` and the ``simdist`` torch.distributed backend (`SimProcessGroup`, what
``dist.all_reduce`` reaches inside `simdist.spawn` and under torchrun) compute their collectives in Python:
nothing reaches torch's dispatcher, so a dispatch mode alone never sees them. While at least one `Audit`
is active, `install` wraps the one method each of them funnels every collective through
(``SimComm._collective``, ``SimProcessGroup._run``): the wrapper finds the audit on the calling thread's
dispatch-mode stack, records the collective (op, dtype of its first tensor, group) at the first source
line outside torch, simdist.world and the audit, and pauses that audit while the collective runs -- so
the reduction model's arithmetic, which runs on whichever rank arrives last, is not charged to that rank.
Without an audit on the thread the wrapper only calls through. Point-to-point sends and receives are not
collectives and are not recorded.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_lock = threading.Lock()
_active = 0
_saved: list[tuple[type, str, object]] = []

WORLD_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "world") + os.sep
"""Frames in simdist/world/ are the simulator's plumbing, never the site of a collective."""


_audit_type: type | None = None
"""The `Audit` class, handed over by `install` (this module does not import `simdist.audit.mode`, which
imports this one)."""


def _thread_audit():
    audit_type = _audit_type
    if audit_type is None:
        return None
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, audit_type):
            return mode
    return None


def _first_tensor(values) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def _wrap(method, prefix: str, group_of):
    @functools.wraps(method)
    def collective(self, call, *rest, **kwargs):
        audit = _thread_audit()
        if audit is None or audit._paused:
            return method(self, call, *rest, **kwargs)
        tensor = _first_tensor((*call.inputs, *call.outputs))
        if tensor is not None:
            op = call.signature[0]
            audit.record_collective(f"{prefix}.{op}", tensor, f"group={group_of(self, call)}", outside=(WORLD_DIR,))
        with audit.paused():
            return method(self, call, *rest, **kwargs)

    # typeshed types functools.wraps' result as _Wrapped, which declares no further attributes
    collective.__simdist_audit_wrapper__ = method  # type: ignore[attr-defined]
    return collective


def _targets() -> list[tuple[type, str, str, Callable[[Any, Any], str]]]:
    from simdist.world.simworld import SimComm

    targets: list[tuple[type, str, str, Callable[[Any, Any], str]]] = [
        (SimComm, "_collective", "comm", lambda self, call: getattr(call.signature[1], "kind", "world"))
    ]
    try:
        from simdist.world.backend import SimProcessGroup
    except ImportError:  # a torch without torch.distributed
        return targets
    targets.append((SimProcessGroup, "_run", "dist", lambda self, call: f"{self.label}, backend simdist"))
    return targets


def install(audit_type: type) -> None:
    """Wrap the worlds' collective funnels (reference-counted: one call per active audit); the wrappers record
    into the innermost mode of the calling thread that is an ``audit_type`` (`simdist.audit.mode.Audit`)."""
    global _active, _audit_type
    with _lock:
        _audit_type = audit_type
        _active += 1
        if _active > 1:
            return
        for cls, name, prefix, group_of in _targets():
            method = cls.__dict__[name]
            _saved.append((cls, name, method))
            setattr(cls, name, _wrap(method, prefix, group_of))


def uninstall() -> None:
    """Undo `install` once the last audit has exited."""
    global _active
    with _lock:
        _active -= 1
        if _active > 0:
            return
        while _saved:
            cls, name, method = _saved.pop()
            setattr(cls, name, method)
