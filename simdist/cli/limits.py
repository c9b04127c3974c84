"""Upper bounds of the CLI's size arguments, checked before anything is allocated.

Each size argument (world size, steps, GAS, seeds, ...) has a fixed ceiling, and the run as a whole has a
memory estimate that must fit in the memory this machine has available. Both checks happen before the run
starts; a violation is a `SizeError` (a `simdist.errors.UsageError`: one line, exit status 2) that states
the limit and the estimated memory.

The estimates are linear fits calibrated on this repository's default workloads (``DEFAULT_PARAMS``:
1040 elements per rank); they are upper-end figures for resident memory, not exact accounting:

* ``repro``: every rank keeps every captured stage of every step and micro-step for the oracle, the
  |terms| run and each policy: about `REPRO_BYTES_PER_RANK_STEP` per (rank, step, micro-step, run);
* ``growth``: the batched states, about `GROWTH_BYTES_PER_SEED_RANK_RUN` per (seed, rank, run) with
  their temporaries, plus the metrics array ``steps x policies x seeds x columns`` float64 three times
  (the array, the checkpoint's copy, its serialisation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from simdist.errors import UsageError

BASE_BYTES = 400 * 2**20
"""The interpreter with torch, numpy and matplotlib imported (measured ~250-300 MB resident), rounded up."""

REPRO_BYTES_PER_RANK_STEP = 256 * 2**10
"""Captures of one rank, step and micro-step of one run (oracle, |terms| or policy) in ``simdist repro``."""

GROWTH_BYTES_PER_SEED_RANK_RUN = 64 * 2**10
"""Batched state and temporaries of one seed, rank and run (oracle or policy) in ``simdist growth``."""

MOE_BYTES_PER_RANK = 8 * 2**20
"""One rank of the folded MoE block in SimWorld (weights, activations, autograd graph), rounded up."""

LIMITS: dict[str, int] = {
    "world_size": 512,  # each simulated rank is a thread
    "tp": 512,
    "ep": 512,
    "etp": 512,
    "steps": 10_000_000,
    "gas": 4096,
    "seeds": 100_000,
    "checkpoint_every": 10_000_000,
}
"""The ceiling of each size argument (``--world-size`` ... ``--checkpoint-every``)."""

SEED_LIMIT = 2**63 - 1
"""``--seed`` must lie in ``[-SEED_LIMIT, SEED_LIMIT]`` (a 64-bit generator seed)."""


class SizeError(UsageError):
    """A size argument above its ceiling, or a run whose estimated memory does not fit (one line)."""


def human_bytes(n: float) -> str:
    """``1.5 GiB``, ``300 MiB``, ``12 KiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def available_memory() -> int:
    """Bytes of memory available to a new allocation: ``MemAvailable`` on Linux, physical memory otherwise."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**63


@dataclass(frozen=True)
class Estimate:
    """The estimated resident memory of a run and what it is made of (for the error message)."""

    bytes: int
    why: str


def repro_estimate(world_size: int, steps: int, gas: int, policies: int, source: str) -> Estimate:
    """Memory of ``simdist repro``: captures of the oracle, the |terms| run (synthetic source) and every policy."""
    runs = policies + (2 if source == "synthetic" else 1)
    per = MOE_BYTES_PER_RANK if source == "moe" else 0
    total = BASE_BYTES + world_size * (per + steps * gas * runs * REPRO_BYTES_PER_RANK_STEP)
    return Estimate(total, f"{world_size} ranks x {steps} steps x GAS {gas} x {runs} runs of captures")


def growth_estimate(world_size: int, steps: int, seeds: int, policies: int, source: str) -> Estimate:
    """Memory of ``simdist growth``: batched states (synthetic) or one MoE run at a time, plus the metrics."""
    columns = 11 if source == "moe" else 12
    metrics = 3 * steps * policies * seeds * columns * 8
    if source == "moe":
        state = 2 * world_size * MOE_BYTES_PER_RANK
    else:
        state = seeds * world_size * (policies + 1) * GROWTH_BYTES_PER_SEED_RANK_RUN
    return Estimate(
        BASE_BYTES + metrics + state,
        f"metrics {human_bytes(metrics)} ({steps} steps x {policies} policies x {seeds} seeds), "
        f"states {human_bytes(state)}",
    )


def check_sizes(values: dict[str, int | None]) -> None:
    """`SizeError` naming the first argument in ``values`` (``--name``: value) above its ceiling."""
    for name, value in values.items():
        if value is None:
            continue
        if name == "seed":
            if abs(value) > SEED_LIMIT:
                raise SizeError(f"--seed {value} is outside the limit [-{SEED_LIMIT}, {SEED_LIMIT}]")
            continue
        limit = LIMITS[name]
        if value > limit:
            raise SizeError(f"--{name.replace('_', '-')} {value} is above the limit {limit}")


def check_memory(estimate: Estimate, available: int | None = None) -> None:
    """`SizeError` when ``estimate`` exceeds 80% of the available memory."""
    budget = int(0.8 * (available_memory() if available is None else available))
    if estimate.bytes > budget:
        raise SizeError(
            f"this run needs an estimated {human_bytes(estimate.bytes)} of memory ({estimate.why}), "
            f"above the limit of {human_bytes(budget)} (80% of the {human_bytes(budget / 0.8)} "
            "available); use fewer ranks, steps or seeds"
        )


def check_run(values: dict[str, int | None], estimate: Estimate) -> None:
    """Both checks, the per-argument ceilings first; the ceiling's message also states the estimated memory."""
    try:
        check_sizes(values)
    except SizeError as exc:
        raise SizeError(f"{exc} (this run would need an estimated {human_bytes(estimate.bytes)} of memory)") from None
    check_memory(estimate)
