"""Run a rank program on real torch.distributed process groups.

Entry points:

* `run_torchrun` -- called inside each process that ``torchrun`` starts (gloo
  on CPU, NCCL when CUDA is available). ``python -m simdist.world.launch`` wraps it
  for the command line::

      torchrun --nproc-per-node 4 -m simdist.world.launch mypkg.study:rank_fn --tp 2 --ep 2

* `spawn_gloo` -- spawns ``spec.world_size`` local processes on 127.0.0.1
  (gloo, one CPU thread each), runs ``fn`` in every rank and returns the
  per-rank return values to the caller. It is what the test suite uses to
  confirm the simulated collectives against real ones. It never hangs: a rank
  that raises stops the run and its traceback is re-raised here naming the
  rank, and a deadline kills every child.

* `spawn_procs` -- the same for plain ``torch.distributed`` code ``fn(rank, *args)``
  (no `Comm`), on ``backend="gloo"`` or on ``backend="simdist"`` (process mode:
  gloo transport, arithmetic by a reduction model; `simdist.world.process`).
  It is the process twin of `simdist.spawn`.

Both are ``simdist.run`` (`simdist.world.runner`) with ``where``/``api`` fixed; `spawn_processes` is the
process launcher behind all three.

Process start-up dominates small runs, so ranks start from a ``forkserver`` that has torch preloaded
(``spawn`` where forkserver does not exist), plus the launch's ``preload`` modules (a framework: DeepSpeed's
and Megatron-Core's imports cost about 13 s per rank otherwise), and that froze its objects out of the
ranks' garbage collections (`simdist.world.forkserver_freeze`). `LaunchTimings` says where a launch's time
went (``bench/startup.py``). Run many cases inside one rank function rather than launching per case.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simdist.errors import UsageError
from simdist.reduce import Reduction, ReductionModel
from simdist.world.attach import Attachment
from simdist.world.attach import install as install_attach
from simdist.world.modelmap import as_model
from simdist.world.options import _UNSET, DEFAULT_TIMEOUT_S, check_timeout
from simdist.world.process import use_reduction
from simdist.world.spec import ParallelSpec
from simdist.world.torch_comm import TorchComm

RankFn = Callable[..., Any]


class RankFailure(RuntimeError):
    """A rank of a spawned run raised; carries the rank and its formatted traceback."""

    def __init__(self, rank: int, world_size: int, remote_traceback: str, others: tuple[int, ...] = ()) -> None:
        also = f" (ranks {list(others)} failed after it)" if others else ""
        super().__init__(f"rank {rank} of {world_size} failed{also}:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


# -- torchrun ----------------------------------------------------------------


def run_torchrun(
    fn: RankFn, spec: ParallelSpec, *args: Any, backend: str | None = None, timeout_s: float = 600.0
) -> Any:
    """Run ``fn(comm, *args)`` as this process's rank of a ``torchrun`` job and return its result.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (and the rendezvous address)
    from the environment torchrun sets, initialises the default process group
    (``nccl`` when CUDA is available, else ``gloo``), builds a `TorchComm`, and
    destroys the group afterwards, also when ``fn`` raises.
    """
    world = int(os.environ["WORLD_SIZE"])
    if world != spec.world_size:
        raise UsageError(f"torchrun started {world} processes but the spec needs {spec.world_size} ({spec.describe()})")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        return fn(TorchComm(spec), *args)
    finally:
        dist.destroy_process_group()


def _load_target(target: str) -> RankFn:
    module, _, name = target.partition(":")
    if not name:
        raise UsageError(f"target must look like 'package.module:function', got {target!r}")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry for torchrun: ``-m simdist.world.launch module:function --tp T --ep E [...]``."""
    parser = argparse.ArgumentParser(prog="python -m simdist.world.launch", description=main.__doc__)
    parser.add_argument("target", help="rank function as package.module:function; called as fn(comm)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep-layout", default="contiguous")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl if CUDA is available)")
    ns = parser.parse_args(argv)
    spec = ParallelSpec(int(os.environ["WORLD_SIZE"]), ns.tp, ns.ep, ns.etp, ns.pp, ns.ep_layout)
    run_torchrun(_load_target(ns.target), spec, backend=ns.backend)


