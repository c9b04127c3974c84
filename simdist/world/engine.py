"""The rendezvous engine: the ranks of a job as threads of one process, meeting at collectives.

One engine serves both front ends: `simdist.world.simworld.SimComm` (rank
programs written against `Comm`) and the ``torch.distributed`` backend of
`simdist.world.backend` (unmodified code on `simdist.spawn`). Each front end
describes a collective as a `Call` per rank and a ``complete`` function; the
engine matches the calls and runs ``complete`` once, on the last member to
arrive, over the calls in group-rank order. Results therefore depend only on
the inputs and the reduction model, never on which thread arrived first.

Matching: the n-th call a rank makes on a group (identified by a key, by
default the group itself) is matched with the n-th call of every other member.
Each arriving call is checked against the first arrival's ``signature`` (op,
shape, dtype, reduce op, ...). Point-to-point messages go through channels
keyed by (group, source, destination, tag), first in first out.

Failure is loud and quick:

* a mismatch raises `CollectiveMismatchError` listing every member's call and
  source line;
* an exception on one rank wakes every waiting rank, and `Engine.run`
  re-raises the original exception with a note naming the rank;
* a rank that returns while a peer waits for it, or a state where every live
  rank waits (collective or receive), raises `CollectiveDeadlockError` naming
  each waiting rank's call;
* an error raised by ``complete`` (e.g. a reduction model refusing AVG on
  integers) is raised by every member from its own call, like a real backend;
* an optional ``timeout_s`` turns a rank stuck outside collectives into
  `SimTimeoutError`.

Observers: `Engine.observers` is an explicit list of callables that see every
collective of both front ends (`observed`, called by each front end's one
funnel, in thread and process mode alike). The audit and blame subscribe to it
(`Engine.subscribe`); nothing swaps methods at run time.

Scheduling: completed ranks are woken one at a time, each when the running rank
blocks or returns, so only one rank thread is runnable at a time (a handoff is
one wake-up, posted after the engine's lock is released, on the rank's own
semaphore of `simdist.world.baton`; the last member to arrive completes the
collective and runs on without sleeping). With a ``switch`` (see
`Engine.__init__`) the ranks also start one after another, so exactly one rank
runs from start to end, and ``switch.suspend(rank)``/``switch.resume(rank)``
run at every handoff (`simdist.world.isolation` swaps per-rank copies of
process-global state there). Rank threads disable
autograd's per-device worker threads, so a collective called from a backward
hook runs on the rank's own thread.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import torch

from simdist.world.baton import Batons
from simdist.world.errors import CollectiveDeadlockError, CollectiveMismatchError, SimTimeoutError

_WORLD_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _wrapper_files() -> tuple[str, ...]:
    """Modules whose decorators wrap torch's functions (``typing_extensions.deprecated``, whose ``wrapper`` frame
    sits between a user's ``dist.all_reduce_coalesced`` call and torch; ``warnings.deprecated`` from Python 3.13):
    their frames are no call site either."""
    import warnings

    files = [warnings.__file__]
    try:
        import typing_extensions

        files.append(typing_extensions.__file__)
    except ImportError:
        pass
    return tuple(os.path.abspath(f) for f in files if f)


WRAPPER_FILES = _wrapper_files()
"""The wrapper modules' files (`is_internal`; the audit skips them too: one call-site rule)."""
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))


class Aborted(BaseException):
    """Unwinds a rank thread after another rank failed (not an `Exception`, so user code cannot swallow it)."""


def is_internal(filename: str) -> bool:
    """Frames of simdist's world layer, of torch and of the wrappers torch's functions are decorated with
    (`WRAPPER_FILES`) are not call sites a user wants to see."""
    path = os.path.abspath(filename)
    return (
        path.startswith(_WORLD_DIR)
        or path.startswith(_TORCH_DIR)
        or path in WRAPPER_FILES
        or filename.startswith("<frozen")
    )


