"""Training steps per second of the folded MoE block on 4 ranks: SimWorld vs real gloo processes vs the floor.

    python bench/training.py [--steps 20] [--repeats 3] [--policy bf16_writeback] [--gas 1]

All three run the same rank program (`train_rank` with `MoEGradients`,
TP2/EP2/ETP1 on 4 ranks, the same policy, steps and data):

* floor    -- the four ranks' local compute back to back on one CPU thread,
              each rank with a loopback communicator that does no
              communication (all_reduce is a no-op, an all-gather repeats the
              local slice, an all-to-all sends every row to itself), so the
              compute is that of a real rank up to routing loads;
* SimWorld -- the 4 ranks as threads of this process (gloo reduction order);
* gloo     -- 4 real gloo processes on 127.0.0.1, one intra-op thread each,
              timed inside the ranks (between barriers, after a warm-up), so
              process start-up is not counted; it is printed separately.

Figures are the best of ``--repeats`` timed runs; ratios are taken within the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import simdist
from simdist.gradpath.path import PathConfig, train_rank
from simdist.policies.catalogue import get_policy
from simdist.reduce.gloo import Gloo
from simdist.sources.moe import MoEGradients
from simdist.world.groups import Group, group_for
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

sys.path.append(str(Path(__file__).resolve().parent))  # bench/report.py, also when loaded by path
from report import Table, machine, write

SPEC = ParallelSpec(4, tp=2, ep=2)


class LoopbackComm:
    """A `Comm` for one rank that communicates with nobody: the floor's communicator."""

    def __init__(self, spec: ParallelSpec, rank: int) -> None:
        self.spec, self._rank = spec, rank

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self, group: Group | None = None) -> int:
        return self.spec.world_size if group is None else group.size

    def group(self, kind: str) -> Group:
        return group_for(self.spec, kind, self._rank)

    def all_reduce(self, tensor, op=None, group=None) -> None:
        pass

    def reduce_scatter_tensor(self, output, input, op=None, group=None) -> None:
        output.copy_(input.reshape(-1)[: output.numel()].view(output.shape))

    def all_gather_into_tensor(self, output, input, group=None) -> None:
        n = output.numel() // max(input.numel(), 1)
        output.copy_(input.reshape(-1).repeat(n).view(output.shape))

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None) -> None:
        if output.numel():
            output.copy_(input.view(output.shape))

    def broadcast(self, tensor, src, group=None) -> None:
        pass

    def barrier(self, group=None) -> None:
        pass


def _run(comm, steps: int, policy: str, gas: int):
    source = MoEGradients(comm.spec, seed=0, gas=gas)
    config = PathConfig(steps=steps, gas=gas)
    return train_rank(comm, source.params, source.initial, source, get_policy(policy), config, frozenset())


def gloo_rank(comm, steps: int, repeats: int, policy: str, gas: int) -> list[float]:
    """Rank program: a warm-up, then ``repeats`` timed runs of ``steps`` steps; seconds per run."""
    _run(comm, 2, policy, gas)
    laps = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        _run(comm, steps, policy, gas)
        comm.barrier()
        laps.append(time.perf_counter() - start)
    return laps


def floor(steps: int, policy: str, gas: int) -> float:
    """Seconds for the four ranks' local compute, back to back on this thread."""
    start = time.perf_counter()
    for rank in range(SPEC.world_size):
        _run(LoopbackComm(SPEC, rank), steps, policy, gas)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--policy", default="bf16_writeback")
    parser.add_argument("--json", metavar="PATH", help="also write the table as bench/report.py's schema")
    ns = parser.parse_args()
    started_on = machine()
    steps, repeats = ns.steps, ns.repeats

    torch.set_num_threads(1)
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if affinity:
        os.sched_setaffinity(0, {min(affinity)})  # the floor on one CPU, like SimWorld's rank threads
    floor(2, ns.policy, ns.gas)
    floor_s = min(floor(steps, ns.policy, ns.gas) for _ in range(repeats))
    if affinity:
        os.sched_setaffinity(0, affinity)

    world = SimWorld(SPEC, reduction=Gloo())
    world.run(_run, 2, ns.policy, ns.gas)
    sim_laps = []
    for _ in range(repeats):
        start = time.perf_counter()
        world.run(_run, steps, ns.policy, ns.gas)
        sim_laps.append(time.perf_counter() - start)
    sim_s = min(sim_laps)

    start = time.perf_counter()
    laps = simdist.run(
        gloo_rank, SPEC, api="comm", where="gloo", args=(steps, repeats, ns.policy, ns.gas), timeout_s=600
    )
    total = time.perf_counter() - start
    gloo_s = min(max(rank[i] for rank in laps) for i in range(repeats))

    print(
        f"bench/training.py: folded MoE block, {SPEC.describe()}, {ns.policy}, {steps} steps x GAS {ns.gas}, "
        f"best of {repeats}; {os.cpu_count()} CPUs"
    )
    print(f"{'world':<10} {'steps/s':>9} {'ms/step':>9}")
    for name, seconds in (("floor", floor_s), ("SimWorld", sim_s), ("4 gloo", gloo_s)):
        print(f"{name:<10} {steps / seconds:>9.1f} {1000 * seconds / steps:>9.2f}")
    print(f"SimWorld / floor: {sim_s / floor_s:.2f}x the floor's time (target <= 1.5x)")
    print(f"gloo / SimWorld:  SimWorld is {gloo_s / sim_s:.1f}x faster than 4 gloo processes (target >= 5x)")
    print(f"gloo end to end (spawn, warm-up, {repeats} runs): {total:.1f} s")
    if ns.json:
        table = Table(
            f"Folded MoE block, {SPEC.describe()}, {ns.policy}, {steps} steps x GAS {ns.gas}, best of {repeats}",
            ["world", "steps/s", "ms/step", "time / SimWorld"],
            notes="The same rank program (`train_rank` with `MoEGradients`) three ways: *floor*, the ranks one "
            "after another on one CPU thread, each with a loopback communicator that does no communication; "
            "*SimWorld*, 4 rank threads; *4 gloo*, 4 real gloo processes on 127.0.0.1 (process start-up not "
            f"counted; end to end {total:.1f} s). Targets: SimWorld <= 1.5x the floor, >= 5x faster than gloo.",
        )
        for name, seconds in (("floor", floor_s), ("SimWorld", sim_s), ("4 gloo", gloo_s)):
            table.add(name, steps / seconds, 1000 * seconds / steps, seconds / sim_s)
        write(ns.json, [table], machine_text=started_on)


if __name__ == "__main__":
    main()
