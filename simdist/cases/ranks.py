"""Where a case runs the real framework: real gloo processes, simdist's backend in processes, or threads.

A case's rank program is an ordinary ``fn(comm, *args)`` that uses ``torch.distributed`` (and the framework)
directly; `run_ranks` runs it on every rank with ``simdist.run(fn, spec, api="comm", where=...)``. A case's
``where`` is `simdist.run`'s (`simdist.world.options.Where`, the one value set; `CASE_WHERES`;
``simdist case run --where``):

* ``"gloo"`` -- ``spec.world_size`` local processes on 127.0.0.1 with real gloo
  (``simdist.run(where="gloo")``): the real framework on the real backend, summing in gloo's own order
  (which the transcription's reference must match for groups of more than two members).
* ``"processes"`` -- the simdist torch.distributed backend in process mode (each rank a process, collectives
  summed by simdist in the launchers' default reduction, gloo's order;
  `simdist.world.processes.transport`).
* ``"threads"`` -- one thread per rank, for the cases whose framework keeps no per-rank module globals
  (FSDP2, DTensor: `simdist.cases.fsdp2.tp_mesh` runs its own threads); `run_ranks` refuses it, since every
  case that calls it keeps per-rank state in module globals, and `simdist.cases.run_case` refuses it for
  every case that names a reason (`simdist.cases.base.Case.processes_because`).

DeepSpeed needs processes, not threads: it keeps its process groups and its communication backend in module
globals (``deepspeed.utils.groups`` ``_TENSOR_MODEL_PARALLEL_GROUP`` and the ``_EXPERT_*`` dictionaries,
``deepspeed.comm.comm.cdb``), which every thread of one process shares, so a thread per rank would hand every
rank the groups of whichever rank set them last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, get_args

from simdist.errors import UsageError, coerce
from simdist.world.options import DEFAULT_TIMEOUT_S, Where
from simdist.world.spec import ParallelSpec

if TYPE_CHECKING:
    from simdist.world.processes.launch import LaunchTimings

CaseWhere = Literal["threads", "processes", "gloo"]
"""`Where`'s values as a type for the cases' signatures and the command line's ``--where`` (a unit test holds the two
equal: one value set)."""
CASE_WHERES: tuple[str, ...] = get_args(CaseWhere)
"""Where a case can run its ranks (``simdist case run --where`` offers these).
``threads`` (one thread per rank) is for cases whose framework keeps no per-rank module globals (FSDP2,
DTensor) and which set none themselves; `run_ranks` refuses it."""


PER_RANK_GLOBALS = "its framework keeps per-rank state in module globals that threads would share"
"""Why `run_ranks` refuses ``threads`` unless a case names its own reason (true of DeepSpeed and Megatron)."""


DEEPSPEED_MODULES: tuple[str, ...] = (
    "deepspeed",
    "deepspeed.comm.torch",
    "deepspeed.utils.groups",
    "deepspeed.runtime.bf16_optimizer",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # BF16_Optimizer imports it; it torch.compile()s at import: 13 s
)
"""What the DeepSpeed cases' ranks import: preloaded once in the forkserver (``preload=``) instead of per rank."""

MEGATRON_MODULES: tuple[str, ...] = (
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.transformer",
)
"""What the Megatron case's ranks import (about 5 s on the 2-core CI machine): preloaded the same way."""


def run_ranks(
    fn: Callable[..., Any],
    spec: ParallelSpec,
    *args: Any,
    where: CaseWhere = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    processes_because: str = PER_RANK_GLOBALS,
    preload: tuple[str, ...] = (),
    timings: list[LaunchTimings] | None = None,
) -> list[Any]:
    """Run ``fn(comm, *args)`` on every rank of ``spec`` in ``where``; return the per-rank results.

    ``simdist.run(fn, spec, api="comm", where=...)``, ``where`` being ``gloo`` or ``processes``. ``threads`` is
    refused with ``processes_because``, the case's reason for
    needing processes. ``preload`` (`DEEPSPEED_MODULES`, `MEGATRON_MODULES`) and ``timings`` as for
    `simdist.world.runner.run`.
    """
    place = coerce(Where, where, "where")
    if place == Where.THREADS:
        raise UsageError(f"this case runs in processes only (where 'gloo' or 'processes'): {processes_because}")
    from simdist.world.runner import run

    return run(fn, spec, api="comm", where=place, args=args, timeout_s=timeout_s, preload=preload, timings=timings)
