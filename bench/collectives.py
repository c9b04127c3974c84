"""Microseconds per all_reduce on a 4-rank group: SimWorld vs real gloo processes vs the floor.

    python bench/collectives.py [--quick]

All three run the same reduction (the `Gloo` model's order, fp32 SUM) on
4 ranks, in one run of this script:

* floor    -- the reduction as one plain function call on the 4 rank tensors,
              plus writing the result into each of them (what an in-place
              all_reduce must do), no threads;
* barrier  -- a 4-rank SimWorld barrier: the cost of handing the
              interpreter round the rank threads, with no arithmetic;
* SimWorld -- ``comm.all_reduce`` in a loop on 4 rank threads;
* gloo     -- the same loop in 4 real gloo processes on 127.0.0.1.

Figures are medians of repeated timed loops; ratios are taken within the run.
Values grow by 4x per iteration and saturate at +-inf/NaN; IEEE adds on the
CPU take the same time for those (no subnormals arise), so every world does
exactly the reduction and nothing else.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from simdist.reduce.gloo import Gloo
from simdist.world.launch import spawn_gloo
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=1, ep=1)
SIZES = (1024, 262144)


def _iterations(numel: int, quick: bool) -> int:
    base = 2000 if numel <= 4096 else 200
    return base // 10 if quick else base


def timed_loop(comm, numel: int, iters: int, repeats: int, barrier_only: bool = False) -> list[float]:
    """Rank program: ``repeats`` timed loops of ``iters`` collectives; seconds per collective (rank 0's clock)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(comm.get_rank()))
    laps = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            if barrier_only:
                comm.barrier()
            else:
                comm.all_reduce(x)
        comm.barrier()
        laps.append((time.perf_counter() - start) / iters)
    return laps


def floor(numel: int, iters: int, repeats: int) -> list[float]:
    model = Gloo()
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(SPEC.world_size)]
    laps = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            result = model.reduce(xs)
            for x in xs:
                x.copy_(result)
        laps.append((time.perf_counter() - start) / iters)
    return laps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run, noisier figures)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    world = SimWorld(SPEC, default_model=Gloo())
    rows = []
    for numel in SIZES:
        iters = _iterations(numel, args.quick)
        floor_us = statistics.median(floor(numel, iters, args.repeats)) * 1e6
        barrier_us = statistics.median(world.run(timed_loop, numel, iters, args.repeats, True)[0]) * 1e6
        sim_us = statistics.median(world.run(timed_loop, numel, iters, args.repeats)[0]) * 1e6
        gloo_iters = max(10, iters // 10)
        gloo_laps = spawn_gloo(timed_loop, SPEC, numel, gloo_iters, args.repeats, timeout_s=600)[0]
        gloo_us = statistics.median(gloo_laps) * 1e6
        rows.append((numel, floor_us, barrier_us, sim_us, gloo_us))
    print(f"all_reduce fp32 SUM on 4 ranks, gloo order; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'elements':>9} {'floor us':>9} {'barrier us':>10} {'SimWorld us':>11} {'gloo us':>9} "
          f"{'Sim/floor':>9} {'gloo/Sim':>9}")
    for numel, floor_us, barrier_us, sim_us, gloo_us in rows:
        print(f"{numel:>9} {floor_us:>9.1f} {barrier_us:>10.1f} {sim_us:>11.1f} {gloo_us:>9.1f} "
              f"{sim_us / floor_us:>8.2f}x {gloo_us / sim_us:>8.1f}x")


if __name__ == "__main__":
    main()
