"""The body of one rank process of a process launch (`simdist.world.processes.launch`): join, run, report.

`rank_main` runs in every rank process, forked from a forkserver that imported this module
(`simdist.world.processes.forkservers`): it joins the launch's group through the TCP store the launcher hosts, runs the
rank function, and leaves its result (``rank{r}.pt``), the times of its phases (``rank{r}.times``) or its
traceback (``rank{r}.err``) in the launch's folder, where the launcher's supervisor looks
(`simdist.world.processes.supervise`). On `STACK_SIGNAL` it writes every thread's Python stack to ``rank{r}.stack``.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simdist.reduce import Reduction
from simdist.world.backend.attach import Attachment
from simdist.world.backend.attach import install as install_attach
from simdist.world.processes.transport import use_reduction
from simdist.world.spec import ParallelSpec
from simdist.world.torch_comm import TorchComm

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
"""The signal on which a rank process writes every thread's Python stack to ``rank{r}.stack`` (POSIX only)."""


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    spec: ParallelSpec | None,
    args: tuple,
    outdir: str,
    timeout_s: float,
    backend: str = "gloo",
    reduction: Reduction | None = None,
    kwargs: dict | None = None,
    preload: tuple[str, ...] = (),
    report_backend: bool = False,
) -> None:
    """Body of one rank process: init the group, run ``fn``, save its result or its traceback.

    ``fn`` gets a `TorchComm` when ``spec`` is given, else its rank (plain ``torch.distributed`` code). With plain
    code, a ``fn`` that calls ``init_process_group`` itself attaches to the group made here
    (`simdist.world.backend.attach`), as on rank threads. The wall-clock times of its phases go to ``rank{r}.times``
    (`simdist.world.processes.launch.LaunchTimings`).
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


def ready() -> None:
    """A no-op rank: starting it waits for the forkserver to have finished its imports."""


def _dump_stack_on_request(path: Path) -> None:
    """Let the parent ask this rank where it is at the deadline: `faulthandler` writes the stacks even while
    the rank waits inside C code (a compiler subprocess, a collective), where no Python handler would run."""
    if STACK_SIGNAL is None:
        return
    faulthandler.register(STACK_SIGNAL, file=path.open("w"), all_threads=True, chain=False)
