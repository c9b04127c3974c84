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

Process start-up dominates small runs, so `spawn_gloo` starts children from a
``forkserver`` that has torch preloaded (``spawn`` where forkserver does not
exist): run many cases inside one rank function rather than spawning per case.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simdist.world.process import MODEL_ENV
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
        raise ValueError(f"torchrun started {world} processes but the spec needs {spec.world_size} ({spec.describe()})")
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
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")
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
    model: str | None = None,
) -> None:
    """Body of one spawned rank: init the group, run ``fn``, save its result or its traceback.

    ``fn`` gets a `TorchComm` when ``spec`` is given, else its rank (plain ``torch.distributed`` code).
    """
    out = Path(outdir)
    try:
        torch.set_num_threads(1)
        ifname = _loopback_ifname()
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # keep gloo on 127.0.0.1
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        if model is not None:
            os.environ[MODEL_ENV] = model
        timeout = timedelta(seconds=timeout_s + 30)  # a backstop: the parent's deadline comes first
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(TorchComm(spec), *args) if spec is not None else fn(rank, *args)
        dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.tmp")
        os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pt")
    except BaseException:  # every failure, KeyboardInterrupt included, is reported to the parent
        (out / f"rank{rank}.err.tmp").write_text(traceback.format_exc())
        os.replace(out / f"rank{rank}.err.tmp", out / f"rank{rank}.err")
        os._exit(1)  # peers may be blocked in a collective with us: no teardown


def _context():
    methods = mp.get_all_start_methods()
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "simdist.world.launch"])
        return ctx
    return mp.get_context("spawn")


def spawn_gloo(
    fn: RankFn, spec: ParallelSpec, *args: Any, timeout_s: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``spec.world_size`` local gloo processes; return the per-rank results.

    ``fn`` must be a picklable top-level function and its results picklable by
    ``torch.save``. Each child sets ``torch.set_num_threads(1)``, joins a gloo
    group through a TCP store that this process hosts on a free 127.0.0.1 port,
    and builds a `TorchComm`. If a rank raises, every child is killed and
    `RankFailure` names the first rank that failed, with its traceback; after
    ``timeout_s`` every child is killed and ``TimeoutError`` names the ranks
    that had not finished. ``backend="simdist"`` runs the same processes on the
    simdist backend in process mode (modelled arithmetic, gloo transport).
    """
    return _spawn(fn, spec.world_size, spec, args, timeout_s, backend, None)


def spawn_procs(
    fn: RankFn,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    model: str | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run plain ``torch.distributed`` code ``fn(rank, *args)`` on ``world_size`` local processes.

    The process-mode twin of `simdist.spawn`: each child initialises the
    default group with ``backend`` (``"gloo"`` for real gloo, ``"simdist"`` for
    the simdist backend in process mode, whose reduction model is the name
    ``model``, default gloo; see `simdist.world.process`) and calls
    ``fn(rank, *args)``. Results come back in rank order; failures and
    timeouts are reported as by `spawn_gloo`.
    """
    return _spawn(fn, world_size, None, args, timeout_s, backend, model)


def _spawn(
    fn: RankFn,
    n: int,
    spec: ParallelSpec | None,
    args: tuple,
    timeout_s: float,
    backend: str,
    model: str | None,
) -> list[Any]:
    store = dist.TCPStore("127.0.0.1", 0, n + 1, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="simdist-gloo-") as outdir:
        out = Path(outdir)
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, n, store.port, fn, spec, args, outdir, timeout_s, backend, model),
                name=f"simdist-rank{r}",
                daemon=True,
            )
            for r in range(n)
        ]
        for p in procs:
            p.start()
        try:
            _supervise(procs, out, timeout_s)
            return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
            del store


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
            raise TimeoutError(f"ranks {pending} of {n} did not finish within {timeout_s:g} s; all ranks killed")
        time.sleep(0.005)


if __name__ == "__main__":
    main()
