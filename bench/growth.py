"""Error-growth benchmark: 10,000 steps of TP2/EP2 (4 ranks), three policies and the FP32 oracle, 8 seeds.

    python bench/growth.py [--steps 10000 --seeds 8 --out runs/bench-growth]

Prints steps per second and total time of the 8-seed run (target <= 45 s on a quiet 2-core machine; the
process's CPU time too, which a loaded machine inflates less than the wall time), the cost of one
seed over a short run for the batching ratio (8 seeds / 1 seed, target <= 3x), and the cost of world 8
(TP2 with DP4, and TP4 with DP2) over world 4 on the same short run (target <= 2.5x). The full run writes
the CSV, PNG and summary of ``simdist growth``. First it prints where the time of a 2000-step run goes
(``--split-steps``; `split`). Metrics are recorded every step up to step 1000, then every 10th
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


def split(steps: int, seeds: int) -> dict[str, tuple[float, int]]:
    """Where a run's time goes: ``{part: (seconds, calls)}`` of one ``steps`` x ``seeds`` run, timed by wrapping
    the parts in place (a few microseconds per call of overhead): the gradient draw, the three policies' gradient path
    steps and within them the reduction's ``sum_many`` (the two-member group sums), the oracle's steps and its
    reductions, the metrics, and the rest (checkpoints, CSV, plot)."""
    from simdist.gradpath.batched import BatchedPath
    from simdist.reduce import make_reduction
    from simdist.studies.growth import run, stream

    spent: dict[str, list[float]] = {}

    def timed_call(name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = spent.setdefault(name, [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1

        return wrapper

    reduction = type(make_reduction(GrowthConfig().reduction))
    patches = [
        (BatchedPath, "run_step", "gradient path"),
        (reduction, "sum_many", "gradient path: sum_many"),
        (run._OracleRun, "run_step", "oracle"),
        (reduction, "reduce", "oracle: reduce"),
        (stream.BatchedGradients, "draw", "draw"),
        (run, "divergence_each", "metrics"),
        (run, "Reference", "metrics: reference"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, name in patches:
        setattr(owner, attr, timed_call(name, getattr(owner, attr)))
    scratch = tempfile.mkdtemp()
    try:
        total = timed(GrowthConfig(POLICIES, steps, seeds, checkpoint_every=500), scratch, False)
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
        shutil.rmtree(scratch, ignore_errors=True)
    out = {name: (seconds, calls) for name, (seconds, calls) in spent.items()}
    out["metrics"] = (out["metrics"][0] + out.pop("metrics: reference")[0], out["metrics"][1])
    out["rest"] = (
        total - sum(out[k][0] for k in ("gradient path", "draw", "oracle", "metrics")),
        1,
    )  # checkpoints, CSV, plot
    out["total"] = (total, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--ratio-steps", type=int, default=1000, help="steps of the 1-vs-N seed comparison")
    parser.add_argument("--out", default="runs/bench-growth")
    parser.add_argument("--split-steps", type=int, default=2000, help="steps of the timed split (0: none)")
    args = parser.parse_args()

    if args.split_steps:
        parts = split(args.split_steps, args.seeds)
        total, steps = parts["total"][0], args.split_steps
        print(f"split of a {steps}-step x {args.seeds}-seed run ({total:.1f} s; the 10k run's metrics are sparser):")
        for name, (seconds, calls) in parts.items():
            if name == "total":
                continue
            per = f", {calls / steps:.0f} calls/step, {1e6 * seconds / calls:.0f} us each" if calls > 1 else ""
            print(f"  {name:18s} {seconds:6.2f} s {100 * seconds / total:5.1f} %{per}")

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
