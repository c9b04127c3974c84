"""gloo's corners, real vs modelled: special values, every op and dtype, groups, roots, layouts.

Runs the corner cases of `simdist.reduce.gloo_probe` on real gloo processes
(127.0.0.1), on the simdist backend (thread ranks, gloo model) and through the
`Gloo` model directly, and prints one row per case::

    python experiments/gloo_corners.py                 # 4 ranks, the fixed corner set
    python experiments/gloo_corners.py --only specials # rows whose name contains "specials"

Verdicts: ``bitwise equal`` (every rank's output bits), ``same error`` (same
exception type), ``refused`` (simdist raises ValueError where real gloo would
reduce memory outside a strided view), ``DIFFERENT``. Exit status 1 if any row
is DIFFERENT.
"""

from __future__ import annotations

import argparse
import sys
import time

import simdist
from simdist.reduce.gloo_probe import compare, corner_cases, model_outcomes, run_cases
from simdist.world.launch import spawn_procs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="experiments/gloo_corners.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--only", default="", help="print only rows whose case name contains this")
    ns = p.parse_args(argv)
    cases = corner_cases(ns.world_size)
    start = time.perf_counter()
    real = spawn_procs(run_cases, ns.world_size, cases, backend="gloo", timeout_s=300)
    spent = time.perf_counter() - start
    backend = simdist.spawn(run_cases, ns.world_size, cases)
    rows_model = compare(cases, real, model_outcomes(cases, ns.world_size))
    rows_backend = compare(cases, real, backend)
    width = max(len(c.name) for c in cases)
    print(f"{len(cases)} cases on {ns.world_size} real gloo processes ({spent:.1f} s)\n")
    print(f"{'case':<{width}}  {'Gloo model':<14} {'simdist backend':<16} real gloo saw")
    for m, b in zip(rows_model, rows_backend, strict=True):
        if ns.only in m.case.name:
            print(f"{m.case.name:<{width}}  {m.verdict:<14} {b.verdict:<16} {m.real}")
    different = [r.case.name for r in rows_model + rows_backend if r.verdict == "DIFFERENT"]
    counts = {
        v: sum(r.verdict == v for r in rows_model) for v in ("bitwise equal", "same error", "refused", "DIFFERENT")
    }
    print(f"\nGloo model: {counts}")
    if different:
        print("DIFFERENT:", ", ".join(sorted(set(different))))
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
