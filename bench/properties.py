"""Examples per second of property (a): fp32_staging is bitwise equal to the FP32 oracle.

    python bench/properties.py [--examples 400] [--layout tp2-ep2 | any] [--profile]

Runs property (a) as ``tests/unit/test_gradpath_properties.py`` runs it (the same strategy and check, from
`simdist.testing.compact`, on the rank-batched engine) under the ci profile's settings (derandomized, no
deadline) with ``--examples`` examples, and prints examples per second, split into the time Hypothesis spends
drawing an example (the layout, GAS, steps and the gradient bytes, and decoding them) and the time the two runs
(fp32_staging and the oracle) take. ``--layout tp2-ep2`` (default) fixes the layout to TP2/EP2 on 4 ranks, as
the issue's target states it; ``any`` draws layouts as the test does (up to 8 ranks). Target: >= 100
examples/s (goal 500). ``--profile`` adds a cProfile report by internal time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

from hypothesis import given, settings

from simdist.testing.compact import staging_departs_from_oracle
from simdist.testing.strategies import oracle_cases
from simdist.world.spec import DEFAULT_SPEC

TARGET, GOAL = 100.0, 500.0  # issue 22 asks for the goal


def ci_settings(examples: int) -> settings:
    """The ci profile of tests/conftest.py with ``examples`` examples and no example database."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
    )


def measure(examples: int, layout: str) -> dict[str, float]:
    """Run property (a) for ``examples`` examples; seconds in total and in the body, and the example count."""
    body_seconds = [0.0]
    count = [0]
    cpu = time.process_time()
    cases = oracle_cases(DEFAULT_SPEC) if layout == "tp2-ep2" else oracle_cases()

    @ci_settings(examples)
    @given(cases)
    def prop(case):
        start = time.perf_counter()
        departure = staging_departs_from_oracle(*case)
        if departure is not None:
            raise AssertionError(f"fp32_staging departs from the oracle at {departure}")
        body_seconds[0] += time.perf_counter() - start
        count[0] += 1

    start = time.perf_counter()
    prop()
    total = time.perf_counter() - start
    return {"examples": count[0], "total": total, "body": body_seconds[0], "cpu": time.process_time() - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--layout", choices=("tp2-ep2", "any"), default="tp2-ep2")
    parser.add_argument("--profile", action="store_true", help="print a cProfile report")
    parser.add_argument("--lines", type=int, default=25, help="rows of the profile report")
    args = parser.parse_args()

    measure(5, args.layout)  # warm-up: imports, strategy caches, torch kernels
    result = measure(args.examples, args.layout)
    n = result["examples"]
    rate = n / result["total"]
    draw = result["total"] - result["body"]
    verdict = "met" if rate >= TARGET else f"{TARGET / rate:.1f}x short"
    print(
        f"property (a), {args.layout}, ci settings: {n} examples in {result['total']:.2f} s = {rate:.0f} examples/s "
        f"(target {TARGET:.0f}/s: {verdict}; goal {GOAL:.0f}/s) [load average {os.getloadavg()[0]:.1f}; "
        f"CPU time {result['cpu']:.2f} s = {n / result['cpu']:.0f} examples per CPU second]"
    )
    print(
        f"  drawing (Hypothesis + decoding the gradient bytes): {100 * draw / result['total']:.0f}%, "
        f"{1000 * draw / n:.2f} ms/example"
    )
    print(
        f"  running (fp32_staging and oracle, rank-batched): {100 * result['body'] / result['total']:.0f}%, "
        f"{1000 * result['body'] / n:.2f} ms/example"
    )

    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        measure(args.examples, args.layout)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.lines)
        print(out.getvalue())


if __name__ == "__main__":
    main()
