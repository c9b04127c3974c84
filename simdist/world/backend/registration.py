"""The backend's half of the ``simdist`` registration that `simdist._autoregister` owns.

`simdist._autoregister` puts the one ``dist.Backend`` table entry in place without importing torch; its factory
imports this module when c10d makes the first ``simdist`` group and runs `complete` (gloo's name-based decisions,
`simdist.world.backend.gloo_names`), then `create_group`. c10d asks for a group for every group it makes with the
``simdist`` backend (the default group and each ``new_group``/DeviceMesh group): on a rank thread of `simdist.run`
it is an in-process group on that run's rendezvous, anywhere else a process-mode group
(`simdist.world.processes.transport`).
"""

from __future__ import annotations

from simdist.world.backend.gloo_names import install as install_gloo_names
from simdist.world.backend.process_group import SimProcessGroup
from simdist.world.processes.transport import process_group
from simdist.world.threads.spawn import current, thread_group


def create_group(options, backend_options=None) -> SimProcessGroup:
    """A ``simdist`` group from c10d's extended-API ``options`` (store, group rank and size, global ranks, name)."""
    rank, size = options.group_rank, options.group_size
    ranks = tuple(options.global_ranks_in_group) or tuple(range(size))
    name = str(options.group_id)
    ctx = current()
    if ctx is not None:
        return thread_group(ctx, rank, size, ranks, name)
    return process_group(options.store, rank, size, ranks, name, options.timeout)


def complete() -> None:
    """What the table entry cannot do without torch: wrap torch's functions that decide by the backend's name
    (``monitored_barrier``, the ZeRO overlap hooks) for gloo-modelled groups. Idempotent."""
    install_gloo_names()
