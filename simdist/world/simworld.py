"""SimWorld: the ranks of a job as threads of one process, with modelled collectives.

`SimWorld.run(fn, *args)` starts one thread per rank, calls ``fn(comm, *args)``
on each with a `SimComm`, and returns the per-rank results in rank order.

How a collective works: the n-th call a rank makes on a group is matched with
the n-th call of every other member of that group. Each arriving call is
checked against the first arrival (op, shape, dtype, device, reduce op, ...);
the last member to arrive stacks the members' tensors in group-rank order,
applies the group's `ReductionModel`, writes every member's output, and wakes
the others. The result therefore depends only on the inputs and the model,
never on which thread arrived first.

Failure is loud and quick:

* a mismatch raises `CollectiveMismatchError` listing every member's call and
  source line;
* an exception on one rank wakes every waiting rank, and `run` re-raises the
  original exception with a note naming the rank;
* a rank that returns while a peer waits for it, or a set of calls that can
  never complete (every live rank waiting), raises `CollectiveDeadlockError`;
* an optional ``timeout_s`` turns a rank stuck outside collectives into
  `SimTimeoutError`.

Rank threads disable autograd's per-device worker threads
(``torch.autograd.set_multithreading_enabled(False)``), so a collective called
from a backward hook runs on the rank's own thread and cannot deadlock a GPU
backward.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from simdist.reduce import ReduceOp, ReductionModel, Sequential
from simdist.world.errors import CollectiveDeadlockError, CollectiveMismatchError, SimTimeoutError
from simdist.world.groups import Group, group_for, world_group
from simdist.world.spec import ParallelSpec

_THIS_FILE = os.path.abspath(__file__)


class _Aborted(BaseException):
    """Unwinds a rank thread after another rank failed (not an `Exception`, so user code cannot swallow it)."""


class _Call:
    """One rank's side of a collective.

    ``signature`` is a tuple of raw values (op name, group, then details such
    as reduce op, shape, dtype, device) that every member must agree on; it is
    formatted only when an error needs it, to keep the hot path cheap.
    """

    __slots__ = ("extra", "frame", "inputs", "outputs", "rank", "signature")

    def __init__(self, rank: int, signature: tuple, frame: Any, inputs: tuple = (), outputs: tuple = (), extra=None):
        self.rank = rank
        self.signature = signature
        self.frame = frame  # the caller's frame, formatted only if an error needs it
        self.inputs = inputs
        self.outputs = outputs
        self.extra = extra

    def describe(self) -> str:
        op, group, *details = self.signature
        shown = ", ".join(_show(d) for d in details)
        return f"rank {self.rank}: {op}(group={group}, {shown}) at {_site(self.frame)}"


def _show(detail: object) -> str:
    if isinstance(detail, ReduceOp):
        return f"op={detail.name}"
    if isinstance(detail, torch.Size):
        return f"shape={tuple(detail)}"
    if isinstance(detail, torch.dtype):
        return f"dtype={str(detail).removeprefix('torch.')}"
    if isinstance(detail, torch.device):
        return f"device={detail}"
    return str(detail)


@dataclass
class _Pending:
    """A collective some members of a group have entered."""

    group: Group
    calls: dict[int, _Call] = field(default_factory=dict)


def _site(frame) -> str:
    """``file:line in function`` of the first frame outside this module."""
    while frame is not None and os.path.abspath(frame.f_code.co_filename) == _THIS_FILE:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class _Run:
    """Shared state of one `SimWorld.run`: pending collectives, waiting ranks, the first error."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world
        self.lock = threading.Lock()
        n = world.spec.world_size
        self.wake = [threading.Lock() for _ in range(n)]
        for w in self.wake:
            w.acquire()
        self.sequence: dict[tuple[int, tuple[int, ...]], int] = {}
        self.pending: dict[tuple[tuple[int, ...], int], _Pending] = {}
        self.waiting: dict[int, _Pending] = {}
        self.ready: deque[int] = deque()
        self.finished: set[int] = set()
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.running = n

    # -- error handling (call with self.lock held) ---------------------------

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        while self.ready:
            self.pass_baton()
        for rank in list(self.waiting):
            del self.waiting[rank]
            self.wake[rank].release()

    def check_progress(self) -> None:
        """Fail if a pending collective waits on a finished rank or every live rank waits."""
        for pending in self.pending.values():
            gone = [r for r in pending.group.ranks if r in self.finished and r not in pending.calls]
            if gone:
                calls = "\n  ".join(c.describe() for c in pending.calls.values())
                self.fail(
                    CollectiveDeadlockError(
                        f"rank(s) {gone} returned while {pending.group} waits for them:\n  {calls}"
                    )
                )
                return
        if self.waiting and len(self.waiting) + len(self.finished) == self.world.spec.world_size:
            lines = []
            for rank in sorted(self.waiting):
                pending = self.waiting[rank]
                missing = [r for r in pending.group.ranks if r not in pending.calls]
                lines.append(f"{pending.calls[rank].describe()}  [waiting for ranks {missing}]")
            self.fail(CollectiveDeadlockError("no collective can complete:\n  " + "\n  ".join(lines)))

    # -- the collective rendezvous -------------------------------------------

    def collective(self, call: _Call, group: Group, complete: Callable[[list[_Call]], None]) -> None:
        """Enter a collective; the last member runs ``complete`` on the calls in group order."""
        rank = call.rank
        with self.lock:
            if self.error is not None:
                raise _Aborted
            seq_key = (rank, group.ranks)
            seq = self.sequence.get(seq_key, 0)
            self.sequence[seq_key] = seq + 1
            key = (group.ranks, seq)
            pending = self.pending.get(key)
            if pending is None:
                pending = self.pending[key] = _Pending(group)
            elif call.signature != next(iter(pending.calls.values())).signature:
                pending.calls[rank] = call
                lines = "\n  ".join(pending.calls[r].describe() for r in sorted(pending.calls))
                missing = [r for r in group.ranks if r not in pending.calls]
                tail = f"\n  (not yet arrived: ranks {missing})" if missing else ""
                self.fail(CollectiveMismatchError(f"collective #{seq} on {group} does not match:\n  {lines}{tail}"))
                raise _Aborted
            pending.calls[rank] = call
            if len(pending.calls) == group.size:
                del self.pending[key]
                try:
                    complete([pending.calls[r] for r in group.ranks])
                except BaseException as exc:
                    _add_rank_note(exc, rank)
                    self.fail(exc)  # also wakes the members waiting on this collective
                    raise _Aborted from exc
                for member in group.ranks:
                    if member != rank:
                        del self.waiting[member]
                        self.ready.append(member)
                return
            self.waiting[rank] = pending
            self.check_progress()
            self.pass_baton()
        self.wake[rank].acquire()
        if self.error is not None:
            raise _Aborted

    def pass_baton(self) -> None:
        """Wake one rank whose collective completed (call with the lock held, just before blocking).

        Completed ranks are not woken at completion but one at a time, each
        when the running rank blocks or returns: only one rank thread is ever
        runnable, so a handoff is a single wake-up with no contention for the
        interpreter lock.
        """
        if self.ready:
            self.wake[self.ready.popleft()].release()

    def rank_finished(self, rank: int, error: BaseException | None) -> None:
        with self.lock:
            self.pass_baton()
            self.finished.add(rank)
            if error is not None:
                _add_rank_note(error, rank)
                self.fail(error)
            elif self.error is None:
                self.check_progress()
            self.running -= 1
            if self.running == 0:
                self.done.set()


