"""Microseconds per all_reduce on a 4-rank group: SimWorld, the simdist backend, torch's threaded group,
LocalTensor, real gloo processes and the floor.

    python bench/collectives.py [--quick] [--no-gloo] [--cpu-clock] [--per-call]

``--per-call`` prints only issue 34's tables (`per_call_tables`): SimWorld's and the backend's all_reduce of
1024 fp32 against the thread floor (handoffs + reduction + writes) with the split above it, c10d's own layer (the
``fake`` backend) and the backend's floor, and a 64 MiB-per-rank all_reduce against the memory-bandwidth floor.

All three run the same reduction (the `Gloo` reduction's order, fp32 SUM) on
4 ranks, in one run of this script:

* floor    -- the reduction as one plain function call on the 4 rank tensors,
              plus writing the result into each of them (what an in-place
              all_reduce must do), no threads;
* barrier  -- a 4-rank SimWorld barrier: the cost of handing the
              interpreter round the rank threads, with no arithmetic;
* SimWorld -- ``comm.all_reduce`` in a loop on 4 rank threads;
* gloo     -- the same loop in 4 real gloo processes on 127.0.0.1.

A second table compares, for 1024 fp32 elements, the ways to run
``torch.distributed``-shaped code on 4 simulated ranks in one process:

* fold     -- the plain rank-order fold ``((x0 + x1) + x2) + x3`` plus the
              writes (the cheapest possible in-place all_reduce, not gloo's order);
* floor, SimWorld -- as above;
* backend  -- unmodified ``dist.all_reduce`` on `simdist.run` (the
              ``simdist`` backend; gloo's order, bit for bit);
* threaded -- torch's own threaded process group (its summation order, not
              gloo's);
* LocalTensor -- ``dist.all_reduce`` on a LocalTensor under LocalTensorMode
              with torch's fake group (one thread; "n/a" where unavailable).

Under it, where SimWorld's and the backend's microseconds go, each part timed
alone in the same run: the reduction, the writes, the handoffs between rank
threads (a bare ring of the rendezvous' wake-ups, `simdist.world.rendezvous.baton`, scaled to
the handoffs one collective makes: 3 on 4 ranks, counted by `handoffs_per_collective`,
as the last rank to arrive completes the collective and runs on), the rest
of SimWorld (rendezvous, checks, Python, and the reduction running slower among four
threads than alone), the isolation swaps of `simdist.run` (a bare rendezvous
barrier with and without `RankIsolation`) and the rest of the backend (c10d's
Python layer, the backend's per-call path); and the least any front end on OS
threads can take: handoffs + reduction + writes. Both rests are then split once
more by running SimWorld and the backend on a reduction that does no arithmetic
(`_NoArithmetic`): what is left is the front end's own rendezvous, checks and
Python, and SimWorld's rest minus it is the reduction running slower inside the
front end than alone (partly so on one thread too: the 4 ranks' calls driven
from one thread cost about 20 us more with the reduction than the reduction alone plus
the same calls on the no-arithmetic reduction; more among the rank threads).

A third table times the rank-batched gradient path's all_reduce (`simdist.gradpath.batched.BatchedOps`: the 4
ranks are one ``[batch, 4, 1024]`` tensor, the group is a view, gloo's order applied as a per-element plan)
against the plain rank-order fold ``((x0 + x1) + x2) + x3`` of the same four tensors (issue target <= 2x),
for one run and for a growth ensemble of 8 seeds. A fourth table times every registered reduction
(``make_reduction(name).reduce`` plus the writes) against the plain fold plus the writes (target for ``gloo``: <= 2x).

Figures are medians of repeated timed loops; ratios are taken within the run.
With ``--cpu-clock`` tables 2-4 are timed in this process's CPU time (`CLOCK`),
which a busy shared machine disturbs far less than wall time.
Every rank's input is zeros: an in-place all_reduce loop feeds each result back
in, and any nonzero data grows 4x per iteration until it is inf/NaN, which sends
the gloo reduction down its (slower) NaN path. Zeros stay finite; the adds cost the
same for any finite, non-subnormal values (the reduction sums 4 x 1024 randn values
and zeros in the same 21-22 us here), so every world does exactly the reduction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import simdist
from simdist.reduce.gloo import Gloo
from simdist.world.rendezvous.baton import Batons
from simdist.world.rendezvous.calls import Call
from simdist.world.rendezvous.meeting import Rendezvous
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec
from simdist.world.threads.isolation import RankIsolation

sys.path.append(str(Path(__file__).resolve().parent))  # bench/report.py, also when loaded by path
from report import Table, machine, write

SPEC = ParallelSpec(4, tp=1, ep=1)

CLOCK = [time.perf_counter]
TABLES: list[Table] = []
"""The tables of this run, for ``--json`` (bench/report.py's schema)."""


def _clock_name() -> str:
    return "this process's CPU time" if CLOCK[0] is time.process_time else "wall time"


"""The clock of every timed loop: wall time, or with ``--cpu-clock`` (tables 2-4) this process's CPU time, which
on a busy shared machine leaves out the time other processes take the CPUs (the rank threads run one at a time,
so on a quiet machine both agree)."""
SIZES = (1024, 262144)


def _input(numel: int) -> torch.Tensor:
    """A rank's all_reduce input: zeros, which an in-place loop keeps finite (see the module docstring)."""
    return torch.zeros(numel)


def _iterations(numel: int, quick: bool) -> int:
    base = 2000 if numel <= 4096 else 200
    return base // 10 if quick else base


def timed_loop(comm, numel: int, iters: int, repeats: int, barrier_only: bool = False) -> list[float]:
    """Rank program: ``repeats`` timed loops of ``iters`` collectives; seconds per collective (rank 0's clock)."""
    x = _input(numel)
    laps = []
    for _ in range(repeats):
        comm.barrier()
        start = CLOCK[0]()
        for _ in range(iters):
            if barrier_only:
                comm.barrier()
            else:
                comm.all_reduce(x)
        comm.barrier()
        laps.append((CLOCK[0]() - start) / iters)
    return laps


def floor(numel: int, iters: int, repeats: int, plain: bool = False) -> list[float]:
    """The reduction as one call (the `Gloo` reduction, or with ``plain`` the rank-order fold ``((x0+x1)+x2)+x3``)
    plus writing the result into every rank's tensor; no threads."""
    reduction = Gloo()
    xs = [_input(numel) for _ in range(SPEC.world_size)]
    laps = []
    for _ in range(repeats):
        start = CLOCK[0]()
        for _ in range(iters):
            if plain:
                a, b, c, d = xs
                result = ((a + b) + c) + d
            else:
                result = reduction.reduce(xs)
            for x in xs:
                x.copy_(result)
        laps.append((CLOCK[0]() - start) / iters)
    return laps


def dist_loop(rank: int, numel: int, iters: int, repeats: int, barrier_only: bool = False) -> list[float]:
    """Rank program in plain torch.distributed: ``repeats`` timed loops of ``iters`` all_reduces (or barriers)."""
    x = _input(numel)
    laps = []
    for _ in range(repeats):
        dist.barrier()
        start = CLOCK[0]()
        for _ in range(iters):
            if barrier_only:
                dist.barrier()
            else:
                dist.all_reduce(x)
        dist.barrier()
        laps.append((CLOCK[0]() - start) / iters)
    return laps


def threaded(numel: int, iters: int, repeats: int) -> list[float]:
    """`dist_loop` on torch's threaded process group (torch's test utility), 4 threads."""
    from torch.testing._internal.distributed import multi_threaded_pg as mt

    n = SPEC.world_size
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mt._install_threaded_pg()
    store = dist.HashStore()
    results: list = [None] * n

    def body(rank: int) -> None:
        torch.set_num_threads(1)
        dist.init_process_group("threaded", rank=rank, world_size=n, store=store)
        results[rank] = dist_loop(rank, numel, iters, repeats)
        dist.destroy_process_group()

    try:
        threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        mt._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    return results[0]


def local_tensor(numel: int, iters: int, repeats: int) -> list[float] | None:
    """``dist.all_reduce`` on a LocalTensor of 4 ranks under LocalTensorMode (fake group); None if unavailable."""
    try:
        from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return None
    n = SPEC.world_size
    dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
    try:
        with LocalTensorMode(n):
            x = LocalTensor({r: _input(numel) for r in range(n)})
            laps = []
            for _ in range(repeats):
                start = CLOCK[0]()
                for _ in range(iters):
                    dist.all_reduce(x)
                laps.append((CLOCK[0]() - start) / iters)
        return laps
    except Exception:
        return None
    finally:
        dist.destroy_process_group()


def _laps(step, iters: int, repeats: int) -> list[float]:
    """Seconds per call of ``step()``: ``repeats`` timed loops of ``iters`` calls."""
    laps = []
    for _ in range(repeats):
        start = CLOCK[0]()
        for _ in range(iters):
            step()
        laps.append((CLOCK[0]() - start) / iters)
    return laps


def reductions_table(iters: int, repeats: int) -> None:
    """Each registered reduction's all_reduce (the reduction's reduce plus the 4 writes) of 1024 fp32 elements
    on 4 ranks against the plain rank-order fold plus the writes, interleaved in one run (issue target for the
    `Gloo` reduction: <= 2x)."""
    from simdist.reduce import REDUCTION_NAMES, make_reduction

    numel, n = 1024, SPEC.world_size
    xs = [_input(numel) for _ in range(n)]

    def step(reduce):
        def run() -> None:
            result = reduce(xs)
            for x in xs:
                x.copy_(result)

        return run

    def plain(ts):
        a, b, c, d = ts
        return ((a + b) + c) + d

    steps = {"fold": step(plain), **{name: step(make_reduction(name).reduce) for name in REDUCTION_NAMES}}
    laps: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):  # interleaved, so a burst of load on the machine hits every row alike
        for name, run in steps.items():
            laps[name] += _laps(run, iters, 1)
    fold_us = statistics.median(laps["fold"]) * 1e6
    print(f"\n{numel} fp32 elements, 4 ranks: reduction + writes vs plain fold + writes (us per all_reduce)")
    print(f"{'reduction':>10} {'us':>8} {'/ fold':>10}")
    table = Table(
        f"Each reduction alone, {numel} fp32 elements on 4 ranks: reduction + writes vs plain fold + writes",
        ["reduction", "us per all_reduce", "/ fold"],
        notes=f"Medians of {repeats} interleaved repeats, {_clock_name()}. The fold is `((x0+x1)+x2)+x3`. "
        "Target for gloo: <= 2x the fold.",
    )
    for name, values in laps.items():
        us = statistics.median(values) * 1e6
        target = "   (target <= 2x)" if name == "gloo" else ""
        print(f"{name:>10} {us:>8.1f} {us / fold_us:>9.2f}x{target}")
        table.add(name, us, us / fold_us)
    TABLES.append(table)


