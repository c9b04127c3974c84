"""Error-growth benchmark: 10,000 steps of TP2/EP2 (4 ranks), three policies and the FP32 oracle, 8 seeds.

    python bench/growth.py [--steps 10000 --seeds 8 --out runs/bench-growth]

Prints steps per second and total time of the 8-seed run (target <= 45 s on a quiet 2-core machine; the
process's CPU time too, which a loaded machine inflates less than the wall time), the cost of one
seed over a short run for the batching ratio (8 seeds / 1 seed, target <= 3x), and the cost of world 8
(TP2 with DP4, and TP4 with DP2) over world 4 on the same short run (target <= 2.5x). The full run writes
the CSV, PNG and summary of ``simdist growth``. Metrics are recorded every step up to step 1000, then every 10th
step (`GrowthConfig.metrics_dense`, ``metrics_every``; the CSV's first line says so); the training runs every step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from simdist.studies.growth import FILES, GrowthConfig, run_growth
from simdist.world.spec import ParallelSpec

POLICIES = ("bf16_writeback", "fp32_staging", "bf16_only")


def timed(config: GrowthConfig, out: str, progress: bool, cpu: list[float] | None = None) -> float:
    """Wall seconds of one run (its CPU seconds appended to ``cpu`` if given)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    run_growth(config, out, force=True, progress=progress)
    if cpu is not None:
        cpu.append(time.process_time() - start_cpu)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--ratio-steps", type=int, default=1000, help="steps of the 1-vs-N seed comparison")
    parser.add_argument("--out", default="runs/bench-growth")
    args = parser.parse_args()

    scratch = tempfile.mkdtemp()
    try:
        one = timed(GrowthConfig(POLICIES, args.ratio_steps, 1, checkpoint_every=500), f"{scratch}/1", False)
        many = timed(GrowthConfig(POLICIES, args.ratio_steps, args.seeds, checkpoint_every=500), f"{scratch}/n", False)
        wide = {
            name: timed(
                GrowthConfig(POLICIES, args.ratio_steps, args.seeds, spec=spec, checkpoint_every=500),
                f"{scratch}/{name.replace('/', '-')}",
                False,
            )
            for name, spec in (("TP2/DP4", ParallelSpec(8, tp=2, ep=2)), ("TP4/DP2", ParallelSpec(8, tp=4, ep=2)))
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"batching: {args.ratio_steps} steps, 1 seed {one:.2f} s, {args.seeds} seeds {many:.2f} s "
        f"-> {many / one:.2f}x one seed (target <= 3x)"
    )
    for name, seconds in wide.items():
        print(
            f"world 8 ({name}): {args.ratio_steps} steps x {args.seeds} seeds {seconds:.2f} s "
            f"-> {seconds / many:.2f}x world 4 (target <= 2.5x)"
        )

    config = GrowthConfig(POLICIES, args.steps, args.seeds, checkpoint_every=500)
    cpu: list[float] = []
    total = timed(config, args.out, True, cpu)
    print(
        f"growth: {args.steps} steps x {args.seeds} seeds x {len(POLICIES)} policies + FP32 oracle, "
        f"TP2/EP2 on 4 ranks: {total:.1f} s total ({cpu[0]:.1f} s CPU), {args.steps / total:.0f} steps/s "
        f"(target <= 45 s; includes metrics, checkpoints every 500 steps, CSV and plot) "
        f"[load average {os.getloadavg()[0]:.1f}]"
    )
    print(f"wrote {args.out}/{FILES['metrics']}, {args.out}/{FILES['plot']}")


if __name__ == "__main__":
    main()
