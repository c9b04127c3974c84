"""The rendezvous: the ranks of a job as threads of one process, meeting at collectives.

One `Rendezvous` serves both front ends: `simdist.world.simworld.SimComm`
(rank programs written against `Comm`) and the ``torch.distributed`` backend
of `simdist.world.backend.process_group` (unmodified code on `simdist.run`). Each front end
describes a collective as a `simdist.world.rendezvous.calls.Call` per rank and a
``complete(calls, targets)`` function; the rendezvous matches the calls and
runs ``complete`` once, on the last member to arrive, over the calls in
group-rank order with every member as a target. Results therefore depend only
on the inputs and the reduction, never on which thread arrived first.

Matching: the n-th call a rank makes on a group (identified by a key, by
default the group itself) is matched with the n-th call of every other member.
Each arriving call is checked against the first arrival's ``signature`` (op,
shape, dtype, reduce op, ...). Point-to-point messages go through channels
keyed by (group, source, destination, tag), first in first out.

Failure is loud and quick:

* a mismatch raises `CollectiveMismatchError` listing every member's call and
  source line;
* an exception on one rank wakes every waiting rank, and `Rendezvous.run`
  re-raises the original exception with a note naming the rank;
* a rank that returns while a peer waits for it, or a state where every live
  rank waits (collective or receive), raises `CollectiveDeadlockError` naming
  each waiting rank's call;
* an error raised by ``complete`` (e.g. a reduction refusing AVG on
  integers) is raised by every member from its own call, like a real backend;
* an optional ``timeout_s`` turns a rank stuck outside collectives into
  `SimTimeoutError`.

Scheduling: completed ranks are woken one at a time, each when the running rank
blocks or returns, so only one rank thread is runnable at a time (a handoff is
one wake-up, posted after the rendezvous' lock is released, on the rank's own
semaphore of `simdist.world.rendezvous.baton`; the last member to arrive completes the
collective and runs on without sleeping). With a ``switch`` (see
`Rendezvous.__init__`) the ranks also start one after another, so exactly one
rank runs from start to end, and ``switch.suspend(rank)``/``switch.resume(rank)``
run at every handoff (`simdist.world.threads.isolation` swaps per-rank copies of
process-global state there). Rank threads disable autograd's per-device worker
threads, so a collective called from a backward hook runs on the rank's own
thread.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from simdist.world.errors import CollectiveDeadlockError, CollectiveMismatchError, SimTimeoutError
from simdist.world.rendezvous.baton import Batons
from simdist.world.rendezvous.calls import Call, where_ranks_are
from simdist.world.rendezvous.waits import PendingCollective, PostedRecv, SentMessage


class Aborted(BaseException):
    """Unwinds a rank thread after another rank failed (not an `Exception`, so user code cannot swallow it)."""


def _fresh(exc: BaseException) -> BaseException:
    """A new exception of the same type and arguments, to raise on another rank's thread."""
    try:
        copy = type(exc)(*exc.args)
    except Exception:
        copy = RuntimeError(f"{type(exc).__name__}: {exc}")
    copy.__cause__ = exc
    return copy