# -- local gloo processes ------------------------------------------------------


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: RankFn,
    spec: ParallelSpec | None,
    args: tuple,
    outdir: str,
    timeout_s: float,
    backend: str = "gloo",
    reduction: ReductionModel | None = None,
    kwargs: dict | None = None,
    preload: tuple[str, ...] = (),
    report_backend: bool = False,
) -> None:
    """Body of one spawned rank: init the group, run ``fn``, save its result or its traceback.

    With plain ``torch.distributed`` code (no ``spec``), a ``fn`` that calls ``init_process_group`` itself
    attaches to the group made here (`simdist.world.attach`), as on rank threads.

    ``fn`` gets a `TorchComm` when ``spec`` is given, else its rank (plain ``torch.distributed`` code). The
    wall-clock times of its phases go to ``rank{r}.times`` (`LaunchTimings`).
    """
    out = Path(outdir)
    entered = time.time()
    _dump_stack_on_request(out / f"rank{rank}.stack")
    try:
        for module in preload:  # already in sys.modules when the forkserver preloaded them
            importlib.import_module(module)
        imported = time.time()
        torch.set_num_threads(1)
        ifname = _loopback_ifname()
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # keep gloo on 127.0.0.1
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        use_reduction(reduction)
        timeout = timedelta(seconds=timeout_s + 30)  # a backstop: the parent's deadline comes first
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        joined = time.time()
        if spec is None:
            init = dist.init_process_group

            def reinit(n: int) -> None:
                prefixed = dist.PrefixStore(f"simdist-reinit{n}", store)
                init(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)

            attachment = Attachment(rank, world_size, reinit, report_backend)
            install_attach(lambda: attachment)  # this process is the rank: no undo
        first = TorchComm(spec) if spec is not None else rank
        result = fn(first, *args, **(kwargs or {}))
        done = time.time()
        if dist.is_initialized():  # the script may have destroyed it
            dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.tmp")
        (out / f"rank{rank}.times").write_text(json.dumps([entered, imported, joined, done]))
        os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pt")
    except BaseException:  # every failure, KeyboardInterrupt included, is reported to the parent
        (out / f"rank{rank}.err.tmp").write_text(traceback.format_exc())
        os.replace(out / f"rank{rank}.err.tmp", out / f"rank{rank}.err")
        os._exit(1)  # peers may be blocked in a collective with us: no teardown


SERVER_PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "torch._dynamo", "simdist.world.launch")
"""What the forkserver always imports before it forks ranks: torch's import is most of a small run."""

FREEZE = "simdist.world.forkserver_freeze"
"""Preloaded last: freezes the server's objects out of the ranks' garbage collections (see the module)."""

_server_lock = threading.Lock()


def _context(preload: tuple[str, ...] = ()):
    """The start method: a ``forkserver`` that has imported `SERVER_PRELOAD` and ``preload`` (``spawn`` where
    forkserver does not exist). A module is imported once in the server and every rank forked from it has it,
    so a framework's import (DeepSpeed's, Megatron's: seconds each) is paid once per process of the caller,
    not once per rank and launch. When a launch needs a module the running server lacks, the server is
    restarted with the union (Python's own API has no other way to add a module; the restart happens between
    launches, when no rank of ours is alive)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)  # the stdlib's one server per process (private name)
    with _server_lock:
        have = list(getattr(server, "_preload_modules", ()))
        wanted = list(dict.fromkeys([*SERVER_PRELOAD, *have, *preload]))
        wanted = [m for m in wanted if m not in ("__main__", FREEZE)] + [FREEZE]  # __main__: the stdlib's default
        if set(wanted) - set(have):
            if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
                server._stop()  # type: ignore[union-attr]
            ctx.set_forkserver_preload(wanted)
    return ctx


def _ready() -> None:
    """A no-op child: starting it waits for the forkserver to have finished its imports."""


@dataclass(frozen=True)
class LaunchTimings:
    """Where the wall time of one process launch went, in seconds, phase after phase (they add up to ``total``).

    ``server`` (re)starting the forkserver and its preloaded imports, until it forks (a no-op child, some
    milliseconds, when it was running with them already);
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


