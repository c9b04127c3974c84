"""Cost of the precision audit: one gradient-path step with and without `simdist.audit`.

    python bench/audit.py [--repeats 30] [--steps 1]

One optimizer step of the gradient path (`simdist.gradpath.path.train_rank`) on a
4-rank SimWorld (TP2/EP2, gloo reduction), ``bf16_writeback``, the
default synthetic parameters. Three variants, timed in interleaved rounds so
that machine noise hits them alike:

* plain       -- ``world.run(train_rank, ...)``;
* audited     -- ``world.run(audited(train_rank), ...)``: every rank under its
                 own audit, collectives recorded, rounding errors computed;
* no errors   -- the same with ``errors=False``;
* empty mode  -- a TorchDispatchMode that only calls each op: the floor any
                 dispatch-mode audit pays on this workload.

Figures are medians over the rounds of the wall time and of this process's
CPU time for one ``world.run`` (thread start-up included); the ratios are
taken within this run. On a loaded machine the CPU-time ratio is the steadier. The audit's cost is
per dispatched op, so the ratio depends on how small the ops are: these are
tiny tensors (a few hundred elements), the worst case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from simdist.audit import audited
from simdist.gradpath.path import PathConfig, train_rank
from simdist.policies.catalogue import get_policy
from simdist.reduce.gloo import Gloo
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, SyntheticGradients
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

sys.path.append(str(Path(__file__).resolve().parent))  # bench/report.py, also when loaded by path
from report import Table, machine, write

SPEC = ParallelSpec(4, tp=2, ep=2)


class _EmptyMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _empty_mode(comm, *args):
    with _EmptyMode():
        return train_rank(comm, *args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="also write the table as bench/report.py's schema")
    ns = parser.parse_args(argv)
    started_on = machine()
    world = SimWorld(SPEC, reduction=Gloo())
    args = (
        list(DEFAULT_PARAMS),
        InitialWeights(SPEC),
        SyntheticGradients(SPEC),
        get_policy("bf16_writeback"),
        PathConfig(steps=ns.steps),
    )
    variants = {
        "plain": train_rank,
        "audited": audited(train_rank),
        "no errors": audited(train_rank, errors=False),
        "empty mode": _empty_mode,
    }
    median, median_cpu = _time(world, args, variants, ns.repeats)
    _, report = world.run(variants["audited"], *args)[0]
    print(
        f"gradient path, {SPEC.describe()}, bf16_writeback, {ns.steps} step(s), {len(DEFAULT_PARAMS)} params, "
        f"median of {ns.repeats} interleaved rounds"
    )
    print(f"rank 0 records {report.total} events at {len(report.sites)} sites per run")
    print(f"  {'':<10} {'wall':>8}    {'ratio':>6}   {'CPU':>8}    {'ratio':>6}")
    for name in variants:
        t, c = median[name], median_cpu[name]
        print(
            f"  {name:<10} {1e3 * t:8.2f} ms {t / median['plain']:6.2f}x   "
            f"{1e3 * c:8.2f} ms {c / median_cpu['plain']:6.2f}x"
        )
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (other processes inflate wall time; "
        "CPU time is this process's own); target: audited <= 3x plain"
    )
    if ns.json:
        write(ns.json, [_table(ns, median, median_cpu, report)], machine_text=started_on)


def _time(world: SimWorld, args: tuple, variants: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Each variant's median wall and CPU seconds of one ``world.run`` over ``repeats`` interleaved rounds, after
    one warm-up run each."""
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up: op tables, site caches, lazy imports
        world.run(fn, *args)
    for _ in range(repeats):
        for name, fn in variants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            world.run(fn, *args)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    median = {name: statistics.median(t) for name, t in wall.items()}
    median_cpu = {name: statistics.median(t) for name, t in cpu.items()}
    return median, median_cpu


def _table(ns: argparse.Namespace, median: dict[str, float], median_cpu: dict[str, float], report) -> Table:
    """The figures as bench/report.py's `Table`."""
    table = Table(
        f"One gradient-path step, {SPEC.describe()}, bf16_writeback, {ns.steps} step(s), "
        f"{len(DEFAULT_PARAMS)} parameters",
        ["variant", "wall ms", "wall / plain", "CPU ms", "CPU / plain"],
    )
    for name in median:
        t, c = median[name], median_cpu[name]
        table.add(name, 1e3 * t, t / median["plain"], 1e3 * c, c / median_cpu["plain"])
    table.notes = (
        f"Medians of {ns.repeats} interleaved rounds of one `world.run` (thread start-up included); rank 0 "
        f"records {report.total} events at {len(report.sites)} sites per run. *audited*: every rank under "
        "`simdist.audit` with rounding errors measured; *no errors*: the same without them; *empty mode*: a "
        "dispatch mode that only calls each op (the floor of any dispatch-mode audit). Target: audited <= 3x "
        "plain. CPU time is this process's own; wall time includes other jobs' load."
    )
    return table


if __name__ == "__main__":
    main()