class Rendezvous:
    """Shared state of one run of ``world_size`` rank threads: pending collectives, channels, the first error."""

    def __init__(self, world_size: int, label: str = "simdist", switch: Any = None) -> None:
        self.world_size = world_size
        self.label = label
        self.switch = switch  # suspend(rank)/resume(rank) at every handoff; ranks start one at a time
        self.lock = threading.Lock()
        self.batons = Batons(world_size)  # each rank sleeps on its own semaphore: one wake-up per handoff
        self.keys: dict[Hashable, int] = {}  # a group's call-sequence key -> its number (`intern`)
        self.sequence: list[dict[Hashable, int]] = [{} for _ in range(world_size)]  # per rank: key -> calls made
        self.pending: dict[tuple[Hashable, int], PendingCollective] = {}
        self.waiting: dict[int, PendingCollective | PostedRecv | SentMessage] = {}
        self.channels: dict[Hashable, deque] = {}
        self.any_recvs: dict[Hashable, deque[PostedRecv]] = {}  # posted any-source receives, per (group, dst, tag)
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
            if isinstance(wait, SentMessage) and wait.dst in self.finished:
                self.fail(
                    CollectiveDeadlockError(f"rank {wait.dst} returned without receiving:\n  {wait.waiting_line(rank)}")
                )
                return
            if isinstance(wait, PostedRecv) and wait.src in self.finished:
                self.fail(
                    CollectiveDeadlockError(f"rank {wait.src} returned without sending:\n  {wait.waiting_line(rank)}")
                )
                return

    def block(self, rank: int, wait: PendingCollective | PostedRecv | SentMessage) -> None:
        """Park ``rank`` on ``wait`` (lock held on entry, released on return); raise `Aborted` on failure."""
        waiting = self.waiting
        waiting[rank] = wait
        if self.finished or len(waiting) == self.world_size:  # `check_progress`'s cases (most blocks have neither)
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

    def intern(self, key: Hashable) -> int:
        """A small number standing for ``key`` in this rendezvous (the same for equal keys): a front end passes it
        as `collective`'s ``key``, so the per-call tables hash an int, not a nested tuple."""
        with self.lock:
            return self.keys.setdefault(key, len(self.keys))

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
            sequence = self.sequence[rank]
            seq = sequence.get(key, 0)
            sequence[key] = seq + 1
            pkey = (key, seq)
            pending = self.pending.get(pkey)
            if pending is None:
                pending = self.pending[pkey] = PendingCollective(members, call.signature)
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
                waiting, ready = self.waiting, self.ready
                for member in members:  # `release` of each other member, inline: this runs on every collective
                    if member != rank:
                        del waiting[member]
                        ready.append(member)
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
    ) -> SentMessage:
        """Deliver a copy of ``tensor`` on ``channel`` (to a posted receive, or queued); never blocks.

        A receive posted on ``channel`` itself takes it first, else the earliest any-source receive posted
        under ``any_key`` (the channel without its source). ``channel[2]`` is the source as the receiver sees
        it (its group rank). Returns the message's `SentMessage`: `wait_send` on it blocks until a receive (of
        global rank ``dst``) has taken the message.
        """
        sent = SentMessage(call, dst)
        with self.lock:
            if self.error is not None:
                raise Aborted
            queue = self.channels.setdefault(channel, deque())
            anyone = self.any_recvs.get(any_key) if any_key is not None else None
            if queue and isinstance(queue[0], PostedRecv):
                self._take(queue.popleft(), tensor, call, sent, channel)
            elif anyone:
                self._take(anyone.popleft(), tensor, call, sent, channel)
            else:
                self.sent_count += 1
                queue.append((call, tensor.detach().clone(), sent, self.sent_count))
        return sent

    def _take(self, recv: PostedRecv, data: torch.Tensor, call: Call, sent: SentMessage, channel: Any) -> None:
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

    def wait_send(self, sent: SentMessage) -> None:
        """Block until a receive has taken ``sent`` (gloo's blocking send)."""
        self._wait_done(sent)

    def post_recv(self, call: Call, channel: Hashable, src: int, tensor: torch.Tensor) -> PostedRecv:
        """Post a receive into ``tensor``; it completes at once if a message is queued."""
        recv = PostedRecv(call, src, tensor)
        with self.lock:
            if self.error is not None:
                raise Aborted
            queue = self.channels.setdefault(channel, deque())
            if queue and not isinstance(queue[0], PostedRecv):
                sent, data, handle, _ = queue.popleft()
                self._take(recv, data, sent, handle, channel)
            else:
                queue.append(recv)
        return recv

    def post_recv_any(
        self, call: Call, channels: Sequence[Hashable], any_key: Hashable, tensor: torch.Tensor
    ) -> PostedRecv:
        """Post a receive from any source: it takes the earliest sent message queued on ``channels`` (one per
        possible source), else the first message later sent to it (`send` with ``any_key``).

        Deterministic: rank threads run one at a time in a fixed schedule, so "earliest sent" is a fact of
        the program, not of a race (on gloo it is whichever message arrives first)."""
        recv = PostedRecv(call, None, tensor)
        with self.lock:
            if self.error is not None:
                raise Aborted
            queued = [
                (q[0][3], channel)
                for channel in channels
                if (q := self.channels.get(channel)) and not isinstance(q[0], PostedRecv)
            ]
            if queued:
                channel = min(queued, key=lambda item: item[0])[1]
                sent, data, handle, _ = self.channels[channel].popleft()
                self._take(recv, data, sent, handle, channel)
            else:
                self.any_recvs.setdefault(any_key, deque()).append(recv)
        return recv

    def wait_recv(self, recv: PostedRecv) -> None:
        """Block until ``recv`` is filled."""
        self._wait_done(recv)

    def _wait_done(self, item: SentMessage | PostedRecv) -> None:
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

    def deliver(self, recv: PostedRecv, data: torch.Tensor, sent: Call) -> None:
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

        if self.switch is not None:  # rank 0 runs first; the others are woken one by one as ranks block or return
            self.ready.extend(range(1, self.world_size))

        threads = [
            threading.Thread(
                target=self._rank_thread,
                args=(rank, body, results, cpu, intra_op_threads),
                name=f"{name}-{rank}",
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for t in threads:
            t.start()
        self._wait_for(threads, timeout_s)
        if intra_op_threads is not None:
            torch.set_num_threads(caller_threads)  # torch's setting is process-wide: give the caller its own back
        if self.error is not None:
            raise self.error
        return results

    def _rank_thread(
        self, rank: int, body: Callable[[int], Any], results: list[Any], cpu: int | None, intra_op_threads: int | None
    ) -> None:
        """One rank thread of `run`: wait for its turn (serial runs), set its CPU and torch's threads, run
        ``body(rank)`` into ``results[rank]`` and report how it finished."""
        error: BaseException | None = None
        if self.switch is not None:
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

    def _wait_for(self, threads: list[threading.Thread], timeout_s: float | None) -> None:
        """Wait until every rank finished or ``timeout_s`` passed (then fail the run naming where the ranks are),
        join the threads, and close the batons when none is left running."""
        if not self.done.wait(timeout_s):
            with self.lock:
                self.fail(SimTimeoutError(where_ranks_are(threads, timeout_s)))
            self.done.wait(1.0)
        for t in threads:
            t.join(timeout=1.0)
        if not any(t.is_alive() for t in threads):
            self.batons.close()  # a rank thread still running keeps them (closed when the rendezvous is collected)


def add_rank_note(exc: BaseException, rank: int, label: str = "simdist") -> None:
    """Note on ``exc`` which rank of a simulated run raised it (once)."""
    note = f"raised on rank {rank} of a {label} run"
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
