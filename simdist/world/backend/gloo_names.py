"""Where torch decides by the backend's *name* that a group is gloo, a simdist group with gloo's reduction is gloo.

``dist.get_backend(group)`` of a simdist group is ``"simdist"`` (it must stay
so: ``new_group`` creates its groups with the default group's backend name).
Two decisions torch takes on that name change what a gloo program does, found
by reading torch 2.13 and checked against real gloo by tests/integration/test_isolation.py:

* ``dist.monitored_barrier`` runs only on gloo (``ValueError`` elsewhere): on a
  simdist group whose reduction is gloo it is a barrier of the group's members (in
  process mode gloo's own ``monitored_barrier`` on the inner group, which names
  the ranks that did not arrive; in threads the rendezvous names them);
* ZeroRedundancyOptimizer's DDP overlap (``hook_with_zero_step`` and
  ``hook_with_zero_step_interleaved``) raises ``RuntimeError`` on gloo: so it
  does on such a group.

`install` wraps ``monitored_barrier`` (idempotent; done by `simdist.world.backend.registration.complete`, before
the first ``simdist`` group), and the ZeRO hooks if their module is loaded; `wrap_zero_hooks` wraps them when their
module is imported later (`simdist._autoregister` watches for it after ``import simdist``). Code that imported
``monitored_barrier`` by name before the first ``simdist`` group keeps torch's original (a loud ``ValueError``,
never different bits); the ZeRO hooks are wrapped wherever they were imported from after ``import simdist``.
"""

from __future__ import annotations

import datetime
import functools
import sys
from types import ModuleType

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from simdist.world.backend.process_group import SimProcessGroup

_ZERO_HOOKS = ("hook_with_zero_step", "hook_with_zero_step_interleaved")


def _gloo_modelled(group) -> SimProcessGroup | None:
    pg = group if group is not None and group is not c10d.GroupMember.WORLD else c10d._world.default_pg
    return pg if isinstance(pg, SimProcessGroup) and pg.gloo_rules else None


def _monitored_barrier(original):
    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        pg = None if c10d._rank_not_in_group(group) else _gloo_modelled(group)
        if pg is None:
            return original(group, timeout, wait_all_ranks)
        inner = getattr(pg.transport, "inner", None)
        if inner is None:  # rank threads: the rendezvous names the ranks that do not arrive
            return pg.barrier().wait() and None
        timeout = c10d._get_default_timeout(c10d.Backend.GLOO) if timeout is None else timeout
        if isinstance(timeout, float):
            timeout = datetime.timedelta(seconds=timeout)
        return inner.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier.simdist_original = original
    return monitored_barrier


def _zero_hook(original):
    @functools.wraps(original)
    def hook(comm_hook, ddp, zero, *args, **kwargs):
        if zero._overlap_with_ddp and _gloo_modelled(ddp.process_group) is not None:
            raise RuntimeError("Gloo backend using Overlapping DDP with ZeRO may meet hangs")
        return original(comm_hook, ddp, zero, *args, **kwargs)

    hook.simdist_original = original
    return hook


ZERO_HOOK_MODULE = "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"
"""Where the ZeRO overlap hooks live: a module of its own that few programs import (about 1 s of imports), so it
is wrapped when it is imported (`simdist._autoregister` watches for it), never imported to be wrapped."""


def install() -> None:
    """Wrap ``monitored_barrier`` and, if their module is loaded, the ZeRO overlap hooks (once each)."""
    if not hasattr(c10d.monitored_barrier, "simdist_original"):
        wrapped = _monitored_barrier(c10d.monitored_barrier)
        c10d.monitored_barrier = dist.monitored_barrier = wrapped
    module = sys.modules.get(ZERO_HOOK_MODULE)
    if module is not None:
        wrap_zero_hooks(module)


def wrap_zero_hooks(ddp_zero_hook: ModuleType) -> None:
    """Wrap the ZeRO overlap hooks of ``ddp_zero_hook`` (the module `ZERO_HOOK_MODULE`, once)."""
    for name in _ZERO_HOOKS:
        current = getattr(ddp_zero_hook, name, None)
        if current is not None and not hasattr(current, "simdist_original"):
            setattr(ddp_zero_hook, name, _zero_hook(current))
