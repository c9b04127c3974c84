"""In-process mode: `spawn_threads` runs unmodified ``torch.distributed`` code on one thread per rank.

    import torch, torch.distributed as dist, simdist

    def step(rank):
        t = torch.full((4,), float(rank))
        dist.all_reduce(t)                 # summed in gloo's ring order, bit for bit
        return t

    results = simdist.run(step, 4)         # [rank 0's t, ..., rank 3's t]

Inside ``fn`` the default process group is initialised with the ``simdist``
backend, so ``dist.get_rank()``, ``new_group``, ``new_subgroups``,
``init_device_mesh``, DTensor, FSDP2's ``fully_shard`` and the functional
collectives work as under torchrun. Collectives are computed by the reduction
chosen for the group (`simdist.world.backend.reduction_map`), on the rendezvous
`simdist.world.rendezvous.meeting.Rendezvous`; a mismatch, a deadlock or an exception on any
rank stops every rank quickly and names each rank's call site.

How ``torch.distributed``'s state is kept per rank thread: c10d keeps its
groups in the module-level ``_world`` object and in a C++ name registry.
While a thread launch runs, ``_world`` is replaced by `ThreadLocalWorld` (each rank
thread sees its own groups; other threads see the original world), and c10d's
thread-isolation mode makes the C++ registry per thread. Both are restored
when the launch returns (thread launches run one at a time). Code that keeps its own module-level
process-group state (DeepSpeed's ``deepspeed.utils.groups``) shares it between
the rank threads; run such code in process mode (`simdist.world.processes.transport`).

Rank threads behave like processes: they run one at a time and carry their own
copy of torch's process-global state (default generator, default dtype,
deterministic flags, ...; `simdist.world.threads.isolation`), and DTensor's tables are
per rank: each rank's DeviceMeshes carry a rank token where torch's own
threaded test backend puts the thread id (so the redistribution and sharding
caches keyed on meshes never hand one rank's plan to another), and DTensor's
custom-op table (``loss_parallel`` edits it) is one dict per rank thread.
A thread launch restores every global it touches (``sys.excepthook``, which c10d
wraps on every ``init_process_group``, included).
"""

from __future__ import annotations

import itertools
import operator
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from simdist.errors import SimdistRuntimeError, UsageError
from simdist.world.backend.attach import Attachment
from simdist.world.backend.attach import install as install_attach
from simdist.world.backend.process_group import BACKEND_NAME, DoneWork, SimProcessGroup
from simdist.world.backend.reduction_map import Chooser
from simdist.world.options import ReductionChoice, check_timeout
from simdist.world.rendezvous.calls import Call
from simdist.world.rendezvous.meeting import Rendezvous
from simdist.world.spec import ParallelSpec
from simdist.world.threads.frameworks import install as refuse_frameworks
from simdist.world.threads.isolation import RankIsolation


class _RankState:
    """One rank thread's c10d state (the attributes c10d reads from ``_world``)."""

    def __init__(self) -> None:
        self.default_pg = None
        self.pg_map: dict = {}
        self.pg_names: dict = {}
        self.pg_group_ranks: dict = {}
        self.pg_backend_config: dict = {}
        self.group_count = 0
        self.tags_to_pg: dict = {}
        self.pg_to_tag: dict = {}
        self.pg_coalesce_state: dict = {}
        self.comms: list = []


def _per_thread(name: str, settable: bool = False) -> property:
    """A ``_world`` attribute read from the calling thread's state: ``operator.attrgetter`` of
    ``_local.state.<name>``, so the read is C code (c10d reads ``default_pg`` twice and ``pg_coalesce_state``
    once on every collective); a thread that is not a rank (or has left) holds the fallback as its state."""

    def set_(self, value):
        setattr(self._local.state, name, value)

    return property(operator.attrgetter(f"_local.state.{name}"), set_ if settable else None)


class _Local(threading.local):
    """Each thread's c10d state: the fallback ``_World`` until the thread enters a rank."""

    def __init__(self, fallback: c10d._World) -> None:  # run in each thread at its first access
        self.state: Any = fallback


