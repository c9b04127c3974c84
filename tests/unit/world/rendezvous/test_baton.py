"""The rank threads' wake-up semaphores (`simdist.world.rendezvous.baton`): both kinds keep the rendezvous' semantics.

Each test runs on the eventfd kind (where the platform has it) and on the lock fallback; the rendezvous' own
tests (world/test_simworld.py, world/backend/test_process_group.py) run on the default kind, and
`test_the_engine_runs_on_the_fallback`
repeats a collective, a mismatch and a deadlock on the fallback.
"""

from __future__ import annotations

import functools
import os
import threading

import pytest
import torch

from simdist.reduce import Gloo
from simdist.world.errors import CollectiveDeadlockError, CollectiveMismatchError
from simdist.world.rendezvous import baton
from simdist.world.rendezvous import meeting as rendezvous
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

KINDS = ["eventfd", "lock"] if hasattr(os, "eventfd") else ["lock"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_wake_before_the_wait_is_not_lost_and_each_wake_is_one_wait(kind):
    batons = baton.Batons(2, prefer=kind)
    assert batons.kind == kind
    woke = [threading.Event(), threading.Event()]

    def sleeper() -> None:
        batons.wait(1)  # the token posted before this wait: returns at once
        woke[0].set()
        batons.wait(1)  # that token was taken: this sleeps until the next wake
        woke[1].set()

    batons.wake(1)
    t = threading.Thread(target=sleeper, daemon=True)  # a thread, so that a lost wake fails instead of hanging
    t.start()
    assert woke[0].wait(5.0)
    assert not woke[1].wait(0.05)
    batons.wake(1)
    assert woke[1].wait(5.0)
    t.join(5.0)
    batons.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_ring_of_four_threads_runs_in_baton_order(kind):
    n, rounds = 4, 50
    batons = baton.Batons(n, prefer=kind)
    order: list[int] = []

    def rank(r: int) -> None:
        for _ in range(rounds):
            batons.wait(r)
            order.append(r)  # only the baton holder runs here
            batons.wake((r + 1) % n)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    batons.wake(0)
    for t in threads:
        t.join(10.0)
    assert order == list(range(n)) * rounds
    batons.close()


def test_without_file_descriptors_every_rank_gets_a_lock(monkeypatch):
    opened: list[int] = []

    def eventfd(initval: int, flags: int) -> int:
        if len(opened) == 2:
            raise OSError(24, "Too many open files")
        opened.append(os.open(os.devnull, os.O_RDONLY))
        return opened[-1]

    monkeypatch.setattr(baton, "_EVENTFD", eventfd)
    batons = baton.Batons(4)
    assert batons.kind == "lock"
    for fd in opened:  # the descriptors opened before the failure were closed
        with pytest.raises(OSError):
            os.fstat(fd)
    batons.wake(3)
    batons.wait(3)
    with pytest.raises(ValueError, match="prefer"):
        baton.Batons(1, prefer="futex")


@pytest.mark.skipif("eventfd" not in KINDS, reason="no os.eventfd on this platform")
def test_runs_close_their_descriptors():
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    world = SimWorld(ParallelSpec(4, tp=1, ep=1))
    world.run(lambda comm: comm.barrier())
    before = fds()
    for _ in range(20):
        world.run(lambda comm: comm.barrier())
    assert fds() == before
    kept = rendezvous.Rendezvous(4)  # still referenced after its run: its descriptors are closed by the run, not by GC
    kept.run(lambda rank: None)
    assert fds() == before
    batons = baton.Batons(3)
    assert batons.kind == "eventfd" and fds() == before + 3
    batons.close()
    batons.close()  # twice is harmless
    assert fds() == before


def test_the_engine_runs_on_the_fallback(monkeypatch):
    monkeypatch.setattr(rendezvous, "Batons", functools.partial(baton.Batons, prefer="lock"))
    world = SimWorld(ParallelSpec(4, tp=2, ep=1), reduction=Gloo())
    values = [torch.tensor([1.0, -0.0, 2.0**-149, float("nan")]) * (r + 1) for r in range(4)]

    def reduce(comm) -> torch.Tensor:
        t = values[comm.get_rank()].clone()
        comm.all_reduce(t)
        comm.all_reduce(t, group=comm.group("tp"))
        return t

    got = world.run(reduce)
    first = Gloo().reduce(values)
    pairs = [Gloo().reduce([first, first]) for _ in range(2)]
    for r, t in enumerate(got):
        assert torch.equal(t.view(torch.int32), pairs[r // 2].view(torch.int32))
    with pytest.raises(CollectiveMismatchError):
        world.run(lambda comm: comm.all_reduce(torch.zeros(comm.get_rank() + 1)))
    with pytest.raises(CollectiveDeadlockError, match=r"returned while"):
        world.run(lambda comm: None if comm.get_rank() == 3 else comm.barrier())