def batched_table(iters: int, repeats: int) -> None:
    """The rank-batched gradient path's all_reduce of 1024 fp32 elements on 4 ranks vs the plain rank-order fold, for
    one run and for a growth ensemble of 8 seeds (``[8, 4, 1024]``: the per-call cost is shared by the batch),
    interleaved in one run."""
    from simdist.gradpath.batched import BatchedOps

    numel, n = 1024, SPEC.world_size
    print(f"\n{numel} fp32 elements, 4 ranks, rank-batched gradient path (us per all_reduce of the whole batch)")
    print(f"{'batch':>5} {'plain fold':>10} {'batched':>8}   {'batched/fold':>12}")
    table = Table(
        f"Rank-batched rendezvous, all_reduce of {numel} fp32 elements on 4 ranks, per batch",
        ["batch", "plain fold us", "rank-batched us", "rank-batched / fold"],
        notes=f"The 4 ranks as one `[batch, 4, {numel}]` tensor, gloo's order (checked bit for bit against the "
        f"gloo reduction first); medians of {repeats} interleaved repeats, {_clock_name()}. Target: <= 2x the fold.",
    )
    for batch in (1, 8):
        gen = torch.Generator().manual_seed(batch)
        value = torch.randn(batch, n, numel, generator=gen)  # [batch, rank, 1024]
        ops = BatchedOps(SPEC, seeds=list(range(batch)), reduction=Gloo())
        for item in range(batch):  # the bits of the gloo reduction, every item
            expected = Gloo().sum(value[item]).view(torch.int32)
            assert torch.equal(ops.all_reduce(value, "dp")[item, 0].view(torch.int32), expected)
        a, b, c, d = value.unbind(1)
        plain, batched = [], []
        for _ in range(repeats):  # interleaved, so a burst of load on the machine hits both alike
            plain += _laps(lambda: ((a + b) + c) + d, iters, 1)  # noqa: B023
            batched += _laps(lambda: ops.all_reduce(value, "dp"), iters, 1)  # noqa: B023
        plain_us, batched_us = statistics.median(plain) * 1e6, statistics.median(batched) * 1e6
        print(f"{batch:>5} {plain_us:>10.1f} {batched_us:>8.1f}   {batched_us / plain_us:>11.2f}x (target <= 2x)")
        table.add(batch, plain_us, batched_us, batched_us / plain_us)
    TABLES.append(table)


