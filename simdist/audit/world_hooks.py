"""Collectives of simdist's own worlds, recorded by whichever audit is active on the calling rank thread.

SimWorld's `SimComm` and the ``simdist`` torch.distributed backend (`SimProcessGroup`, what
``dist.all_reduce`` reaches inside `simdist.run` and under torchrun) compute their collectives in Python:
nothing reaches torch's dispatcher, so a dispatch mode alone never sees them. While at least one `Audit`
is active, `install` subscribes `observe` to the observer list
(`simdist.world.rendezvous.observers.Observers.subscribed`), which both front ends tell before every collective: the
observer
finds the audit on the calling thread's dispatch-mode stack, records the collective (op, dtype of its first
tensor, group) at the user's call site (`simdist.callsite`: the first frame outside torch, simdist.world, the audit
and blame), and pauses that audit while the collective runs -- so the reduction's arithmetic, which runs on
whichever rank arrives last, is not charged to that rank. Without an audit on the thread the observer does
nothing. Point-to-point sends and receives are not collectives and are not recorded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from simdist.world.rendezvous.observers import CollectiveEvent, Observers

_lock = threading.Lock()
_active = 0

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


def observe(event: CollectiveEvent) -> Callable[[], None] | None:
    """The rendezvous observer: record ``event`` into the calling thread's audit and pause it until the collective
    returns (the returned function resumes it)."""
    audit = _thread_audit()
    if audit is None or audit._paused:
        return None
    call = event.call
    tensor = _first_tensor((*call.inputs, *call.outputs))
    if tensor is not None:
        op = call.signature[0]
        audit.record_collective(f"{event.front}.{op}", tensor, f"group={event.group}")
    paused = audit.paused()
    paused.__enter__()
    return lambda: paused.__exit__(None, None, None)


def install(audit_type: type) -> None:
    """Subscribe `observe` to the rendezvous (reference-counted: one call per active audit); it records into the
    innermost mode of the calling thread that is an ``audit_type`` (`simdist.audit.mode.Audit`)."""
    global _active, _audit_type
    with _lock:
        _audit_type = audit_type
        _active += 1
        if _active == 1:
            Observers.subscribe(observe)


def uninstall() -> None:
    """Undo `install` once the last audit has exited."""
    global _active
    with _lock:
        _active -= 1
        if _active == 0:
            Observers.unsubscribe(observe)
