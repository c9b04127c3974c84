"""Real framework programs on 4 simdist rank threads against their compute floor and real gloo processes.

    python bench/frameworks.py [--steps 6] [--repeats 5] [--programs fsdp2,tp_fsdp2,ddp] [--no-gloo] [--profile]

Each program is unmodified ``torch.distributed`` code on 4 ranks, one intra-op thread everywhere:

* ``fsdp2``    -- ``fully_shard`` per block and on the root, ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``,
                  AdamW, a GPT-ish MLP stack;
* ``tp_fsdp2`` -- the same stack on a 2 x 2 mesh: column/row tensor parallelism on ``tp``, ``fully_shard`` on
                  ``dp`` (DTensor on both dimensions);
* ``ddp``      -- ``DistributedDataParallel`` of the same stack with the bf16 compression comm hook, SGD.

and each runs in four worlds, in one run of this script, interleaved per repeat:

* floor    -- the 4 ranks one after another on this thread, each on torch's ``fake`` backend (collectives do
              no communication and no arithmetic): the ranks' own compute, framework code included;
* threads  -- ``simdist.run``: 4 rank threads, the ``simdist`` backend, gloo's reduction order;
* gloo     -- 4 real gloo processes on 127.0.0.1 (``--no-gloo`` leaves them out; timed inside the ranks).

The figure is CPU seconds per step of the whole world (all ranks): this process's CPU time for the floor and
the threads (the rank threads run one at a time), the sum of the ranks' CPU times for gloo. CPU time is what a
busy shared machine disturbs least; wall seconds are printed beside it. Medians of ``--repeats`` laps of
``--steps`` steps after a warm-up step; ratios within the run. ``--profile`` prints cProfile's top functions of
one threaded lap (where simdist's overhead is).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import simdist
from simdist.world.threads.spawn import _clear_mesh_caches

WORLD = 4
WIDTH, BLOCKS, BATCH = 256, 4, 32
"""The model: BLOCKS residual-free MLP blocks Linear(WIDTH, 4 WIDTH) -> GELU -> Linear(4 WIDTH, WIDTH), a batch of
BATCH rows per rank."""


def _stack(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = []
    for _ in range(BLOCKS):
        blocks.append(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)))
    return nn.Sequential(*blocks)


def _batch(rank: int, step: int, width: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, width, generator=generator)


def _fsdp2(rank: int, width: int) -> Callable[[int], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _stack(width)
    mesh = init_device_mesh("cpu", (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step(i: int) -> None:
        model(_batch(rank, i, width)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def _tp_fsdp2(rank: int, width: int) -> Callable[[int], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _stack(width)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for block in model:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    dp_rank = mesh["dp"].get_local_rank()

    def step(i: int) -> None:
        model(_batch(dp_rank, i, width)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def _bf16_hook(state, bucket):  # no return annotation: DDP checks it against the real class, not a string
    """DDP comm hook: each bucket averaged in BF16 (torch's own bf16 hook refuses CPU groups)."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(compressed)  # all_reduce wrote it in place (the fake backend's future holds no value)
        return buffer

    return future.then(decompress)


