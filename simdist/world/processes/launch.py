"""The process launcher behind ``simdist.run(where="processes"|"gloo")``: one local process per rank.

`spawn_processes` starts ``n`` rank processes on this machine, forked from a forkserver that has torch and the
launch's ``preload`` imported (`simdist.world.processes.forkservers`), each running
`simdist.world.processes.rank.rank_main`:
it joins a process group of ``backend`` (``gloo``: real gloo; ``simdist``: process mode, gloo's transport and a
reduction's arithmetic, `simdist.world.processes.transport`) through a TCP store this process hosts on a free
127.0.0.1 port, with one intra-op thread, and runs the rank function. Results come back in rank order. A launch
never hangs: a rank that raises stops the run and its traceback is re-raised here as `RankFailure`, naming the
rank, and at the deadline every rank is killed and ``TimeoutError`` names the ranks that had not finished, with
their stacks (`simdist.world.processes.supervise`). `LaunchTimings` says where a launch's time went
(``bench/startup.py``).
Run many cases inside one rank function rather than launching per case: each launch starts processes.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simdist.errors import UsageError
from simdist.reduce import Reduction, ReductionName
from simdist.world.options import as_reduction, check_timeout
from simdist.world.processes.forkservers import rank_context
from simdist.world.processes.rank import rank_main, ready
from simdist.world.processes.supervise import RankFailure, kill_descendants, remove_build_locks_since, supervise
from simdist.world.spec import ParallelSpec

__all__ = ["LaunchTimings", "RankFailure", "spawn_processes"]


@dataclass(frozen=True)
class LaunchTimings:
    """Where the wall time of one process launch went, in seconds, phase after phase (they add up to ``total``).

    ``server`` starting the launch's forkserver and its preloaded imports, until it forks (a no-op child, some
    milliseconds, when a server with that preload set was running already);
    ``start`` until every rank was running its body (fork, unpickling ``fn`` and importing its module);
    ``imports`` until every rank had imported the launch's ``preload`` modules (0 when the server had);
    ``rendezvous`` until every rank had joined the process group; ``work`` until every rank's ``fn``
    returned; ``finish`` tearing down and loading the results here.
    """

    world_size: int
    server: float
    start: float
    imports: float
    rendezvous: float
    work: float
    finish: float

    @property
    def total(self) -> float:
        return self.server + self.start + self.imports + self.rendezvous + self.work + self.finish

    def describe(self) -> str:
        phases = ("server", "start", "imports", "rendezvous", "work", "finish")
        return " | ".join(f"{name} {getattr(self, name):6.2f} s" for name in phases) + f" | total {self.total:6.2f} s"


def spawn_processes(
    fn: Callable[..., Any],
    n: int,
    spec: ParallelSpec | None,
    args: tuple,
    kwargs: dict,
    timeout_s: float,
    backend: str,
    reduction: Any,
    preload: tuple[str, ...] = (),
    timings: list[LaunchTimings] | None = None,
    report_backend: bool = False,
) -> list[Any]:
    """``fn(comm or rank, *args, **kwargs)`` on ``n`` processes of ``backend`` (``gloo`` or ``simdist``); the
    results in rank order. Called by `simdist.world.runner.run`, which checks and documents the arguments.

    ``fn`` gets a `simdist.world.torch_comm.TorchComm` of ``spec`` when ``spec`` is given, else its rank.
    ``reduction`` is process mode's reduction (a name, `ReductionName` member or `Reduction`; ``None``:
    ``SIMDIST_REDUCTION`` or gloo, `simdist.world.processes.transport`); real gloo accepts only gloo's own.
    ``preload``: modules every rank needs (a framework), imported once in the launch's forkserver instead of once
    per rank; the ranks carry no other framework (`simdist.world.processes.forkservers`). When ``timings`` is a list,
    this
    launch's `LaunchTimings` is appended to it.
    """
    timeout = check_timeout(timeout_s, none_ok=False)
    assert timeout is not None
    if backend not in ("gloo", "simdist"):
        raise UsageError(f"backend={backend!r} is unknown; valid: 'gloo' (real gloo), 'simdist' (process mode)")
    reduction = _process_reduction(reduction, backend)
    preload = tuple(preload)
    began = time.time()
    store = dist.TCPStore("127.0.0.1", 0, n + 1, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="simdist-gloo-") as outdir:
        out = Path(outdir)
        procs: list = []
        try:
            rank_args = (n, store.port, fn, spec, args, outdir, timeout, backend, reduction, kwargs, preload)
            started = _start_ranks(procs, preload, rank_args, report_backend)
            supervise(procs, out, timeout)
            results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]
            if timings is not None:
                timings.append(_launch_timings(out, n, began, started))
            return results
        finally:
            _stop_ranks(procs, began)
            del store


def _start_ranks(procs: list, preload: tuple[str, ...], rank_args: tuple, report_backend: bool) -> float:
    """Fork the ``n`` rank processes (``rank_args`` is `rank_main`'s arguments after the rank) from the
    launch's forkserver, appending each to ``procs`` as it starts (the caller stops what did start); returns
    the time the forkserver was ready, the end of `LaunchTimings.server`."""
    n = rank_args[0]
    with rank_context(preload) as ctx:
        if ctx.get_start_method() == "forkserver":
            warm = ctx.Process(target=ready, name="simdist-forkserver-ready", daemon=True)
            warm.start()  # returns once the server, after its imports, has forked it: `server`'s time
            warm.join()
        started = time.time()
        for r in range(n):
            procs.append(
                ctx.Process(
                    target=rank_main,
                    args=(r, *rank_args, report_backend),
                    name=f"simdist-rank{r}",
                    daemon=True,
                )
            )
            procs[-1].start()
    return started


def _launch_timings(out: Path, n: int, began: float, started: float) -> LaunchTimings:
    """The launch's phases from the times each rank wrote (the slowest rank ends each phase)."""
    times = [json.loads((out / f"rank{r}.times").read_text()) for r in range(n)]
    entered, imported, joined, done = (max(t[i] for t in times) for i in range(4))
    ended = time.time()
    return LaunchTimings(
        n, started - began, entered - started, imported - entered, joined - imported, done - joined, ended - done
    )


def _stop_ranks(procs: list, began: float) -> None:
    """Kill every rank still alive (and what it started), join them all, and remove the build locks a killed
    rank may have left since ``began``."""
    killed = [p for p in procs if p.is_alive()]
    for p in killed:
        kill_descendants(p.pid)  # a compiler or other child the rank started dies with it
        p.kill()
    for p in procs:
        p.join(timeout=5)
    if killed:
        remove_build_locks_since(began)


def _process_reduction(reduction: Any, backend: str) -> Reduction | None:
    """The reduction the ranks install (`simdist.world.processes.transport.use_reduction`); ``None`` for real gloo."""
    if isinstance(reduction, Mapping) or (callable(reduction) and not isinstance(reduction, Reduction)):
        raise TypeError(
            "in processes every group of a rank uses one reduction (a name, a ReductionName member or a "
            f"Reduction); per-kind tables and callables need where='threads', got {type(reduction).__name__}"
        )
    reduction = None if reduction is None else as_reduction(reduction)
    if backend == "gloo":
        if reduction is not None and reduction.name != ReductionName.GLOO:  # the reduction's name, not its class
            raise UsageError(
                f"reduction={reduction!r} with real gloo: real gloo sums in its own order; a reduction is "
                "simulated with where='threads' or where='processes'"
            )
        return None
    return reduction