def backend_table(iters: int, repeats: int) -> None:
    """The 1024-element comparison of in-process ways to run torch.distributed code (second table), and where a
    front end's microseconds go."""
    numel = 1024
    world = SimWorld(SPEC, reduction=Gloo())
    us = front_end_parts(world, iters, repeats)
    fold_us, floor_us, sim_us, backend_us = us["fold"], us["floor"], us["sim"], us["backend"]
    threaded_us = statistics.median(threaded(numel, iters, repeats)) * 1e6
    local = local_tensor(numel, max(10, iters // 4), repeats)
    local_us = statistics.median(local) * 1e6 if local else float("nan")
    print(f"\n{numel} fp32 elements, 4 ranks in one process, dist.all_reduce unless noted (us per all_reduce)")
    print(
        f"{'fold':>6} {'floor':>6} {'SimWorld':>9} {'backend':>8} {'threaded':>9} {'LocalT':>8}   "
        f"{'backend/Sim':>11} {'Sim/fold':>8} {'backend/fold':>12} "
        f"{'threaded/backend':>16} {'LocalT/backend':>14}"
    )
    local_text = f"{local_us:>8.1f}" if local else f"{'n/a':>8}"
    local_ratio = f"{local_us / backend_us:>13.2f}x" if local else f"{'n/a':>14}"
    print(
        f"{fold_us:>6.1f} {floor_us:>6.1f} {sim_us:>9.1f} {backend_us:>8.1f} {threaded_us:>9.1f} {local_text}   "
        f"{backend_us / sim_us:>10.2f}x {sim_us / fold_us:>7.2f}x {backend_us / fold_us:>11.2f}x "
        f"{threaded_us / backend_us:>15.2f}x {local_ratio}"
    )
    print("targets: backend/Sim <= 1.2x, SimWorld and backend <= 3x fold, LocalT/backend > 1x")
    table = Table(
        f"Ways to run torch.distributed code on 4 ranks in one process, {numel} fp32 elements",
        ["front end", "us per all_reduce", "/ fold", "/ simdist backend"],
        notes="*fold*: `((x0+x1)+x2)+x3` plus the writes, the cheapest in-place all_reduce (not gloo's order); "
        "*floor*: the gloo reduction plus the writes, one call; *SimWorld*: `comm.all_reduce` on 4 rank threads; "
        "*simdist backend*: unmodified `dist.all_reduce` (gloo's order, bit for bit); *threaded*: torch's "
        "threaded process group (its own order); *LocalTensor*: torch's LocalTensorMode (one thread). "
        f"Medians of {repeats} interleaved repeats, {_clock_name()}. Targets: backend <= 1.2x SimWorld, "
        "SimWorld and backend <= 3x the fold.",
    )
    for name, value in (
        ("fold", fold_us),
        ("floor", floor_us),
        ("SimWorld", sim_us),
        ("simdist backend", backend_us),
        ("torch threaded group", threaded_us),
        ("LocalTensor", local_us if local else "n/a"),
    ):
        if isinstance(value, str):
            table.add(name, value, value, value)
        else:
            table.add(name, value, value / fold_us, value / backend_us)
    TABLES.append(table)
    split_rows(us)


def baton_ring(iters: int, repeats: int) -> list[float]:
    """Seconds per handoff in a bare ring of 4 threads handing one baton round (`simdist.world.rendezvous.baton`, the
    rendezvous' wake-ups, pinned to one CPU as the rank threads are): a round is 4 handoffs, nothing else."""
    n = SPEC.world_size
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    laps: list[float] = []
    for _ in range(repeats):
        batons = Batons(n)
        threads = [threading.Thread(target=_ring_rank, args=(batons, r, n, cpu, iters, laps)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        batons.close()
    return laps


def _ring_rank(batons: Batons, r: int, n: int, cpu: int | None, iters: int, laps: list[float]) -> None:
    """One thread of `baton_ring`: wake the next rank, sleep until woken, ``iters`` times (rank 0 times it)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if r:
        batons.wait(r)
    start = CLOCK[0]()
    for _ in range(iters):
        batons.wake((r + 1) % n)
        batons.wait(r)
    if r == 0:
        laps.append((CLOCK[0]() - start) / (iters * n))
    batons.wake((r + 1) % n)


class _NoSwitch:
    """A rendezvous switch that swaps nothing: the serial schedule of `simdist.run` without its isolation; it
    counts the handoffs (the rendezvous suspends the rank giving the baton away once per handoff)."""

    def __init__(self) -> None:
        self.handoffs = 0

    def suspend(self, rank: int) -> None:
        self.handoffs += 1

    def resume(self, rank: int) -> None:
        pass


def handoffs_per_collective(iters: int = 200) -> float:
    """Handoffs per 4-rank collective on the bare rendezvous in `simdist.run`'s serial schedule, counted over
    ``iters`` collectives after as many to warm up: 3, not 4, as the last rank to arrive completes the collective
    and runs on to its next call without a switch (SimWorld and the backend use this rendezvous;
    tests/unit/world/rendezvous/test_handoffs.py counts their handoffs too)."""
    n = SPEC.world_size
    switch = _NoSwitch()
    rendezvous = Rendezvous(n, switch=switch)
    members = tuple(range(n))
    counted: list[int] = []

    def body(rank: int) -> None:
        call = Call(rank, ("barrier", "world"), "bench")
        for lap in range(3):  # rank 0 reads the count after laps 1 and 2 (steady state on both sides)
            for _ in range(iters):
                rendezvous.collective(call, members, _nothing)
            if rank == 0 and lap:
                counted.append(switch.handoffs)

    rendezvous.run(body)
    return (counted[1] - counted[0]) / iters


def engine_barriers(iters: int, isolate: bool) -> list[float]:
    """Seconds per 4-rank barrier on the bare rendezvous in `simdist.run`'s serial schedule, with its per-rank
    isolation (`RankIsolation`: each rank's generator and settings swapped at every handoff) or without."""
    n = SPEC.world_size
    isolation = RankIsolation(n) if isolate else None
    rendezvous = Rendezvous(n, switch=isolation or _NoSwitch())
    members = tuple(range(n))

    def body(rank: int) -> float:
        call = Call(rank, ("barrier", "world"), "bench")
        start = CLOCK[0]()
        for _ in range(iters):
            rendezvous.collective(call, members, _nothing)
        return (CLOCK[0]() - start) / iters

    try:
        return [rendezvous.run(body)[0]]
    finally:
        if isolation is not None:
            isolation.restore()


def _nothing(calls: list, targets) -> None:
    """A barrier's completion."""


class _NoArithmetic(Gloo):
    """The `Gloo` reduction doing no arithmetic (the first member's tensor is the result): a
    front end on it costs its rendezvous, checks and Python, the handoffs and the writes, without the arithmetic."""

    def reduce(self, tensors, op=None):  # type: ignore[override]
        return tensors[0]


def c10d_layer(numel: int, iters: int) -> list[float]:
    """Seconds per ``dist.all_reduce`` on torch's ``fake`` backend (world 4, this thread, no communication, no
    arithmetic): c10d's own Python layer and dispatch, which every backend's ``dist.all_reduce`` pays."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    x = _input(numel)
    dist.init_process_group("fake", rank=0, world_size=SPEC.world_size, store=FakeStore())
    try:
        return _laps(lambda: dist.all_reduce(x), iters, 1)
    finally:
        dist.destroy_process_group()


def front_end_parts(world: SimWorld, iters: int, repeats: int) -> dict[str, float]:
    """Medians (us) of every part of table 2 and its split, interleaved in one loop so that a burst of load on
    the machine hits every part alike: the plain fold, the reduction + writes (``floor``), SimWorld's and the
    backend's all_reduce and barrier, and alone: the reduction, the 4 writes, one handoff (a bare baton ring), a
    bare rendezvous barrier with and without the isolation swaps. ``handoffs`` is one handoff times the handoffs a
    collective makes (`handoffs_per_collective`, counted)."""
    numel, n = 1024, SPEC.world_size
    xs = [_input(numel) for _ in range(n)]
    reduction = Gloo()
    bare_world = SimWorld(SPEC, reduction=_NoArithmetic())

    def writes() -> None:
        for x in xs:
            x.copy_(xs[0])

    steps = {
        "c10d": lambda: c10d_layer(numel, iters),
        "fold": lambda: floor(numel, iters, 1, plain=True),
        "floor": lambda: floor(numel, iters, 1),
        "sim": lambda: world.run(timed_loop, numel, iters, 1)[0],
        "backend": lambda: simdist.run(dist_loop, n, args=(numel, iters, 1))[0],
        "reduction": lambda: _laps(lambda: reduction.reduce(xs), iters, 1),
        "writes": lambda: _laps(writes, iters, 1),
        "ring": lambda: baton_ring(iters, 1),
        "iso": lambda: engine_barriers(iters, True),
        "bare": lambda: engine_barriers(iters, False),
        "simbar": lambda: world.run(timed_loop, numel, iters, 1, True)[0],
        "bbar": lambda: simdist.run(dist_loop, n, args=(numel, iters, 1, True))[0],
        "sim0": lambda: bare_world.run(timed_loop, numel, iters, 1)[0],
        "backend0": lambda: simdist.run(dist_loop, n, args=(numel, iters, 1), reduction=_NoArithmetic())[0],
    }
    laps: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            laps[name] += step()
    us = {k: statistics.median(v) * 1e6 for k, v in laps.items()}
    us["per_collective"] = handoffs_per_collective()
    us["handoffs"] = us["ring"] * us["per_collective"]
    return us


def split_rows(us: dict[str, float]) -> None:
    """Where a 4-rank all_reduce's microseconds go (`front_end_parts`): the reduction and the writes (no threads), the
    handoffs (a bare baton ring, times the handoffs a collective makes), the rest of SimWorld (rendezvous, checks,
    Python, and the reduction running slower among four threads than alone), the isolation swaps (bare rendezvous
    barrier with `RankIsolation` minus without) and the rest of the backend (c10d's Python layer and the backend's
    per-call path). The handoffs, the reduction and the writes together are the least a front end on OS threads
    can take."""
    fold_us, sim_us, backend_us = us["fold"], us["sim"], us["backend"]
    isolation = us["iso"] - us["bare"]
    rows = [
        ("reduction (Gloo.reduce)", us["reduction"]),
        ("writes (4 copies)", us["writes"]),
        (f"{us['per_collective']:g} handoffs (bare baton ring)", us["handoffs"]),
        ("SimWorld rest: rendezvous, checks, Python, caches", sim_us - us["reduction"] - us["writes"] - us["handoffs"]),
        ("= SimWorld all_reduce", sim_us),
        ("isolation swaps (one per handoff)", isolation),
        ("backend rest: c10d Python, per-call path", backend_us - sim_us - isolation),
        ("= backend all_reduce", backend_us),
    ]
    print("\nwhere a 4-rank all_reduce of 1024 fp32 goes (us, each part alone, interleaved in one run)")
    for name, value in rows:
        print(f"{name:>46} {value:>8.1f} {value / fold_us:>7.2f}x fold")
    sub_rows = [
        ("SimWorld rest without the reduction's arithmetic", us["sim0"] - us["writes"] - us["handoffs"]),
        ("the reduction slower inside the front end than alone", sim_us - us["sim0"] - us["reduction"]),
        ("backend rest without the reduction's arithmetic", us["backend0"] - us["sim0"] - isolation),
    ]
    print("the rests split by running SimWorld and the backend on a reduction with no arithmetic (same run):")
    for name, value in sub_rows:
        print(f"{name:>46} {value:>8.1f} {value / fold_us:>7.2f}x fold")
    print(
        f"{'barriers: SimWorld':>46} {us['simbar']:>8.1f}   backend {us['bbar']:.1f}   bare rendezvous "
        f"{us['bare']:.1f} (isolated {us['iso']:.1f})"
    )
    least = (us["handoffs"] + us["reduction"] + us["writes"]) / fold_us
    table = Table(
        "Where a 4-rank all_reduce of 1024 fp32 elements goes",
        ["part", "us", "/ fold"],
        notes="Each part timed alone, interleaved in one run. *Handoffs*: a bare ring of the rendezvous' wake-ups, "
        "per handoff, times the rank-to-rank switches one collective makes (counted: 3 on 4 ranks, as the last rank "
        "to arrive completes the collective and runs on); *isolation swaps*: a bare rendezvous barrier with "
        "`RankIsolation` minus without. Handoffs + reduction + writes, the least a front end on OS threads can take: "
        f"{least:.2f}x the fold in this run.",
    )
    for name, value in rows + sub_rows:
        table.add(name, value, value / fold_us)
    TABLES.append(table)
    print(
        f"least on OS threads (handoffs + reduction + writes): {least:.2f}x fold (target for SimWorld, backend: <= 3x)"
    )


def thread_floor_rows(us: dict[str, float]) -> list[tuple[str, float, float, str]]:
    """Issue 34's per-call targets against the thread floor (the handoffs + the reduction + the writes, each measured
    alone in the same run as the front ends, `front_end_parts`): (name, us, ratio to the floor, target) for
    SimWorld and the backend, and the split of each above the floor (rendezvous/checks/Python, isolation swaps,
    c10d's layer)."""
    least = us["handoffs"] + us["reduction"] + us["writes"]
    isolation = us["iso"] - us["bare"]
    sim_rest = us["sim"] - least
    backend_rest = us["backend"] - us["sim"] - isolation
    return [
        ("thread floor: handoffs + reduction + writes", least, 1.0, ""),
        (f"  {us['per_collective']:g} handoffs (counted per collective)", us["handoffs"], us["handoffs"] / least, ""),
        ("  reduction", us["reduction"], us["reduction"] / least, ""),
        ("  writes", us["writes"], us["writes"] / least, ""),
        ("SimWorld all_reduce", us["sim"], us["sim"] / least, "<= 1.3x"),
        ("  SimWorld above the floor: rendezvous, checks, Python", sim_rest, sim_rest / least, ""),
        ("backend dist.all_reduce", us["backend"], us["backend"] / least, "<= 2x"),
        ("  isolation swaps", isolation, isolation / least, ""),
        ("  c10d Python + backend per-call path", backend_rest, backend_rest / least, ""),
        ("  of which c10d's own layer, 4 calls (fake backend)", 4 * us["c10d"], 4 * us["c10d"] / least, ""),
        ("backend floor: thread floor + c10d's layer x 4", least + 4 * us["c10d"], 1 + 4 * us["c10d"] / least, ""),
        ("backend / backend floor", us["backend"], us["backend"] / (least + 4 * us["c10d"]), ""),
    ]


BIG = 64 * 2**20 // 4
"""Elements of fp32 per rank in the bandwidth table: 64 MiB."""


def _cold_call(rank: int, barrier, all_reduce, buffers: list[torch.Tensor], flush: torch.Tensor) -> list[float]:
    """One timed all_reduce of the rank's own preallocated buffer, after rank 0 evicted the caches (wrote
    ``flush``) while the others waited in a barrier; seconds (rank 0's clock)."""
    barrier()
    if rank == 0:
        flush.fill_(1.0)
    barrier()
    start = CLOCK[0]()
    all_reduce(buffers[rank])
    barrier()
    return [CLOCK[0]() - start]


def shared_loop(comm, buffers: list[torch.Tensor], flush: torch.Tensor) -> list[float]:
    """Rank program of `bandwidth_us` on SimWorld (`_cold_call`)."""
    return _cold_call(comm.get_rank(), comm.barrier, comm.all_reduce, buffers, flush)


def shared_dist_loop(rank: int, buffers: list[torch.Tensor], flush: torch.Tensor) -> list[float]:
    """Rank program of `bandwidth_us` in plain torch.distributed, the backend (`_cold_call`)."""
    return _cold_call(rank, dist.barrier, dist.all_reduce, buffers, flush)


def bandwidth_us(rounds: int, numel: int = BIG) -> dict[str, float]:
    """Microseconds per all_reduce of ``numel`` fp32 per rank on 4 ranks (SimWorld, the backend) and the
    memory-bandwidth floor: one read of each rank's input and one write of each rank's output, as 4 copies of
    ``numel`` elements into 4 other tensors or 4 in-place passes do it (the floor is the faster: a copy into
    other memory also reads the destination's lines before writing them). Medians over ``rounds`` interleaved
    rounds.

    Every part works on the same preallocated rank buffers (the ranks of SimWorld and of the backend are threads of
    this process and are handed them): buffers allocated afresh per call land on other physical pages each time,
    and the speed of 4 streams at once varied with them by up to 1.4x between runs, which swamped the comparison.
    Before each timed call a 64 MiB write evicts the 32 MiB last-level cache, so every part starts cold. Inputs
    zeros (see the module docstring)."""
    n = SPEC.world_size
    buffers = [_input(numel) for _ in range(n)]
    targets = [_input(numel) for _ in range(n)]
    flush = torch.empty(max(numel, 2**24))
    world = SimWorld(SPEC, reduction=Gloo())

    def timed(part) -> list[float]:
        flush.fill_(1.0)
        start = CLOCK[0]()
        part()
        return [CLOCK[0]() - start]

    def copies() -> None:
        for src, dst in zip(buffers, targets, strict=True):
            dst.copy_(src)

    def in_place() -> None:  # read and write each tensor once, in place (no read-for-ownership of other lines)
        for x in buffers:
            x.mul_(1.0)

    steps = {
        "copies": lambda: timed(copies),
        "in_place": lambda: timed(in_place),
        "sim": lambda: world.run(shared_loop, buffers, flush)[0],
        "backend": lambda: simdist.run(shared_dist_loop, n, args=(buffers, flush))[0],
    }
    for step in steps.values():  # warm: the first call pages the buffers in
        step()
    laps: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            laps[name] += step()
    us = {k: statistics.median(v) * 1e6 for k, v in laps.items()}
    us["floor"] = min(us["copies"], us["in_place"])
    return us


def per_call_tables(iters: int, repeats: int) -> dict[str, object]:
    """Item 3 of issue 34 in one run: the per-call ratios to the thread floor (1024 fp32) and the 64 MiB ratios to
    the memory-bandwidth floor; printed, and returned for `bench/targets.py`."""
    world = SimWorld(SPEC, reduction=Gloo())
    us = front_end_parts(world, iters, repeats)
    rows = thread_floor_rows(us)
    print("\n1024 fp32 on 4 ranks against the thread floor (us, each part alone, interleaved in one run)")
    for name, value, ratio, target in rows:
        print(f"{name:>52} {value:>8.1f} {ratio:>6.2f}x {target}")
    big = bandwidth_us(max(9, 2 * repeats))
    print("\n64 MiB fp32 per rank, 4 ranks, against one read of each input + one write of each output (ms)")
    big_rows = [
        ("  4 copies of 64 MiB into 4 other tensors", big["copies"], big["copies"] / big["floor"], ""),
        ("  4 in-place passes over 64 MiB (x.mul_(1))", big["in_place"], big["in_place"] / big["floor"], ""),
        ("bandwidth floor: the faster of the two", big["floor"], 1.0, ""),
        ("SimWorld all_reduce", big["sim"], big["sim"] / big["floor"], "<= 1.5x"),
        ("backend dist.all_reduce", big["backend"], big["backend"] / big["floor"], "<= 1.5x"),
    ]
    for name, value, ratio, target in big_rows:
        print(f"{name:>52} {value / 1000:>8.1f} {ratio:>6.2f}x {target}")
    return {"thread_floor": rows, "bandwidth": big_rows, "us": us, "big_us": big}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run, noisier figures)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-gloo", action="store_true", help="only the in-process table (no gloo processes)")
    parser.add_argument("--json", metavar="PATH", help="also write the tables as bench/report.py's schema")
    parser.add_argument(
        "--per-call", action="store_true", help="only issue 34's per-call and bandwidth tables (in-process)"
    )
    parser.add_argument(
        "--cpu-clock",
        action="store_true",
        help="time tables 2-4 in this process's CPU time instead of wall time (for a busy shared machine; the "
        "first table, which has gloo processes, stays in wall time)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    started_on = machine()
    torch.set_num_threads(1)  # as on the rank threads and in the gloo processes: the floor is not run on 2 CPUs
    if args.per_call:
        CLOCK[0] = time.process_time if args.cpu_clock else time.perf_counter
        per_call_tables(_iterations(1024, args.quick), args.repeats)
        return
    if not args.no_gloo:
        gloo_table(args.quick, args.repeats)
    CLOCK[0] = time.process_time if args.cpu_clock else time.perf_counter
    backend_table(_iterations(1024, args.quick), args.repeats)
    batched_table(_iterations(1024, args.quick), args.repeats)
    reductions_table(_iterations(1024, args.quick), args.repeats)
    if args.json:
        write(args.json, TABLES, machine_text=started_on)


def gloo_table(quick: bool, repeats: int) -> None:
    """The first table: SimWorld against the floor and 4 real gloo processes, per size, in wall time."""
    world = SimWorld(SPEC, reduction=Gloo())
    rows = []
    for numel in SIZES:
        iters = _iterations(numel, quick)
        laps: dict[str, list[float]] = {"floor": [], "barrier": [], "sim": []}
        for _ in range(repeats):  # interleaved, so a burst of load on the machine hits each column alike
            laps["floor"] += floor(numel, iters, 1)
            laps["barrier"] += world.run(timed_loop, numel, iters, 1, True)[0]
            laps["sim"] += world.run(timed_loop, numel, iters, 1)[0]
        floor_us, barrier_us, sim_us = (statistics.median(laps[k]) * 1e6 for k in ("floor", "barrier", "sim"))
        gloo_iters = max(10, iters // 10)
        gloo_laps = simdist.run(
            timed_loop, SPEC, api="comm", where="gloo", args=(numel, gloo_iters, repeats), timeout_s=600
        )[0]
        gloo_us = statistics.median(gloo_laps) * 1e6
        rows.append((numel, floor_us, barrier_us, sim_us, gloo_us))
    print(f"all_reduce fp32 SUM on 4 ranks, gloo order; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"{'elements':>9} {'floor us':>9} {'barrier us':>10} {'SimWorld us':>11} {'gloo us':>9} "
        f"{'Sim/floor':>9} {'gloo/Sim':>9}"
    )
    table = Table(
        "all_reduce fp32 SUM on 4 ranks, gloo order: SimWorld against the floor and 4 gloo processes",
        [
            "elements",
            "floor us",
            "SimWorld barrier us",
            "SimWorld us",
            "4 gloo processes us",
            "SimWorld / floor",
            "gloo / SimWorld",
        ],
        notes="*floor*: the gloo reduction's arithmetic plus writing the result into the four rank tensors, one "
        "call; *barrier*: a 4-rank SimWorld barrier (handing the interpreter round the rank threads, no arithmetic); "
        f"*gloo*: the same loop in 4 real gloo processes on 127.0.0.1. Medians of {repeats} interleaved "
        "repeats, wall time; inputs are zeros.",
    )
    for numel, floor_us, barrier_us, sim_us, gloo_us in rows:
        print(
            f"{numel:>9} {floor_us:>9.1f} {barrier_us:>10.1f} {sim_us:>11.1f} {gloo_us:>9.1f} "
            f"{sim_us / floor_us:>8.2f}x {gloo_us / sim_us:>8.1f}x"
        )
        table.add(numel, floor_us, barrier_us, sim_us, gloo_us, sim_us / floor_us, gloo_us / sim_us)
    TABLES.append(table)


if __name__ == "__main__":
    main()