def _ddp(rank: int, width: int) -> Callable[[int], None]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_stack(width))
    model.register_comm_hook(None, _bf16_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        model(_batch(rank, i, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


PROGRAMS: dict[str, Callable[[int, int], Callable[[int], None]]] = {"fsdp2": _fsdp2, "tp_fsdp2": _tp_fsdp2, "ddp": _ddp}


def rank_laps(rank: int, program: str, steps: int, laps: int, width: int = WIDTH) -> list[tuple[float, float]]:
    """Rank program: build ``program``, one warm-up step, then ``laps`` laps of ``steps`` steps: (wall, CPU) each.

    Between barriers, so on rank threads (which run one at a time) rank 0's lap spans every rank's steps, and
    this process's CPU time is all ranks' CPU time."""
    torch.set_num_threads(1)
    step = PROGRAMS[program](rank, width)
    step(0)
    out = []
    for lap in range(laps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            step(1 + lap * steps + i)
        dist.barrier()
        out.append((time.perf_counter() - wall, time.process_time() - cpu))
    return out


_FLOOR_TOKENS = itertools.count(1)
"""A mesh identity per floor rank: DTensor's caches are keyed on meshes, whose hash holds no process group."""


def floor_lap(program: str, steps: int, width: int = WIDTH) -> tuple[float, float]:
    """The 4 ranks one after another on this thread on torch's fake backend: (wall, CPU) of their timed steps."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    wall = cpu = 0.0
    original = DeviceMesh.__init__
    token = [0]

    def mesh_init(self, *args, **kwargs):  # each rank's meshes its own identity, as on rank threads
        original(self, *args, **kwargs)
        if getattr(self, "_thread_id", 0) is None:
            self._thread_id, self._hash = -token[0], None

    for rank in range(WORLD):
        dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
        token[0] = next(_FLOOR_TOKENS)
        setattr(DeviceMesh, "__init__", mesh_init)  # noqa: B010
        try:
            step = PROGRAMS[program](rank, width)
            step(0)
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(steps):
                step(1 + i)
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
        finally:
            setattr(DeviceMesh, "__init__", original)  # noqa: B010
            dist.destroy_process_group()
            _clear_mesh_caches()
    return wall, cpu


def threads_lap(program: str, steps: int, width: int = WIDTH) -> tuple[float, float]:
    """One lap on 4 simdist rank threads: rank 0's (wall, process CPU) of the timed steps."""
    return simdist.run(rank_laps, WORLD, args=(program, steps, 1, width), reduction="gloo", timeout_s=600)[0][0]


@dataclass
class Row:
    program: str
    floor: list[tuple[float, float]]
    threads: list[tuple[float, float]]
    gloo: list[tuple[float, float]]


def _median(laps: list[tuple[float, float]], index: int, steps: int) -> float:
    return statistics.median(lap[index] for lap in laps) / steps if laps else float("nan")


def measure(programs: list[str], steps: int, repeats: int, gloo: bool, width: int = WIDTH, progress=print) -> list[Row]:
    """Every program in every world, floor and threads interleaved per repeat, gloo after them."""
    torch.set_num_threads(1)
    rows = []
    for program in programs:
        row = Row(program, [], [], [])
        floor_lap(program, 1, width)  # warm: first-call imports and caches
        threads_lap(program, 1, width)
        for r in range(repeats):
            row.floor.append(floor_lap(program, steps, width))
            row.threads.append(threads_lap(program, steps, width))
            progress(f"  {program}: repeat {r + 1}/{repeats}")
        if gloo:
            per_rank = simdist.run(rank_laps, WORLD, where="gloo", args=(program, steps, repeats, width), timeout_s=900)
            # wall: the slowest rank's lap; CPU: all ranks' CPU in the lap
            row.gloo = [
                (max(rank[i][0] for rank in per_rank), sum(rank[i][1] for rank in per_rank)) for i in range(repeats)
            ]
        rows.append(row)
    return rows


TARGETS = {"fsdp2": 1.5, "tp_fsdp2": 1.5, "ddp": 1.2}


def table(rows: list[Row], steps: int) -> tuple[list[str], list[list]]:
    """The figures as (columns, rows): ms per step (CPU and wall) and the ratios to the floor."""
    columns = [
        "program",
        "floor ms CPU",
        "threads ms CPU",
        "threads / floor (CPU)",
        "target",
        "simdist ms CPU per rank-step",
        "floor ms wall",
        "threads ms wall",
        "gloo ms CPU (4 ranks)",
        "gloo ms wall",
    ]
    out = []
    for row in rows:
        f_cpu, t_cpu = _median(row.floor, 1, steps), _median(row.threads, 1, steps)
        out.append(
            [
                row.program,
                round(1000 * f_cpu, 2),
                round(1000 * t_cpu, 2),
                round(t_cpu / f_cpu, 2),
                f"<= {TARGETS[row.program]}x",
                round(1000 * (t_cpu - f_cpu) / WORLD, 2),
                round(1000 * _median(row.floor, 0, steps), 2),
                round(1000 * _median(row.threads, 0, steps), 2),
                round(1000 * _median(row.gloo, 1, steps), 2) if row.gloo else "n/a",
                round(1000 * _median(row.gloo, 0, steps), 2) if row.gloo else "n/a",
            ]
        )
    return columns, out


def profile(program: str, steps: int, width: int = WIDTH, top: int = 30) -> str:
    """cProfile of the timed steps of one threaded lap, every rank thread's calls (after building and a warm-up
    step on each rank), sorted by own time; then the callers of the simdist functions among them."""
    profiles: list[cProfile.Profile] = []

    def profiled(rank: int) -> None:
        torch.set_num_threads(1)
        step = PROGRAMS[program](rank, width)
        step(0)
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        try:
            for i in range(steps):
                step(1 + i)
            dist.barrier()
        finally:
            prof.disable()
            profiles.append(prof)

    simdist.run(profiled, WORLD, reduction="gloo", timeout_s=600)
    stream = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=stream)
    for extra in profiles[1:]:
        stats.add(extra)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("simdist", top)
    return stream.getvalue()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--width", type=int, default=WIDTH, help="the MLP's width (a small one shows the overhead)")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--profile", action="store_true")
    ns = parser.parse_args(argv)
    programs = [p for p in ns.programs.split(",") if p]
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown:
        parser.error(f"unknown program(s) {unknown}; choose from {sorted(PROGRAMS)}")
    if ns.profile:
        for program in programs:
            print(profile(program, ns.steps, ns.width))
        return
    rows = measure(
        programs, ns.steps, ns.repeats, not ns.no_gloo, ns.width, progress=lambda m: print(m, file=sys.stderr)
    )
    columns, body = table(rows, ns.steps)
    print(
        f"bench/frameworks.py: {WORLD} ranks, MLP {BLOCKS} x {ns.width}, batch {BATCH}, {ns.steps} steps, "
        f"median of {ns.repeats}; {os.cpu_count()} CPUs"
    )
    print(" | ".join(columns))
    for line in body:
        print(" | ".join(str(v) for v in line))


if __name__ == "__main__":
    main()