def site(frame) -> str:
    """``file:line in function`` of the first frame outside simdist's world layer and torch."""
    first = frame
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    frame = frame or first
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def show(detail: object) -> str:
    """One detail of a call signature as text (``op=SUM``, ``shape=(4,)``, ``dtype=float32``)."""
    name = type(detail).__name__
    if name == "ReduceOp" and hasattr(detail, "name"):
        return f"op={detail.name}"
    if isinstance(detail, torch.Size):
        return f"shape={tuple(detail)}"
    if isinstance(detail, torch.dtype):
        return f"dtype={str(detail).removeprefix('torch.')}"
    if isinstance(detail, torch.device):
        return f"device={detail}"
    return str(detail)


class Call:
    """One rank's side of a collective.

    ``signature`` is a tuple ``(op name, group, *details)`` that every member
    must agree on; it is formatted only when an error needs it. ``frame`` is the
    caller's frame (or an already formatted site string), ``inputs``/``outputs``
    the rank's tensors, ``extra`` anything rank-specific (split sizes, ...).
    """

    __slots__ = ("extra", "frame", "inputs", "outputs", "rank", "signature")

    def __init__(self, rank: int, signature: tuple, frame: Any, inputs: tuple = (), outputs: tuple = (), extra=None):
        self.rank = rank
        self.signature = signature
        self.frame = frame
        self.inputs = inputs
        self.outputs = outputs
        self.extra = extra

    @property
    def site(self) -> str:
        return self.frame if isinstance(self.frame, str) else site(self.frame)

    def describe(self) -> str:
        op, group, *details = self.signature
        shown = ", ".join(show(d) for d in details)
        return f"rank {self.rank}: {op}(group={group}{', ' if shown else ''}{shown}) at {self.site}"


class _Pending:
    """A collective some members of a group have entered."""

    __slots__ = ("calls", "error", "members", "signature")

    def __init__(self, members: tuple[int, ...], signature: tuple) -> None:
        self.members = members
        self.signature = signature  # the first arrival's: every later one must equal it
        self.calls: dict[int, Call] = {}
        self.error: BaseException | None = None

    def waiting_line(self, rank: int) -> str:
        missing = [r for r in self.members if r not in self.calls]
        return f"{self.calls[rank].describe()}  [waiting for ranks {missing}]"


class _Recv:
    """A posted receive: filled by a matching send, waited on by its rank.

    ``src`` is the global rank it receives from (``None``: any source); ``source`` the sender's channel key
    part (its group rank) once a message has filled it."""

    __slots__ = ("call", "done", "source", "src", "tensor")

    def __init__(self, call: Call, src: int | None, tensor: torch.Tensor) -> None:
        self.call = call
        self.src = src
        self.tensor = tensor
        self.done = False
        self.source: Hashable = None

    def waiting_line(self, rank: int) -> str:
        sender = "any rank" if self.src is None else f"rank {self.src}"
        return f"{self.call.describe()}  [waiting for a message from {sender}]"


class _Send:
    """A sent message: ``done`` once a receive took it. Waiting on it is gloo's blocking send, which returns
    only after the peer posted the matching receive (so sends received in another order deadlock, as on gloo)."""

    __slots__ = ("call", "done", "dst")

    def __init__(self, call: Call, dst: int) -> None:
        self.call = call
        self.dst = dst
        self.done = False

    def waiting_line(self, rank: int) -> str:
        return (
            f"{self.call.describe()}  [a blocking send: on gloo it returns only once rank {self.dst} posts the "
            "matching recv (same tag)]"
        )


def _fresh(exc: BaseException) -> BaseException:
    """A new exception of the same type and arguments, to raise on another rank's thread."""
    try:
        copy = type(exc)(*exc.args)
    except Exception:
        copy = RuntimeError(f"{type(exc).__name__}: {exc}")
    copy.__cause__ = exc
    return copy


class CollectiveEvent:
    """One rank's collective as an observer sees it, before it runs.

    ``call`` is the rank's `Call` (its ``signature[0]`` the collective's name),
    ``front`` the front end (``"comm"`` for `SimComm`, ``"dist"`` for the
    ``torch.distributed`` backend), ``group`` the group as text, and
    ``complete`` the function that will compute the collective's result: an
    observer may replace it with one that wraps it (blame measures there).
    """

    __slots__ = ("call", "complete", "front", "group")

    def __init__(self, call: Call, front: str, group: str, complete: Callable) -> None:
        self.call = call
        self.front = front
        self.group = group
        self.complete = complete