def spawn_gloo(
    fn: RankFn,
    spec: ParallelSpec,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    preload: tuple[str, ...] = (),
    timings: list[LaunchTimings] | None = None,
) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``spec.world_size`` local gloo processes; return the per-rank results.

    The older name of ``simdist.run(fn, spec, api="comm", where="gloo")`` (``backend="simdist"``:
    ``where="processes"``). ``fn`` must be a picklable top-level function and its results picklable by
    ``torch.save``. Each child sets ``torch.set_num_threads(1)``, joins a gloo
    group through a TCP store that this process hosts on a free 127.0.0.1 port,
    and builds a `TorchComm`. If a rank raises, every child is killed and
    `RankFailure` names the first rank that failed, with its traceback; after
    ``timeout_s`` every child is killed and ``TimeoutError`` names the ranks
    that had not finished. ``backend="simdist"`` runs the same processes on the
    simdist backend in process mode (modelled arithmetic, gloo transport). ``preload`` and ``timings`` as
    for `spawn_processes`.
    """
    return spawn_processes(fn, spec.world_size, spec, args, {}, timeout_s, backend, None, preload, timings)


def spawn_procs(
    fn: RankFn,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    reduction: Any = _UNSET,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run plain ``torch.distributed`` code ``fn(rank, *args)`` on ``world_size`` local processes.

    The older name of ``simdist.run(fn, world_size, where="gloo")`` (``backend="simdist"``:
    ``where="processes"``), and the process-mode twin of `simdist.spawn`: each child initialises the
    default group with ``backend`` (``"gloo"`` for real gloo, ``"simdist"`` for
    the simdist backend in process mode, whose reduction model is ``reduction``
    default gloo; see `simdist.world.process`) and calls
    ``fn(rank, *args)``. Results come back in rank order; failures and
    timeouts are reported as by `spawn_gloo`.
    """
    chosen = None if reduction is _UNSET else reduction  # None: process mode's own choice (SIMDIST_REDUCTION)
    return spawn_processes(fn, world_size, None, args, {}, timeout_s, backend, chosen, (), None)


def spawn_processes(
    fn: RankFn,
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
    """The process launcher behind `spawn_gloo`, `spawn_procs` and ``simdist.run(where="processes"|"gloo")``.

    ``fn(comm or rank, *args, **kwargs)`` on ``n`` processes of ``backend`` (``gloo`` or ``simdist``).
    ``reduction`` is process mode's model (a name, `Reduction` member or `ReductionModel`; ``None``:
    ``SIMDIST_REDUCTION`` or gloo, `simdist.world.process`); real gloo accepts only gloo's own.
    ``preload``: modules every rank needs (a framework), imported once in the forkserver instead of once
    per rank (`_context`). When ``timings`` is a list, this launch's `LaunchTimings` is appended to it.
    """
    timeout = check_timeout(timeout_s, none_ok=False)
    assert timeout is not None
    if backend not in ("gloo", "simdist"):
        raise UsageError(f"backend={backend!r} is unknown; valid: 'gloo' (real gloo), 'simdist' (process mode)")
    model = _process_model(reduction, backend)
    began = time.time()
    ctx = _context(tuple(preload))
    if ctx.get_start_method() == "forkserver":
        warm = ctx.Process(target=_ready, name="simdist-forkserver-ready", daemon=True)
        warm.start()  # returns once the server, after its imports, has forked it: those imports are `server`
        warm.join()
    started = time.time()
    store = dist.TCPStore("127.0.0.1", 0, n + 1, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="simdist-gloo-") as outdir:
        out = Path(outdir)
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    n,
                    store.port,
                    fn,
                    spec,
                    args,
                    outdir,
                    timeout,
                    backend,
                    model,
                    kwargs,
                    tuple(preload),
                    report_backend,
                ),
                name=f"simdist-rank{r}",
                daemon=True,
            )
            for r in range(n)
        ]
        for p in procs:
            p.start()
        try:
            _supervise(procs, out, timeout)
            results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]
            if timings is not None:
                times = [json.loads((out / f"rank{r}.times").read_text()) for r in range(n)]
                entered, imported, joined, done = (max(t[i] for t in times) for i in range(4))
                ended = time.time()
                timings.append(
                    LaunchTimings(
                        n, started - began, entered - started, imported - entered, joined - imported, done - joined,
                        ended - done,
                    )
                )  # fmt: skip
            return results
        finally:
            killed = [p for p in procs if p.is_alive()]
            for p in killed:
                _kill_descendants(p.pid)  # a compiler or other child the rank started dies with it
                p.kill()
            for p in procs:
                p.join(timeout=5)
            if killed:
                _remove_build_locks_since(began)
            del store


def _process_model(reduction: Any, backend: str) -> ReductionModel | None:
    """The model the ranks install (`simdist.world.process.use_reduction`); ``None`` for real gloo."""
    if isinstance(reduction, Mapping) or (callable(reduction) and not isinstance(reduction, ReductionModel)):
        raise TypeError(
            "in processes every group of a rank uses one reduction model (a name, a Reduction member or a "
            f"ReductionModel); per-kind tables and callables need where='threads', got {type(reduction).__name__}"
        )
    model = None if reduction is None else as_model(reduction, "reduction")
    if backend == "gloo":
        if model is not None and model.name != Reduction.GLOO:  # the model's name, not its class
            raise UsageError(
                f"reduction={reduction!r} with real gloo: real gloo sums in its own order; a reduction model is "
                "simulated with where='threads' or where='processes'"
            )
        return None
    return model


