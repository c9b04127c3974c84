"""simdist against its floors, from one run: one table of ratios per target, with the machine named, and a JSON
result file the docs' benchmarks page renders.

    python bench/targets.py [--name NAME] [--full] [--p8] [--no-gloo]

Runs, in this order, on the machine it is started on:

1. real programs on 4 rank threads against their compute floor (`bench/frameworks.py`: FSDP2 with
   MixedPrecisionPolicy, TP+FSDP2 on a 2 x 2 mesh, DDP with a BF16 comm hook; torch's ``fake`` backend is the
   floor; real gloo processes beside them), CPU time;
2. one all_reduce against the thread floor (handoffs + reduction + writes, each timed alone in the same run) and
   64 MiB per rank against the memory-bandwidth floor (`bench/collectives.py --per-call`), CPU time;
3. process mode's peak resident set per rank against real gloo's (`bench/memory.py`; ``--p8`` adds the 8-rank
   object scatter);
4. growth and properties (`bench/growth.py`, `bench/properties.py`): by default a 1000-step x 8-seed growth run
   and 200 property examples (``--full``: the 10,000-step run and 400 examples).

It prints each table as it is measured and then the summary (one row per target), and writes everything to
``bench/results/<name>.json`` (default name: ``targets``) through `report.write`, the schema the docs render.

About 5 minutes on a quiet 2-vCPU machine with the defaults. Ratios are taken within the run; on a machine
shared with other work, CPU-time ratios hold better than wall-clock ones (the load average is recorded).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time

# the sibling benches as top-level modules: this directory is sys.path[0] here and in the rank processes
import collectives  # type: ignore[import-not-found]
import frameworks  # type: ignore[import-not-found]
import growth  # type: ignore[import-not-found]
import memory  # type: ignore[import-not-found]
import properties  # type: ignore[import-not-found]
import report  # type: ignore[import-not-found]
import torch


def machine() -> str:
    """`report.machine` (CPU, cores, OS, load at the start) with the Python and torch versions."""
    return f"{report.machine()}, Python {platform.python_version()}, torch {torch.__version__}"


def _table(title: str, columns: list[str], rows: list[list], notes: str = "") -> dict:
    print(f"\n{title}")
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(v) for v in row))
    if notes:
        print(notes)
    return {"title": title, "columns": columns, "rows": rows, "notes": notes}


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def frameworks_table(gloo: bool, full: bool) -> dict:
    steps, repeats = (10, 7) if full else (6, 5)
    rows = frameworks.measure(list(frameworks.PROGRAMS), steps, repeats, gloo, progress=_progress)
    columns, body = frameworks.table(rows, steps)
    return _table(
        "Real programs on 4 rank threads against their compute floor (CPU ms per step of all 4 ranks)",
        columns,
        body,
        f"MLP {frameworks.BLOCKS} blocks x width {frameworks.WIDTH}, batch {frameworks.BATCH} per rank; floor: the "
        f"4 ranks one after another on torch's fake backend; medians of {repeats} interleaved laps of {steps} "
        "steps; gloo: 4 real processes (CPU summed over ranks, wall of the slowest).",
    )


def per_call_tables(full: bool) -> list[dict]:
    collectives.CLOCK[0] = time.process_time
    result = collectives.per_call_tables(2000 if full else 400, 5 if full else 3)
    one = _table(
        "One all_reduce of 1024 fp32 on 4 ranks against the thread floor (CPU us per call)",
        ["part", "us", "/ thread floor", "target"],
        [[name.strip(), round(us, 1), round(ratio, 2), target] for name, us, ratio, target in result["thread_floor"]],
        "thread floor = the handoffs one collective makes (counted: 3 on 4 ranks, the last to arrive completes "
        "it and runs on; each timed as a bare ring of the rendezvous' wake-ups) + the reduction + the 4 writes, "
        "each timed alone in the same run.",
    )
    big = _table(
        "all_reduce of 64 MiB fp32 per rank, 4 ranks, against the memory-bandwidth floor (CPU ms per call)",
        ["part", "ms", "/ bandwidth floor", "target"],
        [
            [name.strip(), round(us / 1000, 1), round(ratio, 2), target]
            for name, us, ratio, target in result["bandwidth"]
        ],
        "bandwidth floor = one read of each input and one write of each output (4 in-place passes, or 4 copies "
        "if faster); every part on the same preallocated buffers, each call from a cold cache, medians of "
        "interleaved rounds.",
    )
    return [one, big]


def memory_table(p8: bool) -> dict:
    columns, rows = memory.measure(4, 60, 25, p8, progress=_progress)
    return _table(
        "Process mode's peak resident set per rank against real gloo's (MB)",
        columns,
        rows,
        "all_reduce: 60 in-place calls on 4 MiB fp32; scatter_objects: scatter_object_list of one 25 MB object "
        "per rank from rank 0, then broadcast_object_list of one; peak = VmHWM.",
    )


def growth_properties_table(full: bool) -> dict:
    steps, seeds = (10_000, 8) if full else (1000, 8)
    scratch = tempfile.mkdtemp()
    cpu: list[float] = []
    try:
        config = growth.GrowthConfig(growth.POLICIES, steps, seeds, checkpoint_every=500)
        wall = growth.timed(config, f"{scratch}/growth", False, cpu)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    examples = 400 if full else 200
    found = properties.measure(examples, "tp2-ep2", 8)
    per_cpu = found["cases"] / found["cpu"]
    # the first 1000 steps record metrics every step, later ones every 10th: a short run is no tenth of the 10k one
    growth_target = "<= 45 s wall, quiet" if full else "none at this length (--full: 10k x 8 x 3 <= 45 s, quiet)"
    rows = [
        [
            f"growth {steps} steps x {seeds} seeds x 3 policies + oracle",
            round(wall, 1),
            round(cpu[0], 1),
            growth_target,
        ],
        [
            f"property (a), {found['cases']} cases in {found['examples']} examples",
            round(found["total"], 2),
            round(found["cpu"], 2),
            f"{per_cpu:.0f} cases per CPU second (target >= 500)",
        ],
    ]
    return _table("Growth and properties", ["run", "wall s", "CPU s", "target"], rows)


def summary(tables: list[dict]) -> dict:
    """One row per issue-34 target, read from the tables above."""
    rows: list[list] = []
    fw = tables[0]
    col = fw["columns"].index("threads / floor (CPU)")
    for row in fw["rows"]:
        rows.append([f"{row[0]} on threads / compute floor (CPU)", row[col], row[fw["columns"].index("target")]])
    for row in tables[1]["rows"]:
        if row[3]:
            rows.append([f"{row[0]} / thread floor (1024 fp32, CPU)", row[2], row[3]])
    for row in tables[2]["rows"]:
        if row[3]:
            rows.append([f"{row[0]} / bandwidth floor (64 MiB x 4, CPU)", row[2], row[3]])
    for row in tables[3]["rows"]:
        rows.append([f"process mode peak RSS / gloo's, {row[0]}, {row[1]} ranks (max rank)", row[4], row[6]])
    for row in tables[4]["rows"]:
        rows.append([row[0], row[2], row[3]])
    return _table("Summary: each target", ["figure", "value", "target"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="targets", help="bench/results/<name>.json (default targets)")
    parser.add_argument("--full", action="store_true", help="longer runs: 10k growth, more steps and repeats")
    parser.add_argument("--p8", action="store_true", help="also the 8-rank object scatter in process mode")
    parser.add_argument("--no-gloo", action="store_true", help="leave out the gloo processes of the first table")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    named = machine()
    print(f"bench/targets.py on {named}")
    tables = [frameworks_table(not ns.no_gloo, ns.full)]
    tables += per_call_tables(ns.full)
    tables.append(memory_table(ns.p8))
    tables.append(growth_properties_table(ns.full))
    tables.insert(0, summary(tables))
    elapsed = time.perf_counter() - began
    path = report.RESULTS / f"{ns.name}.json"
    tables_out = [report.Table(t["title"], t["columns"], t["rows"], t["notes"]) for t in tables]
    report.write(path, tables_out, machine_text=named)
    print(f"\nwrote {path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