Observer = Callable[[CollectiveEvent], Callable[[], None] | None]
"""Called on the calling rank's thread before the collective runs; may return a function called after it returns
(or raises)."""


def observed(
    call: Call, complete: Callable, front: str, group: Callable[[], str], proceed: Callable[[Callable], None]
) -> None:
    """Run ``proceed(complete)`` (the front end's rendezvous) with every subscribed observer told first.

    ``group`` is called only when there are observers (formatting text on every collective would cost).
    """
    observers = Engine.observers
    if not observers:
        proceed(complete)
        return
    event = CollectiveEvent(call, front, group(), complete)
    after: list[Callable[[], None]] = []
    try:
        for observer in list(observers):
            done = observer(event)
            if done is not None:
                after.append(done)
        proceed(event.complete)
    finally:
        for done in reversed(after):
            done()


class Engine:
    """Shared state of one run of ``world_size`` rank threads: pending collectives, channels, the first error."""

    observers: ClassVar[list[Observer]] = []
    """Who sees every collective of both front ends (see `observed`); shared by every engine of the process."""

    @classmethod
    def subscribe(cls, observer: Observer) -> None:
        """Add ``observer`` to `observers` (a new list: a collective in flight keeps iterating the old one)."""
        cls.observers = [*cls.observers, observer]

    @classmethod
    def unsubscribe(cls, observer: Observer) -> None:
        """Remove ``observer`` (once) from `observers`."""
        remaining = list(cls.observers)
        remaining.remove(observer)
        cls.observers = remaining

    def __init__(self, world_size: int, label: str = "simdist", switch: Any = None) -> None:
        self.world_size = world_size
        self.label = label
        self.switch = switch  # suspend(rank)/resume(rank) at every handoff; ranks start one at a time
        self.lock = threading.Lock()
        self.batons = Batons(world_size)  # each rank sleeps on its own semaphore: one wake-up per handoff
        self.sequence: dict[tuple[int, Hashable], int] = {}
        self.pending: dict[tuple[Hashable, int], _Pending] = {}
        self.waiting: dict[int, _Pending | _Recv | _Send] = {}
        self.channels: dict[Hashable, deque] = {}
        self.any_recvs: dict[Hashable, deque[_Recv]] = {}  # posted any-source receives, per (group, dst, tag)
        self.sent_count = 0  # numbers queued messages: an any-source receive takes the earliest sent
        self.ready: deque[int] = deque()
        self.finished: set[int] = set()
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.running = world_size

    # -- error handling (call with self.lock held) ---------------------------

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        while self.ready:
            self.pass_baton()
        for rank in list(self.waiting):
            del self.waiting[rank]
            self.batons.wake(rank)

    def check_progress(self) -> None:
        """Fail if a pending collective or receive waits on a finished rank, or every live rank waits."""
        if self.finished:  # (while no rank has returned only the last check can fail: O(1) on every block)
            self._check_finished()
        if self.error is None and self.waiting and len(self.waiting) + len(self.finished) == self.world_size:
            lines = [self.waiting[r].waiting_line(r) for r in sorted(self.waiting)]
            self.fail(CollectiveDeadlockError("no collective can complete:\n  " + "\n  ".join(lines)))

    def _check_finished(self) -> None:
        """Fail if a pending collective or a send or receive waits on a finished rank."""
        for pending in self.pending.values():
            gone = [r for r in pending.members if r in self.finished and r not in pending.calls]
            if gone:
                calls = "\n  ".join(c.describe() for c in pending.calls.values())
                group = next(iter(pending.calls.values())).signature[1]
                self.fail(CollectiveDeadlockError(f"rank(s) {gone} returned while {group} waits for them:\n  {calls}"))
                return
        for rank, wait in self.waiting.items():
            if isinstance(wait, _Send) and wait.dst in self.finished:
                self.fail(
                    CollectiveDeadlockError(f"rank {wait.dst} returned without receiving:\n  {wait.waiting_line(rank)}")
                )
                return
            if isinstance(wait, _Recv) and wait.src in self.finished:
                self.fail(
                    CollectiveDeadlockError(f"rank {wait.src} returned without sending:\n  {wait.waiting_line(rank)}")
                )
                return

    def block(self, rank: int, wait: _Pending | _Recv | _Send) -> None:
        """Park ``rank`` on ``wait`` (lock held on entry, released on return); raise `Aborted` on failure."""
        self.waiting[rank] = wait
        self.check_progress()
        if self.switch is not None and self.error is None:
            self.switch.suspend(rank)
        following = self.ready.popleft() if self.ready else None
        self.lock.release()
        if following is not None:  # woken after the lock is free: it never wakes only to wait for the lock
            self.batons.wake(following)
        self.batons.wait(rank)
        if self.error is not None:
            raise Aborted
        if self.switch is not None:
            self.switch.resume(rank)

    def pass_baton(self) -> None:
        """Wake one rank whose wait completed (lock held; `fail` wakes every ready rank with it, while `block` and
        `rank_finished` pop the next rank under the lock and wake it after releasing the lock)."""
        if self.ready:
            self.batons.wake(self.ready.popleft())

    def release(self, rank: int) -> None:
        """Mark a parked ``rank`` runnable (lock held)."""
        del self.waiting[rank]
        self.ready.append(rank)

    # -- collectives ----------------------------------------------------------

    def collective(
        self,
        call: Call,
        members: tuple[int, ...],
        complete: Callable[[list[Call], Sequence[int]], None],
        key: Hashable | None = None,
    ) -> None:
        """Enter a collective of the global ranks ``members``; the last to arrive runs ``complete(calls,
        targets)``: the calls in ``members`` order, and every member's position as a target (it writes each
        member's outputs).

        ``key`` identifies the group's call sequence (default: ``members``).
        """
        rank = call.rank
        key = members if key is None else key
        self.lock.acquire()
        try:
            if self.error is not None:
                raise Aborted
            seq_key = (rank, key)
            seq = self.sequence.get(seq_key, 0)
            self.sequence[seq_key] = seq + 1
            pkey = (key, seq)
            pending = self.pending.get(pkey)
            if pending is None:
                pending = self.pending[pkey] = _Pending(members, call.signature)
            elif call.signature != pending.signature:
                pending.calls[rank] = call
                lines = "\n  ".join(pending.calls[r].describe() for r in sorted(pending.calls))
                missing = [r for r in members if r not in pending.calls]
                tail = f"\n  (not yet arrived: ranks {missing})" if missing else ""
                group = call.signature[1]
                self.fail(CollectiveMismatchError(f"collective #{seq} on {group} does not match:\n  {lines}{tail}"))
                raise Aborted
            pending.calls[rank] = call
            if len(pending.calls) == len(members):
                del self.pending[pkey]
                try:
                    complete([pending.calls[r] for r in members], range(len(members)))
                except Exception as exc:
                    pending.error = exc
                except BaseException as exc:
                    add_rank_note(exc, rank, self.label)
                    self.fail(exc)
                    raise Aborted from exc
                for member in members:
                    if member != rank:
                        self.release(member)
                if pending.error is not None:
                    raise pending.error
                self.lock.release()
                return
        except BaseException:
            self.lock.release()
            raise
        self.block(rank, pending)
        if pending.error is not None:
            raise _fresh(pending.error)

    # -- point to point -------------------------------------------------------

    def send(
        self, call: Call, channel: Hashable, tensor: torch.Tensor, dst: int = -1, any_key: Hashable = None
    ) -> _Send:
        """Deliver a copy of ``tensor`` on ``channel`` (to a posted receive, or queued); never blocks.

        A receive posted on ``channel`` itself takes it first, else the earliest any-source receive posted
        under ``any_key`` (the channel without its source). ``channel[2]`` is the source as the receiver sees
        it (its group rank). Returns the message's `_Send`: `wait_send` on it blocks until a receive (of
        global rank ``dst``) has taken the message.
        """
        sent = _Send(call, dst)
        with self.lock:
            if self.error is not None:
                raise Aborted
            queue = self.channels.setdefault(channel, deque())
            anyone = self.any_recvs.get(any_key) if any_key is not None else None
            if queue and isinstance(queue[0], _Recv):
                self._take(queue.popleft(), tensor, call, sent, channel)
            elif anyone:
                self._take(anyone.popleft(), tensor, call, sent, channel)
            else:
                self.sent_count += 1
                queue.append((call, tensor.detach().clone(), sent, self.sent_count))
        return sent

    def _take(self, recv: _Recv, data: torch.Tensor, call: Call, sent: _Send, channel: Any) -> None:
        """``recv`` takes the message ``data`` of ``sent`` from ``channel`` (lock held); both are done."""
        self.deliver(recv, data, call)
        recv.done = sent.done = True
        recv.source = channel[2]
        receiver = recv.call.rank
        if self.waiting.get(receiver) is recv:
            self.release(receiver)
        sender = sent.call.rank
        if self.waiting.get(sender) is sent:
            self.release(sender)

    def wait_send(self, sent: _Send) -> None:
        """Block until a receive has taken ``sent`` (gloo's blocking send)."""
        self._wait_done(sent)

    def post_recv(self, call: Call, channel: Hashable, src: int, tensor: torch.Tensor) -> _Recv:
        """Post a receive into ``tensor``; it completes at once if a message is queued."""
        recv = _Recv(call, src, tensor)
        with self.lock:
            if self.error is not None:
                raise Aborted
            queue = self.channels.setdefault(channel, deque())
            if queue and not isinstance(queue[0], _Recv):
                sent, data, handle, _ = queue.popleft()
                self._take(recv, data, sent, handle, channel)
            else:
                queue.append(recv)
        return recv

    def post_recv_any(self, call: Call, channels: Sequence[Hashable], any_key: Hashable, tensor: torch.Tensor) -> _Recv:
        """Post a receive from any source: it takes the earliest sent message queued on ``channels`` (one per
        possible source), else the first message later sent to it (`send` with ``any_key``).

        Deterministic: rank threads run one at a time in a fixed schedule, so "earliest sent" is a fact of
        the program, not of a race (on gloo it is whichever message arrives first)."""
        recv = _Recv(call, None, tensor)
        with self.lock:
            if self.error is not None:
                raise Aborted
            queued = [
                (q[0][3], channel)
                for channel in channels
                if (q := self.channels.get(channel)) and not isinstance(q[0], _Recv)
            ]
            if queued:
                channel = min(queued, key=lambda item: item[0])[1]
                sent, data, handle, _ = self.channels[channel].popleft()
                self._take(recv, data, sent, handle, channel)
            else:
                self.any_recvs.setdefault(any_key, deque()).append(recv)
        return recv

    def wait_recv(self, recv: _Recv) -> None:
        """Block until ``recv`` is filled."""
        self._wait_done(recv)

    def _wait_done(self, item: _Send | _Recv) -> None:
        """Block ``item``'s rank until the matching peer marks it done (at once if it is already)."""
        self.lock.acquire()
        if item.done:
            self.lock.release()
            return
        try:
            if self.error is not None:
                raise Aborted
        except BaseException:
            self.lock.release()
            raise
        self.block(item.call.rank, item)

    def deliver(self, recv: _Recv, data: torch.Tensor, sent: Call) -> None:
        """Copy a message's bytes into a receive buffer (lock held), as gloo does: into the buffer's first bytes,
        whatever its dtype and shape (a larger buffer keeps the rest). A buffer smaller than the message
        (on gloo: the receiver crashes or hangs) fails the run naming both calls."""
        buffer = recv.tensor
        nbytes = data.numel() * data.element_size()
        if buffer.numel() * buffer.element_size() < nbytes:
            self.fail(
                CollectiveMismatchError(
                    f"message ({nbytes} bytes) does not fit the receive buffer "
                    f"({buffer.numel() * buffer.element_size()} bytes):\n  {sent.describe()}\n  "
                    f"{recv.call.describe()}"
                )
            )
            raise Aborted
        if buffer.shape == data.shape and buffer.dtype == data.dtype:
            buffer.copy_(data)
        elif nbytes:
            raw = data.contiguous().reshape(-1).view(torch.uint8)
            buffer.reshape(-1).view(torch.uint8)[:nbytes].copy_(raw)

    # -- ranks ----------------------------------------------------------------

    def rank_finished(self, rank: int, error: BaseException | None) -> None:
        with self.lock:
            if self.switch is not None and self.error is None:
                self.switch.suspend(rank)
            following = self.ready.popleft() if self.ready else None
            self.finished.add(rank)
            if error is not None:
                add_rank_note(error, rank, self.label)
                self.fail(error)
            elif self.error is None:
                self.check_progress()
            self.running -= 1
            if self.running == 0:
                self.done.set()
        if following is not None:
            self.batons.wake(following)

    def run(
        self,
        body: Callable[[int], Any],
        *,
        timeout_s: float | None = None,
        one_cpu: bool = True,
        intra_op_threads: int | None = 1,
        name: str = "simdist-rank",
    ) -> list[Any]:
        """Run ``body(rank)`` on one thread per rank; return the results in rank order or raise the first error.

        ``one_cpu`` pins the rank threads to one CPU (a handoff is then a plain
        context switch); ``intra_op_threads`` sets torch's intra-op threads for
        the run (restored for the caller afterwards).
        """
        results: list[Any] = [None] * self.world_size
        pin = one_cpu and hasattr(os, "sched_setaffinity")
        cpu = min(os.sched_getaffinity(0)) if pin else None
        caller_threads = torch.get_num_threads()

        serial = self.switch is not None
        if serial:  # rank 0 runs first; the others are woken one by one as ranks block or return
            self.ready.extend(range(1, self.world_size))

        def main(rank: int) -> None:
            error: BaseException | None = None
            if serial:
                if rank:
                    self.batons.wait(rank)
                if self.error is not None:
                    self.rank_finished(rank, None)
                    return
                self.switch.resume(rank)
            try:
                if cpu is not None:
                    os.sched_setaffinity(0, {cpu})
                if intra_op_threads is not None:
                    torch.set_num_threads(intra_op_threads)
                with torch.autograd.set_multithreading_enabled(False):
                    results[rank] = body(rank)
            except Aborted:
                pass
            except BaseException as exc:
                error = exc
            self.rank_finished(rank, error)

        threads = [
            threading.Thread(target=main, args=(rank,), name=f"{name}-{rank}", daemon=True)
            for rank in range(self.world_size)
        ]
        for t in threads:
            t.start()
        if not self.done.wait(timeout_s):
            with self.lock:
                self.fail(SimTimeoutError(_where_ranks_are(threads, timeout_s)))
            self.done.wait(1.0)
        for t in threads:
            t.join(timeout=1.0)
        if not any(t.is_alive() for t in threads):
            self.batons.close()  # a rank thread still running keeps them (closed when the engine is collected)
        if intra_op_threads is not None:
            torch.set_num_threads(caller_threads)  # torch's setting is process-wide: give the caller its own back
        if self.error is not None:
            raise self.error
        return results