class ThreadLocalWorld(c10d._World):
    """c10d's ``_world`` with one state per simdist rank thread; other threads see ``fallback``."""

    def __init__(self, fallback: c10d._World) -> None:  # no super().__init__: all state is per thread
        self._fallback = fallback
        self._local = _Local(fallback)

    def _state(self):
        return self._local.state

    def enter_rank(self) -> None:
        """Give the calling thread a fresh, empty c10d state."""
        self._local.state = _RankState()

    def leave_rank(self) -> None:
        self._local.state = self._fallback

    default_pg = _per_thread("default_pg", settable=True)
    pg_map = _per_thread("pg_map")
    pg_names = _per_thread("pg_names")
    pg_group_ranks = _per_thread("pg_group_ranks")
    pg_backend_config = _per_thread("pg_backend_config")
    group_count = _per_thread("group_count", settable=True)
    tags_to_pg = _per_thread("tags_to_pg")
    pg_to_tag = _per_thread("pg_to_tag")
    pg_coalesce_state = _per_thread("pg_coalesce_state")
    comms = _per_thread("comms")


def _mesh_init(original):
    """DeviceMesh.__init__, then the rank token in ``_thread_id`` (torch sets it only for its "threaded" backend)."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        ctx = current()
        if ctx is not None and getattr(self, "_thread_id", 0) is None:
            self._thread_id = ctx.token  # part of the mesh's hash and equality
            self._hash = None

    __init__.simdist_original = original
    return __init__


class _PerRankHandlers(threading.local):
    """DTensor's custom-op table, one dict per rank thread (a copy of the process's table at the rank's start)."""

    def __init__(self, shared: dict) -> None:
        self.table = dict(shared)


def _dispatcher_class(base: type, shared: dict) -> type:
    """A subclass of DTensor's OpDispatcher whose ``_custom_op_handlers`` is the calling rank thread's dict."""
    local = _PerRankHandlers(shared)

    def get(self):
        return local.table if current() is not None else shared

    def set_(self, value):
        if current() is not None:
            local.table = value
        else:
            shared.clear()
            shared.update(value)

    return type(base.__name__, (base,), {"_custom_op_handlers": property(get, set_), "simdist_base": base})


def _patch_dtensor() -> Callable[[], None]:
    """Make DTensor's mesh identity and custom-op table per rank; returns the undo."""
    undo: list[Callable[[], None]] = []
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing shared to isolate
        return lambda: None
    original = DeviceMesh.__init__
    setattr(DeviceMesh, "__init__", _mesh_init(original))  # noqa: B010 (mypy: no method assignment)
    undo.append(lambda: setattr(DeviceMesh, "__init__", original))
    dispatcher = DTensor._op_dispatcher
    base, shared = type(dispatcher), dispatcher.__dict__.get("_custom_op_handlers")
    if isinstance(shared, dict):
        del dispatcher.__dict__["_custom_op_handlers"]
        dispatcher.__class__ = _dispatcher_class(base, shared)

        def restore() -> None:
            dispatcher.__class__ = base
            dispatcher.__dict__["_custom_op_handlers"] = shared

        undo.append(restore)
    undo.append(_clear_mesh_caches)

    def undo_all() -> None:
        for step in reversed(undo):
            step()

    return undo_all


def _clear_mesh_caches() -> None:
    """Drop torch's process-wide caches keyed on meshes: the rank tokens make every spawn's entries new ones."""
    from torch.distributed.tensor import _collective_utils, _redistribute

    for holder, name in ((_redistribute, "_gen_transform_infos"), (_collective_utils.MeshTopoInfo, "build_from_mesh")):
        cached = getattr(holder, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    planners = getattr(_redistribute, "_planner_cache", None)
    if isinstance(planners, dict):
        planners.clear()


_install_lock = threading.Lock()
_installed: list = []  # [world, count, saved world, undo] while spawns run; holds no process group


def _install() -> ThreadLocalWorld:
    with _install_lock:
        if not _installed:
            saved = c10d._world
            world = ThreadLocalWorld(saved)
            c10d._world = world
            # torch's _distributed_c10d stub omits this binding (the threaded process group's switch)
            torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
            _installed[:] = [world, 0, saved, _patch_dtensor()]
        _installed[1] += 1
        return _installed[0]


def _uninstall() -> None:
    with _install_lock:
        _installed[1] -= 1
        if _installed[1] == 0:
            world, _, saved, undo = _installed
            if c10d._world is world:
                c10d._world = saved
            torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]
            undo()
            _installed.clear()


class _Context:
    """What the backend's group factory needs on a rank thread: the rendezvous, the rank, the reduction chooser."""

    local = threading.local()
    tokens = itertools.count(1)

    def __init__(self, rendezvous: Rendezvous, rank: int, chooser: Chooser) -> None:
        self.rendezvous = rendezvous
        self.rank = rank
        self.chooser = chooser
        self.token = next(self.tokens)  # unique per rank of every spawn (a thread id can be reused)
        self.attachment: Attachment | None = None  # the script's own init_process_group calls (`attach`)