def _add_rank_note(exc: BaseException, rank: int) -> None:
    note = f"raised on rank {rank} of a SimWorld run"
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


class SimComm:
    """One rank's communicator in a `SimWorld` run (implements `simdist.world.groups.Comm`)."""

    def __init__(self, run: _Run, rank: int) -> None:
        self._run = run
        self._rank = rank
        self.spec: ParallelSpec = run.world.spec
        self._world = world_group(self.spec)
        self._groups: dict[str, Group] = {}

    # -- identity ------------------------------------------------------------

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self, group: Group | None = None) -> int:
        return self.spec.world_size if group is None else group.size

    def group(self, kind: str) -> Group:
        """The group of ``kind`` (``tp``, ``dp``, ``ep``, ``etp``, ``edp``, ``pp`` or ``world``) holding this rank."""
        found = self._groups.get(kind)
        if found is None:
            found = self._groups[kind] = group_for(self.spec, kind, self._rank)
        return found

    def _resolve(self, group: Group | None) -> Group:
        if group is None:
            return self._world
        if self._rank not in group.ranks:
            raise ValueError(f"rank {self._rank} called a collective on {group}, which it is not a member of")
        return group

    def _model(self, group: Group) -> ReductionModel:
        return self._run.world.model_for(group.kind)

    # -- collectives ---------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None) -> None:
        """Reduce ``tensor`` across ``group`` in place with the group's reduction model."""
        group, op = self._resolve(group), ReduceOp.coerce(op)
        model = self._model(group)

        def complete(calls: list[_Call]) -> None:
            result = model.reduce([c.inputs[0] for c in calls], op)
            for c in calls:
                c.inputs[0].copy_(result)

        sig = ("all_reduce", group, op, tensor.shape, tensor.dtype, tensor.device)
        self._run.collective(_Call(self._rank, sig, sys._getframe(1), (tensor,)), group, complete)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None
    ) -> None:
        """Reduce ``input`` across ``group``; group rank ``i`` receives block ``i`` of the flat result."""
        group, op = self._resolve(group), ReduceOp.coerce(op)
        if input.numel() != output.numel() * group.size or input.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter_tensor on {group}: input has {input.numel()} {input.dtype} elements, "
                f"output {output.numel()} {output.dtype}; need input numel = {group.size} x output numel, same dtype"
            )
        model = self._model(group)

        def complete(calls: list[_Call]) -> None:
            blocks = model.reduce_scatter([c.inputs[0].reshape(-1) for c in calls], op)
            for i, c in enumerate(calls):
                c.outputs[0].copy_(blocks[i].view(c.outputs[0].shape))

        sig = ("reduce_scatter_tensor", group, op, input.shape, input.dtype, input.device)
        self._run.collective(_Call(self._rank, sig, sys._getframe(1), (input,), (output,)), group, complete)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group | None = None) -> None:
        """Concatenate every member's ``input`` (flat, in group-rank order) into ``output``."""
        group = self._resolve(group)
        if output.numel() != input.numel() * group.size or input.dtype != output.dtype:
            raise ValueError(
                f"all_gather_into_tensor on {group}: input has {input.numel()} {input.dtype} elements, "
                f"output {output.numel()} {output.dtype}; need output numel = {group.size} x input numel, same dtype"
            )

        def complete(calls: list[_Call]) -> None:
            gathered = torch.cat([c.inputs[0].reshape(-1) for c in calls])
            for c in calls:
                c.outputs[0].copy_(gathered.view(c.outputs[0].shape))

        sig = ("all_gather_into_tensor", group, input.shape, input.dtype, input.device)
        self._run.collective(_Call(self._rank, sig, sys._getframe(1), (input,), (output,)), group, complete)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Group | None = None,
    ) -> None:
        """Exchange dim-0 slices: this rank's ``input`` slice ``j`` goes to group rank ``j``.

        Without split sizes dim 0 is cut evenly. Split sizes may be uneven; each
        member's input split for ``j`` must equal ``j``'s output split for it.
        """
        group = self._resolve(group)
        n = group.size
        in_splits = _splits(input, input_split_sizes, n, "input")
        out_splits = _splits(output, output_split_sizes, n, "output")
        trailing = tuple(input.shape[1:])
        if tuple(output.shape[1:]) != trailing or output.dtype != input.dtype:
            raise ValueError(
                f"all_to_all_single on {group}: output {tuple(output.shape)} {output.dtype} and input "
                f"{tuple(input.shape)} {input.dtype} must share dtype and trailing dims"
            )

        def complete(calls: list[_Call]) -> None:
            sent = [c.extra[0] for c in calls]
            received = [c.extra[1] for c in calls]
            wrong = [
                f"rank {calls[j].rank} sends {sent[j][i]} rows to rank {calls[i].rank}, which expects {received[i][j]}"
                for i in range(n)
                for j in range(n)
                if sent[j][i] != received[i][j]
            ]
            if wrong:
                raise CollectiveMismatchError(
                    f"all_to_all_single on {group}: split sizes do not match:\n  "
                    + "\n  ".join(wrong)
                    + "\n  calls:\n  "
                    + "\n  ".join(c.describe() for c in calls)
                )
            pieces = [c.inputs[0].split(c.extra[0]) for c in calls]
            for i, c in enumerate(calls):
                if c.outputs[0].numel():
                    torch.cat([pieces[j][i] for j in range(n)], out=c.outputs[0])

        sig = ("all_to_all_single", group, input.dtype, f"trailing dims={trailing}", input.device)
        call = _Call(self._rank, sig, sys._getframe(1), (input,), (output,), (in_splits, out_splits))
        self._run.collective(call, group, complete)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group | None = None) -> None:
        """Copy global rank ``src``'s ``tensor`` into every member's ``tensor``."""
        group = self._resolve(group)
        source = group.rank_of(src)

        def complete(calls: list[_Call]) -> None:
            value = calls[source].inputs[0]
            for i, c in enumerate(calls):
                if i != source:
                    c.inputs[0].copy_(value)

        sig = ("broadcast", group, f"src={src}", tensor.shape, tensor.dtype, tensor.device)
        self._run.collective(_Call(self._rank, sig, sys._getframe(1), (tensor,)), group, complete)

    def barrier(self, group: Group | None = None) -> None:
        """Wait until every member of ``group`` has arrived."""
        group = self._resolve(group)
        self._run.collective(_Call(self._rank, ("barrier", group), sys._getframe(1)), group, lambda calls: None)


