"""Error-growth benchmark: 10,000 steps of TP2/EP2 (4 ranks), three policies and the FP32 oracle, 8 seeds.

    python bench/growth.py [--steps 10000 --seeds 8 --out runs/bench-growth]

Prints steps per second and total time of the 8-seed run, and the cost of one
seed over a short run for the batching ratio (8 seeds / 1 seed, target <= 3x).
The full run writes the CSV, PNG and summary of ``simdist growth``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from simdist.studies.growth import FILES, GrowthConfig, run_growth

POLICIES = ("bf16_writeback", "fp32_staging", "bf16_only")


def timed(config: GrowthConfig, out: str, progress: bool) -> float:
    start = time.perf_counter()
    run_growth(config, out, force=True, progress=progress)
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
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"batching: {args.ratio_steps} steps, 1 seed {one:.2f} s, {args.seeds} seeds {many:.2f} s "
          f"-> {many / one:.2f}x one seed (target <= 3x)")

    config = GrowthConfig(POLICIES, args.steps, args.seeds, checkpoint_every=500)
    total = timed(config, args.out, True)
    print(f"growth: {args.steps} steps x {args.seeds} seeds x {len(POLICIES)} policies + FP32 oracle, "
          f"TP2/EP2 on 4 ranks: {total:.1f} s total, {args.steps / total:.0f} steps/s "
          f"(target < 600 s; includes metrics, checkpoints every 500 steps, CSV and plot)")
    print(f"wrote {args.out}/{FILES['metrics']}, {args.out}/{FILES['plot']}")


if __name__ == "__main__":
    main()
