"""Where a case runs the real framework: real gloo processes now, the simdist backend when it exists.

A case's rank program is an ordinary ``fn(comm, *args)`` that uses
``torch.distributed`` (and the framework) directly; `run_ranks` starts the
ranks on the world that ``world`` names:

* ``"gloo"`` -- ``spec.world_size`` local processes on 127.0.0.1 with real
  gloo (`simdist.world.launch.spawn_gloo`). For the cases in this folder
  real gloo already decides "real == transcription bitwise": every group they
  reduce over has two members, and a two-member sum has one order.
* ``"simdist"`` -- the simdist torch.distributed backend in process mode
  (each rank a process, collectives with modelled arithmetic). Chosen when
  the backend provides a process launcher; otherwise a clear error.

DeepSpeed needs processes, not threads: it keeps its process groups and its
communication backend in module globals (``deepspeed.utils.groups``
``_TENSOR_MODEL_PARALLEL_GROUP`` and the ``_EXPERT_*`` dictionaries,
``deepspeed.comm.comm.cdb``), which every thread of one process shares, so
a thread per rank would hand every rank the groups of whichever rank set
them last.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Literal

from simdist.world.spec import ParallelSpec

World = Literal["gloo", "simdist"]
WORLDS: tuple[str, ...] = ("gloo", "simdist")


def run_ranks(fn: Callable[..., Any], spec: ParallelSpec, *args: Any, world: World = "gloo",
              timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(comm, *args)`` on every rank of ``spec`` in ``world``; return the per-rank results."""
    if world == "gloo":
        from simdist.world.launch import spawn_gloo

        return spawn_gloo(fn, spec, *args, timeout_s=timeout_s)
    if world == "simdist":
        spawn = _simdist_process_launcher()
        return spawn(fn, spec, *args, timeout_s=timeout_s)
    raise ValueError(f"unknown world {world!r}; valid: {', '.join(WORLDS)}")


def _simdist_process_launcher() -> Callable[..., list[Any]]:
    """The simdist backend's process-mode launcher, if this checkout has it."""
    for module, name in (("simdist.world.launch", "spawn_simdist"), ("simdist.world.spawn", "spawn_processes")):
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            found = None
        if found is not None:
            return found
    raise ValueError("world 'simdist' needs the simdist torch.distributed backend's process mode, which this "
                     "checkout does not have yet; use world='gloo'")
