"""Scale benchmark: reductions and the rank-batched growth study from world 8 to world 512.

    python bench/scale.py [--quick] [--worlds 8,16,...,512] [--numel 65536] [--steps 20] [--seeds 1]
                          [--reduction gloo] [--skip-growth] [--skip-models]

For each world size ``n`` it prints:

* (i) one all-reduce of ``--numel`` fp32 elements per rank under the NCCL ring and the NCCL tree models
  (Simple protocol, 2 channels; the tree is NCCL's double binary tree over ``n / 8`` nodes of 8 GPUs, each
  node an intra-node chain) and the gloo reduction: the first call (which builds and caches the plan) and the
  median of 3 later calls;
* (ii) the growth study (`simdist.studies.growth.run_growth`) on TP8 x DP(n/8) with EP8, for ``--steps``
  steps and ``--seeds`` seeds: three policies and the independent FP32 oracle (whose per-rank Python loops
  are most of the cost at large worlds), its total time and steps per second, and the fitted growth
  exponent of the median master error of ``bf16_writeback`` and ``bf16_only`` (``summarise``: log-log slope
  over the steps from ``max(10, steps / 10)``; with few steps the fit is rough, with 1000 it is the
  study's figure).

Memory is the peak resident set size during a case (the all-reduce's input included) above the resident
set size at its start, read from ``VmHWM`` after resetting it through ``/proc/self/clear_refs`` (Linux >=
4.0; elsewhere the growth of ``ru_maxrss``, which only shows a case that raises the process's peak). glibc
is told to serve blocks above 64 KiB from ``mmap`` (so freed tensors leave the resident set); memory the
allocator still holds from an earlier case is reused without raising the peak, so small cases may read low.

Before anything is allocated every case's memory is estimated (inputs, the models' copies and index
tables; `simdist.cli.limits.growth_estimate` for growth, the CLI's estimate) and checked against 80 % of
the available memory, as the CLI does: a request that does not fit stops with one line naming the estimate
(exit status 2), not an out-of-memory kill. ``--quick`` runs worlds 8-64 and 12 growth steps (a few
seconds); the default, worlds 8-512 and 20 steps, takes about 1-2 minutes on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from simdist.cli.limits import BASE_BYTES, Estimate, SizeError, check_memory, growth_estimate, human_bytes
from simdist.reduce import Reduction
from simdist.reduce.gloo import Gloo
from simdist.reduce.nccl import Nccl
from simdist.reduce.nccl.schedule import double_binary_trees
from simdist.studies.growth import GrowthConfig, run_growth
from simdist.world.spec import ParallelSpec

sys.path.append(str(Path(__file__).resolve().parent))  # bench/report.py, also when loaded by path
from report import Table, machine, write

WORLDS = (8, 16, 32, 64, 128, 256, 512)
QUICK_WORLDS = (8, 16, 32, 64)
GPUS_PER_NODE = 8
POLICIES = ("bf16_writeback", "fp32_staging", "bf16_only")
COLLECTIVE_COPIES = 3
"""Copies of the ``[n, numel]`` input a model call may hold at once: the input, the gloo reduction's reordered
hops (or the NCCL ring's gathered rows), and the partial sums."""
INDEX_BYTES_PER_ELEMENT = 4 * 8
"""Per element of one member: the cached int64 tables of a plan (chunk of each column, gather indexes)."""


def collective_estimate(n: int, numel: int, element_size: int = 4) -> Estimate:
    """Upper-end memory of one reduction-model call on ``n`` members of ``numel`` elements."""
    data = COLLECTIVE_COPIES * n * numel * element_size
    index = INDEX_BYTES_PER_ELEMENT * numel + 8 * n * n  # column tables and the ring's [n, orders] table
    return Estimate(BASE_BYTES + data + index, f"{n} ranks x {numel} elements x {COLLECTIVE_COPIES} copies")


def nccl_tree(n: int) -> Nccl:
    """NCCL's tree reduction for ``n`` ranks on ``n / 8`` nodes of 8 (fewer ranks: one node, a chain)."""
    per = min(n, GPUS_PER_NODE)
    nodes = [list(range(start, start + per)) for start in range(0, n, per)]
    return Nccl("tree", trees=double_binary_trees(nodes))


def reductions(n: int) -> dict[str, Reduction]:
    return {"nccl ring": Nccl("ring"), "nccl tree": nccl_tree(n), "gloo": Gloo()}


def growth_config(n: int, steps: int, seeds: int, reduction: str) -> GrowthConfig:
    """TP8 x DP(n/8), EP8 (fewer than 8 ranks: TP n)."""
    tp = min(n, 8)
    spec = ParallelSpec(n, tp=tp, ep=tp)
    return GrowthConfig(POLICIES, steps, seeds, spec=spec, reduction=reduction, checkpoint_every=10**9)


class PeakMemory:
    """Peak RSS of a block above the RSS at its start (``VmHWM`` reset per block where Linux allows it)."""

    def __init__(self) -> None:
        self.exact = self._reset()
        try:  # glibc: blocks above 64 KiB from mmap, returned on free (else freed memory is reused unseen)
            import ctypes

            ctypes.CDLL(None).mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD (fixed: no dynamic raise)
        except (OSError, AttributeError):
            pass

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(field)

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def measure(self, fn: Callable[[], object]) -> tuple[object, int]:
        if self.exact and self._reset():
            start = self._status("VmRSS")
            result = fn()
            return result, max(0, self._status("VmHWM") - start)
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result = fn()
        return result, max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start)


