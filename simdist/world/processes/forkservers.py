"""The forkservers rank processes are forked from: one per preload set, so a rank carries only what its launch needs.

Process start-up dominates small runs, so a process launch (`simdist.world.processes.launch`) forks its ranks from
a ``forkserver`` that has imported torch (`SERVER_PRELOAD`) and the launch's ``preload`` modules (a framework:
DeepSpeed's and Megatron-Core's imports cost seconds per rank otherwise), and that froze its objects out of the
ranks' garbage collections (`FREEZE`, `simdist.world.processes.forkserver_freeze`). A module is imported once in a
server
and every rank forked from it has it, so a framework's import is paid once per server, not once per rank and
launch.

Python keeps one forkserver per process and can only add modules to it by restarting it, so a plain launch after
a DeepSpeed one would fork ranks that carry DeepSpeed (its memory, its import-time side effects). Here each
distinct preload set gets a server of its own, kept for the next launch that asks for the same set: a rank starts
with what `SERVER_PRELOAD`, its launch's ``preload`` and `FREEZE` import, and nothing another launch preloaded.
At most `MAX_SERVERS` are kept (the least recently used is stopped). During a launch's process starts the stdlib's
module-level server is swapped for the chosen one (`rank_context`) and put back afterwards, so code of the caller
that uses the ``forkserver`` start method itself keeps its own server. Where ``forkserver`` does not exist, ranks
start with ``spawn``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from collections import OrderedDict
from collections.abc import Iterator
from multiprocessing import forkserver as stdlib_forkserver
from multiprocessing.context import ForkServerContext, SpawnContext

SERVER_PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "torch._dynamo", "simdist.world.processes.rank")
"""What every server imports before it forks ranks: torch's import is most of a small run; the rank's body."""

FREEZE = "simdist.world.processes.forkserver_freeze"
"""Imported last by every server: freezes the server's objects out of the ranks' garbage collections."""

MAX_SERVERS = 3
"""Servers kept alive at once (one per preload set: plain, DeepSpeed, Megatron-Core); each idle one holds the
memory of its imports."""

_servers: OrderedDict[tuple[str, ...], stdlib_forkserver.ForkServer] = OrderedDict()
_lock = threading.Lock()


def server_modules(preload: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The modules a server for ``preload`` imports, in order: `SERVER_PRELOAD`, ``preload``, `FREEZE` last."""
    wanted = dict.fromkeys([*SERVER_PRELOAD, *preload])
    return (*(m for m in wanted if m not in ("__main__", FREEZE)), FREEZE)  # __main__: the stdlib's default


def _server_for(modules: tuple[str, ...]) -> stdlib_forkserver.ForkServer:
    """The kept server importing exactly ``modules`` (made when there is none; it starts at its first fork)."""
    server = _servers.get(modules)
    if server is None:
        server = stdlib_forkserver.ForkServer()
        server.set_forkserver_preload(list(modules))
        _servers[modules] = server
        while len(_servers) > MAX_SERVERS:
            _, oldest = _servers.popitem(last=False)
            oldest._stop()  # type: ignore[attr-defined]  # between launches: no rank of ours is forked from it any more
    _servers.move_to_end(modules)
    return server


_SWAPPED = ("ensure_running", "get_inherited_fds", "connect_to_new_process", "set_forkserver_preload")
"""The stdlib module's functions bound to its one server (its process starts look them up at call time)."""


@contextlib.contextmanager
def rank_context(preload: tuple[str, ...] = ()) -> Iterator[ForkServerContext | SpawnContext]:
    """The start method for a launch's ranks: processes started inside this block are forked from the server of
    ``preload`` (`server_modules`). One launch at a time holds it (the stdlib's server is a module global)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        yield multiprocessing.get_context("spawn")
        return
    with _lock:
        server = _server_for(server_modules(tuple(preload)))
        saved = {name: getattr(stdlib_forkserver, name) for name in ("_forkserver", *_SWAPPED)}
        stdlib_forkserver._forkserver = server
        for name in _SWAPPED:
            setattr(stdlib_forkserver, name, getattr(server, name))
        try:
            yield multiprocessing.get_context("forkserver")
        finally:
            for name, value in saved.items():
                setattr(stdlib_forkserver, name, value)
