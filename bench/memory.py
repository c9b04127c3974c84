"""Peak resident memory per rank: process mode (the simdist backend in real processes) against real gloo.

    python bench/memory.py [--ranks 4] [--calls 60] [--object-mb 25] [--p8] [--preload deepspeed]

Two rank programs, each run on ``--ranks`` processes launched the same way (``simdist.run(where="gloo"|"processes")``,
one intra-op thread), once on real gloo and once on the ``simdist`` backend in process mode:

* ``all_reduce``      -- ``--calls`` in-place ``dist.all_reduce`` of a 4 MiB fp32 tensor;
* ``scatter_objects`` -- ``dist.scatter_object_list`` of one ``--object-mb`` MB object per rank from rank 0, then
                         ``dist.broadcast_object_list`` of one such object.

Each rank reports its peak resident set size (``VmHWM``) and its resident set at the end (``VmRSS``); the table
shows the largest rank's figures, the root's and a non-root's for the scatter, and the ratio of process mode's
peak to gloo's (issue 34's target: <= 1.3x at 4 ranks). ``--p8`` adds the scatter at 8 ranks (which once ran out
of memory in process mode). ``--preload deepspeed`` (or ``megatron``) forks every rank from a forkserver that
imported the framework: what each rank of a plain launch carried, before launches got a forkserver per preload
set (`simdist.world.processes.forkservers`), once any launch of the process had preloaded it; the ``modules`` columns
count
each rank's ``sys.modules``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import simdist


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def memory_rank(rank: int, case: str, calls: int, object_mb: int) -> dict[str, float]:
    """Rank program: one of the cases above; this rank's peak and final resident set (MB) and seconds."""
    start, start_mb = time.perf_counter(), _status_kb("VmRSS") / 1024
    if case == "all_reduce":
        x = torch.zeros(1 << 20)  # 4 MiB of fp32, zeros: an in-place loop stays finite
        for _ in range(calls):
            dist.all_reduce(x)
    elif case == "scatter_objects":
        world = dist.get_world_size()
        size = object_mb * 1_000_000
        inputs = [bytes([r % 251]) * size for r in range(world)] if rank == 0 else None
        out: list = [None]
        dist.scatter_object_list(out, inputs, src=0)
        assert len(out[0]) == size and out[0][:1] == bytes([rank % 251])
        del inputs
        box = [bytes([7]) * size] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        assert len(box[0]) == size
    else:
        raise ValueError(f"unknown case {case!r}")
    dist.barrier()
    return {
        "peak_mb": _status_kb("VmHWM") / 1024,
        "rss_mb": _status_kb("VmRSS") / 1024,
        "start_mb": start_mb,
        "modules": len(sys.modules),
        "seconds": time.perf_counter() - start,
    }


def run_case(
    case: str, ranks: int, backend: str, calls: int, object_mb: int, preload: tuple[str, ...] = ()
) -> list[dict[str, float]]:
    """Per-rank figures of ``case`` on ``ranks`` fresh processes of ``backend`` ("gloo" or "simdist"), forked from a
    server that imported ``preload``."""
    where = "gloo" if backend == "gloo" else "processes"
    return simdist.run(memory_rank, ranks, where=where, args=(case, calls, object_mb), timeout_s=600, preload=preload)


def framework_modules(name: str | None) -> tuple[str, ...]:
    """The modules the cases preload for the framework ``name`` (``deepspeed``, ``megatron``; ``None``: none)."""
    if name is None:
        return ()
    from simdist.cases.ranks import DEEPSPEED_MODULES, MEGATRON_MODULES

    return {"deepspeed": DEEPSPEED_MODULES, "megatron": MEGATRON_MODULES}[name]


def measure(
    ranks: int = 4,
    calls: int = 60,
    object_mb: int = 25,
    p8: bool = False,
    progress=print,
    preload: tuple[str, ...] = (),
) -> tuple[list[str], list[list]]:
    """The table's (columns, rows): every case on gloo and in process mode."""
    columns = [
        "case",
        "ranks",
        "gloo peak MB (max rank)",
        "process mode peak MB (max rank)",
        "process / gloo (max rank)",
        "process / gloo (non-root)",
        "target",
        "gloo s",
        "process mode s",
        "gloo modules",
        "process mode modules",
    ]
    rows = []
    cases = [("all_reduce", ranks), ("scatter_objects", ranks)] + ([("scatter_objects", 8)] if p8 else [])
    for case, n in cases:
        progress(f"  memory: {case} on {n} ranks")
        gloo = run_case(case, n, "gloo", calls, object_mb, preload)
        sim = run_case(case, n, "simdist", calls, object_mb, preload)
        g_peak, s_peak = max(r["peak_mb"] for r in gloo), max(r["peak_mb"] for r in sim)
        g_other, s_other = max(r["peak_mb"] for r in gloo[1:]), max(r["peak_mb"] for r in sim[1:])
        rows.append(
            [
                case,
                n,
                round(g_peak),
                round(s_peak),
                round(s_peak / g_peak, 2),
                round(s_other / g_other, 2),
                "<= 1.3x" if n == 4 else "runs",
                round(max(r["seconds"] for r in gloo), 2),
                round(max(r["seconds"] for r in sim), 2),
                max(r["modules"] for r in gloo),
                max(r["modules"] for r in sim),
            ]
        )
    return columns, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--object-mb", type=int, default=25)
    parser.add_argument("--p8", action="store_true", help="also the object scatter on 8 ranks")
    parser.add_argument(
        "--preload", choices=("deepspeed", "megatron"), default=None, help="fork the ranks from a server with it"
    )
    ns = parser.parse_args(argv)
    preload = framework_modules(ns.preload)
    progress = lambda m: print(m, file=sys.stderr)  # noqa: E731
    columns, rows = measure(ns.ranks, ns.calls, ns.object_mb, ns.p8, progress, preload)
    print(
        f"bench/memory.py: peak resident set per rank; {os.cpu_count()} CPUs, torch {torch.__version__}; "
        f"ranks forked from a server with {ns.preload or 'torch only'} preloaded"
    )
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(v) for v in row))


if __name__ == "__main__":
    main()
