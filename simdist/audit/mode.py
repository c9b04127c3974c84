"""`Audit`: the TorchDispatchMode that records narrowing conversions, narrow accumulations and collectives."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from simdist.audit import world_hooks
from simdist.audit.ops import _OPS, _describe_op, _get, _Op, _safe_error, _Tensor, _tensors, _wide_error, _widen
from simdist.audit.report import (
    _MAX_SHAPES,
    CAST,
    COLLECTIVE,
    IGNORE,
    AuditReport,
    Record,
    SiteSummary,
    _max_error,
    _sorted,
    _wider,
    dtype_name,
    narrows,
)
from simdist.callsite import NO_SITE, frame_site, internal_prefixes, is_internal
from simdist.errors import UsageError

_RANK_THREAD = re.compile(r"simdist-rank-(\d+)")

# -- the mode ----------------------------------------------------------------------


class _Stats:
    __slots__ = ("count", "error", "ranks", "shapes", "tensor_errors")

    def __init__(self) -> None:
        self.count = 0
        self.error: float | None = None
        self.tensor_errors: dict = {}  # device -> running max (0-dim tensor), read once in report()
        self.shapes: list = []
        self.ranks: set = set()


class _Store:
    """Shared by an audit and the per-thread audits it starts (``threads=True``)."""

    def __init__(self, max_records: int) -> None:
        self.lock = threading.Lock()
        self.stats: dict[tuple, _Stats] = {}
        self.records: list[tuple] = []  # (stats key, shape, rank), made into Records by report()
        self.max_records = max_records
        self.dropped = 0
        self.closed = False
        self.skipped: dict = {}  # id(code object) -> (the code object, skip its frames?)
        self.sites: dict = {}  # (id(code object), line) -> (file, line, function)
        self.followed: list = []  # (thread, native id) of each thread followed with threads=True


def _skip_prefix(entry: str) -> str:
    """A path prefix for ``entry``: a module or package name, or a path."""
    if os.sep in entry or "/" in entry or entry.endswith(".py") or os.path.exists(entry):
        path = os.path.abspath(entry)
        return path + os.sep if os.path.isdir(path) else path
    try:
        spec = importlib.util.find_spec(entry)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise UsageError(f"skip entry {entry!r} is neither an importable module nor a path")
    if spec.submodule_search_locations:
        return os.path.dirname(os.path.abspath(spec.origin)) + os.sep
    return os.path.abspath(spec.origin)


class _PopAtThreadExit:
    """Pops a followed thread's audit off that thread's mode stack when the thread ends.

    Held in a ``threading.local``, whose values are released on the ending thread while it still runs
    Python; left on the stack, the mode would be released by C++ thread-local destructors after the
    thread's Python state is gone, which aborts the process at exit ("terminate called without an
    active exception").
    """

    __slots__ = ("mode",)

    def __init__(self, mode: Audit) -> None:
        self.mode = mode

    def __del__(self) -> None:
        try:
            stack = _get_current_dispatch_mode_stack()
            if stack and stack[-1] is self.mode:
                _pop_mode()
        except Exception:  # interpreter shutting down: nothing left to do
            pass


_THREAD_EXIT = threading.local()


def _wait_for_ended_threads(store: _Store, timeout_s: float = 2.0) -> None:
    """Wait (Linux, at most ``timeout_s``) until the followed threads that have finished are gone from the OS.

    A finished thread still runs its C++ thread-local destructors, which release torch's copy of its
    dispatch-mode state and take the GIL to do so; if the interpreter is finalizing by then, the process
    aborts ("terminate called without an active exception", exit 134). Returning only once those threads
    are gone keeps a script that ends right after its last SimWorld run from aborting under the audit.
    """
    import time

    deadline = time.monotonic() + timeout_s
    with store.lock:
        followed, store.followed = store.followed, []
    for thread, native in followed:
        if thread.is_alive() or not os.path.isdir("/proc/self/task"):
            continue
        while os.path.exists(f"/proc/self/task/{native}") and time.monotonic() < deadline:
            time.sleep(0.001)


class Audit(TorchDispatchMode):
    """Records narrowing conversions, narrow accumulations and collectives while active (see `simdist.audit`).

    ``skip`` -- more modules, packages or path prefixes whose frames are not a
    site (the record goes to the next frame outward); ``errors`` -- compute the
    largest relative rounding error per site; ``collectives`` -- record
    collectives; ``rank`` -- tag for every record; ``threads`` -- also audit
    threads started while active (each into this report, rank from SimWorld's
    thread names); ``max_records`` -- raw records kept (site counts are always
    complete); ``cast_hook`` -- called as ``cast_hook(site, rank, source, result,
    in_place, op=aten name)`` after every narrowing cast it records (``site`` is ``(file, line,
    function)``, ``source`` the wide input, ``result`` the narrowed tensor), with
    the audit paused; for an out-of-place cast (``in_place`` false) a tensor it
    returns replaces the cast's result (`simdist.blame` measures and promotes
    casts with it); ``op_hook`` and ``op_names`` -- every op whose name (e.g.
    ``aten.mm``, ``aten.add_``) is in ``op_names`` is run by
    ``op_hook(site, rank, name, call, written, args, kwargs)`` instead (``call``
    runs the op, ``written`` names the arguments it writes), whatever its
    dtypes; what the hook returns is the op's result (`simdist.blame`'s
    arithmetic sites); ``widen_hook`` -- called as ``widen_hook(source, result)`` after every out-of-place
    floating cast that does not narrow (``.float()`` of a BF16 tensor), with the audit paused; a tensor it
    returns replaces the cast's result (`simdist.blame`'s promotion carries a promoted value through a narrow
    buffer with it).
    """

    def __init__(
        self,
        *,
        skip: Iterable[str] = (),
        errors: bool = True,
        collectives: bool = True,
        rank: int | None = None,
        threads: bool = False,
        max_records: int = 100_000,
        cast_hook: Callable[..., torch.Tensor | None] | None = None,
        op_hook: Callable[..., Any] | None = None,
        op_names: Iterable[str] = (),
        widen_hook: Callable[..., torch.Tensor | None] | None = None,
        _parent: Audit | None = None,
    ) -> None:
        super().__init__()
        self.rank = rank
        self.errors = errors
        self.collectives = collectives
        self.threads = threads
        self._paused = 0
        self._entered = 0
        self._previous_profile: Callable[..., object] | None = None
        self.cast_hook: Callable[..., torch.Tensor | None] | None = cast_hook if _parent is None else _parent.cast_hook
        self.op_hook: Callable[..., Any] | None = op_hook if _parent is None else _parent.op_hook
        self.op_names: frozenset[str] = frozenset(op_names) if _parent is None else _parent.op_names
        self.widen_hook: Callable[..., torch.Tensor | None] | None = (
            widen_hook if _parent is None else _parent.widen_hook
        )
        self._store: _Store
        self._prefixes: tuple[str, ...]
        if _parent is not None:
            self._store = _parent._store
            self._prefixes = _parent._prefixes
        else:
            self._store = _Store(max_records)
            self._prefixes = internal_prefixes(_skip_prefix(s) for s in skip)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in a torch._dynamo.disable shim by default (~1.5 us per op); the audit
        # does not support torch.compile (it would not see inside compiled kernels anyway).
        return False

    # -- entering and leaving ----------------------------------------------------

    def __enter__(self) -> Audit:
        # Push/pop on the thread-local mode stack directly: TorchDispatchMode.__enter__ also saves and restores
        # process-global flags, which rank threads entering and leaving out of order would leave wrong.
        _push_mode(self)
        self._entered += 1
        self._store.closed = False
        world_hooks.install(Audit)
        if self.threads and self._entered == 1:
            self._previous_profile = threading.getprofile()
            threading.setprofile(self._thread_hook())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        popped = _pop_mode()
        if popped is not self:  # someone left a mode of their own on the stack: put it back, refuse
            _push_mode(popped)
            raise RuntimeError(f"audit exited while {popped!r} is still on the dispatch-mode stack above it")
        self._entered -= 1
        world_hooks.uninstall()
        if self.threads and self._entered == 0:
            threading.setprofile(self._previous_profile)
            self._store.closed = True
            _wait_for_ended_threads(self._store)

    def _thread_hook(self):
        previous = self._previous_profile

        def hook(frame, event, arg):
            sys.setprofile(previous)  # one shot: set the thread's audit up, then get out of the way
            if not self._store.closed:
                match = _RANK_THREAD.fullmatch(threading.current_thread().name)
                child = Audit(
                    rank=int(match[1]) if match else None,
                    errors=self.errors,
                    collectives=self.collectives,
                    _parent=self,
                )
                _push_mode(child)
                _THREAD_EXIT.guard = _PopAtThreadExit(child)
                with self._store.lock:
                    self._store.followed.append((threading.current_thread(), threading.get_native_id()))
            if previous is not None:
                return previous(frame, event, arg)
            return None

        return hook

    @contextlib.contextmanager
    def paused(self):
        """Ops run inside this block are not recorded (by this audit)."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1

    def report(self) -> AuditReport:
        """The sites and records so far (a snapshot; the audit may go on)."""
        store = self._store
        with store.lock:
            stats = list(store.stats.items())
            raw = list(store.records)
            dropped = store.dropped
        sites = []
        for key, st in stats:
            err = st.error
            for t in st.tensor_errors.values():
                err = _max_error(err, t.item())
            sites.append(SiteSummary(*_plain_key(key), st.count, err, [tuple(x) for x in st.shapes], sorted(st.ranks)))
        records = []
        for key, shape, rank in raw:
            file, line, function, op, kind, ins, out, context = _plain_key(key)
            records.append(Record(op, kind, ins, out, tuple(shape), file, line, function, rank, context))
        return AuditReport(_sorted(sites), records, dropped, self.rank)

    # -- the dispatch hook -----------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = _OPS.get(id(func))  # OpOverload hashes in Python; its id is stable (the _Op keeps it alive)
        if op is None:
            op = _OPS[id(func)] = _describe_op(func)
        if kwargs is None:
            kwargs = {}
        kind = op.kind
        if self.op_hook is not None and op.name in self.op_names and not self._paused and not self._store.closed:
            site = self._site()
            with self.paused():
                return self.op_hook(site, self.rank, op.name, op.call, op.written, args, kwargs)
        if kind == IGNORE or self._paused or self._store.closed:
            return op.call(*args, **kwargs)
        if kind == CAST:
            return self._cast(op, args, kwargs)
        if kind == COLLECTIVE:
            if self.collectives:
                found = [t for a in args for t in _tensors(a)]
                if found:
                    self._record(op.name, COLLECTIVE, (found[0].dtype,), found[0].dtype, found[0].shape, None, "")
            return op.call(*args, **kwargs)
        # fast path: a single dtype among the tensor inputs and no dtype or out= argument -> nothing can narrow
        dtypes = {a.dtype for a in args if isinstance(a, _Tensor)}
        if op.lists:
            for a in args:
                if isinstance(a, (list, tuple)):
                    dtypes.update(t.dtype for t in a if isinstance(t, _Tensor))
        for k in op.kw_inputs:
            dtypes.update(t.dtype for t in _tensors(kwargs.get(k)))
        if len(dtypes) < 2 and not op.dtype_args and not op.outs:
            return op.call(*args, **kwargs)
        widest = None
        for d in dtypes:
            if d.is_floating_point:
                widest = _wider(widest, d)
        if widest is None:
            return op.call(*args, **kwargs)
        requested = None
        for key in op.dtype_args:
            value = _get(args, kwargs, key)
            if isinstance(value, torch.dtype) and value.is_floating_point and value is not widest:
                requested = value
        if requested is None and not op.outs and sum(d.is_floating_point for d in dtypes) < 2:
            return op.call(*args, **kwargs)
        return self._narrowing(op, args, kwargs, widest, requested)

    def _cast(self, op: _Op, args, kwargs):
        source = _get(args, kwargs, op.source)
        result = op.call(*args, **kwargs)
        if isinstance(source, (list, tuple)):
            self._list_cast(op, source, _get(args, kwargs, 0) if op.written else result)
            return result
        if not isinstance(source, _Tensor):
            return result
        target = _get(args, kwargs, op.written[0]) if op.written else result
        if isinstance(target, _Tensor) and narrows(source.dtype, target.dtype):
            error = _safe_error(target, source) if self.errors else None
            site = self._record(op.name, CAST, (source.dtype,), target.dtype, target.shape, error, "")
            if self.cast_hook is not None:
                with self.paused():
                    replaced = self.cast_hook(site, self.rank, source, target, bool(op.written), op=op.name)
                if replaced is not None and not op.written:
                    return replaced
        elif (
            self.widen_hook is not None
            and not op.written
            and isinstance(result, _Tensor)
            and source.dtype.is_floating_point
            and result.dtype.is_floating_point
        ):
            with self.paused():
                widened = self.widen_hook(source, result)
            if widened is not None:
                return widened
        return result

    def _list_cast(self, op: _Op, sources, targets) -> None:
        """A foreach copy (``torch._foreach_copy_(dsts, srcs)``): each narrowing pair is one cast, in place."""
        for source, target in zip(sources, _tensors(targets), strict=False):
            if isinstance(source, _Tensor) and narrows(source.dtype, target.dtype):
                error = _safe_error(target, source) if self.errors else None
                site = self._record(op.name, CAST, (source.dtype,), target.dtype, target.shape, error, "")
                if self.cast_hook is not None:
                    with self.paused():
                        self.cast_hook(site, self.rank, source, target, True, op=op.name)

    def _narrowing(self, op: _Op, args, kwargs, widest, requested):
        """An op with mixed input dtypes, a dtype argument or an out= argument: did it store narrower?"""
        wide_args = None
        if op.written:
            targets = [t for key in op.written for t in _tensors(_get(args, kwargs, key))]
            if not any(narrows(widest, t.dtype) for t in targets):
                return op.call(*args, **kwargs)
            if self.errors and not op.seeded:  # snapshot before the op overwrites its inputs
                wide_args = _widen(op, args, kwargs, widest, requested)
            result = op.call(*args, **kwargs)
            outputs = targets
        else:
            result = op.call(*args, **kwargs)
            outputs = _tensors(result)
            if not any(narrows(widest, t.dtype) for t in outputs):
                return result
            if self.errors and not op.seeded:
                wide_args = _widen(op, args, kwargs, widest, requested)
        narrowed = [i for i, t in enumerate(outputs) if narrows(widest, t.dtype)]
        error = None
        if wide_args is not None:
            error = _wide_error(op, wide_args, outputs, narrowed)
        inputs = {t.dtype for a in args for t in _tensors(a)}
        inputs.update(t.dtype for k, v in kwargs.items() if k not in op.outs for t in _tensors(v))
        floating = sorted((d for d in inputs if d.is_floating_point), key=lambda d: (d.itemsize, str(d)))
        first = outputs[narrowed[0]]
        self._record(op.name, op.kind, tuple(floating), first.dtype, first.shape, error, "")
        return result

    # -- recording -------------------------------------------------------------------

    def _site(self) -> tuple[str, int, str]:
        """The user's call site by `simdist.callsite`'s rule, with ``skip`` passed over too; whether a frame is
        skipped is cached per code object, its site per (code, line)."""
        store = self._store
        f: FrameType | None
        skipped, prefixes = store.skipped, self._prefixes
        f = sys._getframe(1)
        while f is not None:
            code = f.f_code
            known = skipped.get(id(code))
            if known is None:  # keyed by identity: equal code objects of two files compare equal
                known = skipped[id(code)] = (code, is_internal(code.co_filename, prefixes))  # keeps the id taken
            if not known[1]:
                key = (id(code), f.f_lineno)
                site = store.sites.get(key)
                if site is None:
                    site = store.sites[key] = frame_site(f)
                return site
            f = f.f_back
        return NO_SITE

    def _record(
        self, op: str, kind: str, in_dtypes: tuple, out_dtype, shape, error, context: str
    ) -> tuple[str, int, str]:
        """Count one event at its site; returns the site ``(file, line, function)``."""
        site = self._site()
        node = torch._C._current_autograd_node()
        if node is not None:
            context = f"backward:{node.name()}" + (f"; {context}" if context else "")
        key = (site, op, kind, in_dtypes, out_dtype, context)
        store = self._store
        with store.lock:
            st = store.stats.get(key)
            if st is None:
                st = store.stats[key] = _Stats()
            st.count += 1
            if self.rank is not None:
                st.ranks.add(self.rank)
            if len(st.shapes) < _MAX_SHAPES and shape not in st.shapes:
                st.shapes.append(shape)
            if error is not None:
                if isinstance(error, float):
                    st.error = _max_error(st.error, error)
                else:  # keep it on the device: no sync per op
                    prev = st.tensor_errors.get(error.device)
                    st.tensor_errors[error.device] = error if prev is None else torch.maximum(prev, error)
            if len(store.records) < store.max_records:
                store.records.append((key, shape, self.rank))
            else:
                store.dropped += 1
        return site

    def record_collective(self, op: str, tensor, context: str = "") -> None:
        """Record a collective that does not reach the dispatcher (e.g. a simulated one) with its dtype; its site
        is the first frame outside torch and simdist's world, audit and blame (`simdist.callsite`)."""
        if self.collectives and isinstance(tensor, _Tensor) and not self._paused and not self._store.closed:
            self._record(op, COLLECTIVE, (tensor.dtype,), tensor.dtype, tensor.shape, None, context)


def _plain_key(key: tuple) -> tuple[str, int, str, str, str, tuple[str, ...], str, str]:
    """(site, op, kind, input dtypes, output dtype, context) -> SiteSummary's first eight fields."""
    (file, line, function), op, kind, ins, out, context = key
    return file, line, function, op, kind, tuple(dtype_name(d) for d in ins), dtype_name(out), context


def audit(**options: Any) -> Audit:
    """An `Audit` context manager (same keyword options)."""
    return Audit(**options)
