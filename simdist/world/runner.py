"""`run`: the one launcher of rank programs, on rank threads or on rank processes.

    import simdist

    def step(rank, n):                          # api="dist": plain torch.distributed code
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t

    simdist.run(step, 4, args=(8,))                                 # threads, gloo's order
    simdist.run(step, 4, args=(8,), where="processes")              # one process per rank, same bits
    simdist.run(step, 4, args=(8,), where="gloo")                   # real gloo processes
    simdist.run(rank_program, ParallelSpec(4, tp=2, ep=2), api="comm", reduction="ring")

``where`` says where ranks live (`Where`: ``threads``, ``processes``, ``gloo``), ``api`` what the rank
function is handed (`Api`: ``dist`` -- its rank, with the default ``torch.distributed`` group initialised;
``comm`` -- a `simdist.world.groups.Comm` of the run's `ParallelSpec`). ``fn``'s arguments travel apart from
the launcher's keywords, as in ``torch.multiprocessing.spawn``: ``args=`` and ``kwargs=``. ``reduction=``
(`simdist.world.options`) and ``timeout_s=`` have one default each, whatever ``where`` and ``api``.

``SimWorld(spec).run`` is this function with ``where="threads"``, ``api="comm"``, on the same code path;
`simdist.blame` and the pytest fixture ``simdist_world`` call it with their callers' ``args=``, ``kwargs=`` and
launcher keywords. Process launches (``where="processes"`` or ``"gloo"``) are
`simdist.world.processes.launch.spawn_processes`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from simdist.errors import UsageError, coerce
from simdist.world.options import DEFAULT_REDUCTION, DEFAULT_TIMEOUT_S, Api, ReductionChoice, Where, check_timeout
from simdist.world.processes.launch import LaunchTimings, spawn_processes
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec
from simdist.world.threads.spawn import spawn_threads

__all__ = ["Api", "Where", "run"]


def run(
    fn: Callable[..., Any],
    world: int | ParallelSpec,
    *,
    where: Where | str = Where.THREADS,
    api: Api | str = Api.DIST,
    reduction: ReductionChoice = DEFAULT_REDUCTION,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    preload: Sequence[str] = (),
    timings: list[LaunchTimings] | None = None,
    one_cpu: bool = True,
    intra_op_threads: int | None = 1,
    report_backend: bool = False,
) -> list[Any]:
    """Run ``fn(rank or comm, *args, **kwargs)`` on every rank of ``world``; return the results in rank order.

    ``world``: a world size, or a `ParallelSpec` (needed for ``api="comm"`` layouts other than a flat world,
    and for per-kind reduction tables). ``reduction``: a `simdist.world.options.ReductionChoice` (a reduction
    name, a `ReductionName` member or a `Reduction` for every group; in threads also a mapping from group kind to
    one of those, with a ``"default"`` entry, or a callable ``(ranks) -> Reduction``), read by
    `simdist.world.options.read_reduction` as every front end reads it.
    Real gloo (``where="gloo"``) accepts only gloo's own order. ``timeout_s``
    bounds the whole run (``None``: no bound, threads only). A rank's exception is re-raised naming the rank
    (in processes as `simdist.world.processes.supervise.RankFailure`, with the rank's traceback).

    Processes only: ``fn``, its arguments and results must be picklable (``fn`` a top-level function);
    ``preload`` names modules every rank imports (a framework such as ``deepspeed``), imported once in the
    forkserver the ranks are forked from, a server kept per preload set, so the ranks carry no framework another
    launch preloaded (`simdist.world.processes.forkservers`; on the environment's path: Python 3.11's forkserver ignores
    this process's ``sys.path`` additions, and a module it cannot import is imported by each rank instead);
    ``timings`` (a list) receives the launch's `LaunchTimings`.
    Threads only: ``one_cpu`` and ``intra_op_threads`` as for `SimWorld`.

    With ``api="dist"``, ``fn`` may call ``dist.init_process_group`` itself with any backend name and init
    method (an ``mp.spawn``-style ``worker(rank, world_size)``): it attaches to the rank's default group, and
    ``destroy_process_group`` detaches (`simdist.world.backend.attach`). ``report_backend=True``: ``dist.get_backend()``
    answers the name ``fn`` asked for (``"gloo"``, ``"nccl"``) instead of ``"simdist"``.
    """
    place = coerce(Where, where, "where")
    hand = coerce(Api, api, "api")
    spec, size = _world(world, hand)
    args, kwargs = _arguments(args, kwargs)
    if place == Where.THREADS:
        if preload or timings is not None:
            raise UsageError("preload= and timings= are for process launches (where='processes' or 'gloo')")
        return _run_threads(
            fn, hand, spec, size, args, kwargs, reduction, timeout_s, one_cpu, intra_op_threads, report_backend
        )
    timeout = check_timeout(timeout_s, none_ok=False)
    assert timeout is not None
    backend = "gloo" if place == Where.GLOO else "simdist"
    comm_spec = spec if hand == Api.COMM else None
    return spawn_processes(
        fn, size, comm_spec, args, kwargs, timeout, backend, reduction, tuple(preload), timings, report_backend
    )


def _run_threads(
    fn: Callable[..., Any],
    hand: Api,
    spec: ParallelSpec | None,
    size: int,
    args: tuple,
    kwargs: dict,
    reduction: Any,
    timeout_s: float | None,
    one_cpu: bool,
    intra_op_threads: int | None,
    report_backend: bool,
) -> list[Any]:
    """`run` on rank threads: a `SimWorld` for ``api="comm"``, plain ``torch.distributed`` ranks otherwise."""
    if hand == Api.COMM:
        assert spec is not None
        threads = SimWorld(
            spec, timeout_s=timeout_s, one_cpu=one_cpu, intra_op_threads=intra_op_threads, reduction=reduction
        )
        return threads.run(fn, *args, **kwargs)
    return spawn_threads(fn, size, args, kwargs, reduction, spec, timeout_s, one_cpu, intra_op_threads, report_backend)


def _world(world: Any, api: Api) -> tuple[ParallelSpec | None, int]:
    """The run's spec (made flat from a size for ``api="comm"``) and its size."""
    if isinstance(world, ParallelSpec):
        return world, world.world_size
    if isinstance(world, bool) or not hasattr(type(world), "__index__"):  # numpy's integers are world sizes too
        raise TypeError(f"world must be a world size (int) or a ParallelSpec, got {type(world).__name__} {world!r}")
    world = operator.index(world)
    if world < 1:
        raise UsageError(f"world must be at least 1 rank, got {world}")
    return (ParallelSpec(world) if api == Api.COMM else None), world


def _arguments(args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """``args`` as a tuple and ``kwargs`` as a dict, refusing the shapes that are mistakes (a bare string,
    a dict passed as ``args``) instead of splatting them."""
    if isinstance(args, str | bytes | Mapping) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of fn's positional arguments, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping of fn's keyword arguments, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs or {})