def current() -> _Context | None:
    """The in-process context of the calling thread (``None`` outside `spawn_threads`'s rank threads)."""
    return getattr(_Context.local, "ctx", None)


def _current_attachment() -> Attachment | None:
    ctx = getattr(_Context.local, "ctx", None)
    return None if ctx is None else ctx.attachment


def _current_rank() -> int | None:
    """The calling rank thread's rank (``None`` elsewhere): how per-rank generators find their owner."""
    ctx = getattr(_Context.local, "ctx", None)
    return None if ctx is None else ctx.rank


class RecvWork(dist.Work):
    """A posted receive; ``wait()`` blocks (deadlock-checked) until the message is there."""

    def __init__(self, rendezvous: Rendezvous, recv, tensor: torch.Tensor) -> None:
        super().__init__()
        self._rendezvous = rendezvous
        self._recv = recv
        self._tensor = tensor

    def wait(self, timeout=None) -> bool:
        self._rendezvous.wait_recv(self._recv)
        return True

    def is_completed(self) -> bool:
        return self._recv.done

    def result(self) -> list[torch.Tensor]:
        return [self._tensor]

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch._C.Future = torch._C.Future([])  # gloo's futures are torch._C.Future, not the subclass
        future.set_result([self._tensor])
        return future  # type: ignore[return-value]

    def _source_rank(self) -> int:
        """The sender's group rank (``dist.recv(src=None)`` asks for it after ``wait()``)."""
        self.wait()
        return int(self._recv.source)

    source_rank = _source_rank


class SendWork(DoneWork):
    """A send; ``wait()`` blocks (deadlock-checked) until the peer's receive has taken the message, as gloo's
    send does, so blocking sends received in another order are a reported deadlock, not an answer."""

    def __init__(self, rendezvous: Rendezvous, sent, tensor: torch.Tensor) -> None:
        super().__init__([tensor])
        self._rendezvous = rendezvous
        self._sent = sent

    def wait(self, timeout=None) -> bool:
        self._rendezvous.wait_send(self._sent)
        return True

    def is_completed(self) -> bool:
        return self._sent.done


