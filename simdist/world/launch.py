"""Run a rank program ``fn(comm)`` under ``torchrun``, on the real process groups torchrun's processes make.

`run_torchrun` is called inside each process that ``torchrun`` starts (gloo on CPU, NCCL when CUDA is
available); `main` wraps it for the command line (``python -m simdist.launch`` is this module under a shorter
name)::

    torchrun --nproc-per-node 4 -m simdist.launch mypkg.study:rank_fn --tp 2 --ep 2

Local rank processes started by simdist itself (real gloo, or the ``simdist`` backend in process mode) are
``simdist.run(..., where="gloo"|"processes")`` (`simdist.world.runner`, `simdist.world.processes.launch`).
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from simdist.errors import UsageError
from simdist.world.spec import ParallelSpec
from simdist.world.torch_comm import TorchComm

RankFn = Callable[..., Any]


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
    """Command-line entry for torchrun: ``-m simdist.launch module:function --tp T --ep E [...]``."""
    parser = argparse.ArgumentParser(prog="python -m simdist.launch", description=main.__doc__)
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


if __name__ == "__main__":
    main()