def _splits(t: torch.Tensor, sizes: list[int] | None, n: int, what: str) -> tuple[int, ...]:
    rows = t.shape[0] if t.dim() else 1
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise ValueError(f"all_to_all_single: {what} dim 0 ({rows}) is not divisible by the group size {n}")
        return (rows // n,) * n
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(
            f"all_to_all_single: {what}_split_sizes {list(sizes)} must be {n} sizes >= 0 summing to {rows}"
        )
    return sizes


class SimWorld:
    """Runs a rank function on every rank of ``spec``, one thread per rank, in this process.

    ``models`` maps a group kind (``tp``, ``dp``, ``ep``, ``etp``, ``edp``,
    ``pp``, ``world``) to the `ReductionModel` its collectives use; kinds not
    named use ``default_model`` (a rank-order fold).

    ``one_cpu`` (default on) pins the rank threads to one CPU. Ranks run in
    lockstep at every collective, so each collective hands the interpreter
    from thread to thread; on one CPU a handoff is a plain context switch
    (about 6 us on the 2-vCPU CI machine) instead of a cross-CPU wake-up
    (about 30 us there). Turn it off for rank programs whose local compute is
    large enough to profit from intra-op threads on several CPUs.

    ``timeout_s`` bounds a whole run; a rank still busy then is reported with
    its current source line (collective deadlocks are detected without it).
    """

    def __init__(
        self,
        spec: ParallelSpec,
        models: Mapping[str, ReductionModel] | None = None,
        default_model: ReductionModel | None = None,
        timeout_s: float | None = None,
        one_cpu: bool = True,
        intra_op_threads: int | None = 1,
    ) -> None:
        self.spec = spec
        self.models = dict(models or {})
        self.default_model = default_model or Sequential()
        self.timeout_s = timeout_s
        self.one_cpu = one_cpu and hasattr(os, "sched_setaffinity")
        self.intra_op_threads = intra_op_threads

    def model_for(self, kind: str) -> ReductionModel:
        """The reduction model used by groups of ``kind``."""
        return self.models.get(kind, self.default_model)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(comm, *args, **kwargs)`` on every rank; return the results in rank order."""
        run = _Run(self)
        results: list[Any] = [None] * self.spec.world_size
        cpu = min(os.sched_getaffinity(0)) if self.one_cpu else None
        caller_threads = torch.get_num_threads()

        def body(rank: int) -> None:
            error: BaseException | None = None
            try:
                if cpu is not None:
                    os.sched_setaffinity(0, {cpu})
                if self.intra_op_threads is not None:
                    torch.set_num_threads(self.intra_op_threads)
                with torch.autograd.set_multithreading_enabled(False):
                    results[rank] = fn(SimComm(run, rank), *args, **kwargs)
            except _Aborted:
                pass
            except BaseException as exc:
                error = exc
            run.rank_finished(rank, error)

        threads = [
            threading.Thread(target=body, args=(rank,), name=f"simdist-rank-{rank}", daemon=True)
            for rank in range(self.spec.world_size)
        ]
        for t in threads:
            t.start()
        if not run.done.wait(self.timeout_s):
            with run.lock:
                run.fail(SimTimeoutError(_where_ranks_are(threads, self.timeout_s)))
            run.done.wait(1.0)
        for t in threads:
            t.join(timeout=1.0)
        if self.intra_op_threads is not None:
            torch.set_num_threads(caller_threads)  # torch's setting is process-wide: give the caller its own back
        if run.error is not None:
            raise run.error
        return results


def _where_ranks_are(threads: list[threading.Thread], timeout_s: float | None) -> str:
    frames = sys._current_frames()
    lines = [f"the run did not finish within {timeout_s} s; ranks still running:"]
    for rank, t in enumerate(threads):
        frame = frames.get(t.ident) if t.is_alive() else None
        if frame is not None:
            where = traceback.format_stack(frame, limit=1)[0].strip().splitlines()[0]
            lines.append(f"  rank {rank}: {where}")
    return "\n".join(lines)
