"""Process-mode start-up of the DeepSpeed and Megatron cases: where a launch's wall time goes.

    python bench/startup.py --case deepspeed      # DeepSpeed #8913's real run (4 ranks, one launch)
    python bench/startup.py --case megatron       # Megatron-Core's DP2 and TP2 x DP2 runs (two launches)
    python bench/startup.py --case megatron --where simdist --repeats 2

Each case's real run is launched three ways, in this order: ``before`` (the launcher as it was: the forkserver
preloads torch only and every rank imports the framework itself), ``freeze`` (the server also freezes its
objects out of the ranks' garbage collections, `simdist.world.processes.forkserver_freeze`; DeepSpeed calls
``gc.collect()`` six times per optimizer) and ``preloaded`` (what the cases do now: the framework is imported
once, in the forkserver: `simdist.cases.ranks`'s ``DEEPSPEED_MODULES`` / ``MEGATRON_MODULES``). Every launch
prints `LaunchTimings`: the forkserver's (re)start with its imports, the ranks' start (fork, unpickling), the
rendezvous, the case's own work (which includes every import a rank still makes) and the teardown. The first
launch of a way pays the server's imports (each way has a server of its own, `simdist.world.processes.forkservers`); the
later ones show the steady state. Run each case in its own
process (this script does): a forkserver that has already imported the framework would hide the old cost. The
machine is shared and noisy: compare the ways within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("DS_BUILD_OPS", "0")


def _deepspeed(where: str, preload: tuple[str, ...], timings: list) -> None:
    from simdist.cases.deepspeed.harness import deepspeed_rank
    from simdist.cases.deepspeed.issue_8913 import Config
    from simdist.cases.ranks import run_ranks

    config = Config()
    run_ranks(deepspeed_rank, config.spec, config.runs(), config.seed, where=where, preload=preload, timings=timings)


def _megatron(where: str, preload: tuple[str, ...], timings: list) -> None:
    from simdist.cases.megatron_grad_reduce import Config, megatron_rank
    from simdist.cases.ranks import run_ranks

    config = Config()
    for layout in config.layouts:
        run_ranks(megatron_rank, config.spec(layout), config, layout, where=where, preload=preload, timings=timings)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("deepspeed", "megatron"), required=True)
    parser.add_argument("--where", choices=("gloo", "simdist"), default="gloo")
    parser.add_argument("--repeats", type=int, default=1, help="launches per way after the first (default 1)")
    ns = parser.parse_args(argv)
    from simdist.cases.ranks import DEEPSPEED_MODULES, MEGATRON_MODULES

    body, modules = (_deepspeed, DEEPSPEED_MODULES) if ns.case == "deepspeed" else (_megatron, MEGATRON_MODULES)
    from simdist.world.processes import forkservers

    totals: dict[str, list[float]] = {}
    freeze = forkservers.FREEZE
    for way, preload in (("before", ()), ("freeze", ()), ("preloaded", modules)):
        forkservers.FREEZE = "json" if way == "before" else freeze  # "before": a harmless module in the freezer's place
        for repeat in range(ns.repeats + 1):
            timings: list = []
            began = time.perf_counter()
            body(ns.where, preload, timings)
            wall = time.perf_counter() - began
            totals.setdefault(way, []).append(wall)
            for t in timings:
                print(f"{ns.case:9} {way:9} #{repeat} world {t.world_size}: {t.describe()}", flush=True)
            print(f"{ns.case:9} {way:9} #{repeat} the case's launches: {wall:6.2f} s", flush=True)
    first = {way: walls[0] for way, walls in totals.items()}
    later = {way: statistics.median(walls[1:]) for way, walls in totals.items()}
    for name, figures in (("first launch (server imports included)", first), ("later launches (median)", later)):
        ratios = ", ".join(f"{w} / before = {figures[w] / figures['before']:.2f}" for w in ("freeze", "preloaded"))
        print(f"{ns.case}: {name}: {ratios}")


if __name__ == "__main__":
    main()
