"""A collective on n rank threads costs n - 1 handoffs, in SimWorld and in the backend.

The thread floor of the per-call benchmark (bench/collectives.py) counts the
handoffs one collective makes; this pins the count: the last rank to arrive
completes the collective and runs on to its next call without a switch, so a
steady loop of all_reduces wakes a rank n - 1 times per collective. A change
that added a switch (the completing rank parking itself, a rank woken only to
park again) would cost a handoff per collective, about 4 us on a 2-vCPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist import ParallelSpec, SimWorld
from simdist.world.rendezvous import baton


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of baton waits (one per handoff) of every `Batons` made while the test runs."""
    count = [0]
    made = baton.Batons.__init__

    def counting_init(self, *args, **kwargs) -> None:
        made(self, *args, **kwargs)
        wait = self.wait

        def counted(rank: int) -> None:
            count[0] += 1
            wait(rank)

        self.wait = counted

    monkeypatch.setattr(baton.Batons, "__init__", counting_init)
    return count


def _sim_loop(comm, calls: int) -> None:
    x = torch.zeros(8)
    for _ in range(calls):
        comm.all_reduce(x)


def _dist_loop(rank: int, calls: int) -> None:
    x = torch.zeros(8)
    for _ in range(calls):
        dist.all_reduce(x)


def _per_collective(run, waits: list[int]) -> float:
    """Handoffs per collective: the difference between a run of 40 and one of 10 collectives, over 30 (what a run
    costs to start and end cancels)."""
    counts = []
    for calls in (10, 40):
        waits[0] = 0
        run(calls)
        counts.append(waits[0])
    return (counts[1] - counts[0]) / 30


@pytest.mark.parametrize("n", [2, 3, 4])
def test_simworld_collective_hands_off_n_minus_one_times(n: int, waits: list[int]) -> None:
    world = SimWorld(ParallelSpec(n, tp=1, ep=1))
    assert _per_collective(lambda calls: world.run(_sim_loop, calls), waits) == n - 1


@pytest.mark.parametrize("n", [2, 4])
def test_backend_collective_hands_off_n_minus_one_times(n: int, waits: list[int]) -> None:
    assert _per_collective(lambda calls: simdist.run(_dist_loop, n, args=(calls,)), waits) == n - 1