def add_rank_note(exc: BaseException, rank: int, label: str = "simdist") -> None:
    """Note on ``exc`` which rank of a simulated run raised it (once)."""
    note = f"raised on rank {rank} of a {label} run"
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


def _where_ranks_are(threads: list[threading.Thread], timeout_s: float | None) -> str:
    frames = sys._current_frames()
    lines = [f"the run did not finish within {timeout_s} s; ranks still running:"]
    for rank, t in enumerate(threads):
        frame = frames.get(t.ident) if t.is_alive() and t.ident is not None else None
        if frame is not None:
            lines.append(f"  rank {rank}: {rank_whereabouts(frame)}")
    return "\n".join(lines)


def rank_whereabouts(frame) -> str:
    """Where a rank is stuck: its own code's innermost frame, and the frame it waits in when that is deeper.

    The innermost frame alone (``subprocess.py in communicate`` while a framework compiles an op) does not say
    which line of the rank's program started the wait; the outermost frames are the launcher's. The rank's own
    line is the innermost frame outside torch, simdist's world layer, the standard library and installed
    packages (`site` when every frame is one of those)."""
    chain = traceback.extract_stack(frame)
    innermost = chain[-1]
    own = next((f for f in reversed(chain) if not _is_library(f.filename)), None)
    if own is None:
        return site(frame)
    text = f"{own.filename}:{own.lineno} in {own.name}"
    if own is not innermost:
        text += f", waiting in {innermost.filename}:{innermost.lineno} in {innermost.name}"
    return text


def _is_library(filename: str) -> bool:
    """torch, simdist's world layer, the standard library and installed packages: not a rank's own code."""
    if is_internal(filename):
        return True
    path = os.path.abspath(filename)
    return "site-packages" in path.split(os.sep) or path.startswith(_STDLIB_DIR)
