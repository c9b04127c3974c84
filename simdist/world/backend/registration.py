"""Registers the ``simdist`` backend with ``torch.distributed`` (``dist.Backend.register_backend``).

`register` is idempotent; `simdist._autoregister.create_group` runs it before c10d's first ``simdist`` group, the
one place the backend is registered from (``import simdist`` arranges it). c10d calls
`create_group` for every group it makes with the ``simdist`` backend (the
default group and each ``new_group``/DeviceMesh group): on a rank thread of
`simdist.run` it returns an in-process group on that run's rendezvous, anywhere
else a process-mode group (`simdist.world.processes.transport`).
"""

from __future__ import annotations

import torch.distributed as dist

from simdist.world.backend.gloo_names import install as install_gloo_names
from simdist.world.backend.process_group import BACKEND_NAME, SimProcessGroup
from simdist.world.processes.transport import process_group
from simdist.world.threads.spawn import current, thread_group


def create_group(options, backend_options=None) -> SimProcessGroup:
    """c10d's factory hook (extended API): ``options`` carries store, group rank and size, global ranks, name."""
    rank, size = options.group_rank, options.group_size
    ranks = tuple(options.global_ranks_in_group) or tuple(range(size))
    name = str(options.group_id)
    ctx = current()
    if ctx is not None:
        return thread_group(ctx, rank, size, ranks, name)
    return process_group(options.store, rank, size, ranks, name, options.timeout)


def register() -> None:
    """Make ``dist.init_process_group("simdist")`` available (no-op when already registered)."""
    install_gloo_names()  # gloo's name-based decisions (monitored_barrier, ZeRO overlap) for gloo-modelled groups
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_group, extended_api=True, devices=["cpu", "cuda"])
