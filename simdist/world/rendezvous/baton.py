"""How a rank thread sleeps until the rendezvous hands it the baton, and how it is woken: one semaphore per rank.

The rendezvous (`simdist.world.rendezvous.meeting.Rendezvous`) runs one rank thread at
a time: the running rank wakes the next and goes to sleep. That wake-up is
most of a collective's cost on rank threads, so it uses the cheapest primitive
found by experiment (tests/unit/world/rendezvous/test_baton.py checks the semantics; bench/collectives.py
prints the cost): a Linux ``eventfd`` in semaphore mode per rank. Its write and
read release the interpreter lock *around* the system call, so the woken thread
finds the interpreter lock free. A ``threading.Lock`` releases the sleeper while
the waker still holds the interpreter lock: the woken thread then wakes a second
time for the interpreter lock, and a ring of four rank threads takes about twice
as long per handoff (about 10 us against 5.5 us a handoff on the 2-vCPU machine,
one run, load about 2).

Where ``os.eventfd`` is missing (not Linux) or the process is out of file
descriptors, every rank gets a ``threading.Lock`` instead (same semantics,
slower). Semantics of both: ``wake(rank)`` posts one token, ``wait(rank)``
takes one (sleeping until there is one); a wake that comes before the wait is
not lost. The rendezvous posts at most one token per sleep.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

_EVENTFD = getattr(os, "eventfd", None)
_SEMAPHORE = getattr(os, "EFD_SEMAPHORE", 0) | getattr(os, "EFD_CLOEXEC", 0)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class Batons:
    """One wake-up semaphore per rank: ``wait(rank)`` sleeps until ``wake(rank)`` posted a token.

    ``kind`` is ``"eventfd"`` or ``"lock"`` (``prefer="lock"`` forces the
    fallback, e.g. to test it). The file descriptors are closed by `close` (the
    rendezvous calls it once no rank thread can touch them) or, failing that, when
    the object is collected.
    """

    def __init__(self, world_size: int, prefer: str = "eventfd") -> None:
        if prefer not in ("eventfd", "lock"):
            raise ValueError(f"prefer must be 'eventfd' or 'lock', got {prefer!r}")
        self._fds: list[int] = []
        self.kind = "lock"
        if prefer == "eventfd" and _EVENTFD is not None:
            try:
                for _ in range(world_size):
                    self._fds.append(_EVENTFD(0, _SEMAPHORE))
                self.kind = "eventfd"
            except OSError:  # out of file descriptors: locks for every rank
                _close_all(self._fds)
        if self.kind == "eventfd":
            fds = self._fds
            self._finalizer = weakref.finalize(self, _close_all, fds)
            read, write = os.eventfd_read, os.eventfd_write

            def wait(rank: int) -> None:
                read(fds[rank])

            def wake(rank: int) -> None:
                write(fds[rank], 1)

        else:
            locks = [threading.Lock() for _ in range(world_size)]
            for lock in locks:
                lock.acquire()

            def wait(rank: int) -> None:
                locks[rank].acquire()

            def wake(rank: int) -> None:
                locks[rank].release()

        self.wait = wait
        self.wake = wake

    def close(self) -> None:
        """Close the file descriptors (call only when no thread can wait or wake any more)."""
        if self.kind == "eventfd":
            self._finalizer()