def _supervise(procs: list, out: Path, timeout_s: float) -> None:
    """Wait for every child; raise on the first failure or at the deadline."""
    n = len(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        errors = sorted(out.glob("rank*.err"), key=lambda p: p.stat().st_mtime_ns)
        if errors:
            time.sleep(0.05)  # let peers that fail in consequence report too
            errors = sorted(out.glob("rank*.err"), key=lambda p: p.stat().st_mtime_ns)
            ranks = [int(p.name[4:].split(".")[0]) for p in errors]
            raise RankFailure(ranks[0], n, errors[0].read_text(), tuple(ranks[1:]))
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and not (out / f"rank{r}.err").exists():
                raise RankFailure(r, n, f"process exited with code {p.exitcode} without a Python traceback")
        if all(p.exitcode == 0 for p in procs):
            return
        if time.monotonic() > deadline:
            pending = [r for r, p in enumerate(procs) if p.exitcode is None]
            stacks = _stacks_of(procs, pending, out)
            raise TimeoutError(
                f"ranks {pending} of {n} did not finish within {timeout_s:g} s; all ranks killed{stacks}"
            )
        time.sleep(0.005)


def _kill_descendants(pid: int | None) -> None:
    """SIGKILL every descendant of ``pid`` (Linux: ``/proc/PID/task/*/children``); nothing elsewhere."""
    if pid is None:
        return
    for child in _children(pid):
        _kill_descendants(child)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in task.read_text().split()]
    return found


def _remove_build_locks_since(began: float) -> list[Path]:
    """Remove the torch C++-extension build locks created since ``began`` (wall clock), after this launch
    killed ranks: a rank killed while it compiled an op (DeepSpeed's CPU ops build on first use) leaves
    ``<build root>/<python>_<device>/<op>/lock`` (``$TORCH_EXTENSIONS_DIR/<op>/lock``) behind, and every
    later build of that op, in any process, would wait on it forever. Only locks this launch's ranks can have
    made are touched; each is named on stderr."""
    from torch.utils.cpp_extension import get_default_build_root

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")  # torch's own rule: <dir>/<op>, else <root>/<py>_<dev>/<op>
    root = Path(chosen or get_default_build_root())
    removed = []
    for lock in root.glob("*/lock" if chosen else "*/*/lock") if root.is_dir() else ():
        with contextlib.suppress(OSError):
            if lock.stat().st_mtime >= began - 1.0:
                lock.unlink()
                removed.append(lock)
                print(f"simdist: removed {lock}, left by a rank killed while it built a C++ extension", file=sys.stderr)
    return removed


STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
"""The signal on which a rank process writes every thread's Python stack to ``rank{r}.stack`` (POSIX only)."""


def _dump_stack_on_request(path: Path) -> None:
    """Let the parent ask this rank where it is at the deadline: `faulthandler` writes the stacks even while
    the rank waits inside C code (a compiler subprocess, a collective), where no Python handler would run."""
    if STACK_SIGNAL is None:
        return
    faulthandler.register(STACK_SIGNAL, file=path.open("w"), all_threads=True, chain=False)


def _stacks_of(procs: list, pending: list[int], out: Path, wait_s: float = 1.0) -> str:
    """Each pending rank's Python stack, innermost call last (asked for with `STACK_SIGNAL`), for the deadline's
    message: the rank's own line is in it, not only the frame it waits in."""
    if STACK_SIGNAL is None:
        return ""
    for r in pending:
        if procs[r].pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, STACK_SIGNAL)
    time.sleep(wait_s)  # faulthandler writes from the signal handler at once; the file may need a moment
    parts = []
    for r in pending:
        path = out / f"rank{r}.stack"
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        if text:
            parts.append(f"\n--- rank {r} (most recent call first) ---\n{_trim_stack(text)}")
    return "".join(parts)


def _trim_stack(text: str, keep: int = 12) -> str:
    """faulthandler's dump of the rank's main thread, at most ``keep`` frames from the innermost."""
    block = text.split("\n\n")[0]
    for candidate in text.split("\n\n"):
        if "Current thread" in candidate or "most recent call first" in candidate:
            block = candidate
            break
    lines = block.splitlines()
    head, frames = lines[:1], lines[1:]
    if len(frames) > keep:
        frames = [*frames[:keep], f"  ... {len(frames) - keep} outer frames"]
    return "\n".join(head + frames)


if __name__ == "__main__":
    main()
