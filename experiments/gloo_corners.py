"""gloo's corners, real vs simdist: per category and world size, silent differences and refusal mismatches.

For each world size P, ONE spawn of P real gloo processes (127.0.0.1) runs the
fidelity probes (`simdist.testing._internal.gloo_fidelity`: complex reduce/reduce_scatter,
scatter layouts, bool bytes, refusals, the dtype table, ``dist.reduce`` just
above 2P MiB) and, for P >= 4, the ring corner set (`simdist.testing._internal.gloo_probe`:
NaN payloads, signed zeros, every op and dtype, groups, roots, layouts); then
the simdist backend runs the same program on threads (`simdist.run`) and in
process mode (real processes, modelled arithmetic). A pair is (case, rank);
outputs are compared as storage bytes::

    python experiments/gloo_corners.py                    # P = 2..8, threads and process mode
    python experiments/gloo_corners.py --worlds 3 --no-big --no-process
    python experiments/gloo_corners.py --worlds 4 --rows   # also one row per disagreeing case

Columns per mode: ``silent`` (both succeed, bytes differ) and ``refusal``
(one side raises, or the exception types differ). ``ring corners`` also counts
``refused``: simdist's ValueError on a strided view whose memory outside the
view real gloo would reduce (by design, not a mismatch). Exit status 1 if any
silent difference or refusal mismatch is found.
"""

from __future__ import annotations

import argparse
import sys
import time

import simdist
from simdist.testing._internal.gloo_fidelity import disagreements, fidelity_probes, run_cases_and_probes, tally
from simdist.testing._internal.gloo_probe import agree, corner_cases


def _worlds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def _ring_counts(cases, real, sim, world: int) -> tuple[int, int, int, int]:
    """(pairs, silent, refusal, refused-by-design) over the ring corner cases."""
    pairs = silent = refusal = refused = 0
    for i in range(len(cases)):
        for r in range(world):
            a, b = real[r][0][i], sim[r][0][i]
            if a is None and b is None:
                continue
            pairs += 1
            if agree(a, b):
                continue
            if a is not None and b is not None and a.error is None and b.error == "ValueError":
                refused += 1  # a strided view: simdist refuses where gloo reduces memory outside the view
            elif a is not None and b is not None and a.error is None and b.error is None:
                silent += 1
            else:
                refusal += 1
    return pairs, silent, refusal, refused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="experiments/gloo_corners.py", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2-8", help="world sizes, e.g. 2-8 or 4")
    p.add_argument("--no-big", action="store_true", help="leave out dist.reduce above 2P MiB")
    p.add_argument("--no-process", action="store_true", help="threads only")
    p.add_argument("--rows", action="store_true", help="print every disagreeing (case, rank)")
    ns = p.parse_args(argv)
    bad = 0
    header = f"{'P':>2} {'category':<16} {'pairs':>6}  {'threads silent/refusal':>22}  {'process silent/refusal':>22}"
    print(header)
    for world in _worlds(ns.worlds):
        probes = fidelity_probes(world, big=not ns.no_big)
        cases = corner_cases(world) if world >= 4 else []
        start = time.perf_counter()
        real = simdist.run(run_cases_and_probes, world, where="gloo", args=(cases, probes), timeout_s=900)
        spent = time.perf_counter() - start
        modes = {"threads": simdist.run(run_cases_and_probes, world, args=(cases, probes), timeout_s=900)}
        if not ns.no_process:
            modes["process"] = simdist.run(
                run_cases_and_probes, world, where="processes", args=(cases, probes), timeout_s=900
            )
        per_mode, refused_by_mode = {}, {}
        for mode, sim in modes.items():
            found = disagreements(probes, [r[1] for r in real], [s[1] for s in sim])
            counts = tally(probes, found, world)
            if cases:
                pairs, silent, refusal, refused = _ring_counts(cases, real, sim, world)
                counts["ring corners"] = (pairs, silent, refusal)
                refused_by_mode[mode] = refused
            per_mode[mode] = counts
            bad += sum(s + r for _, s, r in counts.values())
            if ns.rows:
                for v in found:
                    print(f"   {mode} {v.kind}: {v.probe.name} rank {v.rank}: real {v.real} | simdist {v.simulated}")
        for category, (pairs, silent, refusal) in per_mode["threads"].items():
            proc = per_mode.get("process", {}).get(category)
            shown = f"{proc[1]:>10}/{proc[2]:<11}" if proc else f"{'-':>22}"
            print(f"{world:>2} {category:<16} {pairs or '':>6}  {silent:>10}/{refusal:<11}  {shown}")
        refused = f"; strided views refused by design: {refused_by_mode}" if refused_by_mode else ""
        print(f"   ({len(probes)} probes, {len(cases)} ring cases; real gloo spawn {spent:.0f} s{refused})")
    print(f"\nsilent differences + refusal mismatches, all modes: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
