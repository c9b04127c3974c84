"""Python's ``random`` and NumPy's ``np.random`` are per rank on rank threads, as they are per process.

An unmodified program that seeds ``random``/``np.random``/``torch`` with its rank and shuffles its data
(tests/isolation_programs.py ``seeded_data``) gives, on threads, each rank's draws as one process running that
rank's sequence alone would (the default suite: the oracle is that sequence run on this thread with the real
module functions, no spawn involved), and the same bits as process mode and real gloo (slow suite, P=2, 3, 8).
What cannot be per rank is refused at first use, naming the rank, the call site and the fix.
"""

from __future__ import annotations

import random
from random import random as random_taken_before_the_spawn
from random import shuffle as shuffle_taken_before_the_spawn

import isolation_programs as programs
import numpy as np
import pytest
import torch
import torch.distributed as dist
from numpy.random import rand as rand_taken_before_the_spawn

import simdist
from simdist.numerics.floats import bits
from simdist.world.threads.isolation import SharedGlobalStateError

FIELDS = ("order", "picks", "perm", "ints", "values")


def _same(a: dict, b: dict, keys=FIELDS) -> bool:
    return all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in keys)


def _alone(rank: int) -> dict:
    """Rank ``rank``'s sequence run on this thread with the real module functions: what its process draws."""
    saved = random.getstate(), np.random.get_state(), torch.default_generator.get_state()
    try:
        return programs.seeded_data(rank, collectives=False)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.default_generator.set_state(saved[2])


def test_seeded_shuffles_and_draws_are_each_ranks_own_on_threads():
    n = 4
    threads = simdist.run(programs.seeded_data, n)
    for rank in range(n):
        assert _same(threads[rank], _alone(rank)), rank
    # power: ranks really draw different streams, and a shared generator would have been caught above
    assert not torch.equal(threads[0]["order"], threads[1]["order"])
    assert not _same(threads[1], _alone(2))
    assert all(torch.equal(bits(t["total"]), bits(threads[0]["total"])) for t in threads)


def test_the_callers_generators_and_the_modules_are_given_back():
    random.seed(11)
    np.random.seed(11)
    expected = random.random(), np.random.rand()
    random.seed(11)
    np.random.seed(11)
    functions = random.shuffle, random.seed, np.random.seed, np.random.rand, np.random.mtrand.rand
    simdist.run(programs.seeded_data, 2)
    assert (random.random(), np.random.rand()) == expected
    assert (random.shuffle, random.seed, np.random.seed, np.random.rand, np.random.mtrand.rand) == functions
    assert type(random._inst) is random.Random


def test_unseeded_ranks_start_from_entropy_like_fresh_processes():
    seen = simdist.run(lambda r: (random.random(), float(np.random.rand())), 4)
    assert len({a for a, _ in seen}) == 4 and len({b for _, b in seen}) == 4


def test_a_reference_to_pythons_shared_generator_is_refused_at_first_use_naming_rank_and_line():
    reached = []

    def rank(r: int):
        dist.barrier()
        if r == 1:
            shuffle_taken_before_the_spawn([1, 2, 3])  # the line the error names
        reached.append(r)
        dist.barrier()

    state = random.getstate()
    line = rank.__code__.co_firstlineno + 3
    expected = rf"rank 1 used Python's shared .*test_rank_rngs.py:{line} .*where=\"processes\""
    with pytest.raises(SharedGlobalStateError, match=expected):
        simdist.run(rank, 2)
    assert 1 not in reached and random.getstate() == state  # refused before it drew


def test_pythons_c_level_random_taken_before_the_spawn_is_refused_when_the_spawn_ends():
    state = random.getstate()
    with pytest.raises(SharedGlobalStateError, match=r"Python's shared `random` generator.*where=\"processes\""):
        simdist.run(lambda r: random_taken_before_the_spawn(), 2)
    assert random.getstate() == state


def test_a_reference_to_numpys_shared_generator_is_refused_when_the_spawn_ends():
    state = np.random.get_state(legacy=False)

    def rank(r: int):
        rand_taken_before_the_spawn(2)

    with pytest.raises(SharedGlobalStateError, match=r"NumPy's shared global generator.*where=\"processes\""):
        simdist.run(rank, 2)
    assert np.random.get_state(legacy=False)["state"]["pos"] == state["state"]["pos"]


def test_numpys_bit_generator_switches_are_refused_on_rank_threads():
    with pytest.raises(SharedGlobalStateError, match=r"rank 0 called np.random.set_bit_generator at .*test_rank_rngs"):
        simdist.run(lambda r: np.random.set_bit_generator(np.random.PCG64(r)), 1)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("n", [2, 3, 8])
def test_seeded_data_threads_process_mode_and_real_gloo_agree_bitwise(n):
    gloo = simdist.run(programs.seeded_data, n, where="gloo", timeout_s=300)
    processes = simdist.run(programs.seeded_data, n, where="processes", timeout_s=300)
    threads = simdist.run(programs.seeded_data, n)
    for rank in range(n):
        assert _same(processes[rank], gloo[rank], (*FIELDS, "total")), rank
        assert _same(threads[rank], gloo[rank], (*FIELDS, "total")), rank


_NUMPY_IMPORTED_BY_A_RANK = """
import sys
import torch.distributed as dist
import simdist

def draws(rank):
    if rank == 0:
        import numpy.random  # the first import of NumPy's generators in this process: after the spawn began
    dist.barrier()  # a handoff: the next rank's resume finds NumPy imported
    import numpy as np
    np.random.seed(7)
    dist.barrier()  # every rank seeded before any draws
    out = []
    for _ in range(2):
        out.append(np.random.rand(3).tolist())  # ranks alternate: a shared generator gives each other's draws
        dist.barrier()
    return out

assert "numpy.random" not in sys.modules
first, *others = simdist.run(draws, 3)
print("same" if all(o == first for o in others) else f"differ {first} {others}")
"""


def test_numpy_imported_first_by_a_rank_is_per_rank_from_the_next_handoff():
    """A fresh interpreter (this one has NumPy): a rank imports ``numpy.random``; each rank seeded alike then
    draws the same values, as separate processes would."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _NUMPY_IMPORTED_BY_A_RANK], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "same", done.stdout