@dataclass
class Plan:
    worlds: tuple[int, ...]
    numel: int
    steps: int
    seeds: int
    reduction: str
    run_models: bool
    run_growth: bool
    json: str | None = None

    def estimates(self) -> list[tuple[str, Estimate]]:
        out = []
        for n in self.worlds:
            if self.run_models:
                out.append((f"all_reduce at world {n}", collective_estimate(n, self.numel)))
            if self.run_growth:
                est = growth_estimate(n, self.steps, self.seeds, len(POLICIES), "synthetic")
                out.append((f"growth at world {n}", est))
        return out

    def check(self, available: int | None = None) -> None:
        """`SizeError` naming the first case whose estimate does not fit (before anything is allocated)."""
        for what, estimate in self.estimates():
            try:
                check_memory(estimate, available)
            except SizeError as exc:
                raise SizeError(f"{what}: {exc}") from None


def parse(argv: list[str] | None = None) -> Plan:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="worlds 8-64, 12 growth steps")
    parser.add_argument("--worlds", help="comma-separated world sizes (multiples of 8 up to 512 for growth)")
    parser.add_argument("--numel", type=int, default=1 << 16, help="fp32 elements per rank of the all-reduce")
    parser.add_argument("--steps", type=int, default=None, help="growth steps (default 20, --quick 12)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--reduction", default="gloo", help="the growth study's reduction")
    parser.add_argument("--skip-models", action="store_true")
    parser.add_argument("--skip-growth", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the tables as bench/report.py's schema")
    args = parser.parse_args(argv)
    worlds = QUICK_WORLDS if args.quick else WORLDS
    if args.worlds:
        worlds = tuple(int(w) for w in args.worlds.split(","))
    steps = args.steps if args.steps is not None else (12 if args.quick else 20)
    if args.numel < 1 or steps < 1 or args.seeds < 1 or any(w < 1 for w in worlds):
        parser.error("--numel, --steps, --seeds and the worlds must be positive")
    return Plan(
        worlds, args.numel, steps, args.seeds, args.reduction, not args.skip_models, not args.skip_growth, args.json
    )


def bench_models(plan: Plan, peak: PeakMemory) -> Table:
    table = Table(
        f"One all-reduce of {plan.numel} fp32 elements per rank",
        ["world", "reduction", "first call ms", "median ms", "peak MiB"],
        notes="The first call builds and caches the plan; the median is of 3 later calls. Peak: resident set "
        "above the case's start, the input included. NCCL models: Simple protocol, 2 channels; the tree is "
        "NCCL's double binary tree over n / 8 nodes of 8, each node a chain.",
    )
    print(f"(i) one all-reduce of {plan.numel} fp32 elements per rank (first call builds the plan; then median of 3)")
    print(f"{'world':>6} {'model':<10} {'first':>10} {'median':>10} {'peak':>10}")
    for n in plan.worlds:
        for name, reduction in reductions(n).items():

            def first(reduction=reduction, n=n) -> tuple[torch.Tensor, float]:
                x = torch.randn(n, plan.numel, generator=torch.Generator().manual_seed(n)).mul_(1e-3)
                start = time.perf_counter()
                reduction.reduce(x)
                return x, time.perf_counter() - start

            (x, cold), used = peak.measure(first)
            warm = []
            for _ in range(3):
                start = time.perf_counter()
                reduction.reduce(x)
                warm.append(time.perf_counter() - start)
            print(
                f"{n:>6} {name:<10} {cold * 1e3:>8.1f}ms {statistics.median(warm) * 1e3:>8.1f}ms "
                f"{human_bytes(used):>10}",
                flush=True,
            )
            table.add(n, name, cold * 1e3, statistics.median(warm) * 1e3, used / 2**20)
            del x
    return table


def bench_growth(plan: Plan, peak: PeakMemory) -> Table:
    table = Table(
        f"Growth study, TP8 x DP(n/8) with EP8, {plan.steps} steps x {plan.seeds} seed(s)",
        ["world", "total s", "steps/s", "peak MiB", "exponent bf16_writeback", "exponent bf16_only"],
        notes=f"Three policies and the independent FP32 oracle, {plan.reduction} order. Exponent: log-log slope of "
        "the median master error over steps; over a few steps it is rough (the study's figure needs about 1000).",
    )
    print(
        f"(ii) growth, TP8 x DP(n/8) EP8, {plan.steps} steps x {plan.seeds} seed(s) x {len(POLICIES)} policies "
        f"+ FP32 oracle, {plan.reduction} order (exponent: median master error ~ steps^e)"
    )
    print(f"{'world':>6} {'total':>9} {'steps/s':>8} {'peak':>10} {'e bf16_writeback':>17} {'e bf16_only':>12}")
    scratch = tempfile.mkdtemp()
    try:
        for n in plan.worlds:
            config = growth_config(n, plan.steps, plan.seeds, plan.reduction)

            def run(config=config, n=n) -> tuple[dict, float]:
                start = time.perf_counter()
                summary = run_growth(config, f"{scratch}/{n}", force=True, progress=False, plot=False)
                return summary, time.perf_counter() - start

            (summary, seconds), used = peak.measure(run)
            exps = [summary["policies"][p]["master_rel_growth_exponent"] for p in ("bf16_writeback", "bf16_only")]
            shown = ["-" if e is None else f"{e:.3f}" for e in exps]
            print(
                f"{n:>6} {seconds:>8.1f}s {plan.steps / seconds:>8.2f} {human_bytes(used):>10} "
                f"{shown[0]:>17} {shown[1]:>12}",
                flush=True,
            )
            table.add(n, seconds, plan.steps / seconds, used / 2**20, *shown)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return table


def main(argv: list[str] | None = None) -> int:
    plan = parse(argv)
    try:
        plan.check()
    except SizeError as exc:
        print(f"bench/scale.py: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    started_on = machine()
    tables = []
    peak = PeakMemory()
    how = "VmHWM reset per case" if peak.exact else "ru_maxrss growth (VmHWM reset unavailable)"
    print(f"peak memory: RSS above the case's start ({how}); {os.cpu_count()} CPUs, 1 intra-op thread")
    start = time.perf_counter()
    if plan.run_models:
        tables.append(bench_models(plan, peak))
    if plan.run_growth:
        tables.append(bench_growth(plan, peak))
    print(f"total {time.perf_counter() - start:.1f} s")
    if plan.json:
        write(plan.json, tables, machine_text=started_on)
    return 0


if __name__ == "__main__":
    sys.exit(main())