class ThreadTransport:
    """Calls of rank threads meet in the shared `Rendezvous`; the last to arrive completes for all."""

    def __init__(self, rendezvous: Rendezvous, key: int) -> None:
        self.rendezvous = rendezvous
        self.key = key  # the group's call sequence: `Rendezvous.intern` of (name, ranks)

    def collective(self, pg: SimProcessGroup, call: Call, complete) -> None:
        self.rendezvous.collective(call, pg.ranks, complete, self.key)

    def send(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        channel = (pg.group_name, pg.ranks, pg.rank(), dst, tag)
        any_key = (pg.group_name, pg.ranks, dst, tag)  # where an any-source receive of ``dst`` waits
        return SendWork(self.rendezvous, self.rendezvous.send(call, channel, tensor, pg.ranks[dst], any_key), tensor)

    def recv(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        channel = (pg.group_name, pg.ranks, src, pg.rank(), tag)
        # the message is written into a detached alias, as gloo writes from C++: no autograd record, no version bump
        posted = self.rendezvous.post_recv(call, channel, pg.ranks[src], tensor.data)
        return RecvWork(self.rendezvous, posted, tensor)

    def recv_any(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, tag: int) -> dist.Work:
        """A receive from any other member: the earliest sent message (`Rendezvous.post_recv_any`)."""
        me = pg.rank()
        channels = [(pg.group_name, pg.ranks, src, me, tag) for src in range(len(pg.ranks)) if src != me]
        posted = self.rendezvous.post_recv_any(call, channels, (pg.group_name, pg.ranks, me, tag), tensor.data)
        return RecvWork(self.rendezvous, posted, tensor)


def thread_group(ctx: _Context, group_rank: int, group_size: int, ranks: tuple[int, ...], name: str):
    """The backend's group for a rank thread of `spawn_threads`."""
    kind, reduction = ctx.chooser(ranks)
    label = f"{kind}{{{','.join(map(str, ranks))}}}" + ("" if kind == "world" else f"#{name}")
    transport = ThreadTransport(ctx.rendezvous, ctx.rendezvous.intern((name, ranks)))
    return SimProcessGroup(group_rank, group_size, ranks, name, label, reduction, transport)


def spawn_threads(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    reduction: ReductionChoice,
    spec: ParallelSpec | None,
    timeout_s: float | None,
    one_cpu: bool,
    intra_op_threads: int | None,
    report_backend: bool = False,
) -> list[Any]:
    """The thread launcher behind ``simdist.run(where="threads", api="dist")``: ``fn(rank, *args, **kwargs)`` on
    ``world_size`` rank threads (`simdist.world.runner.run` documents the arguments). The default group is
    destroyed when ``fn`` returns; each rank has its own copy of torch's process-global state, starting as a
    fresh process's (`simdist.world.threads.isolation`); a rank's ``sys.exit`` is a `RankExitError`."""
    world_size = check_world_size(world_size)
    timeout_s = check_timeout(timeout_s)
    if current() is not None:
        raise RuntimeError("simdist.run called from a rank thread of another thread launch (they run one at a time)")
    with _spawn_lock:  # process-global state is swapped per rank: one spawn at a time
        return _spawn(
            fn, world_size, args, kwargs, reduction, spec, timeout_s, one_cpu, intra_op_threads, report_backend
        )


_spawn_lock = threading.Lock()


def _spawn(
    fn, world_size, args, kwargs, reduction, spec, timeout_s, one_cpu, intra_op_threads, report_backend
) -> list[Any]:
    # (the backend is registered: `import simdist`, this module's package, installed simdist._autoregister, and
    # the first init below completes the registration)
    chooser = Chooser(reduction, world_size, spec)
    isolation = RankIsolation(world_size, _current_rank)
    rendezvous = Rendezvous(world_size, label="simdist.run", switch=isolation)
    store = dist.HashStore()
    stores: dict[int, dist.Store] = {}  # the stores of scripts' re-inits after their destroy_process_group
    saved = _process_globals()
    world = _install()
    init = c10d.init_process_group  # the original: the launcher's own init is not the script's

    def body(rank: int) -> Any:
        ctx = _Context.local.ctx = _Context(rendezvous, rank, chooser)
        world.enter_rank()
        try:
            init(BACKEND_NAME, rank=rank, world_size=world_size, store=store)

            def reinit(n: int) -> None:
                init(BACKEND_NAME, rank=rank, world_size=world_size, store=stores.setdefault(n, dist.HashStore()))

            ctx.attachment = Attachment(rank, world_size, reinit, report_backend)
            try:
                return fn(rank, *args, **kwargs)
            except SystemExit as exc:  # in a real job this rank's process would end: an error naming the rank
                ended = f"rank {rank} called sys.exit({exc.code!r}); its process would have ended"
                raise RankExitError(ended) from None
            finally:
                if rendezvous.error is None and dist.is_initialized():  # the script may have destroyed it
                    dist.destroy_process_group()
        finally:
            world.leave_rank()
            _Context.local.ctx = None

    undo_attach = install_attach(_current_attachment)
    undo_frameworks = refuse_frameworks(_current_rank)
    try:
        isolation.start()
        results = rendezvous.run(body, timeout_s=timeout_s, one_cpu=one_cpu, intra_op_threads=intra_op_threads)
    except BaseException:
        isolation.restore()  # the caller's generator and settings, also when a rank failed
        raise
    finally:
        undo_frameworks()
        undo_attach()
        _uninstall()
        _restore_process_globals(saved)
    isolation.finish()  # restores them and refuses state that ranks shared
    return results


MAX_RANK_THREADS = 512
"""The most rank threads `spawn_threads` starts (the CLI's ``--world-size`` ceiling, `simdist.cli.limits.LIMITS`)."""


class RankExitError(SimdistRuntimeError):
    """A rank called ``sys.exit``: in a real job its process would have ended while its peers ran on."""


def check_world_size(world_size: Any) -> int:
    """``world_size`` as an int; one-line ``TypeError``/``ValueError`` unless it is one in ``[1, MAX_RANK_THREADS]``."""
    if isinstance(world_size, bool) or not hasattr(type(world_size), "__index__"):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    world_size = operator.index(world_size)
    if not 1 <= world_size <= MAX_RANK_THREADS:
        raise UsageError(
            f"world_size must be in [1, {MAX_RANK_THREADS}] (each rank is a thread of this process), got {world_size}"
        )
    return world_size


def _process_globals() -> tuple:
    """What ``init_process_group`` changes outside c10d's ``_world``: the excepthook and two module globals."""
    return sys.excepthook, c10d._backend, c10d._default_pg_init_method


def _restore_process_globals(saved: tuple) -> None:
    sys.excepthook, c10d._backend, c10d._default_pg_init_method = saved
